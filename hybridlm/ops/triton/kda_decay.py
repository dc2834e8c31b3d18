"""KDA's per-channel decay products inside a chunk, and the launches that pick a form per chunk.

With one log-decay per key channel, A_ij = beta_i sum_d k_id k_jd e^{b_id - b_jd} is not a matmul times a
[BT, BT] decay matrix. As in the PyTorch reference (ops/chunk.py `_masked_products`) the chunk is cut into 16-row
blocks: an off-diagonal block (rows after column block c) factors e^{b_i - b_j} = e^{b_i - r_c} e^{r_c - b_j}
through r_c = b at the last row of block c, both factors <= 1 (one masked dot per column block). The diagonal
blocks factor through a reference r per block and channel (e^{b_i - r} e^{r - b_j}, one masked dot for all four
blocks) when every such factor is within e^60; r is b at the block's middle row in the prep, the midpoint of the
block's range of b in the backward (`_centred`). Under stronger decay, by their two 8-row halves where those stay
within the bound (two masked dots: within a half through its reference, across the halves through the row between
them), and else in the exact pairwise form, one in-block column at a time (16 steps, every block at once). First
of all, a chunk whose every row is within e^60 of its middle row m in every channel takes the whole [BT, BT]
product as one masked dot per key block, e^{b_i - b_j} = e^{b_i - b_m} e^{b_m - b_j} (`_whole_sums`), as GDN's
kernels do; where j > i that product may overflow, and the mask drops it. Each K-blocked KDA kernel is launched
four times over the same grid (`_diag_pass`: whole chunk, 16-row blocks, 8-row halves, exact), each launch taking
the chunks the earlier ones left. Nothing overflows for any decay, and nothing is divided by a decay.

Non-standard: every exponent b_i - b_j (and bL - b_i) is summed directly from the g's between the two rows
(`_g_blk`, `_off_parts`, running sums in the diagonal loops), never taken as a difference of the cumulative b:
under strong decay |b| reaches ~1e3 within a chunk, where an fp32 ulp is ~6e-5, so a difference of two cumulative
sums carries an absolute error of that size and e^{b_i - b_j} a relative one (measured: fp32 dg 1.4e-5 relative
RMS vs float64 at decay 30 a step, 1e-6 with direct sums).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_jit import _chunk_rows, _op
from .gates import _softplus


@triton.jit
def _kimi_gate(raw, A_log, dt_bias, r64, rmask, ihv, HV, K: tl.constexpr, KR, offs, lb, LB: tl.constexpr):
    """Kimi's gate of rows r64 and key channels offs of raw [tokens, HV, K] (any float dtype): x = raw + dt_bias[h],
    A = exp(A_log[h]); g = -A softplus(x), or lb sigmoid(A x) with LB. Returns (g, dg/dx, dg/dA_log), [BT, BK] fp32,
    each 0 on rows past rmask and on channels >= KR (a non-native head dim's zero padding: a zero log-decay there,
    as `gdn.pad_heads` gives a padded g). raw is padded to K, dt_bias is [HV, KR] (not padded)."""
    cm = offs < KR
    m = rmask[:, None] & cm[None, :]
    x = tl.load(raw + (r64[:, None] * HV + ihv) * K + offs[None, :], mask=m, other=0.0).to(tl.float32)
    x += tl.load(dt_bias + ihv * KR + offs, mask=cm, other=0.0).to(tl.float32)[None, :]
    A = tl.exp(tl.load(A_log + ihv).to(tl.float32))
    if LB:
        z = A * x
        e = tl.exp(-tl.abs(z))  # sigmoid(z) and sigmoid(-z) = 1 - sigmoid(z) each without a difference
        sp = 1.0 / (1.0 + e)
        sn = e / (1.0 + e)
        s = tl.where(z >= 0, sp, sn)
        ds = lb * sp * sn  # d g / d z
        g = lb * s
        dx = ds * A
        dA = ds * z
    else:
        sp, s = _softplus(x)
        g = -A * sp
        dx = -A * s
        dA = g  # d g / d A_log
    return tl.where(m, g, 0.0), tl.where(m, dx, 0.0), tl.where(m, dA, 0.0)


@triton.jit
def _gate_store(raw, A_log, dt_bias, g, cu, chunk_seq, chunk_start, HV, K: tl.constexpr, KR, lb,
                BK: tl.constexpr, BT: tl.constexpr, LB: tl.constexpr):
    """g [tokens, HV, K] fp32 of this program's chunk and value head from the raw gate (`_kimi_gate`), then a
    barrier: the same program reads the rows back at once, in other layouts (`_g_blk`, `_block_row`)."""
    ic = tl.program_id(0)
    ihv = tl.program_id(1)
    n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
    for k0 in range(0, K, BK):
        offs = k0 + tl.arange(0, BK)
        gv, _, _ = _kimi_gate(raw, A_log, dt_bias, r64, rmask, ihv, HV, K, KR, offs, lb, LB)
        tl.store(g + (r64[:, None] * HV + ihv) * K + offs[None, :], gv, mask=rmask[:, None])
    tl.debug_barrier()


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
    masked whole-tile scans and two exponentials per column block (5% slower in the
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
    pairs by the 16-row dot instead of 50%, 25% by the half-block dots instead of 37%, none exact instead of 1%).
    Rows past a sequence's end repeat the last row's
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
    prep keeps the middle row: centred, it took the forward 2.371 -> 2.413 ms while the backward gained (H100)."""
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
               DIAG: tl.constexpr, MARKED: tl.constexpr = False, CENTRE: tl.constexpr = True):
    """Whether this program works in this launch. A K-blocked KDA kernel is launched four times with a shared int32
    redo [chunks, HV], in the order DIAG 3, 1, 4, 2; every chunk is taken by exactly one of them:
    3: the chunks whose every row stays within e^60 of the middle row in every channel (`_whole_sums`: log-decays
       summing to at most ~120 over the chunk) take the whole chunk as one masked dot per key block; the rest are
       marked 1;
    1: of those, the chunks whose diagonal blocks can be one masked dot through e^{s_i} e^{-s_j} (`_mid_sums`) in
       every key block, i.e. every factor within e^60 (fp32, tf32 and bf16 reach e^88; the margin keeps a small y
       times e^-60 a normal number), marked 2; the others stay 1;
    4: of those, the chunks whose 8-row half-blocks stay within the bound (`_mid_sums` over 8 rows: log-decays up
       to ~15 a step) take their diagonal blocks as two masked dots, one for the pairs within a half-block
       (through its middle row) and one for the pairs across the two halves (`_off_parts` over 8 rows, both
       factors <= 1), marked 3;
    2: the chunks still marked 1 (log-decays summing beyond ~-120 over 8 rows) through the exact loop.
    One kernel holding every way spills (sm_90: 8-24 -> 670-1460 B per thread in the backward launches).
    MARKED: redo already holds the marks of this call, written by the same launches of an earlier kernel over the
    same g and key blocks (the output backward's, before the state backward): read them, do not recompute them.
    CENTRE: the block bounds about the midpoint of each block's range of b (`_mid_sums`)."""
    ic = tl.program_id(0)
    ihv = tl.program_id(1)
    p = redo + ic * HV + ihv
    if DIAG == 3 and MARKED:
        go = tl.load(p) == 0
    elif DIAG == 3:
        go = _within_bound(g, cu, chunk_seq, chunk_start, ic, ihv, HV, K, BK, BT, 0)
        tl.store(p, tl.where(go, 0, 1).to(tl.int32))
    elif DIAG == 1 and MARKED:
        go = tl.load(p) == 2
    elif DIAG == 1:
        go = ic < 0
        if tl.load(p) != 0:
            go = _within_bound(g, cu, chunk_seq, chunk_start, ic, ihv, HV, K, BK, BT, 16, CENTRE)
            tl.store(p, tl.where(go, 2, 1).to(tl.int32))
    elif DIAG == 4 and MARKED:
        go = tl.load(p) == 3
    elif DIAG == 4:
        go = ic < 0
        if tl.load(p) == 1:
            go = _within_bound(g, cu, chunk_seq, chunk_start, ic, ihv, HV, K, BK, BT, 8, CENTRE)
            tl.store(p, tl.where(go, 3, 1).to(tl.int32))
    else:
        go = tl.load(p) == 1
    return go


@triton.jit
def _same_block(BT: tl.constexpr):
    """[BT, BT] mask of the pairs (i, j) in one 16-row block."""
    rows = tl.arange(0, BT)
    return (rows[:, None] // 16) == (rows[None, :] // 16)


@triton.jit
def _block_row(ptr, row0, nrow, p, stride, col0, offs, BT: tl.constexpr):
    """[BT, BK] fp32 whose row i is x[row0 + 16 (i // 16) + p, col0 + offs] (0 where 16 (i // 16) + p >= nrow): the
    row p of every 16-row block, as the exact diagonal loops pair it with each row of its block. Loads the NB rows
    once and broadcasts them over their blocks, instead of gathering BT rows (16x the addresses and the L1
    requests: Nsight Compute on the H100 found the exact launches limited by integer (address) work and
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
    backward 12.06-12.18 ms with the loop, 10.62 with the reshape; same script and seed,
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
        # with 16-bit operands KDA's bf16 dg reached 9.4e-3 of its 1e-2 bar (H100 check)
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
