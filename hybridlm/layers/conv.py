"""ShortConv: causal depthwise conv over time (the conv in front of q, k, v in GDN / KDA).

Non-standard here: the weight is stored as `[C, 1, W]` (a torch Conv1d weight, the checkpoint layout) and the
op is sequence-first. Packed documents (`cu_seqlens`) are convolved one by one, so a document never reads the
tail of the previous one.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.ops import causal_conv1d


class ShortConv(nn.Module):
    def __init__(self, channels: int, kernel_size: int = 4, activation: str | None = "silu"):
        super().__init__()
        self.activation = activation
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, C] -> [B, T, C]. cu_seqlens: int [N+1] offsets of documents packed in one row (B == 1)."""
        w = self.weight.squeeze(1)
        if cu_seqlens is None:
            return causal_conv1d(x, w, activation=self.activation)[0]
        bounds = cu_seqlens.tolist()
        parts = [causal_conv1d(x[:, s:e], w, activation=self.activation)[0] for s, e in zip(bounds, bounds[1:])]
        return torch.cat(parts, dim=1)
