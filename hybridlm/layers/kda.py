"""KimiDeltaAttention: the delta rule with a per-channel forget gate and low-rank gates (Kimi Linear).

Non-standard here:
- The forget gate is low rank: f = f_b_proj(f_a_proj(x)) + dt_bias (float32, [B, T, H, dk]),
  g = -exp(A_log) * softplus(f) with softplus(f) = f for f > 20 (as Kimi writes it). The op computes it from the
  raw projection (`kda(..., A_log=, dt_bias=)`, `hybridlm.ops.kda_gate`); only a cached decode token computes g
  here, for the fused step kernel.
- The output gate is low rank too: gate = g_b_proj(g_a_proj(x)); the output norm is RMSNorm in float32 with a
  sigmoid gate (not SiLU).
- One short conv over cat(q, k, v) (checkpoints store three convs; `hybridlm.model.hf` concatenates them).
- H query/key heads == H value heads (no GVA).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.ops import glue, kda
from hybridlm.ops.kda_gate import kda_gate

from .conv import ShortConv
from .norm import GatedRMSNorm
from .projection import fused_linear


class KimiDeltaAttention(nn.Module):
    supports_cp = True  # forward takes cp_group (context parallelism)

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, *, conv_kernel: int = 4,
                 norm_eps: float = 1e-5, impl: str = "auto", recompute: bool = False):
        super().__init__()
        self.H, self.dk, self.impl = num_heads, head_dim, impl
        self.recompute = recompute  # the recurrence keeps only its inputs for the backward (hybridlm.ops)
        dim = num_heads * head_dim
        self.dim = dim
        D = hidden_size
        self.q_proj = nn.Linear(D, dim, bias=False)
        self.k_proj = nn.Linear(D, dim, bias=False)
        self.v_proj = nn.Linear(D, dim, bias=False)
        self.conv1d = ShortConv(3 * dim, conv_kernel, activation="silu")
        self.f_a_proj = nn.Linear(D, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(dim))
        self.A_log = nn.Parameter(torch.empty(1, 1, num_heads, 1).uniform_(1, 16).log())
        self.b_proj = nn.Linear(D, num_heads, bias=False)
        self.g_a_proj = nn.Linear(D, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, dim, bias=False)
        self.o_norm = GatedRMSNorm(head_dim, eps=norm_eps, activation="sigmoid", fp32_output=True)
        self.o_proj = nn.Linear(dim, D, bias=False)

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] -> g [B, T, H, dk] float32 (<= 0), on PyTorch."""
        return kda_gate(self._raw_gate(self.f_a_proj(x)), self.A_log.view(self.H), self.dt_bias)

    def _raw_gate(self, f_a: torch.Tensor) -> torch.Tensor:
        """f_a: f_a_proj(x) [B, T, dk] -> the forget gate's input before dt_bias, [B, T, H, dk]."""
        return self.f_b_proj(f_a).view(*f_a.shape[:-1], self.H, self.dk)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, cache=None, cp_group=None) -> torch.Tensor:
        """x: [B, T, D] (normed); attention_mask [B, T]; cu_seqlens [N+1] with B == 1.
        cache: a LinearState (hybridlm.model.cache): conv + float32 recurrent state, updated in place.
        cp_group: a ProcessGroup over which the sequence is split (context parallelism, as in GatedDeltaNet)."""
        if attention_mask is not None:
            x = (x * attention_mask[:, :, None]).to(x.dtype)
        B, T, _ = x.shape
        qkv, f_a, b, g_a = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj), self.f_a_proj, self.b_proj,
                                        self.g_a_proj)
        # q, k, v as three tensors: on the fused path each is written contiguous (no copies of strided views)
        q, k, v = (t.view(B, T, self.H, self.dk)
                   for t in self.conv1d(qkv, cu_seqlens, cache, impl=self.impl, split=(self.dim,) * 3,
                                             cp_group=cp_group))
        raw, beta = self._raw_gate(f_a), torch.sigmoid(b)
        A_log = self.A_log.view(self.H)
        h0 = None if cache is None else cache.recurrent
        o = None
        if h0 is not None and T == 1:  # a cached decode token: the fused step kernel takes g itself
            g = kda_gate(raw, A_log, self.dt_bias, fused=glue.use_triton("kda_gates", self.impl, raw))
            o = glue.recurrent_decode_step("kda", self.impl, h0, q, k, v, g, beta)  # in place, or None
            if o is None:
                raw, A_log = g, None
        if o is None:
            gate = dict(A_log=A_log, dt_bias=self.dt_bias) if A_log is not None else {}
            o, state = kda(q, k, v, g=raw, beta=beta, **gate, use_qk_l2norm=True, cu_seqlens=cu_seqlens,
                           initial_state=h0, output_final_state=cache is not None,
                           impl=glue.step_impl(self.impl, cache is not None, T), recompute=self.recompute,
                           cp_group=cp_group)
            if cache is not None:
                cache.recurrent = state
        gate = self.g_b_proj(g_a).view(B, T, self.H, self.dk)
        return self.o_proj(self.o_norm(o, gate, impl=self.impl).reshape(B, T, self.dim))
