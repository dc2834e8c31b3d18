"""Host side of the Gluon state-gradient chain (`chain_bwd._gdn_chain_bwd_kernel`), which the Triton GDN backward
(`hybridlm.ops.triton.gdn._state_grad_pass`) runs instead of `state_pass._recur_bwd` where `unsupported_reason`
finds nothing: sm_90, 16-bit inputs, K 64 or 128, V 64 to 256 (the forward's rule), the forward's chunk of 64, and
16-byte aligned tensors (TMA). It writes what `_recur_bwd` writes, in the same layouts and dtypes, so the chunk
backward reads it unchanged: dS' of every chunk [chunks, HV, K, V] and dVn [tokens, HV, V] in the storage dtype,
and with an initial state its gradient [N, HV, K, V] fp32.

Two launches: `state_pass._bwd_gate_rows` (Triton, every chunk at once: the row scales of the raw q and k, written
once so the chain reads them by TMA), then the chain. Deterministic: every element is written by one program once.
"""

from __future__ import annotations

import torch

from ..triton import state_pass
from ..triton.chunk_layout import Layout
from . import gdn_fwd
from .chain import _tma_desc
from .chain_bwd import BV, CHUNK, GATE_ROWS
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
    G = torch.empty(lay.nc * HV, GATE_ROWS, CHUNK, device=q.device, dtype=torch.float32)
    state_pass._bwd_gate_rows[(lay.nc, HV)](
        q, k, g, G, lay.cu_t, lay.chunk_seq, lay.chunk_start, scale, H, HV, K=K, BT=CHUNK, L2=l2,
        num_warps=GATE_WARPS,
    )
    descs = _descriptors(q, k, do, Wb, Pb, G, dhb, dvn)
    _gdn_chain_bwd_kernel[(V // BV, lay.N * HV)](
        *descs, dht if dht is not None else dh0 if has_h0 else dvn, dh0 if has_h0 else dvn, dvn, lay.cu_t,
        lay.chunk_off, H, HV, K=K, V=V, BV=BV, C=CHUNK, R=GATE_ROWS, HAS_DHT=dht is not None, STORE_DH0=has_h0,
        num_warps=NUM_WARPS,
    )
