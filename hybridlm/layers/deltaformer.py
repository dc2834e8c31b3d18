"""DeltaFormerAttention: softmax attention over delta-rule-rewritten values (hybridlm.ops.deltaformer), with RoPE.

Non-standard here:
- beta = sigmoid(b_proj(x)) per query head, in (0, 1). fla's layer passes b_proj(x) unbounded; a bounded write
  strength keeps u from growing with the context (each write removes at most the retrieved value).
- RoPE on q and k before both softmaxes (the write and the read), as fla.
- Generation reruns the op over the cached per-token inputs (hybridlm.layers.history): exact, O(S^2) per step.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.ops import deltaformer_attention, glue

from .attention import Rotary, normed_heads
from .history import HistoryHeads, gate_dtype, run_over_history
from .projection import fused_linear


class DeltaFormerAttention(HistoryHeads):
    """x: [B, T, D] -> [B, T, D]."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 qk_norm: str = "none", norm_kind: str = "zero_centered", norm_eps: float = 1e-6,
                 rotary_dim: int = 0, rope_theta: float | None = 10000.0, impl: str = "auto"):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, qk_norm=qk_norm, norm_kind=norm_kind,
                         norm_eps=norm_eps, impl=impl)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=True)
        self.rotary = Rotary(rotary_dim, rope_theta) if rotary_dim and rope_theta is not None else None

    def _parts(self, x: torch.Tensor, position_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
        B, T, _ = x.shape
        q, k, v, b = fused_linear(x, self.q_proj, self.k_proj, self.v_proj, self.b_proj)
        q, k = normed_heads(q, k, self)
        if self.rotary is not None:
            if position_ids is None:
                raise ValueError("position_ids: DeltaFormer with RoPE needs position ids [B|1, T], got None")
            q, k = glue.rotary(q, k, position_ids, rotary_dim=self.rotary.rotary_dim, theta=self.rotary.theta,
                               impl=self.impl)
        beta = torch.sigmoid(gate_dtype(b))
        return dict(q=q, k=k, v=v.view(B, T, self.nKV, self.hd), beta=beta)

    def _attend(self, p: dict[str, torch.Tensor], cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        return deltaformer_attention(p["q"], p["k"], p["v"], beta=p["beta"], cu_seqlens=cu_seqlens, impl=self.impl)

    def forward(self, x: torch.Tensor, mask, position_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """x: [B, T, D]; mask: None (causal), a `Documents` (packed, B == 1) or a bool [B|1, 1, T, S] with key
        padding; position_ids: [B|1, T] for RoPE; cache: a HistoryState."""
        B, T, _ = x.shape
        o = run_over_history(self._attend, self._parts(x, position_ids), mask, T, cache)
        return self.o_proj(o.reshape(B, T, self.nH * self.hd))
