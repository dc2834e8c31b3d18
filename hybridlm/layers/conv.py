"""ShortConv: causal depthwise conv over time (the conv in front of q, k, v in GDN / KDA).

Non-standard here: the weight is stored as `[C, 1, W]` (a torch Conv1d weight, the checkpoint layout) and the
op is sequence-first. Packed documents (`cu_seqlens`) are convolved one by one, so a document never reads the
tail of the previous one. `split=(C0, C1, C2)` returns the output as three tensors (the layer's q, k, v): on the
Triton training path the kernel writes them as three contiguous tensors and reads their gradients as they are, so
the recurrence copies no strided views and autograd concatenates no gradients; elsewhere they are views of one
output. The kernel choice is `hybridlm.ops.glue`'s, from the owning layer's impl.
With `cp_group` (context parallelism) the rank's slice starts from the last W inputs of the rank before (one
all-gather), masked to zero before the start of the document running in, and the slice's documents are convolved
from the local offsets of the global cu_seqlens: the usual packed path then runs unchanged (Triton included).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.ops import glue
from hybridlm.ops.context_parallel import check_group, gather, tie
from hybridlm.ops.offsets import host_offsets


def cp_conv_inputs(x: torch.Tensor, W: int, cu_seqlens: torch.Tensor | None,
                   group) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: this rank's slice [B, T, C] of a sequence split over group; cu_seqlens: global int [N+1] offsets (B == 1)
    or None. -> (initial conv state [B or n, C, W] of the slice's n local segments, local offsets [n+1] or None)."""
    rank, R = check_group(group)
    B, T, C = x.shape
    if T < W:
        raise ValueError(f"x: expected at least W={W} positions a rank with cp_group, got T={T}")
    tails = gather(x[:, -W:].transpose(1, 2), group)  # [R, B, C, W]: every rank's last W inputs
    # rank 0 uses none of them, yet the gather's backward is a collective every rank must reach
    prev = tie(torch.zeros_like(tails[0]), tails) if rank == 0 else tails[rank - 1]
    if cu_seqlens is None:
        return prev, None
    a, bounds = rank * T, host_offsets(cu_seqlens)
    if bounds[0] != 0 or bounds[-1] != R * T:
        raise ValueError(f"cu_seqlens: expected global offsets from 0 to {R * T} (T={T} positions on each of {R} "
                         f"ranks), got {bounds[0]}..{bounds[-1]}")
    start = max(b for b in bounds if b <= a)  # the start of the document running in at this slice's start
    keep = (torch.arange(a - W, a, device=x.device) >= start).to(prev.dtype)  # inputs of that document only
    inner = sorted({b - a for b in bounds if a < b < a + T})
    local = torch.tensor([0, *inner, T], dtype=torch.int32, device=x.device)
    state = torch.cat([prev * keep, prev.new_zeros(len(inner), C, W)])
    return state, local


class ShortConv(nn.Module):
    def __init__(self, channels: int, kernel_size: int = 4, activation: str | None = "silu", impl: str = "auto"):
        super().__init__()
        self.activation, self.impl = activation, impl
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, cache=None,
                impl: str | None = None, split: tuple[int, int, int] | None = None, cp_group=None):
        """x: [B, T, C] -> [B, T, C], or with split=(C0, C1, C2) three tensors [B, T, C0], [B, T, C1], [B, T, C2].
        cu_seqlens: int [N+1] offsets of documents packed in one row (B == 1).
        cache: an object with a `.conv` attribute ([B, C, W] or None): one token updates it in place (decode
        step); several tokens continue from it (prefill / multi-token continuation) and replace it.
        impl: the owning layer's impl (default self.impl); see `hybridlm.ops.glue`.
        cp_group: a ProcessGroup over which the sequence is split (x: this rank's slice, cu_seqlens global)."""
        w = self.weight.squeeze(1)
        impl = self.impl if impl is None else impl
        if cp_group is not None:
            if cache is not None:
                raise ValueError("cp_group: expected no generation cache with context parallelism, got one")
            h0, local = cp_conv_inputs(x, w.shape[1], cu_seqlens, cp_group)
            return glue.causal_conv1d(x, w, activation=self.activation, initial_state=h0, cu_seqlens=local,
                                      split=split, impl=impl)[0]
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
