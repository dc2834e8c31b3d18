"""Host side of the Gluon state-gradient chain (`chain_bwd._gdn_chain_bwd_kernel`), which the Triton GDN backward
(`hybridlm.ops.triton.gdn._state_grad_pass`) runs instead of `state_pass._recur_bwd` where `unsupported_reason`
finds nothing: sm_90, 16-bit inputs, K 64 or 128, V 64 to 256 (the forward's rule), the forward's chunk of 64, and
16-byte aligned tensors (TMA). It writes what `_recur_bwd` writes, in the same layouts and dtypes, so the chunk
backward reads it unchanged: dS' of every chunk [chunks, HV, K, V] and dVn [tokens, HV, V] in the storage dtype,
and with an initial state its gradient [N, HV, K, V] fp32.

One launch: the chain. Its gate rows (the row scales of the raw q and k, qs / m, sk, e^{bL} / m and m: every
chunk's, read by TMA) come from the forward: the Gluon training solve writes them, the Triton forward launches
`gate_rows` (`state_pass._bwd_gate_rows`). Deterministic: every element is written by one program once.
Non-standard: the host path is the forward's (`gdn_fwd`): what a call signature fixes is worked out once (`_Plan`);
each kernel's first launch of a plan goes through the JIT, later ones through its C launcher with cached tensor
maps (`launch.py`), wherever that launch is the JIT's (`_direct_ptrs` says when).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..launch import TmaSpec, aligned, current_stream, direct_launch, direct_ok, launcher, tensor_map
from ..triton import state_pass
from ..triton.chunk_layout import Layout
from . import chunk_bwd, gdn_fwd
from .chain import _tma_desc
from .chain_bwd import BV, CHUNK, GATE_ROWS
from .gdn_fwd import cached_plan
from .parts import _IMPORT_ERROR

if _IMPORT_ERROR is None:
    from .chain_bwd import _gdn_chain_bwd_kernel

NUM_WARPS = 4  # the state warpgroup (the load partition adds one warp)
GATE_WARPS = 4  # `_bwd_gate_rows`


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, Wb: torch.Tensor,
                       Pb: torch.Tensor) -> str | None:
    """None when the Gluon chain takes the backward of q, k [B, T, H, K] with the output cotangent do [B, T, HV, V]
    and the forward's saved W [tokens, HV, K] and P [chunks, HV, BT, BT], else why not (one line)."""
    why = gdn_fwd.unsupported_reason(q, do)
    if why is not None:
        return why
    if Pb.shape[-1] != CHUNK:
        return f"Pb: expected the forward's chunk of {CHUNK} tokens, got {Pb.shape[-1]}"
    for name, x in (("k", k), ("do", do), ("Wb", Wb), ("Pb", Pb)):
        if x.dtype != q.dtype:
            return f"{name}: expected q's dtype {q.dtype}, got {x.dtype}"
    for name, x in (("q", q), ("k", k), ("do", do), ("Wb", Wb), ("Pb", Pb)):
        if x.data_ptr() % 16:
            return f"{name}: expected a 16-byte aligned tensor (TMA), got address {x.data_ptr():#x}"
    return None


def chunk_unsupported_reason(q: torch.Tensor, v: torch.Tensor, BT: int) -> str | None:
    """None when the Gluon chunk backward (`chunk_bwd`) takes q [B, T, H, K] and v [B, T, HV, V] with the forward's
    chunk of BT tokens, else why not (one line): the forward's rule, V at most 128 (a chunk's tiles, the state and
    its gradient among them, fit one program's shared memory) and chunks of 64."""
    why = gdn_fwd.unsupported_reason(q, v)
    if why is not None:
        return why
    if v.shape[-1] > chunk_bwd.MAX_V:
        return f"v: expected a head dim of at most {chunk_bwd.MAX_V}, got {v.shape[-1]}"
    if BT != chunk_bwd.CHUNK:
        return f"BT: expected the forward's chunk of {chunk_bwd.CHUNK} tokens, got {BT}"
    return None


def chunk_grads(q, k, v, g, beta, Tb, hb, dhb, vn, dvn, do, dq, dk, dkp, dv, dg, db, lay: Layout, scale: float,
                l2: bool) -> None:
    """The chunk backward in Gluon, one launch: what `triton.gdn._chunk_bwd`'s two Triton launches write, into the same
    buffers (dv, dbeta, dg, dq, dk). dk's part between the kernel's two parts: at V >= 128 in the dS' tile's shared
    memory (dkp not touched), else in dkp (fp32, each program's own rows, read back from cache). The caller checked
    `chunk_unsupported_reason`; every tensor is contiguous."""
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    launcher(chunk_bwd._chunk_bwd_kernel)[(lay.nc, HV)](
        q, k, v, g, beta, Tb, hb, dhb, vn, dvn, do, dq, dk, dkp, dv, dg, db, lay.cu_t, lay.chunk_seq,
        lay.chunk_start, float(scale), H, HV, K=K, V=V, C=chunk_bwd.CHUNK, L2=bool(l2), num_warps=chunk_bwd.NUM_WARPS)


def _descriptors(q, k, do, Wb, Pb, G, dhb, dvn):
    """TMA descriptors: W as [tokens, HV * K], q and k as [tokens, H * K] in [CHUNK, K] boxes, do and dvn as
    [tokens, HV * V] in [CHUNK, BV] boxes, P as [chunks * HV * CHUNK, CHUNK], the gate rows as
    [slots * GATE_ROWS, CHUNK] fp32, dhb as [chunks * HV * K, V] in [K, BV] boxes."""
    K = q.shape[-1]
    q2, k2 = q.reshape(-1, q.shape[-2] * K), k.reshape(-1, k.shape[-2] * K)
    w2 = Wb.reshape(-1, Wb.shape[-2] * K)
    V = do.shape[-1]
    do2, dvn2 = do.reshape(-1, do.shape[-2] * V), dvn.reshape(-1, dvn.shape[-2] * V)
    return (_tma_desc(w2, CHUNK, K), _tma_desc(q2, CHUNK, K), _tma_desc(k2, CHUNK, K), _tma_desc(do2, CHUNK, BV),
            _tma_desc(Pb.reshape(-1, CHUNK), CHUNK, CHUNK), _tma_desc(G.reshape(-1, CHUNK), GATE_ROWS, CHUNK),
            _tma_desc(dhb.reshape(-1, V), K, BV), _tma_desc(dvn2, CHUNK, BV))


def gate_rows(q, k, g, G, lay: Layout, scale: float, l2: bool) -> None:
    """The chain's gate rows of every chunk into G [>= chunks, HV, GATE_ROWS, CHUNK] fp32 (`state_pass._bwd_gate_rows`)
    from q, k [B, T, H, K] and g [B, T, HV], contiguous: what a Triton forward saves for this backward (the Gluon
    training solve writes them itself)."""
    if lay.nc == 0:
        return
    H, K, HV = q.shape[2], q.shape[3], g.shape[-1]
    launcher(state_pass._bwd_gate_rows)[(lay.nc, HV)](
        q, k, g, G, lay.cu_t, lay.chunk_seq, lay.chunk_start, float(scale), H, HV, K=K, BT=CHUNK, L2=bool(l2),
        num_warps=GATE_WARPS)


def state_grad_chain(do, dht, q, k, G, Wb, Pb, dh0, dhb, dvn, lay: Layout, has_h0: bool) -> None:
    """What `state_pass._recur_bwd` writes, by the Gluon chain: dS' of every chunk into dhb [chunks, HV, K, V],
    dVn into dvn [tokens, HV, V] (both in q's 16-bit dtype), and with has_h0 the initial-state gradient into dh0
    [N, HV, K, V] fp32; from dht [N, HV, K, V] (None: no final-state cotangent) and the forward's gate rows G
    (`gate_rows`). q, k: [B, T, H, K], do [B, T, HV, V], all contiguous; the caller checked `unsupported_reason`."""
    H, K = q.shape[2], q.shape[3]
    HV, V = do.shape[2], do.shape[3]
    if lay.nc == 0:  # no tokens: the gradients go through unchanged
        if has_h0:
            dh0.copy_(dht if dht is not None else torch.zeros_like(dh0))
        return
    # one value for both launch paths (an int 1 would be a constexpr of the JIT's, not the plan's kernel)
    has_h0 = bool(has_h0)
    dev = q.device
    key = (dev.index, q.dtype, dhb.dtype, dvn.dtype, None if dht is None else dht.dtype,
           dh0.dtype if has_h0 else None, H, HV, K, V, lay.N, lay.nc, lay.Ttot, Wb.shape[0], Pb.shape[0],
           dhb.shape[0], has_h0)
    plan = cached_plan(_PLANS, key, lambda: _Plan(H=H, HV=HV, K=K, V=V, N=lay.N, nc=lay.nc, Ttot=lay.Ttot,
                                                  w_rows=Wb.shape[0], p_chunks=Pb.shape[0],
                                                  dhb_chunks=dhb.shape[0], has_dht=dht is not None,
                                                  has_h0=has_h0))
    dht_arg = dht if dht is not None else dh0 if has_h0 else dvn  # never read without HAS_DHT
    dh0_arg = dh0 if has_h0 else dvn  # never written without STORE_DH0
    # the launch's tensors in `_direct_ptrs`' order (G: the chunks' rows only, as the plan's shapes have it)
    ts = (q, k, G[: lay.nc], lay.cu_t, do, Wb, Pb, dhb, dvn, dht_arg, dh0_arg, lay.chunk_off)
    ptrs = _direct_ptrs(dev, ts)
    stream = None if ptrs is None else current_stream(dev.index)
    _launch_chain(plan, ts, ptrs, stream, (H, HV, *plan.chain_consts))


def _launch_chain(plan: _Plan, ts: tuple, ptrs: tuple | None, stream: int | None, tail: tuple) -> None:
    """The chain (`_gdn_chain_bwd_kernel`) on ts and the scalars and constexprs `tail`: directly when ptrs (the
    addresses of ts) is given and the plan has the launch, each descriptor as (tensor map, *shape, *strides), the
    maps from `launch.tensor_map`; else through the JIT (the plan keeps its launch)."""
    q, k, G, cu, do, Wb, Pb, dhb, dvn, dht_arg, dh0_arg, chunk_off = ts
    if ptrs is not None and plan.chain:
        args = []
        for i, spec in zip((5, 0, 1, 4, 6, 2, 7, 8), plan.specs):  # W, q, k, do, P, gate rows, dS', dVn
            args += (tensor_map(ptrs[i], spec), *spec.tail)
        plan.chain(plan.chain_grid, stream, (*args, ptrs[9], ptrs[10], ptrs[8], ptrs[3], ptrs[11], *tail))
        return
    descs = _descriptors(q, k, do, Wb, Pb, G, dhb, dvn)
    compiled = _gdn_chain_bwd_kernel[plan.chain_grid](*descs, dht_arg, dh0_arg, dvn, cu, chunk_off, *tail,
                                                      num_warps=NUM_WARPS)
    if ptrs is not None and plan.chain is None:
        d = direct_launch(compiled)
        if d is not None:
            plan.specs = tuple(TmaSpec(m, shape, (shape[1], 1)) for m, shape in zip(d.metas, plan.shapes,
                                                                                   strict=True))
        plan.chain = d or False


# ------------------------------------------------------------------------------------------------- the host path
# As the forward's (gdn_fwd): a plan per call signature (`_PLANS`, keyed on everything the JIT specialises on but
# the pointers' alignment); a kernel's first launch of a plan goes through the JIT and keeps its C launcher
# (`launch.direct_launch`), later launches take it with the chain's tensor maps from `launch.tensor_map`. A call
# launches directly only where the JIT's launch would be the same (`_direct_ptrs`); any other goes through the JIT.

_PLANS: OrderedDict = OrderedDict()


class _Plan:
    """What one call signature fixes: the grid, the constexprs after the integer arguments, the shapes of the
    chain's eight descriptors (`_descriptors`' order); once the chain was launched through the JIT from a call that
    could launch directly, its direct launch (False: this Triton's launcher is not the one `launch.direct_launch`
    knows) and its tensor-map specs."""

    __slots__ = ("chain_grid", "chain_consts", "shapes", "chain", "specs")

    def __init__(self, *, H, HV, K, V, N, nc, Ttot, w_rows, p_chunks, dhb_chunks, has_dht, has_h0):
        self.chain_grid = (V // BV, N * HV, 1)
        self.chain_consts = (K, V, BV, CHUNK, GATE_ROWS, has_dht, has_h0)  # ... HAS_DHT, STORE_DH0
        # W, q, k, do, P, the gate rows, dS', dVn as 2-D tensors
        self.shapes = ((w_rows, HV * K), (Ttot, H * K), (Ttot, H * K), (Ttot, HV * V),
                       (p_chunks * HV * CHUNK, CHUNK), (nc * HV * GATE_ROWS, CHUNK), (dhb_chunks * HV * K, V),
                       (Ttot, HV * V))
        self.chain = self.specs = None


def _direct_ptrs(dev: torch.device, ts: tuple) -> tuple[int, ...] | None:
    """The addresses of ts (`state_grad_chain`'s order: q, k, the gate rows, the offsets, do, W, P, dS', dVn, the
    chain's state pointers and the chunk offsets) when a direct launch is the JIT's: no Triton hook or debug mode
    and dev the current device (`launch.direct_ok`), every pointer 16-byte aligned (the JIT specialises on it), and
    every tensor the chain reads or writes by TMA contiguous (its tensor maps assume it; `_descriptors` would
    reshape a strided one into a copy). Else None: the call launches through the JIT."""
    if not direct_ok(dev):
        return None
    for x in ts[4:9] + ts[:3]:
        if not x.is_contiguous():
            return None
    ptrs = tuple(x.data_ptr() for x in ts)
    return ptrs if aligned(*ptrs) else None
