"""PaTHAttention: softmax attention with PaTH's Householder position encoding (no RoPE), fla's layer shapes.

Non-standard here:
- w (one Householder direction per token and kv head) comes from a low-rank projection (D -> 32 -> kv width, as
  fla for multi-head attention; w_rank 0 gives a full one), a causal short conv with SiLU, then an l2 norm;
  beta = 2 * sigmoid(bt_proj(x)) per kv head, so a transform may reflect (negative eigenvalue).
- forget_gate (PaTH-FoX): g = logsigmoid(g_proj(x)) per query head, added to the logits after the scale.
- Generation reruns the op over the cached per-token inputs (hybridlm.layers.history): exact, O(S^2) per step.
- No output gate, as fla's layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.ops import l2norm, path_attention

from .attention import normed_heads
from .conv import ShortConv
from .history import HistoryHeads, gate_dtype, run_over_history
from .projection import fused_linear


class PaTHAttention(HistoryHeads):
    """x: [B, T, D] -> [B, T, D]."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 forget_gate: bool = False, qk_norm: str = "none", norm_kind: str = "zero_centered",
                 norm_eps: float = 1e-6, w_rank: int = 32, conv_size: int = 3, impl: str = "auto"):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, qk_norm=qk_norm, norm_kind=norm_kind,
                         norm_eps=norm_eps, impl=impl)
        D, kv = hidden_size, num_kv_heads * head_dim
        self.w_proj = (nn.Sequential(nn.Linear(D, w_rank, bias=False), nn.Linear(w_rank, kv, bias=False))
                       if w_rank else nn.Linear(D, kv, bias=False))
        self.w_conv = ShortConv(kv, conv_size, activation="silu", impl=impl)
        self.bt_proj = nn.Linear(D, num_kv_heads, bias=True)
        self.g_proj = nn.Linear(D, num_heads, bias=True) if forget_gate else None

    def _parts(self, x: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """Per-token inputs of the op, before the w conv (which runs over the whole history)."""
        B, T, _ = x.shape
        low_rank = isinstance(self.w_proj, nn.Sequential)
        q, k, v, w, bt, *g = fused_linear(x, self.q_proj, self.k_proj, self.v_proj,
                                          self.w_proj[0] if low_rank else self.w_proj, self.bt_proj,
                                          *([self.g_proj] if self.g_proj is not None else []))
        q, k = normed_heads(q, k, self)
        beta = 2 * torch.sigmoid(gate_dtype(bt))
        g = F.logsigmoid(gate_dtype(g[0])) if g else None
        w = self.w_proj[1](w) if low_rank else w
        return dict(q=q, k=k, v=v.view(B, T, self.nKV, self.hd), w=w, beta=beta, g=g)

    def _attend(self, p: dict[str, torch.Tensor | None], cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        B, S = p["q"].shape[:2]
        w = self.w_conv(p["w"], cu_seqlens=cu_seqlens).view(B, S, self.nKV, self.hd)
        return path_attention(p["q"], p["k"], p["v"], l2norm(gate_dtype(w)), g=p["g"], beta=p["beta"],
                              cu_seqlens=cu_seqlens, impl=self.impl)

    def forward(self, x: torch.Tensor, mask, position_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """x: [B, T, D]; mask: None (causal), a `Documents` (packed, B == 1) or a bool [B|1, 1, T, S] with key
        padding; position_ids: unused (positions come from the transforms); cache: a HistoryState."""
        B, T, _ = x.shape
        o = run_over_history(self._attend, self._parts(x), mask, T, cache)
        return self.o_proj(o.reshape(B, T, self.nH * self.hd))
