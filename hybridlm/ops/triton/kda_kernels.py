"""Triton kernels of Kimi Delta Attention (the gated delta rule with one log-decay per key channel): the
chunk-local forward work. The sequential state sweep and the decode step are the GDN kernels with CHANNEL=True
(`gdn_kernels._recur_fwd`, `gdn_kernels._decode_step`).

Non-standard here: with per-channel decay, A_ij = beta_i sum_d k_id k_jd e^{b_id - b_jd} is not a matmul
times a [BT, BT] decay matrix. As in the PyTorch reference (ops/chunk.py `_masked_products`) the chunk is cut
into 16-row blocks: an off-diagonal block (rows after column block c) factors e^{b_i - b_j} =
e^{b_i - r_c} e^{r_c - b_j} through r_c = b at the last row of block c, both factors <= 1 (one masked dot per
column block); the diagonal blocks use the exact pairwise form, one in-block column at a time (16 steps, every
block at once). Nothing overflows for any decay, and nothing is divided by a decay.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .gdn_kernels import _chunk_coords, _load_rows, _solve_ut


@triton.jit
def _kda_prep_fwd(
    q, k, v, g, beta, Tbuf, Wbuf, Ubuf, Qg, Kd, Pb, Bc, BL, cu, chunk_seq, chunk_start, scale,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr,
):
    """Per chunk (b = cumsum of g per channel, bL = b at the chunk's end):
    A = strict_lower(beta_i sum_d k_id k_jd e^{b_id - b_jd}), T = (I + A)^{-1}, W = T diag(beta) (K e^b),
    U = T diag(beta) V, Qg = scale Q e^b, Kd = K e^{bL - b}, P_ij = scale sum_d q_id k_jd e^{b_id - b_jd}
    (j <= i). Also stores b (Bc, per token) and bL (BL, per chunk) for the state sweep and the backward."""
    ic = tl.program_id(0)
    ihv = tl.program_id(1)
    ih = ihv // (HV // H)
    n, bos, nval = _chunk_coords(cu, chunk_seq, chunk_start, ic, BT)
    rows = tl.arange(0, BT)
    rmask = rows < nval
    r64 = bos + rows
    offs_k = tl.arange(0, K)
    krow = (r64[:, None] * HV + ihv) * K + offs_k[None, :]
    b = tl.cumsum(tl.load(g + krow, mask=rmask[:, None], other=0.0).to(tl.float32), 0)  # [BT, K], rows past
    # the end add 0, so the last row is bL
    bL = tl.sum(tl.where(rows[:, None] == BT - 1, b, 0.0), 0)
    tl.store(Bc + krow, b, mask=rmask[:, None])
    tl.store(BL + (ic * HV + ihv).to(tl.int64) * K + offs_k, bL)
    bb = tl.load(beta + r64 * HV + ihv, mask=rmask, other=0.0).to(tl.float32)
    kk = _load_rows(k, r64, rmask, H * K, ih * K, offs_k, L2)
    qq = _load_rows(q, r64, rmask, H * K, ih * K, offs_k, L2)
    tl.store(Kd + krow, (kk * tl.exp(bL[None, :] - b)).to(Kd.dtype.element_ty), mask=rmask[:, None])
    tl.store(Qg + krow, (qq * scale * tl.exp(b)).to(Qg.dtype.element_ty), mask=rmask[:, None])
    tl.debug_barrier()  # b of every row is in memory for the gathers below

    # off-diagonal 16-row blocks, one column block c at a time, through r_c = b at its last row
    A = tl.zeros([BT, BT], dtype=tl.float32)
    P = tl.zeros([BT, BT], dtype=tl.float32)
    for cb in tl.static_range(BT // 16 - 1):
        last = cb * 16 + 15
        r_c = tl.sum(tl.where(rows[:, None] == last, b, 0.0), 0)
        xe = tl.exp(tl.where((rows > last)[:, None], b - r_c[None, :], float("-inf")))
        ye = tl.exp(tl.where(((rows >= cb * 16) & (rows <= last))[:, None], r_c[None, :] - b, float("-inf")))
        Y = kk * ye
        A += tl.dot(kk * xe, tl.trans(Y), input_precision=PREC)
        P += tl.dot(qq * xe, tl.trans(Y), input_precision=PREC)
    # diagonal blocks, exact: in-block column j of every block at once (row i pairs with row 16*(i//16) + j)
    pos = rows % 16
    for j in range(16):
        src = rows - pos + j
        smask = src < nval
        kj = _load_rows(k, bos + src, smask, H * K, ih * K, offs_k, L2)
        bj = tl.load(Bc + ((bos + src)[:, None] * HV + ihv) * K + offs_k[None, :], mask=smask[:, None], other=0.0)
        ke = kj * tl.exp(tl.where((pos >= j)[:, None], b - bj, float("-inf")))
        sel = rows[None, :] == src[:, None]
        A = tl.where(sel & (pos > j)[:, None], tl.sum(kk * ke, 1)[:, None], A)
        P = tl.where(sel & (pos >= j)[:, None], tl.sum(qq * ke, 1)[:, None], P)
    A = A * bb[:, None]
    p_TT = (ic * HV + ihv).to(tl.int64) * BT * BT + rows[:, None] * BT + rows[None, :]
    tl.store(Pb + p_TT, (P * scale).to(Pb.dtype.element_ty))
    # the UT transform, as for GDN
    p_T = Tbuf + (ic * HV + ihv).to(tl.int64) * BT * BT
    tl.store(Tbuf + p_TT, A)
    tl.debug_barrier()
    _solve_ut(p_T, BT)
    tl.debug_barrier()
    Tm = tl.load(Tbuf + p_TT)
    W = tl.dot(Tm, kk * tl.exp(b) * bb[:, None], input_precision=PREC)
    tl.store(Wbuf + krow, W.to(Wbuf.dtype.element_ty), mask=rmask[:, None])
    for v0 in range(0, V, BV):
        offs_v = v0 + tl.arange(0, BV)
        vv = _load_rows(v, r64, rmask, HV * V, ihv * V, offs_v, False)
        U = tl.dot(Tm, vv * bb[:, None], input_precision=PREC)
        tl.store(Ubuf + (r64[:, None] * HV + ihv) * V + offs_v[None, :], U.to(Ubuf.dtype.element_ty),
                 mask=rmask[:, None])


__all__ = ["_kda_prep_fwd", "triton"]
