"""GatedDeltaNet: the Gated DeltaNet token mixer in the three released projection layouts.

Non-standard here:
- layout "fused" (Qwen3-Next): `in_proj_qkvz` is grouped per key head, each group `[q (dk) | k (dk) | v (r*dv) |
  z (r*dv)]` with r = HV / H, and `in_proj_ba` per group `[b (r) | a (r)]`; a contiguous split is wrong.
- layout "split" (Qwen3.5): contiguous `in_proj_qkv` (`[q | k | v]`), `in_proj_z`, `in_proj_b`, `in_proj_a`.
- layout "olmo" (OLMo-Hybrid): separate q/k/v/a/b/g projections, output `o_norm` / `o_proj`.
- beta = beta_scale * sigmoid(b) (beta_scale 2 lets the transition have negative eigenvalues, OLMo-Hybrid);
  g = -exp(A_log) * softplus(a + dt_bias) in float32.
- Padding: the (normed) input is multiplied by the 2-D attention mask, so left-padded tokens give q = k = v = 0
  and leave the recurrent state untouched.
- Parameter names are transformers' in-memory names, so the checkpoint key map is a prefix map.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.ops import gated_delta_rule, glue

from .conv import ShortConv
from .norm import GatedRMSNorm
from .projection import fused_linear

LAYOUTS = ("fused", "split", "olmo")


def decay_parameters(num_value_heads: int) -> tuple[nn.Parameter, nn.Parameter]:
    """(A_log, dt_bias) [HV] of g = -exp(A_log) * softplus(a + dt_bias): A in [1, 16] and dt in [1e-3, 1e-1] at init
    (the Mamba-2 / GDN defaults; checkpoints overwrite both), dt_bias the inverse softplus of dt."""
    A_log = nn.Parameter(torch.empty(num_value_heads).uniform_(1, 16).log())
    dt = torch.exp(torch.rand(num_value_heads) * (torch.log(torch.tensor(0.1)) - torch.log(torch.tensor(1e-3)))
                   + torch.log(torch.tensor(1e-3)))
    return A_log, nn.Parameter(dt + torch.log(-torch.expm1(-dt)))


class GatedDeltaNet(nn.Module):
    supports_cp = True  # forward takes cp_group (context parallelism)

    def __init__(self, hidden_size: int, num_key_heads: int, num_value_heads: int, key_head_dim: int,
                 value_head_dim: int, *, conv_kernel: int = 4, layout: str = "split", beta_scale: float = 1.0,
                 norm_eps: float = 1e-6, impl: str = "auto", recompute: bool = False):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        if num_value_heads % num_key_heads:
            raise ValueError(f"num_value_heads ({num_value_heads}) must be a multiple of num_key_heads "
                             f"({num_key_heads})")
        self.layout, self.beta_scale, self.impl = layout, beta_scale, impl
        self.recompute = recompute  # the recurrence keeps only its inputs for the backward (hybridlm.ops)
        self.H, self.HV, self.dk, self.dv = num_key_heads, num_value_heads, key_head_dim, value_head_dim
        key_dim, value_dim = num_key_heads * key_head_dim, num_value_heads * value_head_dim
        self.key_dim, self.value_dim = key_dim, value_dim
        D = hidden_size
        if layout == "fused":
            self.in_proj_qkvz = nn.Linear(D, 2 * key_dim + 2 * value_dim, bias=False)
            self.in_proj_ba = nn.Linear(D, 2 * num_value_heads, bias=False)
        elif layout == "split":
            self.in_proj_qkv = nn.Linear(D, 2 * key_dim + value_dim, bias=False)
            self.in_proj_z = nn.Linear(D, value_dim, bias=False)
            self.in_proj_b = nn.Linear(D, num_value_heads, bias=False)
            self.in_proj_a = nn.Linear(D, num_value_heads, bias=False)
        else:
            self.q_proj = nn.Linear(D, key_dim, bias=False)
            self.k_proj = nn.Linear(D, key_dim, bias=False)
            self.v_proj = nn.Linear(D, value_dim, bias=False)
            self.a_proj = nn.Linear(D, num_value_heads, bias=False)
            self.b_proj = nn.Linear(D, num_value_heads, bias=False)
            self.g_proj = nn.Linear(D, value_dim, bias=False)
        self.conv1d = ShortConv(2 * key_dim + value_dim, conv_kernel, activation="silu")
        self.A_log, self.dt_bias = decay_parameters(num_value_heads)
        norm = GatedRMSNorm(value_head_dim, eps=norm_eps, activation="silu")
        out = nn.Linear(value_dim, D, bias=False)
        if layout == "olmo":
            self.o_norm, self.o_proj = norm, out
        else:
            self.norm, self.out_proj = norm, out

    def _project(self, x: torch.Tensor):
        """x: [B, T, D] -> qkv [B, T, 2*H*dk + HV*dv] (conv order), z [B, T, HV, dv], b, a [B, T, HV]."""
        B, T, _ = x.shape
        if self.layout == "fused":
            r = self.HV // self.H
            qkvz, ba = fused_linear(x, self.in_proj_qkvz, self.in_proj_ba)
            grouped = qkvz.view(B, T, self.H, 2 * self.dk + 2 * r * self.dv)
            q, k, v, z = grouped.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
            b, a = ba.view(B, T, self.H, 2 * r).split([r, r], dim=-1)
            qkv = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
            return qkv, z.reshape(B, T, self.HV, self.dv), b.reshape(B, T, self.HV), a.reshape(B, T, self.HV)
        if self.layout == "split":
            qkv, z, b, a = fused_linear(x, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        else:
            qkv, z, b, a = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj), self.g_proj, self.b_proj,
                                        self.a_proj)
        return qkv, z.view(B, T, self.HV, self.dv), b, a

    def gates(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """a, b: [B, T, HV] -> (g float32 log-decay, beta in the model dtype)."""
        return glue.gdn_gates(a, b, self.A_log, self.dt_bias, beta_scale=self.beta_scale, impl=self.impl)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, cache=None, cp_group=None) -> torch.Tensor:
        """x: [B, T, D] (already normed); attention_mask: [B, T] (1 = token, 0 = pad); cu_seqlens: [N+1] (B == 1).
        cache: a LinearState (hybridlm.model.cache): conv + float32 recurrent state, updated in place.
        cp_group: a ProcessGroup over which the sequence is split (context parallelism): x is this rank's slice,
        cu_seqlens the global offsets; the conv and the recurrence exchange their states over it."""
        if attention_mask is not None:
            x = (x * attention_mask[:, :, None]).to(x.dtype)
        B, T, _ = x.shape
        qkv, z, b, a = self._project(x)
        # q, k, v as three tensors: on the fused path each is written contiguous (no copies of strided views)
        q, k, v = self.conv1d(qkv, cu_seqlens, cache, impl=self.impl,
                              split=(self.key_dim, self.key_dim, self.value_dim), cp_group=cp_group)
        q, k = q.view(B, T, self.H, self.dk), k.view(B, T, self.H, self.dk)
        v = v.view(B, T, self.HV, self.dv)
        g, beta = self.gates(a, b)
        h0 = None if cache is None else cache.recurrent
        o = glue.recurrent_decode_step("gated_delta_rule", self.impl, h0, q, k, v, g, beta)  # in place, or None
        if o is None:
            o, state = gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm=True, cu_seqlens=cu_seqlens,
                                        initial_state=h0, output_final_state=cache is not None,
                                        impl=glue.step_impl(self.impl, cache is not None, T),
                                        recompute=self.recompute, cp_group=cp_group)
            if cache is not None:
                cache.recurrent = state
        norm, out = (self.o_norm, self.o_proj) if self.layout == "olmo" else (self.norm, self.out_proj)
        return out(norm(o, z, impl=self.impl).reshape(B, T, self.value_dim))
