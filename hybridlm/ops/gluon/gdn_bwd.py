"""Host side of the Gluon state-gradient chain (`chain_bwd._gdn_chain_bwd_kernel`), which the Triton GDN backward
(`hybridlm.ops.triton.gdn._state_grad_pass`) runs instead of `state_pass._recur_bwd` where `unsupported_reason`
finds nothing: sm_90, 16-bit inputs, K 64 or 128, V 64 to 256 (the forward's rule), the forward's chunk of 64, and
16-byte aligned tensors (TMA). It writes what `_recur_bwd` writes, in the same layouts and dtypes, so the chunk
backward reads it unchanged: dS' of every chunk [chunks, HV, K, V] and dVn [tokens, HV, V] in the storage dtype,
and with an initial state its gradient [N, HV, K, V] fp32.

Two launches: `state_pass._bwd_gate_rows` (Triton, every chunk at once: the row scales of the raw q and k, written
once so the chain reads them by TMA), then the chain. Deterministic: every element is written by one program once.
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
    buffers (dv, dbeta, dg, dq, dk; dkp holds dk's part between the kernel's two parts, each program's own rows, read
    back from cache). The caller checked `chunk_unsupported_reason`; every tensor is contiguous."""
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


def state_grad_chain(do, dht, q, k, g, Wb, Pb, dh0, dhb, dvn, lay: Layout, scale: float, l2: bool,
                     has_h0: bool) -> None:
    """What `state_pass._recur_bwd` writes, by the Gluon chain: dS' of every chunk into dhb [chunks, HV, K, V],
    dVn into dvn [tokens, HV, V] (both in q's 16-bit dtype), and with has_h0 the initial-state gradient into dh0
    [N, HV, K, V] fp32; from dht [N, HV, K, V] (None: no final-state cotangent). q, k: [B, T, H, K], g [B, T, HV],
    do [B, T, HV, V], all contiguous; the caller checked `unsupported_reason`."""
    H, K = q.shape[2], q.shape[3]
    HV, V = do.shape[2], do.shape[3]
    if lay.nc == 0:  # no tokens: the gradients go through unchanged
        if has_h0:
            dh0.copy_(dht if dht is not None else torch.zeros_like(dh0))
        return
    # one value for both launch paths (an int 1 would be a constexpr of the JIT's, not the plan's kernel)
    scale, l2, has_h0 = float(scale), bool(l2), bool(has_h0)
    dev = q.device
    key = (dev.index, q.dtype, g.dtype, dhb.dtype, dvn.dtype, None if dht is None else dht.dtype,
           dh0.dtype if has_h0 else None, H, HV, K, V, lay.N, lay.nc, lay.Ttot, Wb.shape[0], Pb.shape[0],
           dhb.shape[0], l2, has_h0)
    plan = cached_plan(_PLANS, key, lambda: _Plan(H=H, HV=HV, K=K, V=V, N=lay.N, nc=lay.nc, Ttot=lay.Ttot,
                                                  w_rows=Wb.shape[0], p_chunks=Pb.shape[0],
                                                  dhb_chunks=dhb.shape[0], l2=l2, has_dht=dht is not None,
                                                  has_h0=has_h0))
    G = torch.empty(lay.nc * HV, GATE_ROWS, CHUNK, device=dev, dtype=torch.float32)
    dht_arg = dht if dht is not None else dh0 if has_h0 else dvn  # never read without HAS_DHT
    dh0_arg = dh0 if has_h0 else dvn  # never written without STORE_DH0
    # the launches' tensors in `_direct_ptrs`' order
    ts = (q, k, g, G, lay.cu_t, lay.chunk_seq, lay.chunk_start, do, Wb, Pb, dhb, dvn, dht_arg, dh0_arg,
          lay.chunk_off)
    ptrs = _direct_ptrs(dev, ts)
    stream = None if ptrs is None else current_stream(dev.index)
    _launch_gate_rows(plan, ts, ptrs, stream, (scale, H, HV, *plan.gate_consts))
    _launch_chain(plan, ts, ptrs, stream, (H, HV, *plan.chain_consts))


def _launch_gate_rows(plan: _Plan, ts: tuple, ptrs: tuple | None, stream: int | None, tail: tuple) -> None:
    """`state_pass._bwd_gate_rows` on ts[:7] and the scalars and constexprs `tail`: directly when ptrs (the
    addresses of ts) is given and the plan has the launch, else through the JIT (the plan keeps its launch)."""
    if ptrs is not None and plan.gate:
        plan.gate(plan.gate_grid, stream, (*ptrs[:7], *tail))
        return
    compiled = state_pass._bwd_gate_rows[plan.gate_grid](*ts[:7], *tail, num_warps=GATE_WARPS)
    if ptrs is not None and plan.gate is None:
        plan.gate = direct_launch(compiled) or False


def _launch_chain(plan: _Plan, ts: tuple, ptrs: tuple | None, stream: int | None, tail: tuple) -> None:
    """The chain (`_gdn_chain_bwd_kernel`) as `_launch_gate_rows`; a direct launch takes each descriptor as
    (tensor map, *shape, *strides), the maps from `launch.tensor_map`."""
    q, k, _, G, cu, _, _, do, Wb, Pb, dhb, dvn, dht_arg, dh0_arg, chunk_off = ts
    if ptrs is not None and plan.chain:
        args = []
        for i, spec in zip((8, 0, 1, 7, 9, 3, 10, 11), plan.specs):  # W, q, k, do, P, gate rows, dS', dVn
            args += (tensor_map(ptrs[i], spec), *spec.tail)
        plan.chain(plan.chain_grid, stream, (*args, ptrs[12], ptrs[13], ptrs[11], ptrs[4], ptrs[14], *tail))
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
    """What one call signature fixes: both grids, the constexprs after the integer arguments, the shapes of the
    chain's eight descriptors (`_descriptors`' order); once each kernel was launched through the JIT from a call
    that could launch directly, its direct launch (False: this Triton's launcher is not the one
    `launch.direct_launch` knows) and the chain's tensor-map specs."""

    __slots__ = ("gate_grid", "chain_grid", "gate_consts", "chain_consts", "shapes", "gate", "chain", "specs")

    def __init__(self, *, H, HV, K, V, N, nc, Ttot, w_rows, p_chunks, dhb_chunks, l2, has_dht, has_h0):
        self.gate_grid = (nc, HV, 1)
        self.chain_grid = (V // BV, N * HV, 1)
        self.gate_consts = (K, CHUNK, l2)  # K, BT, L2
        self.chain_consts = (K, V, BV, CHUNK, GATE_ROWS, has_dht, has_h0)  # ... HAS_DHT, STORE_DH0
        # W, q, k, do, P, the gate rows, dS', dVn as 2-D tensors
        self.shapes = ((w_rows, HV * K), (Ttot, H * K), (Ttot, H * K), (Ttot, HV * V),
                       (p_chunks * HV * CHUNK, CHUNK), (nc * HV * GATE_ROWS, CHUNK), (dhb_chunks * HV * K, V),
                       (Ttot, HV * V))
        self.gate = self.chain = self.specs = None


def _direct_ptrs(dev: torch.device, ts: tuple) -> tuple[int, ...] | None:
    """The addresses of ts (`state_grad_chain`'s order: the gate launch's seven tensors, then do, W, P, dS', dVn,
    the chain's state pointers and the chunk offsets) when a direct launch is the JIT's: no Triton hook or debug
    mode and dev the current device (`launch.direct_ok`), every pointer 16-byte aligned (the JIT specialises on
    it), and every tensor the chain reads or writes by TMA contiguous (its tensor maps assume it; `_descriptors`
    would reshape a strided one into a copy). Else None: the call launches through the JIT."""
    if not direct_ok(dev):
        return None
    for x in ts[7:12] + ts[:2]:
        if not x.is_contiguous():
            return None
    ptrs = tuple(x.data_ptr() for x in ts)
    return ptrs if aligned(*ptrs) else None
