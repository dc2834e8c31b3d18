"""Host side of the chunk layout every chunked kernel reads: where the chunks of a (packed) batch are.

A batch [B, T] or a packed varlen batch (cu_seqlens [N+1]) becomes sequences of tokens, each cut into chunks of BT
tokens from its first token; the chunk table maps a global chunk index to its sequence and first token. Non-standard:
the table is cached per layout (and device), so a training step does not rebuild and copy it each call, and the
chunk count is bounded by Ttot // BT + N so fake kernels can size saved buffers without data.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..offsets import host_offsets


def max_chunks(Ttot: int, N: int, BT: int) -> int:
    """An upper bound of the chunks of N sequences of Ttot tokens in all (each sequence adds at most one partial)."""
    return Ttot // BT + N


_TABLES: dict[tuple, tuple] = {}


def _chunk_table(cu: list[int], BT: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(chunk -> sequence, chunk -> first token, sequence -> first chunk, number of chunks), cached per layout
    so a training step does not rebuild and copy it to the device each call."""
    key = (tuple(cu), BT, str(device))
    hit = _TABLES.get(key)
    if hit is None:
        if len(_TABLES) > 64:
            _TABLES.clear()
        hit = _TABLES[key] = _build_chunk_table(cu, BT, device)
    return hit


def _build_chunk_table(cu: list[int], BT: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    seq, start, off = [], [], []
    for n in range(len(cu) - 1):
        off.append(len(seq))
        for s in range(cu[n], cu[n + 1], BT):
            seq.append(n)
            start.append(s)
    off.append(len(seq))
    nc = len(seq)
    if nc == 0:
        seq, start = [0], [0]
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)
    return t(seq), t(start), t(off), nc


def _max_seq_chunks(cu: list[int], BT: int) -> int:
    return max((cu[n + 1] - cu[n] + BT - 1) // BT for n in range(len(cu) - 1))


def _cu_tensor(cu: list[int], cu_seqlens: torch.Tensor | None, dev) -> torch.Tensor:
    if cu_seqlens is not None:
        return cu_seqlens.to(torch.int32)
    key = ("cu", tuple(cu), str(dev))
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(cu, dtype=torch.int32, device=dev)
    return _TABLES[key]


class Layout(NamedTuple):
    """Where the chunks of a (packed) batch are: the host facts every launch needs."""

    cu: list[int]  # sequence offsets [N+1] on the host
    N: int  # sequences
    Ttot: int  # tokens
    chunk_seq: torch.Tensor  # int32 [chunks]: the sequence of each chunk
    chunk_start: torch.Tensor  # int32 [chunks]: its first token
    chunk_off: torch.Tensor  # int32 [N+1]: the first chunk of each sequence
    nc: int  # chunks
    cu_t: torch.Tensor  # int32 [N+1] on the device
    nch: int  # chunks of the longest sequence (the sequential kernels' loop bound)


def layout(cu_seqlens: torch.Tensor | None, B: int, T: int, BT: int, dev) -> Layout:
    cu = _cu_list(cu_seqlens, B, T)
    cs, cst, coff, nc = _chunk_table(cu, BT, dev)
    return Layout(cu, len(cu) - 1, B * T, cs, cst, coff, nc, _cu_tensor(cu, cu_seqlens, dev), _max_seq_chunks(cu, BT))


def _cu_list(cu_seqlens: torch.Tensor | None, B: int, T: int) -> list[int]:
    if cu_seqlens is None:
        return [b * T for b in range(B + 1)]
    return host_offsets(cu_seqlens)

