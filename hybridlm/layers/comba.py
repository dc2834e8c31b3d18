"""Comba: the Comba token mixer (Hu et al. 2025) over `hybridlm.ops.comba`.

Non-standard here:
- The read key is p = sigmoid(decay) * k_hat (the paper's inner decay d in (0, 1), one learned scalar per key
  head; the transition e^g I - beta k p^T then keeps eigenvalues in [e^g - beta d, e^g]) and the query gets the
  output correction q_hat - D * p (one learned D per key head, initialised at `correction_factor`).
- q and k are l2-normalised here, before p and the correction, and the op runs without its own l2 norm. fla's
  layer instead forms p and q - D p from the raw q, k and lets the op l2-normalise q, k and p: there the norm of
  p cancels the inner decay (p_hat == k_hat) and rescales the corrected query. fla's op itself is ours
  (tests/ops/test_comba_vs_fla.py); only the layer's use of it differs.
- The rest follows fla's Comba layer: separate q/k/v projections through one short conv + SiLU, g = -exp(A_log) *
  softplus(a + dt_bias) per value head, beta = beta_scale * sigmoid(b), a sigmoid-gated RMSNorm in float32
  (`o_norm`, gate from `g_proj`), `o_proj`. Grouped value heads (HV a multiple of H) as in GatedDeltaNet.
- Padding: the input is multiplied by the 2-D attention mask, so padded tokens give q = k = v = 0 and leave the
  state untouched.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.ops import comba, glue, l2norm

from .conv import ShortConv
from .gdn import decay_parameters
from .norm import GatedRMSNorm
from .projection import fused_linear


class Comba(nn.Module):
    def __init__(self, hidden_size: int, num_key_heads: int, num_value_heads: int, key_head_dim: int,
                 value_head_dim: int, *, conv_kernel: int = 4, correction_factor: float = 1.0,
                 beta_scale: float = 1.0, norm_eps: float = 1e-5, impl: str = "auto", recompute: bool = False):
        super().__init__()
        if num_value_heads % num_key_heads:
            raise ValueError(f"num_value_heads ({num_value_heads}) must be a multiple of num_key_heads "
                             f"({num_key_heads})")
        self.H, self.HV, self.dk, self.dv = num_key_heads, num_value_heads, key_head_dim, value_head_dim
        self.beta_scale, self.impl, self.recompute = beta_scale, impl, recompute
        self.key_dim, self.value_dim = num_key_heads * key_head_dim, num_value_heads * value_head_dim
        D = hidden_size
        self.q_proj = nn.Linear(D, self.key_dim, bias=False)
        self.k_proj = nn.Linear(D, self.key_dim, bias=False)
        self.v_proj = nn.Linear(D, self.value_dim, bias=False)
        self.conv1d = ShortConv(2 * self.key_dim + self.value_dim, conv_kernel, activation="silu")
        self.a_proj = nn.Linear(D, num_value_heads, bias=False)
        self.b_proj = nn.Linear(D, num_value_heads, bias=False)
        self.decay = nn.Parameter(torch.ones(num_key_heads))  # inner decay d = sigmoid(decay): 0.73 at init
        self.D = nn.Parameter(torch.full((num_key_heads,), float(correction_factor)))  # output correction
        self.A_log, self.dt_bias = decay_parameters(num_value_heads)  # as GatedDeltaNet
        self.g_proj = nn.Linear(D, self.value_dim, bias=False)
        self.o_norm = GatedRMSNorm(value_head_dim, eps=norm_eps, activation="sigmoid", fp32_output=True)
        self.o_proj = nn.Linear(self.value_dim, D, bias=False)

    def features(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k: [B, T, H, dk] after the conv -> (corrected query, key, read key p), each [B, T, H, dk] in q's
        dtype, computed in float32 (float64 for float64 inputs)."""
        cd = torch.float64 if q.dtype == torch.float64 else torch.float32
        q_hat, k_hat = l2norm(q.to(cd)), l2norm(k.to(cd))
        p = torch.sigmoid(self.decay.to(cd))[:, None] * k_hat
        q_c = q_hat - self.D.to(cd)[:, None] * p
        return q_c.to(q.dtype), k_hat.to(q.dtype), p.to(q.dtype)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """x: [B, T, D] (already normed); attention_mask: [B, T] (1 = token, 0 = pad); cu_seqlens: [N+1] (B == 1).
        cache: a LinearState (hybridlm.model.cache): conv + float32 recurrent state, updated in place."""
        if attention_mask is not None:
            x = (x * attention_mask[:, :, None]).to(x.dtype)
        B, T, _ = x.shape
        qkv, a, b, gate = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj), self.a_proj, self.b_proj,
                                       self.g_proj)
        q, k, v = self.conv1d(qkv, cu_seqlens, cache, impl=self.impl,
                              split=(self.key_dim, self.key_dim, self.value_dim))
        q, k, p = self.features(q.reshape(B, T, self.H, self.dk), k.reshape(B, T, self.H, self.dk))
        v = v.reshape(B, T, self.HV, self.dv)
        g, beta = glue.gdn_gates(a, b, self.A_log, self.dt_bias,
                                 beta_scale=self.beta_scale, impl=self.impl)
        h0 = None if cache is None else cache.recurrent
        o, state = comba(q, k, v, p, g=g, beta=beta, cu_seqlens=cu_seqlens, initial_state=h0,
                         output_final_state=cache is not None,
                         impl=glue.step_impl(self.impl, cache is not None, T), recompute=self.recompute)
        if cache is not None:
            cache.recurrent = state
        gate = gate.view(B, T, self.HV, self.dv)
        return self.o_proj(self.o_norm(o, gate, impl=self.impl).reshape(B, T, self.value_dim))

