"""A long sequence's forward split into segments that run side by side (inference only): what the Gluon forward
does when its grid (sequences x value heads x value blocks) would leave most multiprocessors idle, e.g. one long
prompt with few heads per GPU.

Non-standard here:
- One call of the op over all segments gives every segment's local result and its transition at once. A segment
  leaves `S_out = M S_in + C` (docs/math.md, "Context parallelism": each state column evolves on its own, affinely
  in the state). So the values are widened to `v' = [v | 0_K]` (value width V + K) and each segment starts from
  `[S_0 | I_K]` ([K, V + K]): the first V columns run the op as usual, the last K columns run it with v = 0 from
  the identity. A segment's final state is `[C | M]` and its output per token is `[o_local | q_eff]` with
  `q_eff_t = scale * M_t^T q_t` (M_t: the transition up to t inside the segment), so that from the true initial
  state `o_t = o_local_t + q_eff_t^T S_in` ([K] times [K, V]).
- A document's first segment starts from the document's own initial state (`[h0 | I]` instead of `[0 | I]`), so
  its output and end state are already exact: only later segments take the correction, and a document short
  enough to stay one segment needs none. The chain over a document's segments, `S_in[j + 1] = C_j + M_j S_in[j]`,
  and the correction run in the state dtype (float32; float64 for float64 values); a corrected output is cast to
  the output dtype once.
- The inner call is the backend's own unsplit run (`Backend.whole`, else `Backend.run`) on the segments laid out
  as a reshape ([B * S, T / S], when every sequence divides evenly) or as packed documents (`cu_seqlens`, one row).
  A backend with a fixed set of value widths must take V + K (the Gluon forward: V + K in (64, 128, 256)).
- Whether to split (`choose_segments`) models the chain's time as waves x segment length: the programs of S
  segments per sequence, each with the wider value blocks, over the multiprocessors, times the tokens one program
  walks. The constants below are first guesses, to be tuned on an H100 / H200.
- A state pool is supported: its rows are gathered as initial states and the final states written back.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .offsets import remember_offsets
from .validate import state_dtype

if TYPE_CHECKING:
    from .dispatch import Inputs

log = logging.getLogger("hybridlm.ops")

# To be tuned on an H100 / H200 (the automatic split's constants):
CHUNK = 64  # an automatic segment is a whole number of chunks (the Gluon forward's chunk)
MIN_SEGMENT = 2048  # fewest tokens in an automatic segment: each adds K value columns and a chain step
MAX_SEGMENTS = 32  # most segments per sequence (the chain over them runs on the host, one step each)
SPLIT_GAIN = 0.7  # split only when the modelled time is at most this fraction of the unsplit call's
MAX_WAVES = 2  # most waves of split programs (more segments cut the tail wave's idle part, but add chain steps)
BLOCK = 64  # value columns per program of the Gluon chain (gluon.gdn_fwd.BV)
# the choices logged so far (the split's segment count, or why a split was not taken)
_LOGGED: set[tuple] = set()


def choose_segments(grid: int, wide_grid: int, T: int, sms: int) -> int:
    """How many segments (1: no split) to cut sequences of up to T tokens into, on `sms` multiprocessors.

    grid: the unsplit call's programs (sequences x value heads x value blocks); wide_grid: the programs of one
    segment per sequence with the widened values (V + K). Time is modelled as waves x tokens per program; the S
    with the least (the fewest on a tie) is taken if it beats the unsplit call by SPLIT_GAIN, with segments of at
    least MIN_SEGMENT tokens and at most MAX_WAVES waves of programs."""
    if min(grid, wide_grid, T, sms) <= 0:
        return 1
    whole = math.ceil(grid / sms) * T
    best, best_cost = 1, whole
    for s in range(2, min(MAX_SEGMENTS, T // MIN_SEGMENT, MAX_WAVES * sms // wide_grid) + 1):
        cost = math.ceil(s * wide_grid / sms) * segment_length(T, s)
        if cost < best_cost:
            best, best_cost = s, cost
    return best if best_cost <= SPLIT_GAIN * whole else 1


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def segment_length(T: int, segments: int, chunk: int = CHUNK) -> int:
    """Tokens per segment of an automatic split: T / segments rounded up to whole chunks."""
    return _ceil_div(_ceil_div(T, segments), chunk) * chunk


def _longest(x: Inputs) -> int:
    if x.offsets is None:
        return x.dims.T
    return max(b - a for a, b in zip(x.offsets, x.offsets[1:]))


def auto_length(x: Inputs, sms: int, widths: tuple[int, ...]) -> int:
    """The segment length of an automatic split of prepared inputs for the Gluon forward (0: no split), logged
    once per outcome. widths: the value widths the forward takes (V + K must be one)."""
    d = x.dims
    T = _longest(x)
    grid = d.N * d.HV * _ceil_div(d.V, BLOCK)
    segments = choose_segments(grid, d.N * d.HV * _ceil_div(d.V + d.K, BLOCK), T, sms)
    if segments == 1:
        return 0
    if d.V + d.K not in widths:
        _log_once(("whole", d.V + d.K), "not split: V + K = %d is not a value width the Gluon forward takes %s",
                  d.V + d.K, widths)
        return 0
    length = segment_length(T, segments)
    _log_once(("split", segments), "split into %d segments of up to %d tokens (longest sequence %d; %d programs "
              "unsplit on %d multiprocessors)", _ceil_div(T, length), length, T, grid, sms)
    return length


def _log_once(key: tuple, msg: str, *args) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("hybridlm.ops.gated_delta_rule: Gluon forward " + msg, *args)


# ------------------------------------------------------------------------------------------------- the split


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where the segments lie: `equal` (each of B rows cut into S segments of L: a reshape) or packed (one row,
    `cu` the segments' token offsets); per document its segment indices, in order."""

    equal: bool
    S: int  # segments per row (equal layout)
    L: int  # tokens per segment (equal layout; the longest otherwise)
    cu: list[int]  # segment offsets in the flattened row [B * T] (packed layout)
    docs: list[list[int]]  # per document, its segments (none for an empty document)


def _layout(B: int, T: int, offsets: list[int] | None, L: int) -> _Layout:
    if offsets is None and T % L == 0:
        S = T // L
        return _Layout(True, S, L, [], [list(range(b * S, (b + 1) * S)) for b in range(B)])
    bounds = offsets if offsets is not None else [b * T for b in range(B + 1)]
    cu, docs = [0], []
    for a, e in zip(bounds, bounds[1:]):
        first = len(cu) - 1
        cu += list(range(a + L, e, L)) + ([e] if e > a else [])
        docs.append(list(range(first, len(cu) - 1)))
    return _Layout(False, 0, L, cu, docs)


def _segments(t: torch.Tensor | None, lay: _Layout, B: int, T: int) -> torch.Tensor | None:
    """[B, T, ...] as the inner call's [B', T', ...]: a reshape (equal) or the rows flattened into one."""
    if t is None:
        return None
    if lay.equal:
        return t.reshape(B * lay.S, lay.L, *t.shape[2:])
    return t.reshape(1, B * T, *t.shape[2:])


def run_split(whole: Callable[[Inputs], tuple], x: Inputs, L: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The op on prepared inputs (T > 0) with every sequence cut into segments of L tokens (the last may be
    shorter), run side by side in one call of `whole` (a backend's unsplit run) and chained (module docstring).
    Returns (o [B, T, HV, V], the final states [N, HV, K, V] in the state dtype, or None unless asked; a state
    pool's rows are updated)."""
    d = x.dims
    B, T, HV, K, V = d.B, d.T, d.HV, d.K, d.V
    sd = state_dtype(x.v.dtype)
    dev = x.v.device
    rows = None
    h0 = x.initial_state
    if x.state_pool is not None:  # serving: the rows are the initial states, the finals are written back
        rows = x.state_indices.long()
        h0 = x.state_pool.index_select(0, rows)
    lay = _layout(B, T, x.offsets, L)
    n_seg = sum(len(s) for s in lay.docs)
    firsts = [(n, s[0]) for n, s in enumerate(lay.docs) if s]

    # every segment from [0 | I]; a document's first from [h0 | I]
    init = torch.zeros(n_seg, HV, K, V + K, dtype=sd, device=dev)
    init[..., V:] = torch.eye(K, dtype=sd, device=dev)
    if h0 is not None:
        if lay.equal:
            init.view(B, lay.S, HV, K, V + K)[:, 0, ..., :V] = h0
        else:
            idx = torch.tensor([i for pair in firsts for i in pair], device=dev).view(-1, 2)
            init[idx[:, 1], ..., :V] = h0.index_select(0, idx[:, 0]).to(sd)
    cu = None
    if not lay.equal:
        cu = remember_offsets(torch.tensor(lay.cu, dtype=torch.int32, device=dev), lay.cu)
    seg = lambda t: _segments(t, lay, B, T)  # noqa: E731
    inner = dataclasses.replace(
        x, q=seg(x.q), k=seg(x.k), v=seg(F.pad(x.v, (0, K))), g=seg(x.g), beta=seg(x.beta),
        dims=dataclasses.replace(d, B=B * lay.S if lay.equal else 1, T=lay.L if lay.equal else B * T, V=V + K,
                                 N=n_seg),
        initial_state=init, output_final_state=True, cu_seqlens=cu, offsets=None if lay.equal else lay.cu,
        state_pool=None, state_indices=None)
    o_w, fin = whole(inner)
    fin = fin.to(sd)
    o, final = (_chain_equal if lay.equal else _chain_packed)(o_w, fin, lay, x, h0)
    if rows is not None:
        x.state_pool.index_copy_(0, rows, final.to(x.state_pool.dtype))
    return o, (final if x.output_final_state else None)


def _chain_equal(o_w, fin, lay: _Layout, x: Inputs, h0):
    """B rows of S equal segments: the chain along S for all rows at once, one batched correction."""
    d = x.dims
    B, S, L, V = d.B, lay.S, lay.L, d.V
    fin = fin.view(B, S, *fin.shape[1:])
    ends = [fin[:, 0, ..., :V]]
    for j in range(1, S):
        ends.append(fin[:, j, ..., :V] + torch.matmul(fin[:, j, ..., V:], ends[-1]))
    out = o_w[..., :V].reshape(B, S, L, d.HV, V).contiguous()
    if S > 1:
        s_in = torch.stack(ends[:-1], dim=1)  # [B, S - 1, HV, K, V]: the state each later segment starts from
        q_eff = o_w.view(B, S, L, d.HV, V + d.K)[:, 1:, ..., V:].to(s_in.dtype)
        late = out[:, 1:].to(s_in.dtype) + torch.einsum("bsthk,bshkv->bsthv", q_eff, s_in)
        out[:, 1:] = late.to(out.dtype)
    return out.view(B, d.T, d.HV, V), ends[-1]


def _chain_packed(o_w, fin, lay: _Layout, x: Inputs, h0):
    """Packed segments: the chain one step per level (the j-th segment of every document at once), the
    correction one segment at a time."""
    d = x.dims
    V = d.V
    ends = fin[..., :V].clone()
    M = fin[..., V:]
    depth = max(len(s) for s in lay.docs)
    levels = [[s[j] for s in lay.docs if len(s) > j] for j in range(1, depth)]
    if levels:
        flat = torch.tensor([i for lv in levels for i in lv], device=ends.device)
        for at in flat.split([len(lv) for lv in levels]):
            step = ends.index_select(0, at) + torch.matmul(M.index_select(0, at), ends.index_select(0, at - 1))
            ends.index_copy_(0, at, step)
    out = o_w[..., :V].contiguous()
    for segs in lay.docs:
        for s in segs[1:]:
            a, b = lay.cu[s], lay.cu[s + 1]
            q_eff = o_w[:, a:b, :, V:].to(ends.dtype)
            late = out[:, a:b].to(ends.dtype) + torch.einsum("bthk,hkv->bthv", q_eff, ends[s - 1])
            out[:, a:b] = late.to(out.dtype)
    finals = []
    for n, segs in enumerate(lay.docs):
        if segs:
            finals.append(ends[segs[-1]])
        elif h0 is not None:
            finals.append(h0[n].to(ends.dtype))
        else:
            finals.append(ends.new_zeros(ends.shape[1:]))
    return out.view(d.B, d.T, d.HV, V), torch.stack(finals)


# ------------------------------------------------------------------------------------------------- explicit call


def split_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor, beta: torch.Tensor,
                  segments: int, impl: str = "auto", scale: float | None = None,
                  initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                  cu_seqlens: torch.Tensor | None = None, use_qk_l2norm: bool = False,
                  state_pool: torch.Tensor | None = None, state_indices: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`hybridlm.ops.gated_delta_rule` (same arguments and result) with every sequence (every document under
    cu_seqlens) cut into up to `segments` segments of ceil(longest / segments) tokens, run on backend `impl`'s
    unsplit path (module docstring). segments=1 is the unsplit call. Inference only: no gradients.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]."""
    from . import dispatch

    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"segments: expected a positive int, got {segments!r}")
    x = dispatch.prepare("gated_delta_rule", "scalar", True, q, k, v, g=g, beta=beta, scale=scale,
                         initial_state=initial_state, output_final_state=output_final_state,
                         cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm, chunk_size=64, impl=impl,
                         recompute=False, state_pool=state_pool, state_indices=state_indices)
    if x.needs_grad:
        raise RuntimeError("split_prefill: expected inputs without gradients (it is an inference path; run under "
                           "torch.no_grad), got inputs that require grad")
    b = dispatch.choose(x, impl)
    b = dataclasses.replace(b, run=b.whole or b.run)  # the backend's unsplit run, inside and without the split
    if segments == 1 or x.dims.T == 0:
        return dispatch.execute(b, x)
    wide = x.v.new_empty(()).expand(*x.v.shape[:3], x.dims.V + x.dims.K)  # what the inner call gets, unallocated
    why = b.supports(dataclasses.replace(x, v=wide))
    if why is not None:
        raise ValueError(f"v: the split widens the values to V + K = {x.dims.V + x.dims.K}, which the {b.label} "
                         f"does not take: {why}")
    return run_split(b.run, x, _ceil_div(_longest(x), segments))


__all__ = ["choose_segments", "run_split", "split_prefill"]
