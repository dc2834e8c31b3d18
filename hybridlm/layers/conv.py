"""ShortConv: causal depthwise conv over time (the conv in front of q, k, v in GDN / KDA).

Non-standard here: the weight is stored as `[C, 1, W]` (a torch Conv1d weight, the checkpoint layout) and the
op is sequence-first. Packed documents (`cu_seqlens`) are convolved one by one, so a document never reads the
tail of the previous one.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.ops import causal_conv1d, causal_conv1d_update


class ShortConv(nn.Module):
    def __init__(self, channels: int, kernel_size: int = 4, activation: str | None = "silu"):
        super().__init__()
        self.activation = activation
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """x: [B, T, C] -> [B, T, C]. cu_seqlens: int [N+1] offsets of documents packed in one row (B == 1).
        cache: an object with a `.conv` attribute ([B, C, W] or None): one token updates it in place (decode
        step); several tokens continue from it (prefill / multi-token continuation) and replace it."""
        w = self.weight.squeeze(1)
        if cache is not None:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens: packed documents cannot be combined with a generation cache")
            if cache.conv is not None and x.shape[1] == 1:
                return causal_conv1d_update(x[:, 0], cache.conv, w, activation=self.activation)[:, None]
            y, cache.conv = causal_conv1d(x, w, activation=self.activation, initial_state=cache.conv,
                                          output_final_state=True)
            return y
        if cu_seqlens is None:
            return causal_conv1d(x, w, activation=self.activation)[0]
        bounds = cu_seqlens.tolist()
        parts = [causal_conv1d(x[:, s:e], w, activation=self.activation)[0] for s, e in zip(bounds, bounds[1:])]
        return torch.cat(parts, dim=1)


def step_impl(impl: str, cache, T: int) -> str:
    """The recurrence impl for one call: a single cached decode step uses the token loop ("naive", the recurrent
    form: nothing to chunk) unless a kernel was asked for explicitly; prefill / continuation keep `impl`."""
    if cache is not None and T == 1 and impl in ("auto", "chunk"):
        return "naive"
    return impl
