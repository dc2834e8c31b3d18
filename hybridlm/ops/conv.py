"""Causal depthwise convolution over time (the short conv in front of q, k, v), with a decode state.

Non-standard here: the layout is sequence-first `x: [B, T, C]` like every other op, the weight is `[C, W]` with
`weight[:, W-1]` multiplying the current token (the order of a torch Conv1d weight `[C, 1, W]` squeezed), and the
state is the last W inputs `[B, C, W]`, zero-padded on the left, the layout transformers and fla keep in their
caches. Keeping W (not W-1) columns costs one column and lets the step function be a plain dot product.
With `cp_group` (context parallelism) each rank holds a contiguous slice of the sequence: the last W inputs of
every rank are all-gathered (differentiably) and rank r takes rank r - 1's as its state, so that the first W - 1
outputs of a slice see the inputs before it; the final state is the last rank's, on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .context_parallel import check_group, gather, tie
from .validate import check_float, check_rank, check_shape


def _act(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation == "silu":
        return F.silu(y)
    raise ValueError(f"activation: expected None or 'silu', got {activation!r}")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cp_group=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y_t = act(bias + sum_{i<W} weight[:, i] * x_{t - (W-1) + i}), with x_{<0} taken from initial_state (or 0).

    x: [B, T, C]; weight: [C, W]; bias: [C] or None; initial_state: [B, C, W] (the last W inputs before x).
    cp_group: a torch.distributed ProcessGroup over which the sequence is split in rank order (x: this rank's slice,
    T >= W); initial_state applies before rank 0's slice (every rank passes the same one; its gradient is the sum
    over ranks), the final state is the last rank's, returned on every rank (count its gradient on one).
    Returns y [B, T, C] in x's dtype and, if asked, the new state [B, C, W] (x's dtype).
    """
    check_float("x", x)
    check_rank("x", x, 3, "[B, T, C]")
    B, T, C = x.shape
    check_float("weight", weight)
    check_rank("weight", weight, 2, "[C, W]")
    if weight.shape[0] != C:
        raise ValueError(f"weight: expected shape [C={C}, W], got {tuple(weight.shape)}")
    W = weight.shape[1]
    if bias is not None:
        check_shape("bias", bias, (C,), "[C]")
    if initial_state is None:
        past = x.new_zeros(B, C, W)
    else:
        check_shape("initial_state", initial_state, (B, C, W), "[B, C, W]")
        past = initial_state.to(x.dtype)
    if cp_group is not None:
        past, cp_final = _cp_past(x, past, W, cp_group)
    elif T == 0:  # an empty document of a packed row: no output, and its state passes through unchanged
        return x.new_empty(B, 0, C), (past.contiguous() if output_final_state else None)
    # Prepend the last W-1 past inputs, then a valid depthwise conv gives exactly T outputs.
    xt = torch.cat([past[:, :, 1:], x.transpose(1, 2)], dim=2)  # [B, C, W-1+T]
    y = F.conv1d(xt, weight.unsqueeze(1).to(x.dtype), bias=None if bias is None else bias.to(x.dtype), groups=C)
    y = _act(y, activation).transpose(1, 2)
    final = None
    if output_final_state:
        full = torch.cat([past, x.transpose(1, 2)], dim=2)
        final = full[:, :, -W:].contiguous() if cp_group is None else cp_final
    return y, final


def _cp_past(x: torch.Tensor, past: torch.Tensor, W: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's past inputs [B, C, W], the last rank's last W inputs): every rank's last W inputs gathered."""
    rank, R = check_group(group)
    if x.shape[1] < W:
        raise ValueError(f"x: expected at least W={W} positions a rank with cp_group, got T={x.shape[1]}")
    tails = gather(x[:, -W:].transpose(1, 2), group)  # [R, B, C, W]
    return tie(past if rank == 0 else tails[rank - 1], tails), tails[-1].contiguous()


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """One decode step, updating `conv_state` in place. x: [B, C]; conv_state: [B, C, W]. Returns y [B, C]."""
    check_float("x", x)
    check_rank("x", x, 2, "[B, C]")
    B, C = x.shape
    check_rank("weight", weight, 2, "[C, W]")
    W = weight.shape[1]
    check_shape("conv_state", conv_state, (B, C, W), "[B, C, W]")
    new = torch.cat([conv_state[:, :, 1:], x.unsqueeze(-1).to(conv_state.dtype)], dim=2)
    conv_state.copy_(new)
    y = (new.to(x.dtype) * weight.to(x.dtype)).sum(-1)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return _act(y, activation)
