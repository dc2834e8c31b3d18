"""The serial pass over chunk states, forward and backward, shared by GDN (scalar decay per token) and KDA
(CHANNEL: one log-decay per key channel). One program per (V block, sequence, value head) carries the fp32 state
S [K, BV] from chunk to chunk:
    forward:  Vn = U - W S,   S' = e^{bL} S + Kd^T Vn                (stores every chunk-initial S and Vn)
    backward: dVn = P^T dO + Kd dS',   dS = e^{bL} dS' + Qg^T dO - W^T dVn   (stores every dS' and dVn)
The output and the chunk-local gradients are left to launches that take every chunk at once (`chunk_out.py`,
`chunk_bwd.py`, `kda_bwd.py`); the serial chain holds only these dots.

Non-standard: GDN keeps no scaled copies of q and k. Its passes read the raw q, k ([tokens, H, K], per key head)
and put the row scales on the other operand: the forward multiplies Vn's rows by s_k = rk e^{bL - b} (written by
`wy._wu_fwd`) before the state-update dot; the backward puts qs = scale rq e^b on dO's rows and s_k on K dS'
(`_raw_row_scales`). KDA's scaled tiles Qg, Kd carry per-channel decays, so it reads them as they are.
NCH (the longest sequence's chunk count) stays a runtime value in both passes: Triton 3.6 makes an int argument of 1
a constant, and with one chunk and no initial state (forward) that constant loop compiled on an H200 to a wrong
final state and out-of-bounds shared-memory reads at the state update (T 63 or 64 without h0; with h0 it was right).
`_bwd_gate_rows` writes the same row scales of every chunk to a buffer, for the Gluon backward chain
(`hybridlm.ops.gluon.chain_bwd`), which reads them with its chunk by TMA instead of computing norms on its serial path.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_jit import _chunk_p, _chunk_rows, _chunk_scale, _cum_split, _inv_norms, _op, _seq_load, _seq_store


@triton.jit
def _raw_row_scales(qr, kr, gs, scale, L2: tl.constexpr):
    """Row scales of one chunk's raw q and k rows [BT, K] (0 past the end), from its log-decays gs [BT]:
    (qs, sk) with Qg = diag(qs) Q, qs = scale rq e^b, and Kd = diag(sk) K, sk = rk e^{bL - b} (rq, rk: inverse
    l2 norms when L2, else 1)."""
    gc, _gcl, _gL, ged = _cum_split(gs)
    qs = scale * tl.exp(gc)
    sk = tl.exp(ged)
    if L2:
        qs *= _inv_norms(qr)
        sk *= _inv_norms(kr)
    return qs, sk


@triton.jit(do_not_specialize=["NCH"])
def _recur_fwd(
    g, Wbuf, Ubuf, Kd, SK, h0, ht, hbuf, vnbuf, cu, chunk_off, NCH,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, LOWP: tl.constexpr, CHANNEL: tl.constexpr = False,
):
    """Carries S over one sequence's chunks: stores S (chunk-initial, to hbuf) and Vn = U - W S (to vnbuf), then
    S <- e^{bL} S + Kd^T Vn. GDN: g the per-token log-decays [tokens, HV], Kd the raw k [tokens, H, K] and SK its
    row scales s_k [tokens, HV] fp32, W stored as W / m (`_chunk_scale`: Vn = U - m (W / m) S). CHANNEL (KDA):
    g the per-chunk total log-decay per key channel [chunks, HV, K] (S decays by row), Kd the scaled keys
    [tokens, HV, K], SK unused. LOWP: dot operands in the 16-bit storage dtype (else fp32 at PREC); the state and
    every accumulator stay fp32."""
    DT: tl.constexpr = Wbuf.dtype.element_ty
    iv = tl.program_id(0)
    inh = tl.program_id(1)
    n = inh // HV
    ihv = inh % HV
    ih = ihv // (HV // H)
    bos = tl.load(cu + n).to(tl.int64)
    eos = tl.load(cu + n + 1).to(tl.int64)
    Tn = (eos - bos).to(tl.int32)
    c0 = tl.load(chunk_off + n).to(tl.int64)
    rows = tl.arange(0, BT)
    offs_k = tl.arange(0, K)
    offs_v = iv * BV + tl.arange(0, BV)
    s_off = offs_k[:, None] * V + offs_v[None, :]
    if HAS_H0:
        S = tl.load(h0 + (n * HV + ihv).to(tl.int64) * K * V + s_off)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    # loop bound is the longest sequence's chunk count (a launch argument); chunks past this sequence's end
    # have no valid rows and leave S unchanged
    for c in range(NCH):
        t0 = c * BT
        nval = Tn - t0
        live = nval > 0  # chunks past this sequence's end touch no memory (their tiles are empty)
        tl.store(hbuf + ((c0 + c) * HV + ihv) * K * V + s_off, S.to(hbuf.dtype.element_ty),
                 mask=(offs_k < tl.where(live, K, 0))[:, None])
        if CHANNEL:
            dec = tl.exp(tl.load(g + ((c0 + c) * HV + ihv) * K + offs_k, mask=offs_k < tl.where(live, K, 0),
                                 other=0.0))[:, None]
            kd = _seq_load(Kd, bos, Tn, t0, ihv * K, HV * K, BT, K)
        else:
            gs = tl.load(g + (bos + t0 + rows) * HV + ihv, mask=rows < nval, other=0.0).to(tl.float32)
            dec = tl.exp(tl.sum(gs, 0))
            sk = tl.load(SK + (bos + t0 + rows) * HV + ihv, mask=rows < nval, other=0.0)
            kd = _seq_load(Kd, bos, Tn, t0, ih * K, H * K, BT, K)
        W = _seq_load(Wbuf, bos, Tn, t0, ihv * K, HV * K, BT, K)
        U = _seq_load(Ubuf, bos, Tn, t0, ihv * V + iv * BV, HV * V, BT, BV)
        if CHANNEL:
            vn = U.to(tl.float32) - tl.dot(_op(W, DT, LOWP), _op(S, DT, LOWP), input_precision=PREC)
        else:
            m = _chunk_scale(g, bos + t0, ihv, HV, live)
            vn = U.to(tl.float32) - m * tl.dot(_op(W, DT, LOWP), _op(S, DT, LOWP), input_precision=PREC)
        _seq_store(vnbuf, vn, bos, Tn, t0, ihv * V + iv * BV, HV * V, BT, BV)
        if CHANNEL:
            S = S * dec + tl.dot(tl.trans(_op(kd, DT, LOWP)), _op(vn, DT, LOWP), input_precision=PREC)
        else:  # raw keys: their scales go onto Vn's rows
            S = S * dec + tl.dot(tl.trans(_op(kd, DT, LOWP)), _op(vn * sk[:, None], DT, LOWP), input_precision=PREC)
    if STORE_HT:
        tl.store(ht + (n * HV + ihv).to(tl.int64) * K * V + s_off, S)


@triton.jit(do_not_specialize=["NCH"])
def _recur_bwd(
    g, Wbuf, Qg, Kd, Pb, do, dht, dh0, dhbuf, dvnbuf, cu, chunk_off, NCH,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, LOWP: tl.constexpr, CHANNEL: tl.constexpr = False,
    scale=1.0, L2: tl.constexpr = False,
):
    """Reverse recurrence of the state gradient dS [K, BV] over the forward's tiles (Qg, Kd, P, W):
    dVn = P^T dO + Kd dS', dS <- e^{bL} dS' + Qg^T dO - W^T dVn. Stores dS' of every chunk and dVn. GDN takes W as
    W / m (`_chunk_scale`) and computes dS = m ((e^{bL} / m) dS' + Q^T (qs / m) dO - (W / m)^T dVn): each 16-bit
    operand in range however strong the chunk's first decay.
    GDN: Qg and Kd are the raw q and k ([tokens, H, K]); their row scales (`_raw_row_scales`) go onto dO's rows
    (Qg^T dO = Q^T (qs dO)) and onto the rows of K dS' (Kd dS' = sk K dS'), and the raw 16-bit rows are exact dot
    operands. CHANNEL (KDA): g as in `_recur_fwd`, Qg and Kd the scaled tiles [tokens, HV, K]."""
    DT: tl.constexpr = dhbuf.dtype.element_ty
    iv = tl.program_id(0)
    inh = tl.program_id(1)
    n = inh // HV
    ihv = inh % HV
    bos = tl.load(cu + n).to(tl.int64)
    eos = tl.load(cu + n + 1).to(tl.int64)
    Tn = (eos - bos).to(tl.int32)
    c0 = tl.load(chunk_off + n).to(tl.int64)
    rows = tl.arange(0, BT)
    offs_k = tl.arange(0, K)
    offs_v = iv * BV + tl.arange(0, BV)
    if HAS_DHT:
        dS = tl.load(dht + (n * HV + ihv).to(tl.int64) * K * V + offs_k[:, None] * V + offs_v[None, :])
    else:
        dS = tl.zeros([K, BV], dtype=tl.float32)
    for ci in range(NCH):
        c = NCH - 1 - ci
        t0 = c * BT
        nval = Tn - t0
        live = nval > 0
        # gradient of the state after chunk c
        tl.store(dhbuf + ((c0 + c) * HV + ihv) * K * V + offs_k[:, None] * V + offs_v[None, :],
                 dS.to(dhbuf.dtype.element_ty), mask=(offs_k < tl.where(live, K, 0))[:, None])
        W = _seq_load(Wbuf, bos, Tn, t0, ihv * K, HV * K, BT, K)
        dO = _seq_load(do, bos, Tn, t0, ihv * V + iv * BV, HV * V, BT, BV)
        P = _chunk_p(Pb, c0 + c, HV, ihv, live, rows, BT)
        dO_d = _op(dO, DT, LOWP)
        if CHANNEL:
            dec = tl.exp(tl.load(g + ((c0 + c) * HV + ihv) * K + offs_k, mask=offs_k < tl.where(live, K, 0),
                                 other=0.0))[:, None]
            kd = _seq_load(Kd, bos, Tn, t0, ihv * K, HV * K, BT, K)
            qg = _seq_load(Qg, bos, Tn, t0, ihv * K, HV * K, BT, K)
            dvn = tl.dot(tl.trans(_op(P, DT, LOWP)), dO_d, input_precision=PREC) + \
                tl.dot(_op(kd, DT, LOWP), _op(dS, DT, LOWP), input_precision=PREC)
            dQ_d = dO_d
            m = 1.0
        else:
            gs = tl.load(g + (bos + t0 + rows) * HV + ihv, mask=rows < nval, other=0.0).to(tl.float32)
            dec = tl.exp(tl.sum(gs, 0))
            ih = ihv // (HV // H)
            kd = _seq_load(Kd, bos, Tn, t0, ih * K, H * K, BT, K)
            qg = _seq_load(Qg, bos, Tn, t0, ih * K, H * K, BT, K)
            qs, sk = _raw_row_scales(qg, kd, gs, scale, L2)
            dvn = tl.dot(tl.trans(_op(P, DT, LOWP)), dO_d, input_precision=PREC) + \
                tl.dot(_op(kd, DT, LOWP), _op(dS, DT, LOWP), input_precision=PREC) * sk[:, None]
            m = _chunk_scale(g, bos + t0, ihv, HV, live)
            dec = dec / m
            dQ_d = _op(dO * (qs / m)[:, None], DT, LOWP)
        _seq_store(dvnbuf, dvn, bos, Tn, t0, ihv * V + iv * BV, HV * V, BT, BV)
        dS = m * (dS * dec + tl.dot(tl.trans(_op(qg, DT, LOWP)), dQ_d, input_precision=PREC)
                  - tl.dot(tl.trans(_op(W, DT, LOWP)), _op(dvn, DT, LOWP), input_precision=PREC))
    if STORE_DH0:
        tl.store(dh0 + (n * HV + ihv).to(tl.int64) * K * V + offs_k[:, None] * V + offs_v[None, :], dS)


BWD_GATE_ROWS = 4  # rows of a chunk's block in `_bwd_gate_rows`' buffer (a TMA box side is a power of two)


@triton.jit
def _bwd_gate_rows(q, k, g, G, cu, chunk_seq, chunk_start, scale, H, HV, K: tl.constexpr, BT: tl.constexpr,
                   L2: tl.constexpr):
    """The row scales `_recur_bwd` (GDN) computes per chunk, written for every chunk ic and value head ihv (grid
    (chunks, HV)) to G [chunks * HV, 4, BT] fp32 at slot ic * HV + ihv, with m the chunk's scale (`_chunk_scale`):
        row 0: qs / m = scale rq e^b / m,   row 1: sk = rk e^{bL - b},   row 2: e^{bL} / m in every column,
        row 3: m for the sequence's tokens, 0 past its end (rows 0 and 1 are 0 there too)."""
    ic = tl.program_id(0)
    ihv = tl.program_id(1)
    ih = ihv // (HV // H)
    _n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
    gs = tl.load(g + r64 * HV + ihv, mask=rmask, other=0.0).to(tl.float32)
    if L2:
        qr = _seq_load(q, bos, nval, 0, ih * K, H * K, BT, K)
        kr = _seq_load(k, bos, nval, 0, ih * K, H * K, BT, K)
    else:  # the raw rows are read only for their norms
        qr = gs
        kr = gs
    qs, sk = _raw_row_scales(qr, kr, gs, scale, L2)
    m = _chunk_scale(g, bos, ihv, HV, nval > 0)
    qs = qs / m
    dec = tl.exp(tl.sum(gs, 0)) / m
    base = G + (ic * HV + ihv).to(tl.int64) * (4 * BT)  # 4: BWD_GATE_ROWS
    tl.store(base + rows, tl.where(rmask, qs, 0.0))
    tl.store(base + BT + rows, tl.where(rmask, sk, 0.0))
    tl.store(base + 2 * BT + rows, tl.zeros([BT], dtype=tl.float32) + dec)
    tl.store(base + 3 * BT + rows, tl.where(rmask, m, 0.0))
