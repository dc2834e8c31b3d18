"""ShortConv: causal depthwise conv over time (the conv in front of q, k, v in GDN / KDA).

Non-standard here: the weight is stored as `[C, 1, W]` (a torch Conv1d weight, the checkpoint layout) and the
op is sequence-first. Packed documents (`cu_seqlens`) are convolved one by one, so a document never reads the
tail of the previous one. `split=(C0, C1, C2)` returns the output as three tensors (the layer's q, k, v): on the
Triton training path the kernel writes them as three contiguous tensors and reads their gradients as they are, so
the recurrence copies no strided views and autograd concatenates no gradients; elsewhere they are views of one
output. The kernel choice is `hybridlm.ops.glue`'s, from the owning layer's impl.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.ops import glue


class ShortConv(nn.Module):
    def __init__(self, channels: int, kernel_size: int = 4, activation: str | None = "silu", impl: str = "auto"):
        super().__init__()
        self.activation, self.impl = activation, impl
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, cache=None,
                impl: str | None = None, split: tuple[int, int, int] | None = None):
        """x: [B, T, C] -> [B, T, C], or with split=(C0, C1, C2) three tensors [B, T, C0], [B, T, C1], [B, T, C2].
        cu_seqlens: int [N+1] offsets of documents packed in one row (B == 1).
        cache: an object with a `.conv` attribute ([B, C, W] or None): one token updates it in place (decode
        step); several tokens continue from it (prefill / multi-token continuation) and replace it.
        impl: the owning layer's impl (default self.impl); see `hybridlm.ops.glue`."""
        w = self.weight.squeeze(1)
        impl = self.impl if impl is None else impl
        if cache is None:
            return glue.causal_conv1d(x, w, activation=self.activation, cu_seqlens=cu_seqlens, split=split,
                                      impl=impl)[0]
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens: packed documents cannot be combined with a generation cache")
        if cache.conv is not None and x.shape[1] == 1:
            y = glue.causal_conv1d_update(x[:, 0], cache.conv, w, activation=self.activation, impl=impl)[:, None]
        else:
            y, cache.conv = glue.causal_conv1d(x, w, activation=self.activation, initial_state=cache.conv,
                                               output_final_state=True, impl=impl)
        return y if split is None else tuple(y.split(list(split), dim=-1))
