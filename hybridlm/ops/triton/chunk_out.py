"""The output of every chunk at once, after the serial state pass: O = diag(gamma) Q^ S + P Vn per chunk and V
block, from the stored chunk-initial states S and corrected values Vn, off the serial path.

- `_out_fwd_raw` (GDN): from the raw q and k; it makes the intra-chunk attention
  P = scale (Q^ K^^T * e^{b_i - b_j}, j <= i) itself and, in a training forward, stores P for the backward.
- `_out_fwd` (KDA): from the scaled tiles Qg and P that KDA's prep makes (they carry its per-channel decay).
Non-standard: Q S is taken on the raw q rows and scaled by row afterwards (qs = scale rq e^b), so a 16-bit q is an
exact dot operand instead of a rounded scaled copy.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_jit import _chunk_rows, _cum_split, _inv_norms, _op, _pair_exponent, _seq_load


@triton.jit
def _q_raw_scaled(q, b_k, rk, gc, gcl, bos, Tn, t0, col0, stride, scale, K: tl.constexpr, BT: tl.constexpr,
                  L2: tl.constexpr, PREC: tl.constexpr):
    """Of one chunk, from the raw q rows and the raw k tile b_k [BT, K]: (Q raw, its row scales qs = scale rq e^b, and
    P = scale rq_i rk_j (Q K^T)_ij e^{b_i - b_j} for j <= i, [BT, BT] fp32). Q S is then (Q_raw S) * qs: the raw
    16-bit rows are exact dot operands (no rounding of a scaled copy)."""
    rows = tl.arange(0, BT)
    b_q = _seq_load(q, bos, Tn, t0, col0, stride, BT, K)
    if L2:
        rq = _inv_norms(b_q) * scale
    else:
        rq = tl.full([BT], 1.0, tl.float32) * scale
    incl = rows[:, None] >= rows[None, :]
    P = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
    P = tl.where(incl, P * tl.exp(_pair_exponent(gc, gcl, incl)) * rq[:, None] * rk[None, :], 0.0)
    return b_q, rq * tl.exp(gc), P


@triton.jit
def _out_fwd_raw(
    q, k, g, RK, hbuf, vnbuf, o, Pb, cu, chunk_seq, chunk_start, scale,
    H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    LOWP: tl.constexpr, L2: tl.constexpr, STORE_P: tl.constexpr = False,
):
    """O = diag(qs) Q S + P Vn of one chunk and V block (grid V/BV x chunks x HV; `_q_raw_scaled`) from the raw q
    and k and the key norms RK (`wy._wu_fwd`). STORE_P (a training forward): the first V block's program also
    writes P to Pb for the backward."""
    DT: tl.constexpr = hbuf.dtype.element_ty
    iv = tl.program_id(0)
    ic = tl.program_id(1)
    ihv = tl.program_id(2)
    ih = ihv // (HV // H)
    n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
    gc, gcl, _gL, _ged = _cum_split(tl.load(g + r64 * HV + ihv, mask=rmask, other=0.0).to(tl.float32))
    rk = tl.load(RK + r64 * HV + ihv, mask=rmask, other=0.0)
    b_k = _seq_load(k, bos, nval, 0, ih * K, H * K, BT, K)
    b_q, qs, P = _q_raw_scaled(q, b_k, rk, gc, gcl, bos, nval, 0, ih * K, H * K, scale, K, BT, L2, PREC)
    if STORE_P:
        if iv == 0:
            tl.store(Pb + (ic * HV + ihv).to(tl.int64) * BT * BT + rows[:, None] * BT + rows[None, :],
                     P.to(Pb.dtype.element_ty))
    offs_k = tl.arange(0, K)
    offs_v = iv * BV + tl.arange(0, BV)
    S = tl.load(hbuf + (ic * HV + ihv).to(tl.int64) * K * V + offs_k[:, None] * V + offs_v[None, :])
    vrow = (r64[:, None] * HV + ihv) * V + offs_v[None, :]
    vn = tl.load(vnbuf + vrow, mask=rmask[:, None], other=0.0)
    oo = tl.dot(_op(b_q, DT, LOWP), _op(S, DT, LOWP), input_precision=PREC) * qs[:, None]
    oo += tl.dot(_op(P, DT, LOWP), _op(vn, DT, LOWP), input_precision=PREC)
    tl.store(o + vrow, oo.to(o.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _out_fwd(
    Qg, Pb, hbuf, vnbuf, o, cu, chunk_seq, chunk_start,
    HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    LOWP: tl.constexpr,
):
    """O = Qg S + P Vn of one chunk and V block (grid V/BV x chunks x HV), from the chunk-initial state S and
    the corrected values Vn that `_recur_fwd` stored: every chunk in parallel, off the serial path."""
    DT: tl.constexpr = hbuf.dtype.element_ty
    iv = tl.program_id(0)
    ic = tl.program_id(1)
    ihv = tl.program_id(2)
    n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
    offs_k = tl.arange(0, K)
    offs_v = iv * BV + tl.arange(0, BV)
    blk = (ic * HV + ihv).to(tl.int64)
    qg = tl.load(Qg + (r64[:, None] * HV + ihv) * K + offs_k[None, :], mask=rmask[:, None], other=0.0)
    S = tl.load(hbuf + blk * K * V + offs_k[:, None] * V + offs_v[None, :])
    P = tl.load(Pb + blk * BT * BT + rows[:, None] * BT + rows[None, :])
    vrow = (r64[:, None] * HV + ihv) * V + offs_v[None, :]
    vn = tl.load(vnbuf + vrow, mask=rmask[:, None], other=0.0)
    oo = tl.dot(_op(qg, DT, LOWP), _op(S, DT, LOWP), input_precision=PREC)
    oo += tl.dot(_op(P, DT, LOWP), _op(vn, DT, LOWP), input_precision=PREC)
    tl.store(o + vrow, oo.to(o.dtype.element_ty), mask=rmask[:, None])
