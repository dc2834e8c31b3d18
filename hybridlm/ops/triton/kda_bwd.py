"""KDA's chunk backward, every chunk in parallel after `state_pass._recur_bwd` (CHANNEL) has made dS' and dVn:
`_kda_bwd_out_blk` (through O = (scale Q^ e^b) S + P Vn: dq final, dk's and db's parts) then `_kda_bwd_state_blk`
(through the state write, W, U and the UT transform: dv, dbeta final, dk and dg finished), each launched four times
over the same grid, one per decay form (`kda_decay._diag_pass`); the state backward reads the marks the output
backward wrote.

Non-standard: as in the prep, K is walked in blocks of BK channels with the l2 norms as row/column scales; the l2
norm's backward is applied in place at the end of each kernel (`_l2_bwd_blk`), since its row sums need every
block first. dq, dk, dg are fp32 [tokens, HV, K]: they are read back and added to within the launch. With Kimi's
gate inside the op the state backward's last pass applies the gate's backward where dg becomes final (GATE).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_bwd import _bwd_dp, _bwd_dqs_blk, _bwd_kd_blk, _bwd_u_blk, _bwd_w_blk
from .chunk_jit import _chunk_rows, _dg_rows, _load_rows, _op, _row_inv_norms
from .kda_decay import _cols_prod_blk, _diag_band, _diag_pass, _g_blk, _kimi_gate, _rows_prod_blk


@triton.jit
def _l2_bwd_blk(dx, x, r64, rmask, ihv, rx, s, HV, stride, col0, K: tl.constexpr, BK: tl.constexpr):
    """dx <- (dx - x^ s) r in place over K blocks: the l2 norm's backward (x^ = x r, s_i = sum_d x^_id dx_id).
    dx was just stored by this program in another layout: other threads' global stores, visible to the CTA only
    after a barrier (as in `chunk_bwd._chunk_bwd_state_blk`)."""
    tl.debug_barrier()
    for k0 in range(0, K, BK):
        offs = k0 + tl.arange(0, BK)
        row = (r64[:, None] * HV + ihv) * K + offs[None, :]
        xh = _load_rows(x, r64, rmask, stride, col0, offs, False) * rx[:, None]
        d = tl.load(dx + row, mask=rmask[:, None], other=0.0)
        tl.store(dx + row, (d - xh * s[:, None]) * rx[:, None], mask=rmask[:, None])


@triton.jit
def _kda_bwd_out_blk(
    q, k, g, hbuf, vnbuf, do, dq, dk, dg, redo, cu, chunk_seq, chunk_start, scale,
    H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr, DIAG: tl.constexpr,
):
    """Backward phase 1, through O = (scale Q^ e^b) S + P Vn: dP = dO Vn^T once, then per K block dQS = dO S^T,
    and the decay products of P's gradient. Stores dq (final), dk's part (through P) and db's part (dg buffer);
    phase 2 finishes dk and dg."""
    DT: tl.constexpr = hbuf.dtype.element_ty
    if _diag_pass(g, redo, cu, chunk_seq, chunk_start, HV, K, BK, BT, DIAG, False):
        ic = tl.program_id(0)
        ihv = tl.program_id(1)
        ih = ihv // (HV // H)
        n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
        hb = (ic * HV + ihv).to(tl.int64) * K * V
        rq = _row_inv_norms(q, r64, rmask, H * K, ih * K, K, BK, BT, L2)
        rk = _row_inv_norms(k, r64, rmask, H * K, ih * K, K, BK, BT, L2)
        dP = _bwd_dp(vnbuf, do, r64, rmask, ihv, HV, V, BT, BV, PREC, LOWP)
        # P's gradient below the diagonal through the decay products; its diagonal (exponent 0) goes straight to dq
        # and dk and never into db, where q_i N_ii k_i would cancel only to fp32 rounding (`_dg_rows`)
        N = tl.where(rows[:, None] > rows[None, :], dP * scale, 0.0)
        nd = tl.sum(tl.where(rows[:, None] == rows[None, :], dP, 0.0), 1) * scale
        Nr = N * rk[None, :]  # Y1_i = sum_{j<i} N_ij k^_j e^.. on raw rows of k
        Nc = N * rq[:, None]  # Y2_j = sum_{i>j} N_ij q^_i e^.. on raw rows of q
        bandR = _diag_band(Nr, BT, DIAG)
        bandC = _diag_band(tl.trans(Nc), BT, DIAG)
        sq = tl.zeros([BT], dtype=tl.float32)
        for k0 in range(0, K, BK):
            offs = k0 + tl.arange(0, BK)
            krow = (r64[:, None] * HV + ihv) * K + offs[None, :]
            dQS = _bwd_dqs_blk(hbuf, do, hb, r64, rmask, ihv, HV, offs, V, BT, BK, BV, PREC, LOWP)
            gg, gn = _g_blk(g, r64, nval, ihv, HV, K, k0, BK, BT)
            eb = tl.exp(tl.cumsum(gg, 0))
            qr = _load_rows(q, r64, rmask, H * K, ih * K, offs, False)
            kr = _load_rows(k, r64, rmask, H * K, ih * K, offs, False)
            qq = qr * rq[:, None]
            Y1 = _rows_prod_blk(Nr, bandR, kr, gg, gn, k, g, bos, nval, ihv, H * K, ih * K + k0, HV, K, k0, BK, BT,
                                True, PREC, DT, LOWP, DIAG)
            Y2 = _cols_prod_blk(Nc, bandC, qr, gg, gn, q, g, bos, nval, ihv, H * K, ih * K + k0, HV, K, k0, BK, BT,
                                True, PREC, DT, LOWP, DIAG)
            kk = kr * rk[:, None]
            dqn = dQS * eb * scale + Y1 + nd[:, None] * kk
            db = dQS * qq * eb * scale + qq * Y1 - kk * Y2
            sq += tl.sum(qq * dqn, 1)
            tl.store(dq + krow, dqn, mask=rmask[:, None])
            tl.store(dk + krow, Y2 + nd[:, None] * qq, mask=rmask[:, None])
            tl.store(dg + krow, db, mask=rmask[:, None])
        if L2:
            _l2_bwd_blk(dq, q, r64, rmask, ihv, rq, sq, HV, H * K, ih * K, K, BK)


@triton.jit
def _kda_bwd_state_blk(
    k, v, g, beta, Tbuf, BL, hbuf, dhbuf, vnbuf, dvnbuf, dk, dv, dg, dbeta, redo, cu, chunk_seq, chunk_start,
    raw, A_log, dt_bias, KR, lb, draw, dAp, ddtp,
    H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr, DIAG: tl.constexpr, MARKED: tl.constexpr = False,
    GATE: tl.constexpr = False, LB: tl.constexpr = False,
):
    """Backward phase 2 (MARKED: see `_diag_pass`): the state write S' = e^{bL} S + Kd^T Vn,
    W = T diag(beta) (K^ e^b), U = T diag(beta) V and the UT transform (dA = -T^T dT T^T), in three passes:
    1. over V blocks: dv = diag(beta) T^T dVn, dT = dVn (diag(beta) V)^T, beta's gradient through U;
    2. over K blocks (each with a V loop for dKd = Vn dS'^T, dW = -dVn S^T, rowsum(S * dS')): dT += dW Kb^T,
       the K and b gradients through Kd, S's decay and W, added to phase 1's parts in the dk and dg buffers; dg's
       part so far is finished there (`_dg_rows`);
    3. over K blocks, with the full dA: the decay products of A's gradient, whose db adds to dg by reverse cumsum,
       dk; then the l2 norm's backward of dk.
    GATE: g was made from Kimi's raw gate (`kda_decay._kimi_gate`): pass 3 stores the raw gate's gradient
    dg * dg/dx to draw (raw's dtype) instead of dg, this program's row sums of it to ddtp [chunks, HV, K] (-> dt_bias)
    and its sum of dg * dg/dA_log to dAp [chunks, HV] (fp32 partials, summed on the host: deterministic)."""
    DT: tl.constexpr = hbuf.dtype.element_ty
    if _diag_pass(g, redo, cu, chunk_seq, chunk_start, HV, K, BK, BT, DIAG, MARKED):
        ic = tl.program_id(0)
        ihv = tl.program_id(1)
        ih = ihv // (HV // H)
        n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
        hb = (ic * HV + ihv).to(tl.int64) * K * V
        rk = _row_inv_norms(k, r64, rmask, H * K, ih * K, K, BK, BT, L2)
        bb = tl.load(beta + r64 * HV + ihv, mask=rmask, other=0.0).to(tl.float32)
        p_T = Tbuf + (ic * HV + ihv).to(tl.int64) * BT * BT + rows[:, None] * BT + rows[None, :]
        Tm_d = _op(tl.load(p_T), DT, LOWP)
        # 1. through U
        dT, dbeta_ = _bwd_u_blk(v, dvnbuf, dv, tl.trans(Tm_d), bb, r64, rmask, ihv, HV, V, BT, BV, PREC, LOWP)
        # 2. through Kd, the state's decay and W, per K block
        for k0 in range(0, K, BK):
            offs = k0 + tl.arange(0, BK)
            krow = (r64[:, None] * HV + ihv) * K + offs[None, :]
            dKd, dSS = _bwd_kd_blk(hbuf, dhbuf, vnbuf, hb, r64, rmask, ihv, HV, offs, V, BT, BK, BV, PREC, LOWP)
            dW = _bwd_w_blk(hbuf, dvnbuf, hb, r64, rmask, ihv, HV, offs, V, BT, BK, BV, PREC, LOWP)
            gg, gn = _g_blk(g, r64, nval, ihv, HV, K, k0, BK, BT)
            kk = _load_rows(k, r64, rmask, H * K, ih * K, offs, False) * rk[:, None]
            eb = tl.exp(tl.cumsum(gg, 0))
            ed = tl.exp(tl.cumsum(gn, 0, reverse=True))  # e^{bL - b}, summed from g
            bL = tl.load(BL + (ic * HV + ihv).to(tl.int64) * K + offs)
            # Kd = K^ e^{bL - b}; S decays by e^{bL}
            t = dKd * kk * ed
            dkn = tl.load(dk + krow, mask=rmask[:, None], other=0.0) + dKd * ed
            db = tl.load(dg + krow, mask=rmask[:, None], other=0.0)
            # W = T Kb, Kb = diag(beta) K^ e^b
            kb = kk * eb * bb[:, None]
            dW_d = _op(dW, DT, LOWP)
            dT += tl.dot(dW_d, tl.trans(_op(kb, DT, LOWP)), input_precision=PREC)
            dKb = tl.dot(tl.trans(Tm_d), dW_d, input_precision=PREC)
            dkn += dKb * eb * bb[:, None]
            dbeta_ += tl.sum(dKb * kk * eb, 1)
            db += dKb * kb
            tl.store(dk + krow, dkn, mask=rmask[:, None])
            tl.store(dg + krow, _dg_rows(tl.where(rmask[:, None], db, 0.0), t, (tl.exp(bL) * dSS)[None, :]),
                     mask=rmask[:, None])
        # 3. T = (I + A)^{-1}; A_ij = beta_i sum_d k^_id k^_jd e^{b_id - b_jd} (j < i). Its K walk reads back the dk
        # and dg rows pass 2 stored, in other layouts: a barrier first makes other threads' stores visible
        tl.debug_barrier()
        dA = tl.where(rows[:, None] > rows[None, :],
                      -tl.dot(_op(tl.dot(tl.trans(Tm_d), _op(dT, DT, LOWP), input_precision=PREC), DT, LOWP),
                              tl.trans(Tm_d), input_precision=PREC), 0.0)
        Mr = dA * rk[None, :]  # X1_i = sum_j dA_ij k^_j e^..
        Mc = dA * (bb * rk)[:, None]  # X2_j = sum_i dA_ij beta_i k^_i e^..
        bandR = _diag_band(Mr, BT, DIAG)
        bandC = _diag_band(tl.trans(Mc), BT, DIAG)
        sk = tl.zeros([BT], dtype=tl.float32)
        sA = tl.zeros([BT], dtype=tl.float32)
        for k0 in range(0, K, BK):
            offs = k0 + tl.arange(0, BK)
            krow = (r64[:, None] * HV + ihv) * K + offs[None, :]
            gg, gn = _g_blk(g, r64, nval, ihv, HV, K, k0, BK, BT)
            kr = _load_rows(k, r64, rmask, H * K, ih * K, offs, False)
            kk = kr * rk[:, None]
            X1 = _rows_prod_blk(Mr, bandR, kr, gg, gn, k, g, bos, nval, ihv, H * K, ih * K + k0, HV, K, k0, BK, BT,
                                True, PREC, DT, LOWP, DIAG)
            dbeta_ += tl.sum(kk * X1, 1)
            X1 = X1 * bb[:, None]
            X2 = _cols_prod_blk(Mc, bandC, kr, gg, gn, k, g, bos, nval, ihv, H * K, ih * K + k0, HV, K, k0, BK, BT,
                                True, PREC, DT, LOWP, DIAG)
            dkn = tl.load(dk + krow, mask=rmask[:, None], other=0.0) + X1 + X2
            db = tl.where(rmask[:, None], kk * (X1 - X2), 0.0)
            sk += tl.sum(kk * dkn, 1)
            tl.store(dk + krow, dkn, mask=rmask[:, None])
            dg_done = tl.load(dg + krow, mask=rmask[:, None], other=0.0)  # finished in pass 2
            dgv = tl.cumsum(db, 0, reverse=True) + dg_done
            if GATE:  # the gate's backward here: dg is never written, nor read back by another launch
                _, dx, dgA = _kimi_gate(raw, A_log, dt_bias, r64, rmask, ihv, HV, K, KR, offs, lb, LB)
                dr = dgv * dx
                tl.store(draw + krow, dr.to(draw.dtype.element_ty), mask=rmask[:, None])
                tl.store(ddtp + (ic * HV + ihv).to(tl.int64) * K + offs, tl.sum(dr, 0))
                sA += tl.sum(dgv * dgA, 1)
            else:
                tl.store(dg + krow, dgv, mask=rmask[:, None])
        if GATE:
            tl.store(dAp + ic * HV + ihv, tl.sum(sA, 0))
        if L2:
            _l2_bwd_blk(dk, k, r64, rmask, ihv, rk, sk, HV, H * K, ih * K, K, BK)
        tl.store(dbeta + r64 * HV + ihv, dbeta_, mask=rmask)
