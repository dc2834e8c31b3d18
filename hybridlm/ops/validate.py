"""Input checks shared by every public op.

Non-standard here: every check raises with a message that names the argument, what was expected and what was
given, because a shape error deep inside an einsum is the worst way to learn that `g` had the wrong rank.
Nothing is ever cast, broadcast or reshaped silently: these functions only look (the casts that the public
recurrences document, q/k to v's dtype and a 16-bit initial_state up to the state's dtype, happen in their
dispatch, after these checks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .offsets import host_offsets

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CHUNK_SIZES = (16, 32, 64, 128)
# the impls of the ops outside the recurrence dispatch's table ("gluon": gated_delta_rule, kda; ops.dispatch)
IMPLS = ("auto", "naive", "chunk", "triton", "gluon")


def check_float(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a floating dtype in {[str(d) for d in FLOAT_DTYPES]}, got {x.dtype}")


def check_rank(name: str, x: torch.Tensor, rank: int, layout: str) -> None:
    if x.dim() != rank:
        raise ValueError(f"{name}: expected rank {rank} ({layout}), got shape {tuple(x.shape)}")


def check_shape(name: str, x: torch.Tensor, expected: tuple[int, ...], layout: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)} ({layout}), got {tuple(x.shape)}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    devices = {n: t.device for n, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all inputs must be on one device, got {devices}")


@dataclass(frozen=True)
class Dims:
    """Sizes read off validated inputs: batch B, time T, key heads H, value heads HV, key dim K, value dim V,
    number of sequences N (B, or len(cu_seqlens) - 1 in varlen mode)."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int


def check_recurrence_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor | None,
    g_kind: str,
    beta: torch.Tensor | None,
    beta_name: str = "beta",
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int,
    impl: str,
    mixed_qk: bool = False,
    impls: tuple[str, ...] = IMPLS,
) -> Dims:
    """Validate the common signature of the linear recurrences.

    g_kind: "none" (g must be None), "scalar" (g [B, T, HV]), "channel" (g [B, T, HV, K]) or
    "scalar_or_channel" (either). mixed_qk: q and k may come in other floating dtypes than v (the caller casts
    them to v's); otherwise q, k and v must share one dtype. impls: the impl names that exist (the recurrences pass
    their dispatch table's).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float(name, x)
    check_rank("q", q, 4, "[B, T, H, K]")
    check_rank("k", k, 4, "[B, T, H, K]")
    check_rank("v", v, 4, "[B, T, HV, V]")
    if k.shape != q.shape:
        raise ValueError(f"k: expected the shape of q {tuple(q.shape)} ([B, T, H, K]), got {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"v: expected batch and time {(B, T)} to match q ([B, T, HV, V]), got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        raise ValueError(f"v: expected value heads HV to be a multiple of the key heads H={H}, got HV={HV}")
    if K == 0 or V == 0:
        raise ValueError(f"q/v: expected non-empty head dims, got K={K}, V={V}")
    if not mixed_qk and not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: expected one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")

    if g_kind == "none":
        if g is not None:
            raise ValueError("g: this op has no decay; expected None")
    else:
        if g is None:
            raise ValueError("g: expected a log-decay tensor, got None")
        check_float("g", g)
        shape = tuple(g.shape)
        ok = ((g_kind != "channel" and shape == (B, T, HV)) or (g_kind != "scalar" and shape == (B, T, HV, K)))
        if not ok:
            want = {
                "scalar": f"{(B, T, HV)} ([B, T, HV])",
                "channel": f"{(B, T, HV, K)} ([B, T, HV, K])",
                "scalar_or_channel": f"{(B, T, HV)} ([B, T, HV]) or {(B, T, HV, K)} ([B, T, HV, K])",
            }[g_kind]
            raise ValueError(f"g: expected shape {want}, got {tuple(g.shape)}")
    if beta is not None:
        check_float(beta_name, beta)
        check_shape(beta_name, beta, (B, T, HV), "[B, T, HV]")

    if cu_seqlens is None:
        N = B
    else:
        N = check_cu_seqlens(cu_seqlens, B=B, T=T)
    if initial_state is not None:
        check_float("initial_state", initial_state)
        check_shape("initial_state", initial_state, (N, HV, K, V), "[N, HV, K, V]")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {CHUNK_SIZES}, got {chunk_size}")
    if impl not in impls:
        raise ValueError(f"impl: expected one of {impls}, got {impl!r}")
    dev = q.device
    if not all(x is None or x.device == dev for x in (k, v, g, beta, initial_state)):
        check_same_device(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    return Dims(B=B, T=T, H=H, HV=HV, K=K, V=V, N=N)


def state_dtype(v_dtype: torch.dtype) -> torch.dtype:
    """The dtype the recurrences keep their state in: float64 for float64 values, else float32."""
    return torch.float64 if v_dtype == torch.float64 else torch.float32


def check_state_dtype(name: str, x: torch.Tensor, v_dtype: torch.dtype) -> None:
    """A given initial state is upcast to the state dtype; one it cannot hold exactly (float64 for a float32
    state) is refused rather than rounded."""
    want = state_dtype(v_dtype)
    if x.dtype != want and torch.finfo(x.dtype).bits > torch.finfo(want).bits:
        raise TypeError(f"{name}: expected dtype {want} or a narrower float, upcast (the state of {v_dtype} inputs "
                        f"is kept in {want}), got {x.dtype}")


def check_cu_seqlens(cu_seqlens: torch.Tensor, *, B: int, T: int) -> int:
    """FlashAttention-style offsets: int32/int64 [N+1], 0 first, non-decreasing, T last, and B == 1."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens: expected an int32/int64 tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens: expected dtype int32 or int64, got {cu_seqlens.dtype}")
    if B != 1:
        raise ValueError(f"cu_seqlens: varlen inputs are packed into one row, expected batch B=1, got B={B}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected shape [N+1] with N >= 1, got {tuple(cu_seqlens.shape)}")
    c = host_offsets(cu_seqlens)
    if c[0] != 0:
        raise ValueError(f"cu_seqlens: expected to start at 0, got {c[0]}")
    if any(b < a for a, b in zip(c[:-1], c[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets, got {c}")
    if c[-1] != T:
        raise ValueError(f"cu_seqlens: expected to end at T={T}, got {c[-1]}")
    return len(c) - 1


def check_state_pool(state_pool: torch.Tensor | None, state_indices: torch.Tensor | None, *,
                     initial_state: torch.Tensor | None, dims: Dims, dtype: torch.dtype,
                     device: torch.device) -> None:
    """A pool of recurrent states [P, HV, K, V] in the compute dtype, read at and written back to rows
    state_indices [N] (int32/int64). The rows' values are not checked (distinct, in range): that needs the device."""
    if state_pool is None or state_indices is None:
        given, missing = ("state_pool", "state_indices") if state_indices is None else ("state_indices", "state_pool")
        raise ValueError(f"{missing}: expected a tensor with {given} (the pool is read and written at those rows), "
                         "got None")
    if initial_state is not None:
        raise ValueError("initial_state: expected None with state_pool (the pool's rows are the initial states), "
                         "got a tensor")
    check_float("state_pool", state_pool)
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != (dims.HV, dims.K, dims.V):
        raise ValueError(f"state_pool: expected shape [P, {dims.HV}, {dims.K}, {dims.V}] ([P, HV, K, V]), got "
                         f"{tuple(state_pool.shape)}")
    if state_pool.dtype != dtype:
        raise TypeError(f"state_pool: expected dtype {dtype} (the state's compute dtype), got {state_pool.dtype}")
    if state_pool.requires_grad:
        raise ValueError("state_pool: expected a tensor without requires_grad (it is updated in place), got one "
                         "that requires grad")
    if not isinstance(state_indices, torch.Tensor) or state_indices.dtype not in (torch.int32, torch.int64):
        got = state_indices.dtype if isinstance(state_indices, torch.Tensor) else type(state_indices).__name__
        raise TypeError(f"state_indices: expected an int32/int64 tensor, got {got}")
    check_shape("state_indices", state_indices, (dims.N,), "[N], one row per sequence")
    for name, x in (("state_pool", state_pool), ("state_indices", state_indices)):
        if x.device != device:
            raise ValueError(f"{name}: expected a tensor on the inputs' device {device}, got {x.device}")

