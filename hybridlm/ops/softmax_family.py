"""What the softmax-attention relatives (PaTH attention, DeltaFormer) share: input checks, dtypes, varlen loop.

Non-standard here: these ops are attention, not recurrences, so heads follow attention's GQA convention (q has HQ
heads, k / v / the per-token transforms have H kv heads, HQ a multiple of H; query head h reads kv head
h // (HQ / H)), and there is no state: varlen sequences are simply run one by one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .offsets import host_offsets
from .validate import IMPLS, check_cu_seqlens, check_float, check_rank, check_same_device, check_shape


def check_softmax_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                         per_token: dict[str, tuple[torch.Tensor | None, str]], cu_seqlens: torch.Tensor | None,
                         impl: str) -> tuple[int, int, int, int, int, int]:
    """q: [B, T, HQ, K]; k: [B, T, H, K]; v: [B, T, H, V]. per_token: name -> (tensor or None, layout), layout one
    of "kv_vec" ([B, T, H, K]), "kv" ([B, T, H]) or "q" ([B, T, HQ]). Returns (B, T, HQ, H, K, V)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float(name, x)
    check_rank("q", q, 4, "[B, T, HQ, K]")
    check_rank("k", k, 4, "[B, T, H, K]")
    check_rank("v", v, 4, "[B, T, H, V]")
    B, T, HQ, K = q.shape
    H = k.shape[2]
    if k.shape[0] != B or k.shape[1] != T or k.shape[3] != K:
        raise ValueError(f"k: expected shape {(B, T, 'H', K)} ([B, T, H, K], batch/time/K of q), got "
                         f"{tuple(k.shape)}")
    if H == 0 or HQ % H != 0:
        raise ValueError(f"q: expected query heads HQ to be a multiple of the kv heads H={H}, got HQ={HQ}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v: expected batch, time and heads {tuple(k.shape[:3])} of k ([B, T, H, V]), got "
                         f"{tuple(v.shape)}")
    V = v.shape[3]
    if K == 0 or V == 0:
        raise ValueError(f"q/v: expected non-empty head dims, got K={K}, V={V}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: expected one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    shapes = {"kv_vec": ((B, T, H, K), "[B, T, H, K]"), "kv": ((B, T, H), "[B, T, H]"),
              "q": ((B, T, HQ), "[B, T, HQ]")}
    for name, (x, layout) in per_token.items():
        if x is not None:
            check_float(name, x)
            check_shape(name, x, *shapes[layout])
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, B=B, T=T)
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    check_same_device(q=q, k=k, v=v, **{n: x for n, (x, _) in per_token.items()})
    return B, T, HQ, H, K, V


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def to_query_heads(x: torch.Tensor | None, groups: int) -> torch.Tensor | None:
    """[B, T, H, ...] -> [B, T, H * groups, ...]: kv head h serves query heads h * groups .. h * groups + groups-1."""
    if x is None or groups == 1:
        return x
    return x.repeat_interleave(groups, dim=2)


def per_sequence(core: Callable, cu_seqlens: torch.Tensor | None, *xs: torch.Tensor | None) -> torch.Tensor:
    """core(*xs) over the whole batch, or with cu_seqlens over each packed sequence (time is dim 1), concatenated."""
    if cu_seqlens is None:
        return core(*xs)
    b = host_offsets(cu_seqlens)
    outs = [core(*(None if x is None else x[:, s:e] for x in xs)) for s, e in zip(b[:-1], b[1:]) if e > s]
    return torch.cat(outs, dim=1)
