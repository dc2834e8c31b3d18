"""The UT transform's solve: T = (I + A)^{-1} per chunk and value head, A = strict_lower(diag(beta) K K^T * decay).

- `_kkt_solve` (GDN): A and its inverse in one launch, by [16, 16] blocks. The ten lower blocks A_IJ of a 64-token
  chunk are summed over K in registers (one [16, BK] tile of k per row block and K block, so K is read once); the
  l2 norms enter as row and column scales, and beta and the decays e^{b_i - b_j} are put on each block just before
  its first use. Only T goes to memory.
- `_solve_blocks` (KDA, whose per-channel decay makes A in the prep): the same block solve on an A staged in memory.

Both invert by blocks (`_t_from_blocks`): the diagonal blocks by doubling (`_solve_doubling`: four steps of two
[16, 16] tensor-core dots, no per-row steps), the rest by the block recursion of a lower-triangular inverse
    T_II = (I + A_II)^{-1},   T_IJ = -T_II sum_{J <= M < I} A_IM T_MJ   (I > J).
Non-standard: for 16-bit inputs the solve's dots run at tf32 (fp32 inputs: IEEE), and T is stored in the 16-bit
storage dtype when every later dot rounds it to 16 bits anyway.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_jit import _blk, _chunk_coords, _load_raw


@triton.jit
def _solve_doubling(A, BT: tl.constexpr, PREC: tl.constexpr):
    """T = (I + A)^{-1} of a strictly lower [BT, BT] fp32 register tile by doubling the inverted diagonal blocks:
    with Y the inverse of I + A's block diagonal of b x b blocks and L the lower-left b x b block of each 2b x 2b
    diagonal block, [[X, 0], [L, Z]]^{-1} = Y - Y L Y, so log2(BT) steps of two [BT, BT] dots from Y = I (1 x 1
    blocks) reach T. No loads, no per-row steps: tensor-core dots at PREC
    instead of the 15 dependent row updates of forward substitution. fp32 accuracy equals forward substitution's
    (CPU emulation, keys of cosine up to 0.99, beta up to 2: 2.4e-7 vs 4.1e-7 relative; tf32x3 4.8e-7)."""
    r = tl.arange(0, BT)
    T = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for s in tl.static_range(6):
        if (1 << s) < BT:  # block size b = 2^s
            sel = ((r[:, None] >> (s + 1)) == (r[None, :] >> (s + 1))) & (((r[:, None] >> s) & 1) == 1) \
                & (((r[None, :] >> s) & 1) == 0)
            L = tl.where(sel, A, 0.0)
            T = T - tl.dot(tl.dot(T, L, input_precision=PREC), T, input_precision=PREC)
    return T


@triton.jit
def _kkt_gates(g, beta, bos, r0, nval, ihv, HV, off):
    """Rows r0 .. r0+15 of a chunk: their cumulative log-decay b from the chunk's start, summed in fp64 from off
    (the sum of the chunk's earlier gates, fp64 scalar) and split as `_cum_split` splits it (fp32 hi, lo), beta,
    and the running sum after them."""
    rows = r0 + tl.arange(0, 16)
    m = rows < nval
    gg = tl.load(g + (bos + rows) * HV + ihv, mask=m, other=0.0).to(tl.float64)
    b = tl.cumsum(gg, 0) + off
    hi = b.to(tl.float32)
    bb = tl.load(beta + (bos + rows) * HV + ihv, mask=m, other=0.0).to(tl.float32)
    return hi, (b - hi.to(tl.float64)).to(tl.float32), bb, off + tl.sum(gg, 0)


@triton.jit
def _kkt_scale(A, hi_i, lo_i, bs_i, hi_j, lo_j, rk_j, STRICT: tl.constexpr):
    """A block of raw K K^T sums times beta_i rk_i (bs_i), rk_j and e^{b_i - b_j}; with STRICT (a diagonal block)
    only j < i is kept and the exponent is masked above it, where it could overflow."""
    x = (hi_i[:, None] - hi_j[None, :]) + (lo_i[:, None] - lo_j[None, :])
    if STRICT:
        r = tl.arange(0, 16)
        keep = r[:, None] > r[None, :]
        out = tl.where(keep, A * tl.exp(tl.where(keep, x, 0.0)) * bs_i[:, None] * rk_j[None, :], 0.0)
    else:
        out = A * tl.exp(x) * bs_i[:, None] * rk_j[None, :]
    return out


@triton.jit
def _kkt_tile(k, bos, r0, nval, col, H, K: tl.constexpr, BK: tl.constexpr):
    """The raw [16, BK] tile of k at chunk rows r0.. and key columns col.. (input dtype; 0 past the chunk)."""
    rows = r0 + tl.arange(0, 16)
    return _load_raw(k, bos + rows, rows < nval, H * K, col, tl.arange(0, BK))


@triton.jit
def _put16(p_T, x, r0, c0, BT: tl.constexpr):
    """Store a [16, 16] block of T at (r0, c0) of the chunk's row-major [BT, BT] slot p_T, in p_T's dtype."""
    r = tl.arange(0, 16)
    tl.store(p_T + (r0 + r)[:, None] * BT + (c0 + r)[None, :], x.to(p_T.dtype.element_ty))


@triton.jit
def _kkt_solve(
    k, g, beta, Tout, cu, chunk_seq, chunk_start,
    H, HV, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr,
):
    """T = (I + A)^{-1}, A = strict_lower(beta_i rk_i rk_j (K K^T)_ij e^{b_i - b_j}), of one chunk and value head
    (grid chunks x HV), written to Tout ([chunks, HV, BT, BT] row-major, its dtype; upper blocks 0). BT in
    {16, 32, 64}: NB = BT / 16 row blocks; blocks past NB stay zero and are never stored. K K^T is summed from
    raw input-dtype tiles, the l2 norms entering as row and column scales rk; the solve's dots take fp32 operands,
    all at PREC (tf32 for 16-bit inputs: one pass, ~1e-3, below the 16-bit T it makes; IEEE for fp32)."""
    ic = tl.program_id(0)
    ihv = tl.program_id(1)
    ih = ihv // (HV // H)
    n, bos, nval = _chunk_coords(cu, chunk_seq, chunk_start, ic, BT)
    p_T = Tout + (ic * HV + ihv).to(tl.int64) * BT * BT
    col0 = ih * K
    off = tl.sum(tl.zeros([16], dtype=tl.float64), 0)
    hi0, lo0, bb0, off = _kkt_gates(g, beta, bos, 0, nval, ihv, HV, off)
    hi1, lo1, bb1, off = _kkt_gates(g, beta, bos, 16, nval, ihv, HV, off)
    hi2, lo2, bb2, off = _kkt_gates(g, beta, bos, 32, nval, ihv, HV, off)
    hi3, lo3, bb3, off = _kkt_gates(g, beta, bos, 48, nval, ihv, HV, off)
    z = tl.zeros([16, 16], dtype=tl.float32)
    A00, A10, A11, A20, A21, A22, A30, A31, A32, A33 = z, z, z, z, z, z, z, z, z, z
    s0 = tl.zeros([16], dtype=tl.float32)
    s1, s2, s3 = s0, s0, s0
    # 1. the raw sums K_I K_J^T over K blocks, and the rows' squared norms
    for c in range(0, K, BK):
        k0 = _kkt_tile(k, bos, 0, nval, col0 + c, H, K, BK)
        A00 += tl.dot(k0, tl.trans(k0), input_precision=PREC)
        if L2:
            s0 += tl.sum(k0.to(tl.float32) * k0.to(tl.float32), 1)
        if BT >= 32:
            k1 = _kkt_tile(k, bos, 16, nval, col0 + c, H, K, BK)
            A10 += tl.dot(k1, tl.trans(k0), input_precision=PREC)
            A11 += tl.dot(k1, tl.trans(k1), input_precision=PREC)
            if L2:
                s1 += tl.sum(k1.to(tl.float32) * k1.to(tl.float32), 1)
        if BT == 64:
            k2 = _kkt_tile(k, bos, 32, nval, col0 + c, H, K, BK)
            k3 = _kkt_tile(k, bos, 48, nval, col0 + c, H, K, BK)
            A20 += tl.dot(k2, tl.trans(k0), input_precision=PREC)
            A21 += tl.dot(k2, tl.trans(k1), input_precision=PREC)
            A22 += tl.dot(k2, tl.trans(k2), input_precision=PREC)
            A30 += tl.dot(k3, tl.trans(k0), input_precision=PREC)
            A31 += tl.dot(k3, tl.trans(k1), input_precision=PREC)
            A32 += tl.dot(k3, tl.trans(k2), input_precision=PREC)
            A33 += tl.dot(k3, tl.trans(k3), input_precision=PREC)
            if L2:
                s2 += tl.sum(k2.to(tl.float32) * k2.to(tl.float32), 1)
                s3 += tl.sum(k3.to(tl.float32) * k3.to(tl.float32), 1)
    # 2. row/column scales (beta, l2 norms: the reference's epsilon under the root) and the decays
    if L2:
        rk0, rk1, rk2, rk3 = tl.rsqrt(s0 + 1e-6), tl.rsqrt(s1 + 1e-6), tl.rsqrt(s2 + 1e-6), tl.rsqrt(s3 + 1e-6)
    else:
        rk0 = tl.full([16], 1.0, tl.float32)
        rk1, rk2, rk3 = rk0, rk0, rk0
    # 3. T by blocks, each block of A scaled just before its first use
    _t_from_blocks(p_T, A00, A10, A11, A20, A21, A22, A30, A31, A32, A33, hi0, lo0, bb0 * rk0, rk0,
                   hi1, lo1, bb1 * rk1, rk1, hi2, lo2, bb2 * rk2, rk2, hi3, lo3, bb3 * rk3, rk3, BT, PREC)


@triton.jit
def _t_from_blocks(p_T, A00, A10, A11, A20, A21, A22, A30, A31, A32, A33, hi0, lo0, r0, c0, hi1, lo1, r1, c1,
                   hi2, lo2, r2, c2, hi3, lo3, r3, c3, BT: tl.constexpr, PREC: tl.constexpr):
    """T = (I + A)^{-1} from the ten lower [16, 16] blocks of an unscaled A (blocks past BT / 16 unused): block IJ
    is first scaled by `_kkt_scale` (rows r_I, columns c_J, decays e^{b_i - b_j} from the hi/lo parts; the diagonal
    blocks strictly lower), then T is stored to the chunk's row-major [BT, BT] slot p_T with zeros above the
    diagonal blocks: the diagonal blocks by doubling, block row I from the rows above it, every dot at PREC. Each
    block is scaled where it is first needed (measured order: scaling all ten first took 255 registers instead of
    240 at one warp, sm_90)."""
    z = tl.zeros([16, 16], dtype=tl.float32)
    A00 = _kkt_scale(A00, hi0, lo0, r0, hi0, lo0, c0, True)
    T00 = _solve_doubling(A00, 16, PREC)
    _put16(p_T, T00, 0, 0, BT)
    if BT >= 32:
        A10 = _kkt_scale(A10, hi1, lo1, r1, hi0, lo0, c0, False)
        A11 = _kkt_scale(A11, hi1, lo1, r1, hi1, lo1, c1, True)
        T11 = _solve_doubling(A11, 16, PREC)
        T10 = -tl.dot(T11, tl.dot(A10, T00, input_precision=PREC), input_precision=PREC)
        _put16(p_T, T10, 16, 0, BT)
        _put16(p_T, T11, 16, 16, BT)
        _put16(p_T, z, 0, 16, BT)
    if BT == 64:
        A20 = _kkt_scale(A20, hi2, lo2, r2, hi0, lo0, c0, False)
        A21 = _kkt_scale(A21, hi2, lo2, r2, hi1, lo1, c1, False)
        A22 = _kkt_scale(A22, hi2, lo2, r2, hi2, lo2, c2, True)
        T22 = _solve_doubling(A22, 16, PREC)
        T21 = -tl.dot(T22, tl.dot(A21, T11, input_precision=PREC), input_precision=PREC)
        T20 = -tl.dot(T22, tl.dot(A20, T00, input_precision=PREC) + tl.dot(A21, T10, input_precision=PREC),
                      input_precision=PREC)
        A30 = _kkt_scale(A30, hi3, lo3, r3, hi0, lo0, c0, False)
        A31 = _kkt_scale(A31, hi3, lo3, r3, hi1, lo1, c1, False)
        A32 = _kkt_scale(A32, hi3, lo3, r3, hi2, lo2, c2, False)
        A33 = _kkt_scale(A33, hi3, lo3, r3, hi3, lo3, c3, True)
        T33 = _solve_doubling(A33, 16, PREC)
        T32 = -tl.dot(T33, tl.dot(A32, T22, input_precision=PREC), input_precision=PREC)
        T31 = -tl.dot(T33, tl.dot(A31, T11, input_precision=PREC) + tl.dot(A32, T21, input_precision=PREC),
                      input_precision=PREC)
        T30 = -tl.dot(T33, tl.dot(A30, T00, input_precision=PREC) + tl.dot(A31, T10, input_precision=PREC)
                      + tl.dot(A32, T20, input_precision=PREC), input_precision=PREC)
        _put16(p_T, T20, 32, 0, BT)
        _put16(p_T, T21, 32, 16, BT)
        _put16(p_T, T22, 32, 32, BT)
        _put16(p_T, T30, 48, 0, BT)
        _put16(p_T, T31, 48, 16, BT)
        _put16(p_T, T32, 48, 32, BT)
        _put16(p_T, T33, 48, 48, BT)
        for c in tl.static_range(32, 64, 16):  # the upper blocks of rows 0-31
            _put16(p_T, z, 0, c, BT)
            _put16(p_T, z, 16, c, BT)
        _put16(p_T, z, 32, 48, BT)


@triton.jit
def _solve_blocks(Tbuf, HV, BT: tl.constexpr, PREC: tl.constexpr):
    """T = (I + A)^{-1} in place of A (fp32, one row-major [BT, BT] slot per chunk and value head; grid chunks x
    HV), by `_t_from_blocks` (its scales all 1, its exponents 0): A's ten lower [16, 16] blocks are read into
    registers first, so T can overwrite them; entries on and above the diagonal are ignored. For a prep that
    stages A in memory (KDA's)."""
    p_T = Tbuf + (tl.program_id(0) * HV + tl.program_id(1)).to(tl.int64) * BT * BT
    z = tl.zeros([16, 16], dtype=tl.float32)
    A00 = _blk(p_T, 0, 0, BT)
    A10, A11, A20, A21, A22, A30, A31, A32, A33 = z, z, z, z, z, z, z, z, z
    if BT >= 32:
        A10 = _blk(p_T, 16, 0, BT)
        A11 = _blk(p_T, 16, 16, BT)
    if BT == 64:
        A20 = _blk(p_T, 32, 0, BT)
        A21 = _blk(p_T, 32, 16, BT)
        A22 = _blk(p_T, 32, 32, BT)
        A30 = _blk(p_T, 48, 0, BT)
        A31 = _blk(p_T, 48, 16, BT)
        A32 = _blk(p_T, 48, 32, BT)
        A33 = _blk(p_T, 48, 48, BT)
    tl.debug_barrier()  # every read of A is done before T overwrites it
    o = tl.zeros([16], dtype=tl.float32)  # no decay (exponent 0) and unit scales: A is already scaled
    u = o + 1.0
    _t_from_blocks(p_T, A00, A10, A11, A20, A21, A22, A30, A31, A32, A33, o, o, u, u, o, o, u, u, o, o, u, u,
                   o, o, u, u, BT, PREC)
