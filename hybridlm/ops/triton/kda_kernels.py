"""Triton kernels of Kimi Delta Attention (the gated delta rule with one log-decay per key channel): the
chunk-local work of the forward and the backward, in two plans (`kda.TUNE["variant"]`): the whole-K kernels
(`_kda_prep_fwd`, `_kda_chunk_bwd`: [BT, K] tiles) and, below them, the K-blocked ones (the default). The
sequential state sweeps, the output kernel and the decode step are the GDN kernels with CHANNEL=True
(`gdn_kernels._recur_fwd`, `_recur_bwd`, `_out_fwd`, `_decode_step`).

Non-standard here: with per-channel decay, A_ij = beta_i sum_d k_id k_jd e^{b_id - b_jd} is not a matmul
times a [BT, BT] decay matrix. As in the PyTorch reference (ops/chunk.py `_masked_products`) the chunk is cut
into 16-row blocks: an off-diagonal block (rows after column block c) factors e^{b_i - b_j} =
e^{b_i - r_c} e^{r_c - b_j} through r_c = b at the last row of block c, both factors <= 1 (one masked dot per
column block). The diagonal blocks factor through a reference r per block and channel (e^{b_i - r} e^{r - b_j},
one masked dot for all four blocks) when every such factor is within e^60 (`_diag_pass`, per chunk and head, all
key blocks): r is b at the block's middle row in the prep, the midpoint of the block's range of b in the backward
(`_centred`). Under stronger decay, by their two 8-row halves where those stay within the bound (two masked dots:
within a half through its reference, across the halves through the row between them, `kda.TUNE["sub_dot"]`),
and else in the exact pairwise form, one in-block column at a time (16 steps, every block at once). Nothing
overflows for any decay, and nothing is divided by a decay.
First of all (`kda.TUNE["whole_dot"]`), a chunk whose every row is within e^60 of its middle row m in every channel
takes the whole [BT, BT] product as one masked dot per key block, e^{b_i - b_j} = e^{b_i - b_m} e^{b_m - b_j}
(`_whole_sums`), as GDN's kernels do; where j > i that product may overflow, and the mask drops it. The launches
and their marks are in `_diag_pass`.

Every exponent b_i - b_j (and bL - b_i) is summed directly from the g's between the two rows (`_g_tiles`,
`_off_parts`, running sums in the diagonal loops), never taken as a difference of the cumulative b: under strong
decay |b| reaches ~1e3 within a chunk, where an fp32 ulp is ~6e-5, so a difference of two cumulative sums carries
an absolute error of that size and e^{b_i - b_j} a relative one (measured: fp32 dg 1.4e-5 relative RMS vs float64
at decay 30 a step, 1e-6 with direct sums).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .gdn_kernels import (
    _bwd_dp,
    _bwd_dqs_blk,
    _bwd_kd_blk,
    _bwd_out_loop,
    _bwd_state_loop,
    _bwd_u_blk,
    _bwd_w_blk,
    _chunk_rows,
    _dg_rows,
    _inv_norms,
    _load_rows,
    _op,
    _row_inv_norms,
    _solve_ut,
    _tu_blk,
)


@triton.jit
def _g_tiles(g, r64, nval, ihv, HV, K: tl.constexpr, BT: tl.constexpr):
    """`_g_blk` over every key channel: [BT, K]."""
    return _g_blk(g, r64, nval, ihv, HV, K, 0, K, BT)


@triton.jit
def _g_blk(g, r64, nval, ihv, HV, K: tl.constexpr, k0, BK: tl.constexpr, BT: tl.constexpr):
    """g of the chunk's rows and g of the row after each, for key channels k0..k0+BK ([BT, BK] fp32, 0 past the
    chunk's end)."""
    rows = tl.arange(0, BT)
    offs = k0 + tl.arange(0, BK)
    gg = tl.load(g + (r64[:, None] * HV + ihv) * K + offs[None, :], mask=(rows < nval)[:, None], other=0.0)
    gn = tl.load(g + ((r64 + 1)[:, None] * HV + ihv) * K + offs[None, :], mask=(rows + 1 < nval)[:, None],
                 other=0.0)
    return gg.to(tl.float32), gn.to(tl.float32)


@triton.jit
def _off_parts(gg, gn, BT: tl.constexpr, SPAN: tl.constexpr = 16):
    """The factors of the off-diagonal blocks of every column block at once (`_off_exps_from` picks one column
    block's): E_i = e^{sum of g over row i's SPAN-row block from its first row to i}, Y_i = e^{sum of g over rows
    i+1 .. the last row of i's block}, and the block totals Tb [BT // SPAN, BK] of g. For i in a later block than
    j, e^{b_i - b_j} = E_i (e^ of the totals between) Y_j, every factor <= 1 (SPAN 8: the two halves of a 16-row
    block, DIAG 4). Two scans over the tile seen as [BT // SPAN, SPAN, BK] and two exponentials, instead of two
    masked whole-tile scans and two exponentials per column block (the form before 2026-11-24: 5% slower in the
    prep and in the backward on the H100)."""
    BK: tl.constexpr = gg.shape[1]
    pos = (tl.arange(0, BT) % SPAN)[:, None]
    g3 = tl.reshape(gg, [BT // SPAN, SPAN, BK])
    E = tl.exp(tl.reshape(tl.cumsum(g3, 1), [BT, BK]))
    Y = tl.exp(tl.reshape(tl.cumsum(tl.reshape(tl.where(pos < SPAN - 1, gn, 0.0), [BT // SPAN, SPAN, BK]), 1,
                                    reverse=True), [BT, BK]))
    return E, Y, tl.sum(g3, 1)


@triton.jit
def _off_exps_from(E, Y, Tb, cb: tl.constexpr, BT: tl.constexpr):
    """The factors of column block cb's off-diagonal blocks (r_c = b at its last row) from `_off_parts`: xe_i =
    e^{b_i - r_c} for rows after the block, ye_j = e^{r_c - b_j} for rows in it, 0 elsewhere. ye = Y on cb's rows;
    for a row i in a later block j, xe_i = E_i e^{Tb_{cb+1} + ... + Tb_{j-1}} (g summed from the row after block cb
    to i, in two parts, each a direct sum of g: no difference of cumulative sums; both factors <= 1)."""
    BK: tl.constexpr = E.shape[1]
    NB: tl.constexpr = BT // 16
    rows = tl.arange(0, BT)
    blk = tl.arange(0, NB)
    between = (blk[None, :] > cb) & (blk[None, :] < blk[:, None])  # [j, m]: cb < m < j
    F = tl.exp(tl.sum(tl.where(between[:, :, None], Tb[None, :, :], 0.0), 1))  # [NB, BK]
    F = tl.where((blk > cb)[:, None], F, 0.0)
    xe = tl.reshape(tl.reshape(E, [NB, 16, BK]) * F[:, None, :], [BT, BK])
    ye = tl.where((rows // 16 == cb)[:, None], Y, 0.0)
    return xe, ye


@triton.jit
def _centred(s, BT: tl.constexpr, SPAN: tl.constexpr):
    """s minus the midpoint of its range in each SPAN-row block and channel: s_i - (s_first + s_last) / 2 (s falls
    down a block, so its first and last rows hold its range). e^{s_i} e^{-s_j} is unchanged (the shift cancels) and
    max |s| is half the block's log-decay span, the least any reference can give: the dot bound then takes blocks
    whose decay is uneven between the two halves (the kernel bench's init gates, B4 T4096 H16: 63% of (chunk, head)
    pairs by the 16-row dot instead of 50%, 25% by the half-block dots instead of 37%, none exact instead of 1%;
    `scripts/kda_whole_share.py --bench-init [--middle-row]`). Rows past a sequence's end repeat the last row's
    s."""
    BK: tl.constexpr = s.shape[1]
    s3 = tl.reshape(s, [BT // SPAN, SPAN, BK])
    pos = tl.arange(0, SPAN)[None, :, None]
    ends = tl.sum(tl.where((pos == 0) | (pos == SPAN - 1), s3, 0.0), 1)  # s_first + s_last, [BT // SPAN, BK]
    return tl.reshape(s3 - 0.5 * ends[:, None, :], [BT, BK])


@triton.jit
def _mid_sums(gg, gn, BT: tl.constexpr, SPAN: tl.constexpr = 16, CENTRE: tl.constexpr = True):
    """s_i = b_i - r over row i's SPAN-row block (16: the diagonal blocks of DIAG 1; 8: their halves, DIAG 4), summed
    from g ([BT, BK]): within a block e^{b_i - b_j} = e^{s_i} e^{-s_j}, each factor at most e^{max |s|}. r = b_m at
    the block's middle row m = SPAN / 2 - 1, by one scan each way over the tile seen as [BT // SPAN, SPAN, BK]
    (masked scans over the whole tile, one block at a time, made the dot launches slower than the exact loop on the
    H100); with CENTRE (the backward kernels) then shifted to the midpoint of the block's range (`_centred`). The
    prep keeps the middle row: centred, it took the forward 2.371 -> 2.413 ms while the backward gained (H100,
    2026-11-25 06:12-06:20, `scripts/gpu_kda_centred.sh`)."""
    BK: tl.constexpr = gg.shape[1]
    M: tl.constexpr = SPAN // 2 - 1
    pos = (tl.arange(0, BT) % SPAN)[:, None]
    up = tl.reshape(tl.cumsum(tl.reshape(tl.where(pos > M, gg, 0.0), [BT // SPAN, SPAN, BK]), 1), [BT, BK])
    dn = tl.reshape(tl.cumsum(tl.reshape(tl.where(pos < M, gn, 0.0), [BT // SPAN, SPAN, BK]), 1, reverse=True),
                    [BT, BK])
    s = tl.where(pos > M, up, 0.0) - tl.where(pos < M, dn, 0.0)  # g of rows m+1..i, minus g of rows i+1..m
    if CENTRE:
        s = _centred(s, BT, SPAN)
    return s


@triton.jit
def _whole_sums(gg, gn, BT: tl.constexpr):
    """s_i = b_i - b_m, m = BT / 2 - 1 the chunk's middle row, summed from g ([BT, BK]): for any two rows of the
    chunk e^{b_i - b_j} = e^{s_i} e^{-s_j}, so while every |s| stays within the dot bound a chunk's whole [BT, BT]
    product is one masked dot per key block, as GDN's is (`_diag_pass` DIAG 3)."""
    rows = tl.arange(0, BT)[:, None]
    M: tl.constexpr = BT // 2 - 1
    up = tl.cumsum(tl.where(rows > M, gg, 0.0), 0)  # g of rows m+1..i
    dn = tl.cumsum(tl.where(rows < M, gn, 0.0), 0, reverse=True)  # g of rows i+1..m
    return tl.where(rows > M, up, 0.0) - tl.where(rows < M, dn, 0.0)


@triton.jit
def _half_masks(BT: tl.constexpr):
    """[BT, BT] masks of DIAG 4: the pairs within one 8-row half-block, and the pairs (i in the second half of a
    16-row block, j in its first half)."""
    rows = tl.arange(0, BT)
    same8 = (rows[:, None] // 8) == (rows[None, :] // 8)
    cross = ((rows[:, None] // 16) == (rows[None, :] // 16)) & ((rows[:, None] % 16) >= 8) \
        & ((rows[None, :] % 16) < 8)
    return same8, cross


@triton.jit
def _within_bound(g, cu, chunk_seq, chunk_start, ic, ihv, HV, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                  SPAN: tl.constexpr, CENTRE: tl.constexpr = True):
    """Whether every factor of chunk ic's dot stays within e^60 in every key channel: through the middle row of the
    whole chunk (SPAN 0: `_whole_sums`), or through each block of SPAN rows' reference (16: the diagonal blocks, 8:
    their halves; `_mid_sums`: its middle row, or with CENTRE the midpoint of its range of b)."""
    n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
    worst = tl.zeros([BT, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        gg, gn = _g_blk(g, r64, nval, ihv, HV, K, k0, BK, BT)
        if SPAN == 0:
            worst = tl.maximum(worst, tl.abs(_whole_sums(gg, gn, BT)))
        else:
            worst = tl.maximum(worst, tl.abs(_mid_sums(gg, gn, BT, SPAN, CENTRE)))
    return tl.max(tl.max(worst, 1), 0) <= 60.0


@triton.jit
def _diag_pass(g, redo, cu, chunk_seq, chunk_start, HV, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
               DIAG: tl.constexpr, MARKED: tl.constexpr = False, WHOLE: tl.constexpr = False,
               CENTRE: tl.constexpr = True):
    """Whether this program works in this launch. DIAG 0: one launch, every chunk through the exact per-column
    loop. Else the kernel is launched two or three times with a shared int32 redo [chunks, HV]: DIAG 1 takes the
    chunks (and heads) whose diagonal blocks can be one masked dot through e^{s_i} e^{-s_j} (`_mid_sums`) in every
    key block, i.e. every factor within e^60 (fp32, tf32 and bf16 reach e^88; the margin keeps a small y times
    e^-60 a normal number), and marks the others; DIAG 2 takes only the marked ones (log-decays summing beyond
    ~-120 over 16 rows) through the exact loop. DIAG 3 (first, before the others) does the same with the whole
    chunk as one block (`_whole_sums`: every row within e^60 of the middle row, log-decays summing to at most ~120
    over the chunk), so a chunk it takes needs neither the off-diagonal blocks' factors nor the diagonal blocks. One
    kernel holding both ways spills (sm_90: 8-24 -> 670-1460 B per thread in the backward launches).
    MARKED (with DIAG 3, 1 and 4): redo already holds the marks of this call, written by the same launches of an
    earlier kernel over the same g and key blocks (the output backward's, before the state backward): read them,
    do not recompute them.
    DIAG 4 (after DIAG 1, before DIAG 2): of the chunks DIAG 1 left, those whose 8-row half-blocks stay within the
    bound (`_mid_sums` over 8 rows: log-decays up to ~15 a step) take their diagonal 16-row blocks as two masked
    dots, one for the pairs within a half-block (through its middle row) and one for the pairs across the two
    halves (`_off_parts` over 8 rows, both factors <= 1); the exact loop keeps only what is left.
    The marks: 0 the whole chunk by dot (DIAG 3), 2 its diagonal blocks by dot (DIAG 1), 3 by half-block dots (DIAG
    4), 1 none of these (DIAG 2). WHOLE (with DIAG 1): a DIAG 3 launch of this kernel came first, so the chunks it
    marked 0 are done. Every chunk is taken by exactly one launch of a sequence (3, 1, 4, 2), (3, 1, 2), (3, 2),
    (1, 4, 2), (1, 2) or (0)."""
    ic = tl.program_id(0)
    ihv = tl.program_id(1)
    p = redo + ic * HV + ihv
    if DIAG == 3 and MARKED:
        go = tl.load(p) == 0
    elif DIAG == 3:  # the whole chunk by one dot per key block (`_whole_sums` within the bound), the rest marked
        go = _within_bound(g, cu, chunk_seq, chunk_start, ic, ihv, HV, K, BK, BT, 0)
        tl.store(p, tl.where(go, 0, 1).to(tl.int32))
    elif DIAG == 1 and MARKED:
        go = tl.load(p) == 2
    elif DIAG == 1:
        go = ic < 0
        if WHOLE:
            todo = tl.load(p) != 0
        else:
            todo = ic >= 0
        if todo:
            go = _within_bound(g, cu, chunk_seq, chunk_start, ic, ihv, HV, K, BK, BT, 16, CENTRE)
            tl.store(p, tl.where(go, 2, 1).to(tl.int32))
    elif DIAG == 4 and MARKED:
        go = tl.load(p) == 3
    elif DIAG == 4:  # after a DIAG 1 launch: of the chunks it left (mark 1), those whose 8-row halves allow the dot
        go = ic < 0
        if tl.load(p) == 1:
            go = _within_bound(g, cu, chunk_seq, chunk_start, ic, ihv, HV, K, BK, BT, 8, CENTRE)
            tl.store(p, tl.where(go, 3, 1).to(tl.int32))
    elif DIAG == 2:
        go = tl.load(p) == 1
    else:
        go = ic >= 0
    return go


@triton.jit
def _same_block(BT: tl.constexpr):
    """[BT, BT] mask of the pairs (i, j) in one 16-row block."""
    rows = tl.arange(0, BT)
    return (rows[:, None] // 16) == (rows[None, :] // 16)


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
    n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
    offs_k = tl.arange(0, K)
    krow = (r64[:, None] * HV + ihv) * K + offs_k[None, :]
    gg, gn = _g_tiles(g, r64, nval, ihv, HV, K, BT)
    b = tl.cumsum(gg, 0)  # [BT, K], rows past the end add 0, so the last row is bL
    bL = tl.sum(tl.where(rows[:, None] == BT - 1, b, 0.0), 0)
    tl.store(Bc + krow, b, mask=rmask[:, None])
    tl.store(BL + (ic * HV + ihv).to(tl.int64) * K + offs_k, bL)
    bb = tl.load(beta + r64 * HV + ihv, mask=rmask, other=0.0).to(tl.float32)
    kk = _load_rows(k, r64, rmask, H * K, ih * K, offs_k, L2)
    qq = _load_rows(q, r64, rmask, H * K, ih * K, offs_k, L2)
    ed = tl.exp(tl.cumsum(gn, 0, reverse=True))  # e^{bL - b}
    tl.store(Kd + krow, (kk * ed).to(Kd.dtype.element_ty), mask=rmask[:, None])
    tl.store(Qg + krow, (qq * scale * tl.exp(b)).to(Qg.dtype.element_ty), mask=rmask[:, None])

    # off-diagonal 16-row blocks, one column block c at a time, through r_c = b at its last row
    A = tl.zeros([BT, BT], dtype=tl.float32)
    P = tl.zeros([BT, BT], dtype=tl.float32)
    E, Yf, Tb = _off_parts(gg, gn, BT)
    for cb in tl.static_range(BT // 16 - 1):
        xe, ye = _off_exps_from(E, Yf, Tb, cb, BT)
        Y = kk * ye
        A += tl.dot(kk * xe, tl.trans(Y), input_precision=PREC)
        P += tl.dot(qq * xe, tl.trans(Y), input_precision=PREC)
    # diagonal blocks, exact: in-block column j of every block at once (row i pairs with row 16*(i//16) + j),
    # j from 15 down; acc = b_i - b_j = sum of g over rows j+1..i, one gathered row added per step
    pos = rows % 16
    acc = tl.zeros([BT, K], dtype=tl.float32)
    for jj in range(16):
        j = 15 - jj
        src = rows - pos + j
        smask = src < nval
        kj = _load_rows(k, bos + src, smask, H * K, ih * K, offs_k, L2)
        acc += tl.load(g + ((bos + src + 1)[:, None] * HV + ihv) * K + offs_k[None, :],
                       mask=((pos > j) & (src + 1 < nval))[:, None], other=0.0).to(tl.float32)
        ke = kj * tl.exp(tl.where((pos >= j)[:, None], acc, float("-inf")))
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
    _solve_ut(p_T, p_T, BT, False, 0, "ieee")
    tl.debug_barrier()
    Tm = tl.load(Tbuf + p_TT)
    W = tl.dot(Tm, kk * tl.exp(b) * bb[:, None], input_precision=PREC)
    tl.store(Wbuf + krow, W.to(Wbuf.dtype.element_ty), mask=rmask[:, None])
    _tu_blk(Tm, v, bb, Ubuf, r64, rmask, ihv, HV, V, BV, PREC, False)



@triton.jit
def _rows_prod(M, yy, gg, gn, y, g, bos, nval, ihv, stride, col0, HV, K: tl.constexpr, BT: tl.constexpr,
               L2: tl.constexpr, STRICT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, LOWP: tl.constexpr):
    """out_i = sum_j M_ij y_j e^{b_i - b_j} over j < i (STRICT) or j <= i, per channel: [BT, K]. M [BT, BT] is
    zero outside that range; yy [BT, K] the (normalised) rows of y; y (raw, in memory) is gathered again for the
    diagonal blocks. gg, gn: `_g_tiles`; g (in memory) is gathered for the diagonal blocks' exponents.
    Off-diagonal blocks through r_c (both factors <= 1), diagonal blocks exact."""
    rows = tl.arange(0, BT)
    offs_k = tl.arange(0, K)
    out = tl.zeros([BT, K], dtype=tl.float32)
    E, Yf, Tb = _off_parts(gg, gn, BT)
    for cb in tl.static_range(BT // 16 - 1):
        xe, ye = _off_exps_from(E, Yf, Tb, cb, BT)
        out += tl.dot(_op(M, DT, LOWP), _op(yy * ye, DT, LOWP), input_precision=PREC) * xe
    pos = rows % 16
    acc = tl.zeros([BT, K], dtype=tl.float32)  # b_i - b_src = sum of g over rows src+1..i (j from 15 down)
    for jj in range(16):
        j = 15 - jj
        src = rows - pos + j
        smask = src < nval
        ys = _load_rows(y, bos + src, smask, stride, col0, offs_k, L2)
        acc += tl.load(g + ((bos + src + 1)[:, None] * HV + ihv) * K + offs_k[None, :],
                       mask=((pos > j) & (src + 1 < nval))[:, None], other=0.0).to(tl.float32)
        if STRICT:
            keep = pos > j
        else:
            keep = pos >= j
        m = tl.sum(tl.where(rows[None, :] == src[:, None], M, 0.0), 1)
        out += m[:, None] * ys * tl.exp(tl.where(keep[:, None], acc, float("-inf")))
    return out


@triton.jit
def _cols_prod(M, yy, gg, gn, y, g, bos, nval, ihv, stride, col0, HV, K: tl.constexpr, BT: tl.constexpr,
               L2: tl.constexpr, STRICT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, LOWP: tl.constexpr):
    """out_j = sum_i M_ij y_i e^{b_i - b_j} over i > j (STRICT) or i >= j, per channel: [BT, K] (the transpose
    partner of `_rows_prod`)."""
    rows = tl.arange(0, BT)
    offs_k = tl.arange(0, K)
    out = tl.zeros([BT, K], dtype=tl.float32)
    E, Yf, Tb = _off_parts(gg, gn, BT)
    for cb in tl.static_range(BT // 16 - 1):
        xe, ye = _off_exps_from(E, Yf, Tb, cb, BT)
        out += tl.dot(tl.trans(_op(M, DT, LOWP)), _op(yy * xe, DT, LOWP), input_precision=PREC) * ye
    pos = rows % 16
    acc = tl.zeros([BT, K], dtype=tl.float32)  # b_src - b_j = sum of g over rows j+1..src (p upwards)
    for p in range(16):
        src = rows - pos + p
        smask = src < nval
        ys = _load_rows(y, bos + src, smask, stride, col0, offs_k, L2)
        acc += tl.load(g + ((bos + src)[:, None] * HV + ihv) * K + offs_k[None, :],
                       mask=((pos < p) & smask)[:, None], other=0.0).to(tl.float32)
        if STRICT:
            keep = p > pos
        else:
            keep = p >= pos
        m = tl.sum(tl.where(rows[:, None] == src[None, :], M, 0.0), 0)
        out += m[:, None] * ys * tl.exp(tl.where(keep[:, None], acc, float("-inf")))
    return out


@triton.jit
def _kda_bwd_out(q, k, hbuf, vnbuf, do, dq, dk, dg, g, gg, gn, eb, kk, krow, hb, r64, rmask, bos, nval, ihv, ih,
                 scale, H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
                 PREC: tl.constexpr, LOWP: tl.constexpr):
    """Phase 1 of `_kda_chunk_bwd`: through O = scale (Q e^b) S + P Vn. Stores dq (final), dk's part (dk buffer)
    and db's part (dg buffer, finished by phase 2)."""
    DT: tl.constexpr = hbuf.dtype.element_ty
    rows = tl.arange(0, BT)
    offs_k = tl.arange(0, K)
    incl = rows[:, None] >= rows[None, :]
    dQS, dP = _bwd_out_loop(hbuf, vnbuf, do, hb, r64, rmask, ihv, HV, K, V, BT, BV, PREC, LOWP)
    qr = _load_rows(q, r64, rmask, H * K, ih * K, offs_k, False)
    if L2:
        rq = _inv_norms(qr)
        qq = qr * rq[:, None]
    else:
        qq = qr
    dqn = dQS * eb * scale
    db = dQS * qq * eb * scale
    N = tl.where(incl, dP * scale, 0.0)
    Y1 = _rows_prod(N, kk, gg, gn, k, g, bos, nval, ihv, H * K, ih * K, HV, K, BT, L2, False, PREC, DT, LOWP)
    Y2 = _cols_prod(N, qq, gg, gn, q, g, bos, nval, ihv, H * K, ih * K, HV, K, BT, L2, False, PREC, DT, LOWP)
    dqn += Y1
    db += qq * Y1 - kk * Y2
    if L2:
        dqn = (dqn - qq * tl.sum(qq * dqn, 1)[:, None]) * rq[:, None]
    tl.store(dq + krow, dqn, mask=rmask[:, None])
    tl.store(dk + krow, Y2, mask=rmask[:, None])
    tl.store(dg + krow, db, mask=rmask[:, None])


@triton.jit
def _kda_chunk_bwd(
    q, k, v, g, beta, Tbuf, Bc, BL, hbuf, dhbuf, vnbuf, dvnbuf, do, dq, dk, dv, dg, dbeta,
    cu, chunk_seq, chunk_start, scale,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
    PHASE: tl.constexpr,
):
    """dq, dk, dv, dg [.., K], dbeta of one KDA chunk from S, dS' (after the chunk), Vn, dVn, in two launches
    (PHASE 1 then 2; each compiled kernel holds half the live tiles):
    1. the output's paths (O = scale (Q e^b) S + P Vn): dq complete, dk's and db's parts parked in the dk and dg
       buffers;
    2. the state write (S' = e^{bL} S + (K e^{bL-b})^T Vn), W = T diag(beta) (K e^b), U = T diag(beta) V and the
       UT transform (dA = -T^T dT T^T); per-channel decay gradients by the same block factorisation as the
       forward (`_rows_prod`, `_cols_prod`); dg = reverse cumsum of db over the chunk."""
    DT: tl.constexpr = hbuf.dtype.element_ty
    ic = tl.program_id(0)
    ihv = tl.program_id(1)
    ih = ihv // (HV // H)
    n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
    offs_k = tl.arange(0, K)
    krow = (r64[:, None] * HV + ihv) * K + offs_k[None, :]
    hb = (ic * HV + ihv).to(tl.int64) * K * V
    bb = tl.load(beta + r64 * HV + ihv, mask=rmask, other=0.0).to(tl.float32)
    b = tl.load(Bc + krow, mask=rmask[:, None], other=0.0)
    bL = tl.load(BL + (ic * HV + ihv).to(tl.int64) * K + offs_k)
    # rows past the chunk's end carry b = bL so that every masked factor below stays exp(<= 0)
    b = tl.where(rmask[:, None], b, bL[None, :])
    strict = rows[:, None] > rows[None, :]
    gg, gn = _g_tiles(g, r64, nval, ihv, HV, K, BT)

    kk = _load_rows(k, r64, rmask, H * K, ih * K, offs_k, L2)
    eb = tl.exp(b)
    if PHASE == 1:
        _kda_bwd_out(q, k, hbuf, vnbuf, do, dq, dk, dg, g, gg, gn, eb, kk, krow, hb, r64, rmask, bos, nval, ihv, ih,
                     scale, H, HV, K, V, BT, BV, L2, PREC, LOWP)
    else:  # phase 2
        db = tl.load(dg + krow, mask=rmask[:, None], other=0.0)
        Tm_d = _op(tl.load(Tbuf + ((ic * HV + ihv) * BT + rows[:, None]) * BT + rows[None, :]), DT, LOWP)
        dKd, dW, dT, dbeta_, dSS = _bwd_state_loop(hbuf, dhbuf, vnbuf, dvnbuf, v, dv, Tm_d, bb, hb, r64, rmask, ihv,
                                                   HV, K, V, BT, BV, PREC, LOWP)
        # Kd = K e^{bL - b}; S decays by e^{bL}
        ed = tl.exp(tl.cumsum(gn, 0, reverse=True))  # e^{bL - b}, summed from g
        dkn = tl.load(dk + krow, mask=rmask[:, None], other=0.0) + dKd * ed
        t = dKd * kk * ed
        db -= t
        dbL = tl.sum(t, 0) + tl.exp(bL) * dSS
        # W = T Kb, Kb = diag(beta) K e^b
        kb = kk * eb * bb[:, None]
        dW_d = _op(dW, DT, LOWP)
        dT += tl.dot(dW_d, tl.trans(_op(kb, DT, LOWP)), input_precision=PREC)
        dKb = tl.dot(tl.trans(Tm_d), dW_d, input_precision=PREC)
        dkn += dKb * eb * bb[:, None]
        dbeta_ += tl.sum(dKb * kk * eb, 1)
        db += dKb * kb
        # T = (I + A)^{-1}; A_ij = beta_i sum_d k_id k_jd e^{b_id - b_jd} (j < i)
        dA = tl.where(strict, -tl.dot(_op(tl.dot(tl.trans(Tm_d), _op(dT, DT, LOWP), input_precision=PREC), DT, LOWP),
                                      tl.trans(Tm_d), input_precision=PREC), 0.0)
        X1 = _rows_prod(dA, kk, gg, gn, k, g, bos, nval, ihv, H * K, ih * K, HV, K, BT, L2, True, PREC, DT, LOWP)
        dbeta_ += tl.sum(kk * X1, 1)
        X1 = X1 * bb[:, None]
        X2 = _cols_prod(dA * bb[:, None], kk, gg, gn, k, g, bos, nval, ihv, H * K, ih * K, HV, K, BT, L2, True, PREC,
                        DT, LOWP)
        dkn += X1 + X2
        db += kk * X1 - kk * X2
        # bL is b at the last valid row
        db += tl.where((rows == nval - 1)[:, None], dbL[None, :], 0.0)
        db = tl.where(rmask[:, None], db, 0.0)
        dgg = tl.cumsum(db, 0, reverse=True)
        if L2:
            kr = _load_rows(k, r64, rmask, H * K, ih * K, offs_k, False)
            rk = _inv_norms(kr)
            dkn = (dkn - kk * tl.sum(kk * dkn, 1)[:, None]) * rk[:, None]
        tl.store(dk + krow, dkn, mask=rmask[:, None])
        tl.store(dg + krow, dgg, mask=rmask[:, None])
        tl.store(dbeta + r64 * HV + ihv, dbeta_, mask=rmask)



# ---------------------------------------------------------------------------------------------------------------
# K-blocked kernels (the default, TUNE["variant"] = "kblock" in kda.py). The whole-K kernels above hold [BT, K]
# fp32 tiles of q, k, g, the decay factors and their gradients at once: at BT = 64, K = 128, 8 warps that is 32
# registers per tile, and they spill 1.7-4.2 KB per thread (sm_90 compile, scripts/compile_sm90.py). Everything
# per channel (the decay factors, Qg, Kd, W, the gradients of b) is local to a channel, and everything that mixes
# channels is a sum over them (A, P, dT, row norms), so the kernels below walk K in blocks of BK columns and
# accumulate the [BT, BT] sums. Two details make the blocking exact:
# - q and k are used raw; the l2 norm enters as row/column scales of the [BT, BT] matrices (A_ij = beta_i r_i
#   r_j sum_d k_id k_jd e^..., with r = 1/||k||), computed in a first pass over K, so no gathered row needs its
#   own norm;
# - the exact diagonal loop reads the diagonal 16x16 blocks of a [BT, BT] matrix M as a [BT, 16] band
#   (band[i, j] = M[i, 16 (i // 16) + j]) built once, not once per K block (`_diag_band`).
# The cumulative log-decay b is recomputed from g wherever it is needed (a cumsum of a tile that is loaded anyway)
# instead of being stored: 4 bytes per token, head and channel less to write, keep for the backward and read.
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _block_row(ptr, row0, nrow, p, stride, col0, offs, BT: tl.constexpr):
    """[BT, BK] fp32 whose row i is x[row0 + 16 (i // 16) + p, col0 + offs] (0 where 16 (i // 16) + p >= nrow): the
    row p of every 16-row block, as the exact diagonal loops pair it with each row of its block. Loads the NB rows
    once and broadcasts them over their blocks, instead of gathering BT rows (16x the addresses and the L1
    requests: Nsight Compute on the H100, 2026-11-24, found the exact launches limited by integer (address) work and
    latency, at a third of the issue rate)."""
    NB: tl.constexpr = BT // 16
    BK: tl.constexpr = offs.shape[0]
    src = tl.arange(0, NB) * 16 + p
    x = tl.load(ptr + (row0 + src).to(tl.int64)[:, None] * stride + col0 + offs[None, :], mask=(src < nrow)[:, None],
                other=0.0)
    return tl.reshape(tl.broadcast_to(x.to(tl.float32)[:, None, :], [NB, 16, BK]), [BT, BK])


@triton.jit
def _band(M, BT: tl.constexpr):
    """The diagonal 16x16 blocks of M [BT, BT] as a [BT, 16] band: band[i, j] = M[i, 16 (i // 16) + j]. By one
    reshape to [NB, 16, NB, 16] and a masked sum over the column blocks, not a 16-step loop of masked [BT, BT] row sums
    (H100, B4 T4096 H16 D128 bf16 on a fresh layer's gates, half of whose chunks take the exact launches: forward +
    backward 12.06-12.18 ms with the loop at 11:46-11:55 UTC, 10.62 with the reshape at 12:48; same script and seed,
    two runs; BENCHMARKS.md)."""
    NB: tl.constexpr = BT // 16
    blk = tl.arange(0, NB)
    M4 = tl.reshape(M, [NB, 16, NB, 16])
    return tl.reshape(tl.sum(tl.where((blk[:, None] == blk[None, :])[:, None, :, None], M4, 0.0), 2), [BT, 16])


@triton.jit
def _unband(band, BT: tl.constexpr):
    """The [BT, BT] matrix that is `band` on its diagonal 16x16 blocks and 0 elsewhere (inverse of `_band`, by the
    same reshape)."""
    NB: tl.constexpr = BT // 16
    blk = tl.arange(0, NB)
    b4 = tl.reshape(band, [NB, 16, 1, 16])
    return tl.reshape(tl.where((blk[:, None] == blk[None, :])[:, None, :, None], b4, 0.0), [BT, BT])


@triton.jit
def _diag_band(M, BT: tl.constexpr, DIAG: tl.constexpr):
    """`_band(M)` for the exact diagonal loop of `_rows_prod_blk` / `_cols_prod_blk`, built once per program
    before the key-block loop; the dot launches (DIAG 1 and 3) read M itself, so they get zeros."""
    if DIAG == 1 or DIAG == 3 or DIAG == 4:
        band = tl.zeros([BT, 16], dtype=tl.float32)
    else:
        band = _band(M, BT)
    return band


@triton.jit
def _band_col(band, j):
    """Column j of a [BT, 16] band, as [BT]."""
    return tl.sum(tl.where(tl.arange(0, 16)[None, :] == j, band, 0.0), 1)


@triton.jit
def _rows_prod_blk(M, band, yr, gg, gn, y, g, bos, nval, ihv, stride, col0, HV, K: tl.constexpr, k0,
                   BK: tl.constexpr, BT: tl.constexpr, STRICT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
                   LOWP: tl.constexpr, DIAG: tl.constexpr):
    """out_i = sum_j M_ij y_j e^{b_i - b_j} over j < i (STRICT) or j <= i, for channels k0..k0+BK: [BT, BK].
    M [BT, BT] is zero outside that range, band = `_diag_band(M)`; yr [BT, BK] the raw rows of y (y in memory at
    column col0, gathered again by the exact diagonal loop); gg, gn = `_g_blk`. Off-diagonal blocks through r_c
    (both factors <= 1, `_off_exps_from`); diagonal blocks by one masked dot through the blocks' middle rows (DIAG 1,
    `_mid_sums`) or exactly, one in-block column at a time (the launch for log-decays too strong for the dot,
    `_diag_pass`); exponents summed from g. The off-diagonal factors of every column block come from one
    `_off_parts` (2 exponential tiles; per column block, 6 made the init-gate backward 5% slower)."""
    rows = tl.arange(0, BT)
    offs = tl.arange(0, BK)
    if DIAG == 3:  # the whole chunk through its middle row (`_whole_sums`), fp32 operands as the diagonal dot's
        s = _whole_sums(gg, gn, BT)
        return tl.dot(M, yr * tl.exp(-s), input_precision=PREC) * tl.exp(s)
    out = tl.zeros([BT, BK], dtype=tl.float32)
    E, Yf, Tb = _off_parts(gg, gn, BT)
    for cb in tl.static_range(BT // 16 - 1):
        xe, ye = _off_exps_from(E, Yf, Tb, cb, BT)
        out += tl.dot(_op(M, DT, LOWP), _op(yr * ye, DT, LOWP), input_precision=PREC) * xe
    if DIAG == 1:
        s = _mid_sums(gg, gn, BT)
        Md = tl.where(_same_block(BT), M, 0.0)
        # fp32 operands (tf32 dots for 16-bit inputs): these blocks carry the least-decayed, largest terms, and
        # with 16-bit operands KDA's bf16 dg reached 9.4e-3 of its 1e-2 bar (H100 check, 2026-11-24 02:30)
        out += tl.dot(Md, yr * tl.exp(-s), input_precision=PREC) * tl.exp(s)
    elif DIAG == 4:  # the diagonal blocks by their 8-row halves: within a half, then across the two (fp32 operands)
        s = _mid_sums(gg, gn, BT, 8)
        same8, cross = _half_masks(BT)
        out += tl.dot(tl.where(same8, M, 0.0), yr * tl.exp(-s), input_precision=PREC) * tl.exp(s)
        Eh, Yh, _ = _off_parts(gg, gn, BT, 8)
        out += tl.dot(tl.where(cross, M, 0.0), yr * Yh, input_precision=PREC) * Eh
    else:
        pos = rows % 16
        acc = tl.zeros([BT, BK], dtype=tl.float32)  # b_i - b_src = sum of g over rows src+1..i (j from 15 down)
        for jj in range(16):
            j = 15 - jj
            ys = _block_row(y, bos, nval, j, stride, col0, offs, BT)
            gs = _block_row(g, bos + 1, nval - 1, j, HV * K, ihv * K + k0, offs, BT)  # g of row src + 1
            acc += tl.where((pos > j)[:, None], gs, 0.0)
            if STRICT:
                keep = pos > j
            else:
                keep = pos >= j
            out += _band_col(band, j)[:, None] * ys * tl.exp(tl.where(keep[:, None], acc, float("-inf")))
    return out


@triton.jit
def _cols_prod_blk(M, bandT, yr, gg, gn, y, g, bos, nval, ihv, stride, col0, HV, K: tl.constexpr, k0,
                   BK: tl.constexpr, BT: tl.constexpr, STRICT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
                   LOWP: tl.constexpr, DIAG: tl.constexpr):
    """out_j = sum_i M_ij y_i e^{b_i - b_j} over i > j (STRICT) or i >= j, channels k0..k0+BK: [BT, BK] (the
    transpose partner of `_rows_prod_blk`, with the same two ways through the diagonal blocks; bandT =
    `_diag_band(M^T)`)."""
    rows = tl.arange(0, BT)
    offs = tl.arange(0, BK)
    if DIAG == 3:  # as in `_rows_prod_blk`
        s = _whole_sums(gg, gn, BT)
        return tl.dot(tl.trans(M), yr * tl.exp(s), input_precision=PREC) * tl.exp(-s)
    out = tl.zeros([BT, BK], dtype=tl.float32)
    E, Yf, Tb = _off_parts(gg, gn, BT)
    for cb in tl.static_range(BT // 16 - 1):
        xe, ye = _off_exps_from(E, Yf, Tb, cb, BT)
        out += tl.dot(tl.trans(_op(M, DT, LOWP)), _op(yr * xe, DT, LOWP), input_precision=PREC) * ye
    if DIAG == 1:
        s = _mid_sums(gg, gn, BT)
        Md = tl.where(_same_block(BT), M, 0.0)
        out += tl.dot(tl.trans(Md), yr * tl.exp(s), input_precision=PREC) * tl.exp(-s)  # fp32 operands as above
    elif DIAG == 4:  # as in `_rows_prod_blk`
        s = _mid_sums(gg, gn, BT, 8)
        same8, cross = _half_masks(BT)
        out += tl.dot(tl.trans(tl.where(same8, M, 0.0)), yr * tl.exp(s), input_precision=PREC) * tl.exp(-s)
        Eh, Yh, _ = _off_parts(gg, gn, BT, 8)
        out += tl.dot(tl.trans(tl.where(cross, M, 0.0)), yr * Eh, input_precision=PREC) * Yh
    else:
        pos = rows % 16
        acc = tl.zeros([BT, BK], dtype=tl.float32)  # b_src - b_j = sum of g over rows j+1..src (p upwards)
        for p in range(16):
            ys = _block_row(y, bos, nval, p, stride, col0, offs, BT)
            acc += tl.where((pos < p)[:, None], _block_row(g, bos, nval, p, HV * K, ihv * K + k0, offs, BT), 0.0)
            if STRICT:
                keep = p > pos
            else:
                keep = p >= pos
            out += _band_col(bandT, p)[:, None] * ys * tl.exp(tl.where(keep[:, None], acc, float("-inf")))
    return out


@triton.jit
def _kda_prep_ap(
    q, k, g, beta, Tbuf, Qg, Kd, Pb, BL, redo, cu, chunk_seq, chunk_start, scale,
    H, HV, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr,
    DIAG: tl.constexpr, WHOLE: tl.constexpr = False, CENTRE: tl.constexpr = False,
):
    """Stage 1 of the K-blocked prep, per chunk: Qg = scale Q^ e^b, Kd = K^ e^{bL - b}, bL (BL), and
    the [BT, BT] sums over channels P_ij = scale sum_d q^_id k^_jd e^{b_id - b_jd} (j <= i, stored in Pb) and
    A_ij = beta_i sum_d k^_id k^_jd e^{b_id - b_jd} (j < i, staged in Tbuf for the solve). ^: l2-normalised.
    The off-diagonal blocks' factors come from `_off_parts` once per key block. DIAG 3: the
    chunks whose log-decays allow it (`_diag_pass`) as one masked dot for A and one for P per key block, through
    the chunk's middle row (`_whole_sums`), with no blocks at all; a DIAG 2 launch takes the others. CENTRE
    (kda.TUNE prep_centre, off): the 16- and 8-row blocks' bounds about the midpoint of each block's log-decay range,
    as in the backward kernels."""
    if _diag_pass(g, redo, cu, chunk_seq, chunk_start, HV, K, BK, BT, DIAG, False, WHOLE, CENTRE):
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
                    s = _mid_sums(gg, gn, BT, 16, CENTRE)
                    mA, mP = blk & low, blk & (low | diag)
                Y = kr * tl.exp(-s)
                A += tl.where(mA, tl.dot(kr * tl.exp(s), tl.trans(Y), input_precision=PREC), 0.0)
                P += tl.where(mP, tl.dot(qr * tl.exp(s), tl.trans(Y), input_precision=PREC), 0.0)
            elif DIAG == 4:  # the diagonal blocks by their 8-row halves (`_diag_pass`), fp32 operands
                s = _mid_sums(gg, gn, BT, 8, CENTRE)
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
        if DIAG == 0 or DIAG == 2:  # the exact loop's diagonal blocks
            A += _unband(Da, BT)
            P += _unband(Dp, BT)
        A = A * (bb * rk)[:, None] * rk[None, :]
        P = P * (rq * scale)[:, None] * rk[None, :]
        p_TT = (ic * HV + ihv).to(tl.int64) * BT * BT + rows[:, None] * BT + rows[None, :]
        tl.store(Pb + p_TT, P.to(Pb.dtype.element_ty))
        tl.store(Tbuf + p_TT, A)


@triton.jit
def _kda_solve(Tbuf, HV, BT: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Stage 2: T = (I + A)^{-1} in place, per chunk (`_solve_ut`)."""
    p_T = Tbuf + (tl.program_id(0) * HV + tl.program_id(1)).to(tl.int64) * BT * BT
    _solve_ut(p_T, p_T, BT, INTERLEAVE, 0, "ieee")


@triton.jit
def _kda_prep_wu(
    k, v, g, beta, Tbuf, Wbuf, Ubuf, cu, chunk_seq, chunk_start,
    H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
):
    """Stage 3: W = T diag(beta) (K^ e^b), U = T diag(beta) V, by K and V blocks. LOWP: T and the right-hand
    tiles as 16-bit dot operands."""
    DT: tl.constexpr = Wbuf.dtype.element_ty
    ic = tl.program_id(0)
    ihv = tl.program_id(1)
    ih = ihv // (HV // H)
    n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
    rk = _row_inv_norms(k, r64, rmask, H * K, ih * K, K, BK, BT, L2)
    bb = tl.load(beta + r64 * HV + ihv, mask=rmask, other=0.0).to(tl.float32)
    Tm = _op(tl.load(Tbuf + (ic * HV + ihv).to(tl.int64) * BT * BT + rows[:, None] * BT + rows[None, :]), DT, LOWP)
    for k0 in range(0, K, BK):
        offs = k0 + tl.arange(0, BK)
        krow = (r64[:, None] * HV + ihv) * K + offs[None, :]
        gg, gn = _g_blk(g, r64, nval, ihv, HV, K, k0, BK, BT)
        kb = _load_rows(k, r64, rmask, H * K, ih * K, offs, False) * (bb * rk)[:, None] * tl.exp(tl.cumsum(gg, 0))
        W = tl.dot(Tm, _op(kb, DT, LOWP), input_precision=PREC)
        tl.store(Wbuf + krow, W.to(Wbuf.dtype.element_ty), mask=rmask[:, None])
    _tu_blk(Tm, v, bb, Ubuf, r64, rmask, ihv, HV, V, BV, PREC, LOWP)


@triton.jit
def _l2_bwd_blk(dx, x, r64, rmask, ihv, rx, s, HV, stride, col0, K: tl.constexpr, BK: tl.constexpr):
    """dx <- (dx - x^ s) r in place over K blocks: the l2 norm's backward (x^ = x r, s_i = sum_d x^_id dx_id).
    dx was just stored by this program in another layout: other threads' global stores, visible to the CTA only
    after a barrier (as in gdn_kernels' state backward)."""
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
    L2: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr, DIAG: tl.constexpr, WHOLE: tl.constexpr = False,
):
    """Backward phase 1, through O = (scale Q^ e^b) S + P Vn: dP = dO Vn^T once, then per K block dQS = dO S^T,
    and the decay products of P's gradient. Stores dq (final), dk's part (through P) and db's part (dg buffer);
    phase 2 finishes dk and dg."""
    DT: tl.constexpr = hbuf.dtype.element_ty
    if _diag_pass(g, redo, cu, chunk_seq, chunk_start, HV, K, BK, BT, DIAG, False, WHOLE):
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
    H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr, DIAG: tl.constexpr, MARKED: tl.constexpr = False,
    WHOLE: tl.constexpr = False,
):
    """Backward phase 2 (MARKED: see `_diag_pass`): the state write S' = e^{bL} S + Kd^T Vn,
    W = T diag(beta) (K^ e^b), U = T diag(beta) V and the UT transform (dA = -T^T dT T^T), in three passes:
    1. over V blocks: dv = diag(beta) T^T dVn, dT = dVn (diag(beta) V)^T, beta's gradient through U;
    2. over K blocks (each with a V loop for dKd = Vn dS'^T, dW = -dVn S^T, rowsum(S * dS')): dT += dW Kb^T,
       the K and b gradients through Kd, S's decay and W, added to phase 1's parts in the dk and dg buffers; dg's
       part so far is finished there (`_dg_rows`);
    3. over K blocks, with the full dA: the decay products of A's gradient, whose db adds to dg by reverse cumsum,
       dk; then the l2 norm's backward of dk."""
    DT: tl.constexpr = hbuf.dtype.element_ty
    if _diag_pass(g, redo, cu, chunk_seq, chunk_start, HV, K, BK, BT, DIAG, MARKED, WHOLE):
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
            tl.store(dg + krow, tl.cumsum(db, 0, reverse=True) + dg_done, mask=rmask[:, None])
        if L2:
            _l2_bwd_blk(dk, k, r64, rmask, ihv, rk, sk, HV, H * K, ih * K, K, BK)
        tl.store(dbeta + r64 * HV + ihv, dbeta_, mask=rmask)


__all__ = ["_kda_prep_fwd", "_kda_chunk_bwd", "_kda_prep_ap", "_kda_solve", "_kda_prep_wu", "_kda_bwd_out_blk",
           "_kda_bwd_state_blk", "triton"]
