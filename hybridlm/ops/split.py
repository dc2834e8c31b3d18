"""A long sequence cut into segments inside one GPU, so that a forward whose grid is one program per (sequence,
value head, value block) fills the multiprocessors when there are few sequences and heads (the inference forward
of the Gluon backend: B1 T32768 HV8 is 16 programs on 132 multiprocessors, each walking 512 chunks).

Non-standard here:
- The state a segment leaves is affine in the state it gets, S_out = M S_in + C (`hybridlm.ops.context_parallel`,
  docs/math.md "Context parallelism"). A pre-pass without autograd runs the op once, varlen, over every segment
  of the cut documents but each one's last (whose map nothing needs), at width V + K with v' = [v | 0_K] from the
  state [0 | I_K]: its final states are [C | M]. Where the backend does not take width V + K it is two calls (M
  from I with v = 0 at width K, C from 0). The segments' initial states are then chained in the state dtype, one
  step per segment index, batched over documents and heads: S_in(0) = the document's initial state (or zeros),
  S_in(j + 1) = M_j S_in(j) + C_j. The main pass is one varlen call over every segment (uncut documents as one
  segment) from those states: o, and each document's final state is its last segment's.
- The inputs are not copied for the main pass (the segments are the documents' tokens in order: only the offsets
  change); the pre-pass takes a slice where the cut documents' leading segments are one range from the first
  token (one long sequence), else one concatenation.
- Cost: the pre-pass walks S - 1 of S segments at width V + K (twice the state work at K = V), the main pass all
  of them: about three times the uncut state work, in S times as many programs, which finish in about 2/S of the
  uncut time where both grids fit the multiprocessors once.
- The choice (`segment_counts`) is a pure function of the lengths, the heads, the head dims and the number of
  multiprocessors; it cuts only where the uncut chain programs leave more than half of them idle, only documents
  of at least MIN_DOC tokens, into S >= MIN_SEGMENTS segments of at least MIN_SEGMENT tokens on chunk boundaries,
  S - 1 of them across all cut documents filling the multiprocessors once in the pre-pass.
- A state pool is read (the documents' rows gathered as initial states) and written (their final states
  scattered back) here, around plain calls.
- What a call's lengths fix (the offsets of both passes with their host copies recorded, the gathers' indices, the
  pre-pass's initial states) is made once and kept (`_layout`), so that a repeat call copies nothing from the host
  and can be captured in a CUDA graph.
- `disabled()` turns the cut off for a block (timing the forward with and without it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .offsets import host_offsets, remember_offsets
from .validate import Dims, state_dtype

log = logging.getLogger("hybridlm.ops")

CHUNK = 64  # segment boundaries fall on multiples of the kernels' chunk, counted from the document's start
BLOCK = 64  # the value columns of one program of the chained forward
MIN_DOC = 4096  # tokens: shorter documents are never cut (the pre-pass and the chain would not pay)
MIN_SEGMENT = 1024  # tokens: no segment shorter
MIN_SEGMENTS = 4  # the fewest segments of a cut: the pre-pass and the main pass each walk a segment (2/S of the
# chain's time) and each runs its solve (the uncut forward runs its solve beside the chain): estimated from the
# H100 times in docs/kernels.md, S = 3 gains nothing at B2 T16384 H8 and 10% at B1 T32768 H8, S = 5 35% there
MAX_LAYOUTS = 64  # lengths remembered (`_layout`)
_state = {"enabled": True}
_LOGGED: set[tuple] = set()  # (op, device type, segments) of the cuts logged


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run a block without cutting any sequence (the forward as one call); the setting comes back afterwards."""
    old = _state["enabled"]
    _state["enabled"] = False
    try:
        yield
    finally:
        _state["enabled"] = old


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def segment_counts(lengths: Sequence[int], *, HV: int, K: int, V: int, sms: int) -> tuple[int, ...] | None:
    """Segments per document of the given lengths (1: whole), or None where nothing is cut: the documents of at
    least MIN_DOC tokens are cut when their chain programs (HV * ceil(V / 64) each) fill less than half of the
    `sms` multiprocessors; into S segments, S - 1 the most segments of them all whose pre-pass at width V + K fits
    the multiprocessors once, and no more than a document's length / MIN_SEGMENT; not at all where S would be
    below MIN_SEGMENTS."""
    long = [n for n in lengths if n >= MIN_DOC]
    if not long or 2 * len(long) * HV * _cdiv(V, BLOCK) >= sms:
        return None
    S = 1 + sms // (len(long) * HV * _cdiv(V + K, BLOCK))
    if S < MIN_SEGMENTS:
        return None
    counts = tuple(min(S, n // MIN_SEGMENT) if n >= MIN_DOC else 1 for n in lengths)
    return counts if any(c > 1 for c in counts) else None


def segment_lengths(length: int, count: int) -> list[int]:
    """A document of `length` tokens in `count` segments: count - 1 of the same length, a multiple of CHUNK, and
    the last with the rest (at least as long)."""
    if count <= 1:
        return [length]
    seg = length // count // CHUNK * CHUNK
    return [seg] * (count - 1) + [length - seg * (count - 1)]


def counts_for(x) -> tuple[int, ...] | None:
    """The cut of a prepared call (`hybridlm.ops.dispatch.Inputs`) on its device, or None; logged once per (op,
    device type, segments)."""
    if not _state["enabled"]:
        return None
    d = x.dims
    if x.offsets is None:
        if d.T < MIN_DOC:
            return None
        lengths = (d.T,) * d.B
    else:
        lengths = tuple(b - a for a, b in zip(x.offsets, x.offsets[1:]))
    sms = _multiprocessors(x.device)
    counts = segment_counts(lengths, HV=d.HV, K=d.K, V=d.V, sms=sms)
    if counts is not None:
        key = (x.op, x.device.type, max(counts))
        if key not in _LOGGED:
            _LOGGED.add(key)
            cut = sum(c > 1 for c in counts)
            log.info("hybridlm.ops.%s: the forward cuts %d of %d sequences into up to %d segments (%d chain "
                     "programs on %d multiprocessors uncut)", x.op, cut, len(counts), max(counts),
                     cut * d.HV * _cdiv(d.V, BLOCK), sms)
    return counts


@functools.lru_cache(maxsize=8)
def _multiprocessors(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


# ------------------------------------------------------------------------------------------------- the layout


@dataclass
class _Layout:
    """What one call's lengths fix (module docstring)."""

    main: torch.Tensor  # int32 offsets of every segment, host copy recorded
    pre: torch.Tensor  # int32 offsets of the pre-pass's segments (packed), host copy recorded
    pre_ranges: list[tuple[int, int]]  # token ranges of the input the pre-pass reads, one per cut document
    cut: torch.Tensor | None  # int64 [cut documents]: which they are (None: all of them, in order)
    per_doc: int  # the most segments of a document (S)
    pad: torch.Tensor | None  # int64 [pre segments]: each one's row in [cut, S - 1] (None: every row)
    sources: torch.Tensor | None  # int64 [segments]: each one's initial state, rows of [docs | chained] (None:
    # the chained states as they are)
    last: torch.Tensor  # int64 [docs]: each document's last segment
    h0: dict  # the pre-pass's initial states by (width, dtype), made on first use


_LAYOUTS: OrderedDict = OrderedDict()


def _layout(lengths: tuple[int, ...], counts: tuple[int, ...], dev: torch.device) -> _Layout:
    key = (lengths, counts, dev)
    hit = _LAYOUTS.get(key)
    if hit is not None:
        _LAYOUTS.move_to_end(key)
        return hit
    main, pre, ranges, cut, sources, last = [0], [0], [], [], [], []
    S = max(counts)
    start = 0
    for n, (length, c) in enumerate(zip(lengths, counts)):
        segs = segment_lengths(length, c)
        if c > 1:
            slot = len(cut)
            cut.append(n)
            for a in segs[:-1]:
                pre.append(pre[-1] + a)
            ranges.append((start, start + sum(segs[:-1])))
            sources += [len(lengths) + slot * S + j for j in range(c)]
        else:
            sources.append(n)
        for a in segs:
            main.append(main[-1] + a)
        last.append(len(main) - 2)
        start += length
    pad = [i * (S - 1) + j for i, n in enumerate(cut) for j in range(counts[n] - 1)]
    # copies without a device sync (pageable memory is staged at once), normal tensors under inference_mode too
    # (an inference tensor's host copy is never recorded, `hybridlm.ops.offsets`)
    i32 = lambda xs: remember_offsets(torch.tensor(xs, dtype=torch.int32).to(dev, non_blocking=True), xs)  # noqa: E731
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64).to(dev, non_blocking=True)  # noqa: E731
    all_cut = len(cut) == len(lengths)
    with torch.inference_mode(False):
        layout = _Layout(main=i32(main), pre=i32(pre), pre_ranges=ranges,
                         cut=None if all_cut else i64(cut), per_doc=S,
                         pad=None if len(pad) == len(cut) * (S - 1) else i64(pad),
                         sources=None if all_cut and all(c == S for c in counts) else i64(sources),
                         last=i64(last), h0={})
    _LAYOUTS[key] = layout
    if len(_LAYOUTS) > MAX_LAYOUTS:
        _LAYOUTS.popitem(last=False)
    return layout


def _pre_h0(lay: _Layout, P: int, HV: int, K: int, V: int, sd: torch.dtype, dev: torch.device) -> torch.Tensor:
    """[P, HV, K, V + K]: [0 | I] (V = 0: I alone), kept with the layout (the backends only read it)."""
    key = (HV, K, V, sd)
    h0 = lay.h0.get(key)
    if h0 is None:
        with torch.inference_mode(False):
            h0 = torch.zeros(P, HV, K, V + K, dtype=sd, device=dev)
            h0[..., V:] = torch.eye(K, dtype=sd, device=dev)
        lay.h0[key] = h0
    return h0


# ------------------------------------------------------------------------------------------------- the run


def _take(t: torch.Tensor | None, ranges: list[tuple[int, int]]) -> torch.Tensor | None:
    """The tokens of `ranges` of t [1, T, ...] packed: a slice for one range from the first token, else one
    concatenation (a slice from a later token may start off the 16-byte alignment the kernels were compiled for:
    a per-token gate of one head is 4 bytes a token)."""
    if t is None:
        return None
    if len(ranges) == 1 and ranges[0][0] == 0:
        return t[:, : ranges[0][1]]
    return torch.cat([t[:, a:b] for a, b in ranges], dim=1)


def _part(x, q, k, v, g, beta, h0, cu: torch.Tensor, final: bool):
    """x as one varlen call over the segments of `cu` (its host copy recorded), values v, from h0."""
    offsets = host_offsets(cu)
    dims = Dims(B=1, T=q.shape[1], H=x.dims.H, HV=x.dims.HV, K=x.dims.K, V=v.shape[-1], N=len(offsets) - 1)
    return dataclasses.replace(x, q=q, k=k, v=v, g=g, beta=beta, dims=dims, initial_state=h0,
                               output_final_state=final, cu_seqlens=cu, offsets=offsets, state_pool=None,
                               state_indices=None)


def _maps(x, call: Callable, lay: _Layout, q, k, v, g, beta, wide: bool):
    """The pre-pass: (M [P, HV, K, K], C [P, HV, K, V]) of every pre-pass segment."""
    K, V = x.dims.K, x.dims.V
    HV = x.dims.HV
    P = lay.pre.numel() - 1
    sd = state_dtype(v.dtype)
    qp, kp, vp, gp, bp = (_take(t, lay.pre_ranges) for t in (q, k, v, g, beta))
    zeros = vp.new_zeros(*vp.shape[:-1], K)
    if wide:
        h0 = _pre_h0(lay, P, HV, K, V, sd, v.device)
        F = call(_part(x, qp, kp, torch.cat([vp, zeros], dim=-1), gp, bp, h0, lay.pre, True))[1]
        return F[..., V:], F[..., :V]
    M = call(_part(x, qp, kp, zeros, gp, bp, _pre_h0(lay, P, HV, K, 0, sd, v.device), lay.pre, True))[1]
    C = call(_part(x, qp, kp, vp, gp, bp, None, lay.pre, True))[1]
    return M, C


def _rows(t: torch.Tensor, lay: _Layout, n_cut: int) -> torch.Tensor:
    """Pre-pass rows [P, ...] as [cut documents, S - 1, ...] (documents with fewer segments padded with zeros,
    whose chained states nothing reads)."""
    S = lay.per_doc
    if lay.pad is not None:
        t = t.new_zeros(n_cut * (S - 1), *t.shape[1:]).index_copy_(0, lay.pad, t)
    return t.reshape(n_cut, S - 1, *t.shape[1:])


def run(x, call: Callable, counts: tuple[int, ...], *, wide: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The op of prepared inputs x (`hybridlm.ops.dispatch.Inputs`, T > 0) with documents cut into `counts`
    segments (module docstring). call(inputs) -> (o, final state) runs one call of the op (a backend's runner);
    wide: it takes values of width V + K (the pre-pass is then one call). A state pool in x is read and written
    here; every call gets plain initial states. No autograd."""
    d = x.dims
    B, T = d.B, d.T
    lengths = (T,) * B if x.offsets is None else tuple(b - a for a, b in zip(x.offsets, x.offsets[1:]))
    lay = _layout(lengths, tuple(counts), x.v.device)
    flat = lambda t: None if t is None else t.reshape(1, B * T, *t.shape[2:])  # noqa: E731
    q, k, v, g, beta = (flat(t) for t in (x.q, x.k, x.v, x.g, x.beta))
    sd = state_dtype(v.dtype)
    init = x.initial_state
    rows = None
    if x.state_pool is not None:
        rows = x.state_indices.long()
        init = x.state_pool.index_select(0, rows)
    N = len(lengths)
    n_cut = N if lay.cut is None else lay.cut.numel()
    with torch.no_grad():
        M, C = _maps(x, call, lay, q, k, v, g, beta, wide)
        M, C = _rows(M, lay, n_cut), _rows(C, lay, n_cut)
        if init is None:
            s = v.new_zeros(n_cut, d.HV, d.K, d.V, dtype=sd)
        else:
            s = init if lay.cut is None else init.index_select(0, lay.cut)
        states = [s]
        for j in range(lay.per_doc - 1):
            s = torch.einsum("nhij,nhjv->nhiv", M[:, j], s) + C[:, j]
            states.append(s)
        h0 = torch.stack(states, dim=1).flatten(0, 1)
        if lay.sources is not None:
            first = init if init is not None else h0.new_zeros(N, *h0.shape[1:])
            h0 = torch.cat([first, h0]).index_select(0, lay.sources)
        need_final = x.output_final_state or rows is not None
        o, F = call(_part(x, q, k, v, g, beta, h0, lay.main, need_final))
        final = F.index_select(0, lay.last) if need_final else None
    if rows is not None:
        x.state_pool.index_copy_(0, rows, final)
    return o.reshape(B, T, *o.shape[2:]), (final if x.output_final_state else None)
