"""Triton helpers shared by every chunked kernel of the delta-rule family (GDN and KDA): the packed-sequence chunk
addressing, tile loads and stores, dot operands, row norms and the chunk's cumulative log-decay.

Layout: every kernel sees the batch flattened into packed sequences (varlen form): tokens [Ttot, heads, dim],
sequence n spans [cu[n], cu[n+1]), and chunks of BT tokens start at each sequence's first token. A chunk table
(chunk_seq, chunk_start) maps a global chunk index to its sequence and first token; chunk_off[n] is the global
index of sequence n's first chunk (host side: `chunk_layout.py`). Value head hv reads key head hv // G (GVA).

Non-standard: the cumulative log-decay is summed in fp64 and kept as fp32 hi + lo parts (`_cum_split`), and
exponents are taken as differences of those parts (`_pair_exponent`), so a factor e^{b_i - b_j} keeps its own
precision and not |b|'s.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _inv_norms(x):
    """1 / ||x_i|| of a tile's rows [BT, K] -> [BT] fp32, with the reference l2 norm's epsilon under the root."""
    xf = x.to(tl.float32)
    return tl.rsqrt(tl.sum(xf * xf, 1) + 1e-6)


@triton.jit
def _load_rows(ptr, rows64, rmask, stride, col0, offs, L2: tl.constexpr):
    x = tl.load(ptr + rows64[:, None] * stride + col0 + offs[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    if L2:
        x = x * _inv_norms(x)[:, None]
    return x


@triton.jit
def _load_raw(ptr, r64, rmask, stride, col0, offs):
    """Rows r64 at columns col0 + offs, in the input dtype (0 past the chunk's end)."""
    return tl.load(ptr + r64[:, None] * stride + col0 + offs[None, :], mask=rmask[:, None], other=0.0)


@triton.jit
def _row_inv_norms(x, r64, rmask, stride, col0, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                   L2: tl.constexpr):
    """1 / ||x_i|| of the chunk's rows ([BT] fp32, as `_load_rows` normalises), by K blocks (unrolled: the loads
    of every block can be in flight at once); ones without L2."""
    if L2:
        ss = tl.zeros([BT], dtype=tl.float32)
        for kb in tl.static_range(K // BK):
            b_x = _load_raw(x, r64, rmask, stride, col0 + kb * BK, tl.arange(0, BK)).to(tl.float32)
            ss += tl.sum(b_x * b_x, 1)
        r = tl.rsqrt(ss + 1e-6)
    else:
        r = tl.full([BT], 1.0, tl.float32)
    return r


@triton.jit
def _op(x, DT: tl.constexpr, LOWP: tl.constexpr):
    """A dot operand: rounded to the 16-bit storage dtype DT when LOWP, else fp32."""
    if LOWP:  # one return: the compiler wants the same return type on every path, even constexpr ones
        y = x.to(DT)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _chunk_scale(g, tok, ihv, HV, live):
    """m = 2^floor(log2 e^{g_0}) within [2^-60, 1], g_0 the log-decay of the chunk's first token tok (1 where the
    chunk is not live). Every row of W = T diag(beta gamma) K^ and of dO diag(qs) is at most ~e^{g_0} in size: the
    kernels keep W / m and dO diag(qs / m) in 16 bits and multiply m back onto the fp32 products, so that a strong
    first decay (e^{g_0} = 1e-11 at g_0 = -25, under float16's smallest subnormal 6e-8) does not round them, and
    the initial state's gradient with them, to zero. A power of two: dividing and multiplying by it is exact."""
    g0 = tl.load(g + tok * HV + ihv, mask=live, other=0.0).to(tl.float32)
    return tl.exp2(tl.minimum(tl.maximum(tl.floor(g0 * 1.4426950408889634), -60.0), 0.0))


@triton.jit
def _chunk_coords(cu, chunk_seq, chunk_start, ic, BT: tl.constexpr):
    n = tl.load(chunk_seq + ic)
    bos = tl.load(chunk_start + ic).to(tl.int64)
    eos = tl.load(cu + n + 1).to(tl.int64)
    nval = tl.minimum(eos - bos, BT)
    return n, bos, nval


@triton.jit
def _chunk_rows(cu, chunk_seq, chunk_start, ic, BT: tl.constexpr):
    """`_chunk_coords` of chunk ic plus its rows: (sequence, first token, valid rows, rows [BT], row mask, token
    index of each row)."""
    n, bos, nval = _chunk_coords(cu, chunk_seq, chunk_start, ic, BT)
    rows = tl.arange(0, BT)
    return n, bos, nval, rows, rows < nval, bos + rows


@triton.jit
def _blk(ptr, r0, c0, BT: tl.constexpr):
    """The [16, 16] block of a row-major [BT, BT] fp32 matrix at (r0, c0)."""
    r = tl.arange(0, 16)
    return tl.load(ptr + (r0 + r)[:, None] * BT + (c0 + r)[None, :])


@triton.jit
def _seq_tile(ptr, bos, Tn, t0, col0, stride, BT: tl.constexpr, BC: tl.constexpr):
    """(pointers, row mask) of the [BT, BC] tile at token t0 of a sequence starting at bos and Tn tokens long, in
    a [tokens, heads * dim] buffer: load with other=0 (rows past the sequence's end read as 0), store with the
    mask (they are not written). Plain pointers, not block pointers: Triton 3.9 removed tl.make_block_ptr."""
    r = t0 + tl.arange(0, BT)
    return ptr + (bos + r)[:, None] * stride + col0 + tl.arange(0, BC)[None, :], (r < Tn)[:, None]


@triton.jit
def _seq_load(ptr, bos, Tn, t0, col0, stride, BT: tl.constexpr, BC: tl.constexpr):
    """The [BT, BC] tile of `_seq_tile`, rows past the sequence's end as 0."""
    p, m = _seq_tile(ptr, bos, Tn, t0, col0, stride, BT, BC)
    return tl.load(p, mask=m, other=0.0)


@triton.jit
def _seq_store(ptr, x, bos, Tn, t0, col0, stride, BT: tl.constexpr, BC: tl.constexpr):
    """Store x [BT, BC] into the tile of `_seq_tile`, rows past the sequence's end left unwritten."""
    p, m = _seq_tile(ptr, bos, Tn, t0, col0, stride, BT, BC)
    tl.store(p, x.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _chunk_p(Pb, ic, HV, ihv, live, rows, BT: tl.constexpr):
    """The intra-chunk attention tile P [BT, BT] of chunk ic and value head ihv (zeros past a sequence's end)."""
    return tl.load(Pb + (ic * HV + ihv) * BT * BT + rows[:, None] * BT + rows[None, :],
                   mask=(rows < tl.where(live, BT, 0))[:, None], other=0.0)


@triton.jit
def _chunk_gates(g, beta, r64, rmask, ihv, HV):
    """Of one chunk: `_cum_split` of its log-decays (b, b_lo, bL, bL - b) and beta [BT] (fp32; 0 past nval)."""
    gg = tl.load(g + r64 * HV + ihv, mask=rmask, other=0.0).to(tl.float32)
    bb = tl.load(beta + r64 * HV + ihv, mask=rmask, other=0.0).to(tl.float32)
    gc, gcl, gL, ged = _cum_split(gg)
    return gc, gcl, gL, ged, bb


@triton.jit
def _cum_split(gg):
    """gg: [BT] fp32 log-decays of one chunk. Returns the cumulative log-decay b as fp32 hi (b itself) and lo parts
    [BT], its total bL and bL - b [BT] (fp32), all summed in fp64.

    Why: every decay factor is e^{b_i - b_j} or e^{bL - b_j}, and a difference of two fp32 running sums keeps only
    |b| * 6e-8 of absolute precision, which becomes the factor's relative error (after a strongly decaying stretch,
    -30 a step, fp32 dg was off by 1.5e-5). The [BT] vectors are cheap in fp64; the [BT, BT] exponents stay fp32 as
    (hi_i - hi_j) + (lo_i - lo_j) (`_pair_exponent`)."""
    b = tl.cumsum(gg.to(tl.float64), 0)
    tot = tl.sum(gg.to(tl.float64), 0)
    hi = b.to(tl.float32)
    return hi, (b - hi.to(tl.float64)).to(tl.float32), tot.to(tl.float32), (tot - b).to(tl.float32)


@triton.jit
def _pair_exponent(gc, gcl, mask):
    """[BT, BT] exponent b_i - b_j where mask (j <= i or j < i), 0 elsewhere so its exp never overflows; from the
    hi (gc) and lo (gcl) parts of `_cum_split`."""
    return tl.where(mask, (gc[:, None] - gc[None, :]) + (gcl[:, None] - gcl[None, :]), 0.0)


@triton.jit
def _excl_combine(e1, v1, e2, v2):
    """Combine of an exclusive prefix sum as an associative scan over (sum before the last element, last element)."""
    return e1 + v1 + e2, v2


@triton.jit
def _dg_rows(dgc, r, c):
    """dg of one chunk ([BT], or [BT, BK] for KDA's per-channel decay) from the three ways b_i reaches the loss:
    through b_s for s >= i (dgc: reverse cumsum), through the state write's decays e^{bL - b_s} for s < i (r:
    exclusive cumsum, an associative scan that adds the terms before row i alone) and through bL (c: every row; a
    scalar, or [1, BK]). Summing r through bL onto the last row and taking it back in the reverse cumsum (the
    algebra's shortest form) leaves each early row of a strongly decaying chunk a difference of two fp32 sums of
    ~|r| (dg off by up to 6e-6 at log-decays of -30 a step)."""
    before, _last = tl.associative_scan((tl.zeros_like(r), r), 0, _excl_combine)
    return tl.cumsum(dgc, 0, reverse=True) + before + c
