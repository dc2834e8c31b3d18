"""MesaNet: the token mixer whose memory is the ridge-regression fit of all keys seen so far to their values.

Non-standard here (fla's `MesaNet` layer is the reference for the layout):
- Separate q/k/v projections; the short conv + SiLU runs over q and k only (v goes in raw), as in fla.
- Gates from biased projections, in float32: g = logsigmoid(a_proj(x)) (forget), beta = sigmoid(b_proj(x)) (write).
- lambda = softplus(lambda_params) + lambda_lower_bound, one per key channel ([H * dk] parameters, initialised so
  that lambda starts at 1; the lower bound, 0.25 as in fla, keeps the solve well conditioned).
- q and k are l2-normalised and q is not scaled (scale=1, as fla: o is linear in q, the output norm undoes any scale).
- Output: RMSNorm per head, or with output_gate an RMSNorm gated by SiLU(g_proj(x)) (fla's use_output_gate).
- cg_iters=None solves exactly; an int runs that many conjugate-gradient steps (fla trains with 30).
- The op has no Triton kernel: a layer built with impl="triton" (a whole model on kernels) runs it with "auto"
  (the chunk form, logged once by `resolve_impl`); its conv and norm still take the Triton path.
- Padding: the input is multiplied by the 2-D attention mask and so are g and beta: a padded token neither writes
  nor forgets (the gate projections have biases, so a zero input alone would still decay the state).
- The cache's recurrent state is the pair (H [B, H, dk, dk], G [B, H, dk, dv]) in float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from hybridlm.ops import glue, mesa_net

from .conv import ShortConv
from .norm import GatedRMSNorm, RMSNorm
from .projection import fused_linear


def _gate_dtype(x: torch.Tensor) -> torch.Tensor:
    """Gates in float32 (float64 for float64 models)."""
    return x if x.dtype == torch.float64 else x.float()


class MesaNet(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, key_head_dim: int, value_head_dim: int, *,
                 conv_kernel: int = 4, output_gate: bool = False, lambda_lower_bound: float = 0.25,
                 cg_iters: int | None = None, norm_eps: float = 1e-5, impl: str = "auto", recompute: bool = False):
        super().__init__()
        if lambda_lower_bound <= 0:
            raise ValueError(f"lambda_lower_bound: expected > 0 (the solve needs a ridge), got {lambda_lower_bound}")
        self.H, self.dk, self.dv, self.impl = num_heads, key_head_dim, value_head_dim, impl
        self.lambda_lower_bound, self.cg_iters = lambda_lower_bound, cg_iters
        self.recompute = recompute  # the op keeps only its inputs for the backward (torch.utils.checkpoint)
        self.key_dim, self.value_dim = num_heads * key_head_dim, num_heads * value_head_dim
        D = hidden_size
        self.q_proj = nn.Linear(D, self.key_dim, bias=False)
        self.k_proj = nn.Linear(D, self.key_dim, bias=False)
        self.v_proj = nn.Linear(D, self.value_dim, bias=False)
        self.a_proj = nn.Linear(D, num_heads, bias=True)
        self.b_proj = nn.Linear(D, num_heads, bias=True)
        self.conv1d = ShortConv(2 * self.key_dim, conv_kernel, activation="silu")
        # softplus^{-1}(1 - lower bound): lambda starts at 1 (at the bound + log 2 for a bound >= 1)
        start = math.log(math.expm1(1.0 - lambda_lower_bound)) if lambda_lower_bound < 1 else 0.0
        self.lambda_params = nn.Parameter(torch.full((self.key_dim,), start))
        if output_gate:
            self.g_proj = nn.Linear(D, self.value_dim, bias=False)
            self.o_norm = GatedRMSNorm(value_head_dim, eps=norm_eps, activation="silu", impl=impl)
        else:
            self.g_proj = None
            self.o_norm = RMSNorm(value_head_dim, eps=norm_eps, kind="fp32_weight", impl=impl)
        self.o_proj = nn.Linear(self.value_dim, D, bias=False)

    def ridge(self) -> torch.Tensor:
        """lambda: [H, dk] (> lambda_lower_bound) in float32 (float64 for a float64 model)."""
        return (F.softplus(_gate_dtype(self.lambda_params)) + self.lambda_lower_bound).view(self.H, self.dk)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """x: [B, T, D] (normed); attention_mask [B, T] (1 = token, 0 = pad); cu_seqlens [N+1] with B == 1.
        cache: a LinearState (hybridlm.model.cache): conv state + the (H, G) pair, replaced after the call."""
        if attention_mask is not None:
            x = (x * attention_mask[:, :, None]).to(x.dtype)
        B, T, _ = x.shape
        qk, v, a, b, *gate = fused_linear(x, (self.q_proj, self.k_proj), self.v_proj, self.a_proj, self.b_proj,
                                          *([self.g_proj] if self.g_proj is not None else []))
        qk = self.conv1d(qk, cu_seqlens, cache, impl=self.impl)
        q, k = (t.reshape(B, T, self.H, self.dk) for t in qk.split([self.key_dim, self.key_dim], dim=-1))
        v = v.view(B, T, self.H, self.dv)
        g = F.logsigmoid(_gate_dtype(a))
        beta = torch.sigmoid(_gate_dtype(b))
        if attention_mask is not None:
            keep = attention_mask[:, :, None].to(g.dtype)
            g, beta = g * keep, beta * keep
        lamb = self.ridge()
        h0 = None if cache is None else cache.recurrent
        op_impl = glue.step_impl("auto" if self.impl == "triton" else self.impl, cache is not None, T)

        def op(q, k, v, g, beta, lamb):
            return mesa_net(q, k, v, g=g, beta=beta, lamb=lamb, scale=1.0, use_qk_l2norm=True, cu_seqlens=cu_seqlens,
                            initial_state=h0, output_final_state=cache is not None, cg_iters=self.cg_iters,
                            impl=op_impl)

        if self.recompute and cache is None and torch.is_grad_enabled():
            o, state = torch.utils.checkpoint.checkpoint(op, q, k, v, g, beta, lamb, use_reentrant=False)
        else:
            o, state = op(q, k, v, g, beta, lamb)
        if cache is not None:
            cache.recurrent = state
        if gate:
            o = self.o_norm(o, gate[0].view(B, T, self.H, self.dv), impl=self.impl)
        else:
            o = self.o_norm(o)
        return self.o_proj(o.reshape(B, T, self.value_dim))
