"""W and U of the WY/UT form, per chunk and value head: W = T diag(beta gamma) K^, U = T diag(beta) V, with T from
`ut_solve.py`, gamma = e^b and K^ the (l2-normalised) keys. The serial state pass then needs only
Vn = U - W S per chunk. W is stored as W / m, m the chunk's power-of-two scale (`chunk_jit._chunk_scale`), which
its readers multiply back onto their fp32 products.

Non-standard: K enters raw, walked in blocks of BK key channels; its l2 norm and the decays are row scales. The
same launch writes the keys' inverse norms rk [tokens, HV] (for the output launch) and the row scales
s_k = rk e^{bL - b} [tokens, HV] fp32 of the state write, so that no scaled copy of K goes to memory: the state
pass reads the raw k and puts s_k on Vn's rows instead.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_jit import _chunk_coords, _chunk_gates, _chunk_scale, _load_raw, _load_rows, _op, _row_inv_norms


@triton.jit
def _tu_blk(Tm, v, bb, Ubuf, r64, rmask, ihv, HV, V: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
            LOWP: tl.constexpr):
    """U = T diag(beta) V of one chunk, stored by V blocks (Tm: T as a dot operand; LOWP: diag(beta) V rounded to
    the storage dtype of Ubuf as the other operand)."""
    DT: tl.constexpr = Ubuf.dtype.element_ty
    for v0 in range(0, V, BV):
        offs_v = v0 + tl.arange(0, BV)
        vb = _load_rows(v, r64, rmask, HV * V, ihv * V, offs_v, False) * bb[:, None]
        U = tl.dot(Tm, _op(vb, DT, LOWP), input_precision=PREC)
        tl.store(Ubuf + (r64[:, None] * HV + ihv) * V + offs_v[None, :], U.to(DT), mask=rmask[:, None])



@triton.jit
def _wu_fwd(
    k, v, g, beta, Tbuf, Wbuf, Ubuf, SK, RK, cu, chunk_seq, chunk_start,
    H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
):
    """Of one chunk and value head (grid chunks x HV): W / m = T diag(beta rk gamma / m) K by K blocks (m:
    `_chunk_scale`) and U = T diag(beta) V
    by V blocks (T from Tbuf; LOWP: T and the right-hand tiles as 16-bit dot operands), the keys' inverse norms rk
    to RK and the state write's key scales s_k = rk e^{bL - b} to SK (both [tokens, HV] fp32; rk = 1 without L2)."""
    DT: tl.constexpr = Wbuf.dtype.element_ty
    ic = tl.program_id(0)
    ihv = tl.program_id(1)
    ih = ihv // (HV // H)
    n, bos, nval = _chunk_coords(cu, chunk_seq, chunk_start, ic, BT)
    rows = tl.arange(0, BT)
    rmask = rows < nval
    r64 = bos + rows
    gc, gcl, _gL, ged, bb = _chunk_gates(g, beta, r64, rmask, ihv, HV)
    rk = _row_inv_norms(k, r64, rmask, H * K, ih * K, K, BK, BT, L2)
    tl.store(RK + r64 * HV + ihv, rk, mask=rmask)
    tl.store(SK + r64 * HV + ihv, rk * tl.exp(ged), mask=rmask)
    Tm = tl.load(Tbuf + (ic * HV + ihv).to(tl.int64) * BT * BT + rows[:, None] * BT + rows[None, :])
    Tm_d = _op(Tm, DT, LOWP)
    s_w = bb * rk * tl.exp(gc) / _chunk_scale(g, bos, ihv, HV, nval > 0)
    for k0 in range(0, K, BK):
        offs = k0 + tl.arange(0, BK)
        b_raw = _load_raw(k, r64, rmask, H * K, ih * K, offs).to(tl.float32)
        b_W = tl.dot(Tm_d, _op(b_raw * s_w[:, None], DT, LOWP), input_precision=PREC)
        tl.store(Wbuf + (r64[:, None] * HV + ihv) * K + offs[None, :], b_W.to(DT), mask=rmask[:, None])
    _tu_blk(Tm_d, v, bb, Ubuf, r64, rmask, ihv, HV, V, BV, PREC, LOWP)
