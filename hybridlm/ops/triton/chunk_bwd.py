"""GDN's chunk backward, every chunk in parallel after `state_pass._recur_bwd` has made dS' (the state gradient
after each chunk) and dVn: two launches per (chunk, value head), each walking K in blocks of BK channels.
1. `_chunk_bwd_state_blk`: the paths through the state write S' = e^{bL} S + Kd^T Vn, through Vn = U - W S,
   W = T diag(beta gamma) K^, U = T diag(beta) V and T = (I + A)^{-1}: dv and dbeta final, dk's part parked in an
   fp32 buffer, dg's part finished, dKK + dKK^T parked [BT, BT].
2. `_chunk_bwd_out_blk`: the output's paths O = diag(scale gamma) Q^ S + P Vn, then dq, dk and dg finished.
The `_bwd_*_blk` helpers (V loops for one K block) are shared with KDA's backward (`kda_bwd.py`).

Non-standard: everything per key channel (dKd, dW, dQS, dq, dk) is local to a block of BK channels, and everything
that mixes channels is a sum over them (dT += dW Kb^T, K K^T, Q K^T, the row sums of the decay gradient and of the
l2 norm's backward). q and k enter the dots raw (16-bit inputs: exact products) with the norms as row/column scales
of the [BT, BT] operands. The extra reads are of the chunk's own tiles, from cache:
- the l2 norm's backward dx = (dx^ - x^ s) r needs s_i = sum_d x^_id dx^_id before any block is final. For dk,
  every term of s is already a [BT] sum of the state launch (r, t bg, the UT part) or of the output launch's
  R = dPg * Q^K^^T (column sums): the state launch passes its share on in a [BT] vector per chunk (dsk);
- for dq, s_i = scale gamma_i q^_i . dQS_i + rowsum(R)_i: the output launch walks K twice, the first pass for
  q^ . dQS and Q K^T, the second (dQS = dO S^T again, from cache) for dq and dk.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_jit import _chunk_gates, _chunk_rows, _cum_split, _dg_rows, _load_raw, _op, _pair_exponent, _row_inv_norms


@triton.jit
def _bwd_u_blk(v, dvnbuf, dv, Tt_d, bb, r64, rmask, ihv, HV, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
               PREC: tl.constexpr, LOWP: tl.constexpr):
    """The paths through U = T diag(beta) V, over V blocks (Tt_d: T^T as a dot operand): stores
    dv = diag(beta) T^T dVn; returns dT = dVn (diag(beta) V)^T and beta's gradient through U."""
    DT: tl.constexpr = dvnbuf.dtype.element_ty
    dT = tl.zeros([BT, BT], dtype=tl.float32)
    db = tl.zeros([BT], dtype=tl.float32)
    for v0 in range(0, V, BV):
        vrow = (r64[:, None] * HV + ihv) * V + v0 + tl.arange(0, BV)[None, :]
        dvn_d = _op(tl.load(dvnbuf + vrow, mask=rmask[:, None], other=0.0), DT, LOWP)
        vv = tl.load(v + vrow, mask=rmask[:, None], other=0.0).to(tl.float32)
        dT += tl.dot(dvn_d, tl.trans(_op(vv * bb[:, None], DT, LOWP)), input_precision=PREC)
        dVb = tl.dot(Tt_d, dvn_d, input_precision=PREC)
        tl.store(dv + vrow, (dVb * bb[:, None]).to(dv.dtype.element_ty), mask=rmask[:, None])
        db += tl.sum(vv * dVb, 1)
    return dT, db


@triton.jit
def _bwd_kd_blk(hbuf, dhbuf, vnbuf, hb, r64, rmask, ihv, HV, offs, V: tl.constexpr, BT: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr):
    """For the key channels offs, over V blocks: dKd = Vn dS'^T [BT, BK] (the state write's read of Kd) and the
    channels' sum of S * dS' [BK] (the state's decay)."""
    DT: tl.constexpr = hbuf.dtype.element_ty
    dKd = tl.zeros([BT, BK], dtype=tl.float32)
    dss = tl.zeros([BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        offs_v = v0 + tl.arange(0, BV)
        s_off = hb + offs[:, None] * V + offs_v[None, :]
        S = tl.load(hbuf + s_off)
        dSn = tl.load(dhbuf + s_off)
        vn_d = _op(tl.load(vnbuf + (r64[:, None] * HV + ihv) * V + offs_v[None, :], mask=rmask[:, None], other=0.0),
                   DT, LOWP)
        dKd += tl.dot(vn_d, tl.trans(_op(dSn, DT, LOWP)), input_precision=PREC)
        dss += tl.sum(S.to(tl.float32) * dSn.to(tl.float32), 1)
    return dKd, dss


@triton.jit
def _bwd_w_blk(hbuf, dvnbuf, hb, r64, rmask, ihv, HV, offs, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr):
    """dW = -dVn S^T [BT, BK] for the key channels offs (Vn = U - W S), over V blocks."""
    DT: tl.constexpr = hbuf.dtype.element_ty
    dW = tl.zeros([BT, BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        offs_v = v0 + tl.arange(0, BV)
        S_d = _op(tl.load(hbuf + hb + offs[:, None] * V + offs_v[None, :]), DT, LOWP)
        dvn_d = _op(tl.load(dvnbuf + (r64[:, None] * HV + ihv) * V + offs_v[None, :], mask=rmask[:, None],
                            other=0.0), DT, LOWP)
        dW -= tl.dot(dvn_d, tl.trans(S_d), input_precision=PREC)
    return dW


@triton.jit
def _bwd_dqs_blk(hbuf, do, hb, r64, rmask, ihv, HV, offs, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr):
    """dQS = dO S^T [BT, BK] for the key channels offs (the output's read of the chunk-initial state S), over V
    blocks."""
    DT: tl.constexpr = hbuf.dtype.element_ty
    dQS = tl.zeros([BT, BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        offs_v = v0 + tl.arange(0, BV)
        S_d = _op(tl.load(hbuf + hb + offs[:, None] * V + offs_v[None, :]), DT, LOWP)
        dO_d = _op(tl.load(do + (r64[:, None] * HV + ihv) * V + offs_v[None, :], mask=rmask[:, None], other=0.0),
                   DT, LOWP)
        dQS += tl.dot(dO_d, tl.trans(S_d), input_precision=PREC)
    return dQS


@triton.jit
def _bwd_dp(vnbuf, do, r64, rmask, ihv, HV, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
            PREC: tl.constexpr, LOWP: tl.constexpr):
    """dP = dO Vn^T [BT, BT] (the intra-chunk attention's gradient), over V blocks."""
    DT: tl.constexpr = vnbuf.dtype.element_ty
    dP = tl.zeros([BT, BT], dtype=tl.float32)
    for v0 in range(0, V, BV):
        vrow = (r64[:, None] * HV + ihv) * V + v0 + tl.arange(0, BV)[None, :]
        vn_d = _op(tl.load(vnbuf + vrow, mask=rmask[:, None], other=0.0), DT, LOWP)
        dO_d = _op(tl.load(do + vrow, mask=rmask[:, None], other=0.0), DT, LOWP)
        dP += tl.dot(dO_d, tl.trans(vn_d), input_precision=PREC)
    return dP


@triton.jit
def _chunk_bwd_state_blk(
    k, v, g, beta, Tbuf, hbuf, dhbuf, vnbuf, dvnbuf, dkp, dv, dg, dbeta, dKKbuf, dsk,
    cu, chunk_seq, chunk_start,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
):
    """The first launch (the state write S' = e^{bL} S + Kd^T Vn, Vn = U - W S, W = T diag(beta gamma) K^,
    U = T diag(beta) V, T = (I + A)^{-1}), in three parts: 1. over V blocks, through U
    (dv, dT, beta); 2. per K block (each with its V loop for dKd, dW): dk's parts through Kd and W to dkp (fp32),
    dT += dW Kb^T, K K^T summed raw; 3. dA = -T^T dT T^T: dbeta final, dg's part of these paths finished
    (`_dg_rows`) in dg, dKK + dKK^T parked in dKKbuf and, with L2, this launch's share of sum_d k^_id dk^_id in dsk
    [tokens, HV]."""
    DT: tl.constexpr = hbuf.dtype.element_ty
    ic = tl.program_id(0)
    ihv = tl.program_id(1)
    ih = ihv // (HV // H)
    n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
    blk = (ic * HV + ihv).to(tl.int64)
    hb = blk * K * V
    gc, gcl, gL, ged, bb = _chunk_gates(g, beta, r64, rmask, ihv, HV)
    rk = _row_inv_norms(k, r64, rmask, H * K, ih * K, K, BK, BT, L2)
    # T enters every dot transposed: loaded as T^T (a plain operand, no transposed copy held through the loops)
    Tt_d = _op(tl.load(Tbuf + blk * BT * BT + rows[None, :] * BT + rows[:, None]), DT, LOWP)
    # 1. U = T diag(beta) V
    dT, db = _bwd_u_blk(v, dvnbuf, dv, Tt_d, bb, r64, rmask, ihv, HV, V, BT, BV, PREC, LOWP)
    # 2a. per K block, Kd = K^ e^{bL - b} and S's decay e^{bL}: dk's part to dkp
    ed = tl.exp(ged)
    r = tl.zeros([BT], dtype=tl.float32)
    dss = tl.zeros([BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs = k0 + tl.arange(0, BK)
        dKd, dss_b = _bwd_kd_blk(hbuf, dhbuf, vnbuf, hb, r64, rmask, ihv, HV, offs, V, BT, BK, BV, PREC, LOWP)
        dss += dss_b
        kk = _load_raw(k, r64, rmask, H * K, ih * K, offs).to(tl.float32) * rk[:, None]
        r += tl.sum(kk * dKd, 1)
        tl.store(dkp + (r64[:, None] * HV + ihv) * K + offs[None, :], dKd * ed[:, None], mask=rmask[:, None])
    # 2b. per K block, W = T Kb with Kb = diag(beta gamma) K^: dT += dW Kb^T, dk's part added to dkp (its own
    # block of 2a, back from cache). Two K walks instead of one: each holds one [BT, BK] accumulator
    gam = tl.exp(gc)
    bg = bb * gam
    t = tl.zeros([BT], dtype=tl.float32)
    # 2b reads back what 2a stored, in the layout of another dot: other threads' global stores, which the CUDA
    # memory model makes visible to the CTA only after a barrier
    tl.debug_barrier()
    for k0 in range(0, K, BK):
        offs = k0 + tl.arange(0, BK)
        dW_d = _op(_bwd_w_blk(hbuf, dvnbuf, hb, r64, rmask, ihv, HV, offs, V, BT, BK, BV, PREC, LOWP), DT, LOWP)
        kk = _load_raw(k, r64, rmask, H * K, ih * K, offs).to(tl.float32) * rk[:, None]
        dT += tl.dot(dW_d, tl.trans(_op(kk * bg[:, None], DT, LOWP)), input_precision=PREC)
        dKb = tl.dot(Tt_d, dW_d, input_precision=PREC)
        t += tl.sum(kk * dKb, 1)
        p_dk = dkp + (r64[:, None] * HV + ihv) * K + offs[None, :]
        tl.store(p_dk, tl.load(p_dk, mask=rmask[:, None], other=0.0) + dKb * bg[:, None], mask=rmask[:, None])
    r = r * ed
    c = tl.exp(gL) * tl.sum(dss, 0)
    db += t * gam
    dgc = t * bg
    # 3. T = (I + A)^{-1}: dA = -T^T dT T^T on the strict lower part; A = strict(diag(beta) K^ K^^T e^{b_i - b_j}),
    # K K^T summed over K blocks on the raw rows (after the loops, which then hold no [BT, BT] sum of their own)
    dA = -tl.dot(_op(tl.dot(Tt_d, _op(dT, DT, LOWP), input_precision=PREC), DT, LOWP), Tt_d, input_precision=PREC)
    strict = rows[:, None] > rows[None, :]
    dAG = tl.where(strict, dA * tl.exp(_pair_exponent(gc, gcl, strict)), 0.0)
    KK = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        b_k = _load_raw(k, r64, rmask, H * K, ih * K, k0 + tl.arange(0, BK))
        KK += tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
    RA = dAG * KK * rk[:, None] * rk[None, :]
    db += tl.sum(RA, 1)
    RA = RA * bb[:, None]  # = dKK * K^K^^T, dKK = diag(beta) dAG (A's gradient in K^ K^^T)
    dKK = dAG * bb[:, None]
    p_TT = blk * BT * BT + rows[:, None] * BT + rows[None, :]
    tl.store(dKKbuf + p_TT, (dKK + tl.trans(dKK)).to(dKKbuf.dtype.element_ty))
    dgc += tl.sum(RA, 1) - tl.sum(RA, 0)
    if L2:  # sum_d k^_id dk^_id of this launch's parts (Kd, W, A), for the l2 norm's backward in the output launch
        tl.store(dsk + r64 * HV + ihv, r + t * bg + tl.sum(RA, 1) + tl.sum(RA, 0), mask=rmask)
    tl.store(dg + r64 * HV + ihv, _dg_rows(tl.where(rmask, dgc, 0.0), r, c), mask=rmask)
    tl.store(dbeta + r64 * HV + ihv, db, mask=rmask)


@triton.jit
def _chunk_bwd_out_blk(
    q, k, g, hbuf, vnbuf, do, dq, dk, dkp, dg, dKKbuf, dsk,
    cu, chunk_seq, chunk_start, scale,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
):
    """The second launch: the output's paths O = diag(scale gamma) Q^ S + P Vn,
    P = scale (Q^ K^^T) e^{b_i - b_j} (j <= i), and the finish of `_chunk_bwd_state_blk`'s dk (dkp, dKK + dKK^T,
    the l2 norm's backward) and dg (its own part's reverse cumsum added). Pass 1 over K blocks sums Q K^T (raw)
    and q . dQS per row (dQS = dO S^T per K block); with dP = dO Vn^T (over V blocks) they give R = dPg * Q^K^^T
    and the l2 norms' row sums; pass 2 computes dQS again and writes dq and dk per K block."""
    DT: tl.constexpr = hbuf.dtype.element_ty
    ic = tl.program_id(0)
    ihv = tl.program_id(1)
    ih = ihv // (HV // H)
    n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
    hb = (ic * HV + ihv).to(tl.int64) * K * V
    gc, gcl, _gL, _ged = _cum_split(tl.load(g + r64 * HV + ihv, mask=rmask, other=0.0).to(tl.float32))
    s_q = scale * tl.exp(gc)  # row scale of the state read: O += diag(scale gamma) Q^ S
    rq = _row_inv_norms(q, r64, rmask, H * K, ih * K, K, BK, BT, L2)
    rk = _row_inv_norms(k, r64, rmask, H * K, ih * K, K, BK, BT, L2)
    incl = rows[:, None] >= rows[None, :]
    # pass 1: Q K^T and q . dQS, summed over K blocks on the raw rows
    QK = tl.zeros([BT, BT], dtype=tl.float32)
    a = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs = k0 + tl.arange(0, BK)
        dQS = _bwd_dqs_blk(hbuf, do, hb, r64, rmask, ihv, HV, offs, V, BT, BK, BV, PREC, LOWP)
        b_q = _load_raw(q, r64, rmask, H * K, ih * K, offs)
        b_k = _load_raw(k, r64, rmask, H * K, ih * K, offs)
        QK += tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
        a += tl.sum(b_q.to(tl.float32) * dQS, 1)
    a = a * rq * s_q  # sum_d q^_id dq^_id through the state read
    # dP = dO Vn^T, after pass 1 (which then holds one [BT, BT] sum, not two)
    dP = _bwd_dp(vnbuf, do, r64, rmask, ihv, HV, V, BT, BV, PREC, LOWP)
    dPg = tl.where(incl, dP * tl.exp(_pair_exponent(gc, gcl, incl)) * scale, 0.0)
    R = dPg * QK * rq[:, None] * rk[None, :]
    if L2:  # R's diagonal, for the l2 norms' row sums below; dg leaves it out (`_row_minus_col`)
        rd = tl.sum(tl.where(rows[:, None] == rows[None, :], R, 0.0), 1)
    R = tl.where(rows[:, None] != rows[None, :], R, 0.0)
    rs, cs = tl.sum(R, 1), tl.sum(R, 0)
    dgc = a + rs - cs
    if L2:
        sq = a + rs + rd  # sum_d q^_id dq^_id
        sk = tl.load(dsk + r64 * HV + ihv, mask=rmask, other=0.0) + cs + rd
    # [BT, BT] operands with the norms as scales, so the dots take raw rows: dq^ += dPg K^ = (dPg diag(rk)) K,
    # dk^ += dPg^T Q^ = (diag(rq) dPg)^T Q and (dKK + dKK^T) K^ = ((dKK + dKK^T) diag(rk)) K
    dPk_d = _op(dPg * rk[None, :], DT, LOWP)
    dPq_d = _op(dPg * rq[:, None], DT, LOWP)
    p_TT = (ic * HV + ihv).to(tl.int64) * BT * BT + rows[:, None] * BT + rows[None, :]
    M_d = _op(tl.load(dKKbuf + p_TT).to(tl.float32) * rk[None, :], DT, LOWP)
    # pass 2: dq and dk per K block
    for k0 in range(0, K, BK):
        offs = k0 + tl.arange(0, BK)
        krow = (r64[:, None] * HV + ihv) * K + offs[None, :]
        dQS = _bwd_dqs_blk(hbuf, do, hb, r64, rmask, ihv, HV, offs, V, BT, BK, BV, PREC, LOWP)
        b_q = _load_raw(q, r64, rmask, H * K, ih * K, offs)
        b_k = _load_raw(k, r64, rmask, H * K, ih * K, offs)
        b_dq = dQS * s_q[:, None] + tl.dot(dPk_d, _op(b_k, DT, LOWP), input_precision=PREC)
        if L2:
            b_dq = (b_dq - b_q.to(tl.float32) * (rq * sq)[:, None]) * rq[:, None]
        tl.store(dq + krow, b_dq.to(dq.dtype.element_ty), mask=rmask[:, None])
        b_dk = tl.load(dkp + krow, mask=rmask[:, None], other=0.0)
        b_dk += tl.dot(tl.trans(dPq_d), _op(b_q, DT, LOWP), input_precision=PREC)
        b_dk += tl.dot(M_d, _op(b_k, DT, LOWP), input_precision=PREC)
        if L2:
            b_dk = (b_dk - b_k.to(tl.float32) * (rk * sk)[:, None]) * rk[:, None]
        tl.store(dk + krow, b_dk.to(dk.dtype.element_ty), mask=rmask[:, None])
    dgc = tl.where(rmask, dgc, 0.0)
    dg_state = tl.load(dg + r64 * HV + ihv, mask=rmask, other=0.0)  # finished by the state launch (`_dg_rows`)
    tl.store(dg + r64 * HV + ihv, tl.cumsum(dgc, 0, reverse=True) + dg_state, mask=rmask)
