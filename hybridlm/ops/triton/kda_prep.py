"""KDA's chunk prep, everything of a chunk that does not depend on the state, in three launches per (chunk, value
head): `_kda_prep_ap` (Qg = scale Q^ e^b, Kd = K^ e^{bL - b}, bL, the intra-chunk attention P and A, staged in
memory; four launches, one per decay form, `kda_decay._diag_pass`), the UT solve (`ut_solve._solve_blocks`), then
`_kda_prep_wu` (W = T diag(beta) (K^ e^b), U = T diag(beta) V).

Non-standard: q and k are walked raw in blocks of BK key channels; the l2 norms enter as row/column scales of the
[BT, BT] sums, from a first pass over K. The cumulative log-decay b is recomputed from g wherever it is needed (a
cumsum of a tile that is loaded anyway) instead of being stored. W and U take fp32 operands (T is fp32 here).
With Kimi's gate inside the op, the first launch of `_kda_prep_ap` makes g from the raw gate before anything
reads it (GATE; `kda.py` says why g is written rather than recomputed).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_jit import _chunk_rows, _load_rows, _row_inv_norms
from .kda_decay import (
    _block_row,
    _diag_pass,
    _g_blk,
    _gate_store,
    _half_masks,
    _mid_sums,
    _off_exps_from,
    _off_parts,
    _same_block,
    _unband,
    _whole_sums,
)
from .wy import _tu_blk


@triton.jit
def _kda_prep_ap(
    q, k, g, beta, Tbuf, Qg, Kd, Pb, BL, redo, cu, chunk_seq, chunk_start, scale, raw, A_log, dt_bias, KR, lb,
    H, HV, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr,
    DIAG: tl.constexpr, GATE: tl.constexpr = False, LB: tl.constexpr = False,
):
    """Stage 1 of the K-blocked prep, per chunk: Qg = scale Q^ e^b, Kd = K^ e^{bL - b}, bL (BL), and
    the [BT, BT] sums over channels P_ij = scale sum_d q^_id k^_jd e^{b_id - b_jd} (j <= i, stored in Pb) and
    A_ij = beta_i sum_d k^_id k^_jd e^{b_id - b_jd} (j < i, staged in Tbuf for the solve). ^: l2-normalised.
    The off-diagonal blocks' factors come from `_off_parts` once per key block. DIAG 3: the
    chunks whose log-decays allow it (`_diag_pass`) as one masked dot for A and one for P per key block, through
    the chunk's middle row (`_whole_sums`), with no blocks at all; the later launches take the others. The 16- and
    8-row blocks' references are their middle rows (CENTRE False): centred as in the backward, they made the forward
    slower.
    GATE (the first launch only, DIAG 3): g is first made here from Kimi's raw gate (`kda_decay._gate_store`; raw,
    A_log, dt_bias, KR, lb, LB as in `_kimi_gate`) and written to g for every later launch and kernel to read."""
    if GATE:
        _gate_store(raw, A_log, dt_bias, g, cu, chunk_seq, chunk_start, HV, K, KR, lb, BK, BT, LB)
    if _diag_pass(g, redo, cu, chunk_seq, chunk_start, HV, K, BK, BT, DIAG, False, False):
        ic = tl.program_id(0)
        ihv = tl.program_id(1)
        ih = ihv // (HV // H)
        n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
        pos = rows % 16
        c16 = tl.arange(0, 16)
        rq = _row_inv_norms(q, r64, rmask, H * K, ih * K, K, BK, BT, L2)
        rk = _row_inv_norms(k, r64, rmask, H * K, ih * K, K, BK, BT, L2)
        A = tl.zeros([BT, BT], dtype=tl.float32)
        P = tl.zeros([BT, BT], dtype=tl.float32)
        Da = tl.zeros([BT, 16], dtype=tl.float32)  # diagonal blocks of A and P, as bands
        Dp = tl.zeros([BT, 16], dtype=tl.float32)
        blk = _same_block(BT)
        low = rows[:, None] > rows[None, :]
        diag = rows[:, None] == rows[None, :]
        for k0 in range(0, K, BK):
            offs = k0 + tl.arange(0, BK)
            krow = (r64[:, None] * HV + ihv) * K + offs[None, :]
            gg, gn = _g_blk(g, r64, nval, ihv, HV, K, k0, BK, BT)
            b = tl.cumsum(gg, 0)  # rows past the end add 0, so the last row is bL
            tl.store(BL + (ic * HV + ihv).to(tl.int64) * K + offs, tl.sum(tl.where(rows[:, None] == BT - 1, b, 0.0), 0))
            kr = _load_rows(k, r64, rmask, H * K, ih * K, offs, False)
            qr = _load_rows(q, r64, rmask, H * K, ih * K, offs, False)
            ed = tl.exp(tl.cumsum(gn, 0, reverse=True))  # e^{bL - b}, summed from g
            tl.store(Kd + krow, (kr * rk[:, None] * ed).to(Kd.dtype.element_ty), mask=rmask[:, None])
            tl.store(Qg + krow, (qr * (rq * scale)[:, None] * tl.exp(b)).to(Qg.dtype.element_ty), mask=rmask[:, None])
            if DIAG != 3:  # the off-diagonal 16-row blocks (DIAG 3 has no blocks)
                E, Yf, Tb = _off_parts(gg, gn, BT)
                for cb in tl.static_range(BT // 16 - 1):
                    xe, ye = _off_exps_from(E, Yf, Tb, cb, BT)
                    Y = kr * ye
                    A += tl.dot(kr * xe, tl.trans(Y), input_precision=PREC)
                    P += tl.dot(qr * xe, tl.trans(Y), input_precision=PREC)
            if DIAG == 1 or DIAG == 3:
                # one dot each, e^{b_i - b_j} = e^{s_i} e^{-s_j}: through the chunk's middle row for every pair (DIAG
                # 3) or through each 16-row block's for the pairs within it (DIAG 1); fp32 operands. Where j > i
                # the product may overflow, and the masks drop it
                if DIAG == 3:
                    s = _whole_sums(gg, gn, BT)
                    mA, mP = low, low | diag
                else:
                    s = _mid_sums(gg, gn, BT, 16, False)
                    mA, mP = blk & low, blk & (low | diag)
                Y = kr * tl.exp(-s)
                A += tl.where(mA, tl.dot(kr * tl.exp(s), tl.trans(Y), input_precision=PREC), 0.0)
                P += tl.where(mP, tl.dot(qr * tl.exp(s), tl.trans(Y), input_precision=PREC), 0.0)
            elif DIAG == 4:  # the diagonal blocks by their 8-row halves (`_diag_pass`), fp32 operands
                s = _mid_sums(gg, gn, BT, 8, False)
                same8, cross = _half_masks(BT)
                Y = kr * tl.exp(-s)
                A += tl.where(same8 & low, tl.dot(kr * tl.exp(s), tl.trans(Y), input_precision=PREC), 0.0)
                P += tl.where(same8 & (low | diag), tl.dot(qr * tl.exp(s), tl.trans(Y), input_precision=PREC), 0.0)
                Eh, Yh, _ = _off_parts(gg, gn, BT, 8)
                Y = kr * Yh
                A += tl.where(cross, tl.dot(kr * Eh, tl.trans(Y), input_precision=PREC), 0.0)
                P += tl.where(cross, tl.dot(qr * Eh, tl.trans(Y), input_precision=PREC), 0.0)
            else:
                # exactly: in-block column j of every block at once (row i pairs with row 16 (i // 16) + j), j from 15
                # down; acc = b_i - b_j, one gathered row of g added per step
                acc = tl.zeros([BT, BK], dtype=tl.float32)
                for jj in range(16):
                    j = 15 - jj
                    kj = _block_row(k, bos, nval, j, H * K, ih * K, offs, BT)
                    acc += tl.where((pos > j)[:, None], _block_row(g, bos + 1, nval - 1, j, HV * K, ihv * K, offs, BT),
                                    0.0)
                    ke = kj * tl.exp(tl.where((pos >= j)[:, None], acc, float("-inf")))
                    col = c16[None, :] == j
                    Da += tl.where(col & (pos > j)[:, None], tl.sum(kr * ke, 1)[:, None], 0.0)
                    Dp += tl.where(col & (pos >= j)[:, None], tl.sum(qr * ke, 1)[:, None], 0.0)
        bb = tl.load(beta + r64 * HV + ihv, mask=rmask, other=0.0).to(tl.float32)
        if DIAG == 2:  # the exact loop's diagonal blocks
            A += _unband(Da, BT)
            P += _unband(Dp, BT)
        A = A * (bb * rk)[:, None] * rk[None, :]
        P = P * (rq * scale)[:, None] * rk[None, :]
        p_TT = (ic * HV + ihv).to(tl.int64) * BT * BT + rows[:, None] * BT + rows[None, :]
        tl.store(Pb + p_TT, P.to(Pb.dtype.element_ty))
        tl.store(Tbuf + p_TT, A)


@triton.jit
def _kda_prep_wu(
    k, v, g, beta, Tbuf, Wbuf, Ubuf, cu, chunk_seq, chunk_start,
    H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2: tl.constexpr, PREC: tl.constexpr,
):
    """Stage 3: W = T diag(beta) (K^ e^b), U = T diag(beta) V, by K and V blocks, fp32 operands (T from Tbuf, fp32:
    16-bit operands here cost accuracy for no measured gain)."""
    ic = tl.program_id(0)
    ihv = tl.program_id(1)
    ih = ihv // (HV // H)
    n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
    rk = _row_inv_norms(k, r64, rmask, H * K, ih * K, K, BK, BT, L2)
    bb = tl.load(beta + r64 * HV + ihv, mask=rmask, other=0.0).to(tl.float32)
    Tm = tl.load(Tbuf + (ic * HV + ihv).to(tl.int64) * BT * BT + rows[:, None] * BT + rows[None, :])
    for k0 in range(0, K, BK):
        offs = k0 + tl.arange(0, BK)
        krow = (r64[:, None] * HV + ihv) * K + offs[None, :]
        gg, gn = _g_blk(g, r64, nval, ihv, HV, K, k0, BK, BT)
        kb = _load_rows(k, r64, rmask, H * K, ih * K, offs, False) * (bb * rk)[:, None] * tl.exp(tl.cumsum(gg, 0))
        W = tl.dot(Tm, kb, input_precision=PREC)
        tl.store(Wbuf + krow, W.to(Wbuf.dtype.element_ty), mask=rmask[:, None])
    _tu_blk(Tm, v, bb, Ubuf, r64, rmask, ihv, HV, V, BV, PREC, False)
