"""Triton kernels of the chunked gated delta rule (forward, backward) and its one-token decode step.

Layout: every kernel sees the batch flattened into packed sequences (varlen form): tokens [Ttot, heads, dim],
sequence n spans [cu[n], cu[n+1]), and chunks of BT tokens start at each sequence's first token. A chunk table
(chunk_seq, chunk_start) maps a global chunk index to its sequence and first token; chunk_off[n] is the global
index of sequence n's first chunk. Value head hv reads key head hv // G (GVA).

Per chunk (b = cumsum of g inside the chunk, gamma = e^b, bL = b at the chunk's last token):
    A = strict_lower(diag(beta) K K^T * e^{b_i - b_j}),   T = (I + A)^{-1}     (`_kkt_solve`, by 16 x 16 blocks)
    W = T diag(beta gamma) K,   U = T diag(beta) V              (`_prep_fwd_blk` stage 3, with Kd; or `_prep_fwd`)
    Vn = U - W S,   S' = e^{bL} S + (K * e^{bL - b})^T Vn        (kernel `_recur_fwd`, serial over chunks)
    O = diag(gamma) Q S + (Q K^T * e^{b_i - b_j}, j <= i) Vn      (`_out_fwd_raw`, all chunks at once)
Backward: `_recur_bwd` runs the state-gradient recurrence in reverse (dVn, dS per chunk), then the chunk backward
turns them into dq, dk, dv, dg, dbeta chunk by chunk (all chunks in parallel): by default `_chunk_bwd_state_blk`
and `_chunk_bwd_out_blk` (K-blocked), or the whole-K plans `_chunk_bwd_state` / `_chunk_bwd_out`, `_chunk_bwd`.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def _patch_interpreter_index() -> None:
    """Triton's CPU interpreter (3.6) turns a scalar into an int with int(ndarray of shape (1,)), which
    numpy >= 2.4 refuses; loop bounds that are launch arguments then fail. Only under TRITON_INTERPRET=1."""
    try:
        from triton.runtime import interpreter as itp
    except ImportError:  # pragma: no cover
        return
    orig = getattr(itp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_hybridlm", False):
        return

    def patched(tensor, *scope):  # Triton 3.6+: (tensor, scope); 3.4/3.5: (tensor,)
        orig(tensor, *scope)
        index = lambda self: int(self.handle.data.reshape(-1)[0])
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    patched._hybridlm = True
    itp._patch_lang_tensor = patched


def _patch_interpreter_bf16() -> None:
    """Triton's CPU interpreter (3.4.0 to 3.9.0) holds bf16 tensors as their uint16 bit patterns; its tl.dot multiplies
    those integers (triton-lang/triton#11584) and its fp32 -> bf16 cast truncates, where the GPU rounds to nearest
    even. So every bf16 dot is wrong there and every bf16 store is off by up to one ulp toward zero. This widens bf16
    dot operands to fp32 first (what the GPU computes: bf16 products are exact in fp32, fp32 accumulation) and casts
    fp32 <-> bf16 by the bit patterns with round-to-nearest-even. Only under TRITON_INTERPRET=1; a no-op where the
    interpreter lacks these entry points. tests/ops/triton/interp_bf16.py matches torch exactly with it under 3.4.0,
    3.5.1, 3.6.0, 3.7.1 and 3.9.0, and is off by 2e10 without it under each (2026-11-25)."""
    try:
        from triton.runtime import interpreter as itp
    except ImportError:  # pragma: no cover
        return
    builder = getattr(itp, "InterpreterBuilder", None)
    orig_dot = getattr(builder, "create_dot", None)
    orig_cast = getattr(builder, "cast_impl", None)
    if orig_dot is None or orig_cast is None or getattr(orig_dot, "_hybridlm", False):
        return
    import numpy as np

    def to_f32(bits):  # bf16 bit patterns (uint16) -> float32, exact
        return (bits.astype(np.uint32) << 16).view(np.float32)

    def to_bf16(x):  # float32 -> bf16 bit patterns, round to nearest even (NaN stays a quiet NaN)
        u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
        r = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
        return np.where(np.isnan(x), np.uint16(0x7FC0), r)

    def widen(x):
        return itp.TensorHandle(to_f32(x.data), tl.float32) if x.dtype.scalar == tl.bfloat16 else x

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        s, t = src.dtype.scalar, dst_type.scalar
        if s == tl.bfloat16 and t == tl.float32:
            return itp.TensorHandle(to_f32(src.data), tl.float32)
        if s == tl.float32 and t == tl.bfloat16:
            return itp.TensorHandle(to_bf16(src.data), tl.bfloat16)
        return orig_cast(self, src, dst_type)

    create_dot._hybridlm = True
    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    # the create_fp_* lambdas look cast_impl up on the instance, so they take the patched one


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_index()
    _patch_interpreter_bf16()


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
def _op(x, DT: tl.constexpr, LOWP: tl.constexpr):
    """A dot operand: rounded to the 16-bit storage dtype DT when LOWP, else fp32."""
    if LOWP:  # one return: the compiler wants the same return type on every path, even constexpr ones
        y = x.to(DT)
    else:
        y = x.to(tl.float32)
    return y


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
def _inv_diags(ptr, BT: tl.constexpr):
    """(I + A_bb)^{-1} of every strictly lower [16, 16] diagonal block of A (NB = BT / 16 blocks), as one
    [NB, 16, 16] tile, by forward substitution run on all blocks together: row i = e_i - a_i T (rows < i are
    final). 15 dependent steps instead of 15 NB, and unrolled: the rows of A are read from memory and no load
    depends on T, so every load can be in flight before the first step needs it."""
    NB: tl.constexpr = BT // 16
    b = tl.arange(0, NB)
    r = tl.arange(0, 16)
    Ti = tl.where((r[:, None] == r[None, :])[None, :, :], 1.0, 0.0) + tl.zeros([NB, 16, 16], dtype=tl.float32)
    base = (b * 16 * (BT + 1))[:, None] + r[None, :]  # A[16 b, 16 b + c]; row i adds i * BT
    for i in tl.static_range(1, 16):
        a_i = tl.load(ptr + base + i * BT, mask=(r < i)[None, :], other=0.0)
        t_i = tl.where(r == i, 1.0, 0.0)[None, :] - tl.sum(a_i[:, :, None] * Ti, 1)
        Ti = tl.where((r == i)[None, :, None], t_i[:, None, :], Ti)
    return Ti


@triton.jit
def _inv_diag(ptr, r0, BT: tl.constexpr):
    """(I + A_ii)^{-1} of the one strictly lower [16, 16] diagonal block of A at row/column r0, by forward
    substitution (row i = e_i - a_i T, rows of A read from memory)."""
    r = tl.arange(0, 16)
    Ti = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, 16):
        a_i = tl.load(ptr + (r0 + i) * BT + r0 + r, mask=r < i, other=0.0)
        t_i = tl.where(r == i, 1.0, 0.0) - tl.sum(a_i[:, None] * Ti, 0)
        Ti = tl.where(r[:, None] == i, t_i[None, :], Ti)
    return Ti


@triton.jit
def _diag_inv(ptr, Tii, j, BT: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Diagonal block j of T: from the interleaved [NB, 16, 16] tile, or solved on its own."""
    if INTERLEAVE:
        y = _pick(Tii, j, BT // 16)
    else:
        y = _inv_diag(ptr, 16 * j, BT)
    return y


@triton.jit
def _pick(Ti, j, NB: tl.constexpr):
    """Block j of a [NB, 16, 16] tile, as [16, 16]."""
    return tl.sum(tl.where((tl.arange(0, NB) == j)[:, None, None], Ti, 0.0), 0)


@triton.jit
def _eye_rows(r0, BT: tl.constexpr):
    """Rows r0..r0+15 of the [BT, BT] identity, as a [16, BT] tile."""
    return tl.where((r0 + tl.arange(0, 16))[:, None] == tl.arange(0, BT)[None, :], 1.0, 0.0)


@triton.jit
def _inv_diags_doubling(ptr, BT: tl.constexpr, SPREC: tl.constexpr):
    """`_inv_diags` by doubling (`_solve_doubling` on every 16 x 16 diagonal block at once, as batched
    [NB, 16, 16] dots): 4 steps of two dots instead of 15 dependent row updates."""
    NB: tl.constexpr = BT // 16
    b = tl.arange(0, NB)
    r = tl.arange(0, 16)
    A = tl.load(ptr + (b * 16 * (BT + 1))[:, None, None] + r[None, :, None] * BT + r[None, None, :])
    T = tl.where((r[:, None] == r[None, :])[None, :, :], 1.0, 0.0) + tl.zeros([NB, 16, 16], dtype=tl.float32)
    for s in tl.static_range(4):  # block size 2^s
        sel = ((r[:, None] >> (s + 1)) == (r[None, :] >> (s + 1))) & (((r[:, None] >> s) & 1) == 1) \
            & (((r[None, :] >> s) & 1) == 0)
        L = tl.where(sel[None, :, :], A, 0.0)
        T = T - tl.dot(tl.dot(T, L, input_precision=SPREC), T, input_precision=SPREC)
    return T


@triton.jit
def _ut_blocks(p_T, BT: tl.constexpr, INTERLEAVE: tl.constexpr, DBL16: tl.constexpr, SPREC: tl.constexpr):
    """The block rows T_0..T_3 ([16, BT] each; zeros past NB = BT / 16) of T = (I + A)^{-1}, A strictly lower
    [BT, BT] fp32 at p_T (row-major): the diagonal blocks by forward substitution (one after another, or all at
    once with INTERLEAVE: `_inv_diags`), then block row i = T_ii (E_i - sum_{j<i} A_ij T_j) with fp32 dots."""
    if DBL16:
        Tii = _inv_diags_doubling(p_T, BT, SPREC)
    elif INTERLEAVE:
        Tii = _inv_diags(p_T, BT)
    else:
        Tii = tl.zeros([BT // 16, 16, 16], dtype=tl.float32)  # unused
    T0 = tl.dot(_diag_inv(p_T, Tii, 0, BT, INTERLEAVE), _eye_rows(0, BT), input_precision="ieee")
    T1 = tl.zeros([16, BT], dtype=tl.float32)
    T2 = tl.zeros([16, BT], dtype=tl.float32)
    T3 = tl.zeros([16, BT], dtype=tl.float32)
    if BT >= 32:
        X1 = _eye_rows(16, BT) - tl.dot(_blk(p_T, 16, 0, BT), T0, input_precision="ieee")
        T1 = tl.dot(_diag_inv(p_T, Tii, 1, BT, INTERLEAVE), X1, input_precision="ieee")
    if BT == 64:
        X2 = (_eye_rows(32, BT) - tl.dot(_blk(p_T, 32, 0, BT), T0, input_precision="ieee")
              - tl.dot(_blk(p_T, 32, 16, BT), T1, input_precision="ieee"))
        T2 = tl.dot(_diag_inv(p_T, Tii, 2, BT, INTERLEAVE), X2, input_precision="ieee")
        X3 = (_eye_rows(48, BT) - tl.dot(_blk(p_T, 48, 0, BT), T0, input_precision="ieee")
              - tl.dot(_blk(p_T, 48, 16, BT), T1, input_precision="ieee")
              - tl.dot(_blk(p_T, 48, 32, BT), T2, input_precision="ieee"))
        T3 = tl.dot(_diag_inv(p_T, Tii, 3, BT, INTERLEAVE), X3, input_precision="ieee")
    return T0, T1, T2, T3


@triton.jit
def _solve_doubling(A, BT: tl.constexpr, SPREC: tl.constexpr):
    """T = (I + A)^{-1} of a strictly lower [BT, BT] fp32 register tile by doubling the inverted diagonal blocks:
    with Y the inverse of I + A's block diagonal of b x b blocks and L the lower-left b x b block of each 2b x 2b
    diagonal block, [[X, 0], [L, Z]]^{-1} = Y - Y L Y, so log2(BT) steps of two [BT, BT] dots from Y = I (1 x 1
    blocks) reach T. No loads, no per-row steps: tensor-core dots (SPREC "tf32x3": about fp32 accuracy; "ieee")
    instead of the 15 dependent row updates of forward substitution. fp32 accuracy equals forward substitution's
    (CPU emulation, keys of cosine up to 0.99, beta up to 2: 2.4e-7 vs 4.1e-7 relative; tf32x3 4.8e-7)."""
    r = tl.arange(0, BT)
    T = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for s in tl.static_range(6):
        if (1 << s) < BT:  # block size b = 2^s
            sel = ((r[:, None] >> (s + 1)) == (r[None, :] >> (s + 1))) & (((r[:, None] >> s) & 1) == 1) \
                & (((r[None, :] >> s) & 1) == 0)
            L = tl.where(sel, A, 0.0)
            T = T - tl.dot(tl.dot(T, L, input_precision=SPREC), T, input_precision=SPREC)
    return T


@triton.jit
def _solve_ut(p_A, p_T, BT: tl.constexpr, INTERLEAVE: tl.constexpr, DOUBLING: tl.constexpr,
              SPREC: tl.constexpr):
    """T = (I + A)^{-1} of the strictly lower [BT, BT] matrix A at p_A (fp32, row-major), written to p_T (row-major,
    in p_T's dtype: the 16-bit copy the backward keeps, or p_A itself, overwritten): by 16-row blocks
    (`_ut_blocks`; BT in {16, 32, 64}; DOUBLING 2: its diagonal blocks by doubling), or with DOUBLING 1 from the
    whole tile (`_solve_doubling`). T is solved in fp32 either way."""
    rows = tl.arange(0, BT)
    TD: tl.constexpr = p_T.dtype.element_ty
    if DOUBLING == 1:
        p_tile = rows[:, None] * BT + rows[None, :]
        T = _solve_doubling(tl.load(p_A + p_tile), BT, SPREC)
        tl.debug_barrier()  # when p_T is p_A: every read of A is done before T overwrites it
        tl.store(p_T + p_tile, T.to(TD))
    else:
        T0, T1, T2, T3 = _ut_blocks(p_A, BT, INTERLEAVE, DOUBLING == 2, SPREC)
        tl.debug_barrier()  # when p_T is p_A: every read of A is done before T overwrites it
        r16 = tl.arange(0, 16)
        p_row = p_T + r16[:, None] * BT + rows[None, :]
        tl.store(p_row, T0.to(TD))
        if BT >= 32:
            tl.store(p_row + 16 * BT, T1.to(TD))
        if BT == 64:
            tl.store(p_row + 32 * BT, T2.to(TD))
            tl.store(p_row + 48 * BT, T3.to(TD))


@triton.jit
def _solve_tile(p_T, BT: tl.constexpr, INTERLEAVE: tl.constexpr, DBL16: tl.constexpr, SPREC: tl.constexpr):
    """T = (I + A)^{-1} as a [BT, BT] fp32 register tile (A at p_T, left in place): the block rows of `_ut_blocks`
    put in place by exact 0/1 dots (E_i^T T_i), so no T goes back to memory."""
    T0, T1, T2, T3 = _ut_blocks(p_T, BT, INTERLEAVE, DBL16, SPREC)
    Tm = tl.dot(tl.trans(_eye_rows(0, BT)), T0, input_precision="ieee")
    if BT >= 32:
        Tm += tl.dot(tl.trans(_eye_rows(16, BT)), T1, input_precision="ieee")
    if BT == 64:
        Tm += tl.dot(tl.trans(_eye_rows(32, BT)), T2, input_precision="ieee")
        Tm += tl.dot(tl.trans(_eye_rows(48, BT)), T3, input_precision="ieee")
    return Tm


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
def _prep_fwd(
    q, k, v, g, beta, Tbuf, Tout, Wbuf, Ubuf, Qg, Kd, Pb, RK, cu, chunk_seq, chunk_start, scale,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr,
    STAGE: tl.constexpr = 0, INTERLEAVE: tl.constexpr = False, LOWP: tl.constexpr = False,
):
    """Everything of one chunk that does not depend on the state, so the sequential kernel only streams tiles:
    A = strict_lower(diag(beta) K K^T e^{b_i-b_j}), T = (I + A)^{-1}, W = T diag(beta e^b) K, U = T diag(beta) V,
    Qg = scale Q e^b (reads the chunk-initial state), Kd = K e^{bL-b} (writes the next state),
    P = scale (Q K^T) e^{b_i-b_j} for j <= i (intra-chunk attention). T is found by 16-row blocks (`_solve_ut`)
    from A staged in Tbuf (fp32) and written to Tout (Tbuf itself, or a 16-bit copy for the backward). Q and K are
    l2-normalised here (L2) once for all later kernels.
    STAGE 0 does it all in one launch; 1, 2, 3 are three launches (Qg, Kd, P and A; the solve; W and U), each
    with fewer live tiles, so more programs share a multiprocessor. LOWP: the dots' operands (Q, K, T, V) are
    rounded to the 16-bit storage dtype (tensor-core rate, fewer registers); T itself is always solved in fp32.
    RK is unused (the K-blocked kernel's key-norm output; the launch passes the same arguments to both)."""
    DT: tl.constexpr = Wbuf.dtype.element_ty
    ic = tl.program_id(0)
    ihv = tl.program_id(1)
    ih = ihv // (HV // H)
    n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
    offs_k = tl.arange(0, K)
    p_TT = (ic * HV + ihv).to(tl.int64) * BT * BT + rows[:, None] * BT + rows[None, :]
    blk = (ic * HV + ihv).to(tl.int64) * BT * BT
    krow = (r64[:, None] * HV + ihv) * K + offs_k[None, :]
    if STAGE != 2:
        kk = _load_rows(k, r64, rmask, H * K, ih * K, offs_k, L2)
        gg = tl.load(g + r64 * HV + ihv, mask=rmask, other=0.0).to(tl.float32)
        bb = tl.load(beta + r64 * HV + ihv, mask=rmask, other=0.0).to(tl.float32)
        gc, gcl, gL, ged = _cum_split(gg)
    if STAGE < 2:
        strict = rows[:, None] > rows[None, :]
        incl = rows[:, None] >= rows[None, :]
        # state-independent reads and writes of the recurrence
        tl.store(Kd + krow, (kk * tl.exp(ged)[:, None]).to(Kd.dtype.element_ty), mask=rmask[:, None])
        qq = _load_rows(q, r64, rmask, H * K, ih * K, offs_k, L2)
        tl.store(Qg + krow, (qq * (scale * tl.exp(gc))[:, None]).to(Qg.dtype.element_ty), mask=rmask[:, None])
        kk_d = _op(kk, DT, LOWP)
        P = tl.dot(_op(qq, DT, LOWP), tl.trans(kk_d), input_precision=PREC) * scale
        P = tl.where(incl, P * tl.exp(_pair_exponent(gc, gcl, incl)), 0.0)
        tl.store(Pb + p_TT, P.to(Pb.dtype.element_ty))
        # the UT transform's A
        KK = tl.dot(kk_d, tl.trans(kk_d), input_precision=PREC)
        A = tl.where(strict, bb[:, None] * KK * tl.exp(_pair_exponent(gc, gcl, strict)), 0.0)
        tl.store(Tbuf + p_TT, A)
    if STAGE == 0:
        tl.debug_barrier()
    if STAGE == 0 or STAGE == 2:
        _solve_ut(Tbuf + blk, Tout + blk, BT, INTERLEAVE, 0, "ieee")
    if STAGE == 0:
        tl.debug_barrier()
    if STAGE == 0 or STAGE == 3:
        Tm = _op(tl.load(Tout + p_TT), DT, LOWP)
        kb = kk * (bb * tl.exp(gc))[:, None]
        W = tl.dot(Tm, _op(kb, DT, LOWP), input_precision=PREC)
        tl.store(Wbuf + krow, W.to(Wbuf.dtype.element_ty), mask=rmask[:, None])
        _tu_blk(Tm, v, bb, Ubuf, r64, rmask, ihv, HV, V, BV, PREC, LOWP)


# ---------------------------------------------------------------------------------------------------------------
# K-blocked forward prep (gdn.TUNE["prep_variant"] = "kblock"). `_prep_fwd` holds whole [BT, K] fp32 tiles of q and
# k at once (sm_90, K=V=128 bf16, 8 warps, the launcher's alignment hints: stage 1 143 registers and 96 KB of
# shared memory, one program per multiprocessor). Everything per key channel (Qg, Kd, W) is local to a block of BK
# channels and everything that mixes channels is a [BT, BT] sum over them (Q K^T, K K^T), so the kernels below walk
# K in blocks of BK columns and accumulate the sums. q and k enter those dots raw (16-bit inputs: exact products,
# 16-bit tensor-core operands); the l2 norm enters as row/column scales 1/||x_i|| of the [BT, BT] sums, from a first
# pass over K (`_row_inv_norms`; its rows are read again in the second pass, from cache, not HBM).
# ---------------------------------------------------------------------------------------------------------------


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
def _load_raw(ptr, r64, rmask, stride, col0, offs):
    """Rows r64 at columns col0 + offs, in the input dtype (0 past the chunk's end)."""
    return tl.load(ptr + r64[:, None] * stride + col0 + offs[None, :], mask=rmask[:, None], other=0.0)


@triton.jit
def _prep_ap_blk(q, k, g, beta, Tbuf, Qg, Kd, Pb, blk, bos, nval, ihv, ih, scale, H, HV, K: tl.constexpr,
                 BT: tl.constexpr, BK: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr, WITH_A: tl.constexpr):
    """Stage 1 of one chunk: Qg = scale Q^ e^b and Kd = K^ e^{bL - b} (^: l2-normalised) block by block, and the
    raw sums over K blocks Q K^T and K K^T (input-dtype operands), scaled once at the end:
    P = scale rq_i rk_j (Q K^T)_ij e^{b_i - b_j} (j <= i, to Pb), A = beta_i rk_i rk_j (K K^T)_ij e^{b_i - b_j}
    (j < i, staged in Tbuf for the solve; not made without WITH_A, when `_kkt_solve` makes A and T itself);
    rq, rk = 1 / row norms."""
    rows = tl.arange(0, BT)
    rmask = rows < nval
    r64 = bos + rows
    gc, gcl, gL, ged, bb = _chunk_gates(g, beta, r64, rmask, ihv, HV)
    rq = _row_inv_norms(q, r64, rmask, H * K, ih * K, K, BK, BT, L2)
    rk = _row_inv_norms(k, r64, rmask, H * K, ih * K, K, BK, BT, L2)
    s_q = rq * scale * tl.exp(gc)  # row scales of Qg and Kd
    s_k = rk * tl.exp(ged)
    b_P = tl.zeros([BT, BT], dtype=tl.float32)
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs = k0 + tl.arange(0, BK)
        b_q = _load_raw(q, r64, rmask, H * K, ih * K, offs)
        b_k = _load_raw(k, r64, rmask, H * K, ih * K, offs)
        krow = (r64[:, None] * HV + ihv) * K + offs[None, :]
        tl.store(Qg + krow, (b_q.to(tl.float32) * s_q[:, None]).to(Qg.dtype.element_ty), mask=rmask[:, None])
        tl.store(Kd + krow, (b_k.to(tl.float32) * s_k[:, None]).to(Kd.dtype.element_ty), mask=rmask[:, None])
        b_P += tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
        if WITH_A:
            b_A += tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
    # decays e^{b_i - b_j} on and below the diagonal (the exponent is masked above it, where it could overflow)
    incl = rows[:, None] >= rows[None, :]
    D = tl.exp(_pair_exponent(gc, gcl, incl))
    b_P = tl.where(incl, b_P * D * (rq * scale)[:, None] * rk[None, :], 0.0)
    p_TT = blk * BT * BT + rows[:, None] * BT + rows[None, :]
    tl.store(Pb + p_TT, b_P.to(Pb.dtype.element_ty))
    if WITH_A:
        b_A = tl.where(rows[:, None] > rows[None, :], b_A * D * (bb * rk)[:, None] * rk[None, :], 0.0)
        tl.store(Tbuf + p_TT, b_A)


@triton.jit
def _prep_wu_blk(k, v, g, beta, Tbuf, Wbuf, Ubuf, Kd, RK, blk, bos, nval, ihv, ih, H, HV, K: tl.constexpr,
                 V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
                 PREC: tl.constexpr, LOWP: tl.constexpr, KD: tl.constexpr):
    """Stage 3 of one chunk: W = T diag(beta rk gamma) K by K blocks, U = T diag(beta) V by V blocks (T from
    Tbuf; LOWP: T and the right-hand tiles as 16-bit dot operands). KD (the raw-output forward, which has no stage
    1): the keys' inverse norms rk to RK [tokens, HV], and with KD 1 Kd = K^ e^{bL - b} from the same k tiles, with
    KD 2 only its row scales s_k = rk e^{bL - b} to Kd as [tokens, HV] fp32 (the state pass then reads raw k)."""
    rows = tl.arange(0, BT)
    rmask = rows < nval
    r64 = bos + rows
    gc, gcl, _gL, ged, bb = _chunk_gates(g, beta, r64, rmask, ihv, HV)
    rk = _row_inv_norms(k, r64, rmask, H * K, ih * K, K, BK, BT, L2)
    if KD != 0:
        tl.store(RK + r64 * HV + ihv, rk, mask=rmask)
    if KD == 2:
        tl.store(Kd + r64 * HV + ihv, rk * tl.exp(ged), mask=rmask)
    Tm = tl.load(Tbuf + blk * BT * BT + rows[:, None] * BT + rows[None, :])
    _wu_from_t(Tm, k, v, Wbuf, Ubuf, r64, rmask, bb * rk * tl.exp(gc), bb, ihv, ih, H, HV, K, V, BK, BV, PREC, LOWP,
               Kd, rk * tl.exp(ged), KD == 1)


@triton.jit
def _wu_from_t(Tm, k, v, Wbuf, Ubuf, r64, rmask, s_w, bb, ihv, ih, H, HV, K: tl.constexpr, V: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr, Kd, s_k,
               KD: tl.constexpr):
    """W = T diag(s_w) K by K blocks (s_w = beta rk gamma), U = T diag(beta) V by V blocks (Tm: T, fp32, or 16-bit
    with LOWP); with KD also Kd = diag(s_k) K (s_k = rk e^{bL - b}) from the same tiles."""
    DT: tl.constexpr = Wbuf.dtype.element_ty
    Tm_d = _op(Tm, DT, LOWP)
    for k0 in range(0, K, BK):
        offs = k0 + tl.arange(0, BK)
        b_raw = _load_raw(k, r64, rmask, H * K, ih * K, offs).to(tl.float32)
        b_W = tl.dot(Tm_d, _op(b_raw * s_w[:, None], DT, LOWP), input_precision=PREC)
        krow = (r64[:, None] * HV + ihv) * K + offs[None, :]
        tl.store(Wbuf + krow, b_W.to(DT), mask=rmask[:, None])
        if KD:
            tl.store(Kd + krow, (b_raw * s_k[:, None]).to(Kd.dtype.element_ty), mask=rmask[:, None])
    _tu_blk(Tm_d, v, bb, Ubuf, r64, rmask, ihv, HV, V, BV, PREC, LOWP)


@triton.jit
def _prep_fwd_blk(
    q, k, v, g, beta, Tbuf, Tout, Wbuf, Ubuf, Qg, Kd, Pb, RK, cu, chunk_seq, chunk_start, scale,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr,
    STAGE: tl.constexpr = 0, INTERLEAVE: tl.constexpr = False, LOWP: tl.constexpr = False,
    DOUBLING: tl.constexpr = 0, SPREC: tl.constexpr = "ieee", WITH_A: tl.constexpr = True,
    KD: tl.constexpr = 0,
):
    """The K-blocked `_prep_fwd` (same outputs, same launch grid chunks x HV): STAGE 1 Qg, Kd, P, A
    (`_prep_ap_blk`, A to Tbuf; without WITH_A no A: `_kkt_solve` then replaces stage 2), 2 the solve
    T = (I + A)^{-1} into Tout (`_solve_ut`; Tbuf itself or a 16-bit copy), 3 W, U (`_prep_wu_blk`, T from Tout;
    with KD also the key norms RK and Kd (KD 1) or Kd's row scales (KD 2), for the raw-output forward that skips
    stage 1); 0 all three in one launch.
    LOWP applies to stage 3's dots (stage 1 always takes the inputs' own dtype)."""
    ic = tl.program_id(0)
    ihv = tl.program_id(1)
    ih = ihv // (HV // H)
    n, bos, nval = _chunk_coords(cu, chunk_seq, chunk_start, ic, BT)
    blk = (ic * HV + ihv).to(tl.int64)  # this chunk and head's [BT, BT] slot in Tbuf and Pb
    if STAGE == 0 or STAGE == 1:
        _prep_ap_blk(q, k, g, beta, Tbuf, Qg, Kd, Pb, blk, bos, nval, ihv, ih, scale, H, HV, K, BT, BK, L2, PREC,
                     WITH_A or STAGE == 0)
    if STAGE == 0:
        tl.debug_barrier()
    if STAGE == 0 or STAGE == 2:
        _solve_ut(Tbuf + blk * BT * BT, Tout + blk * BT * BT, BT, INTERLEAVE, DOUBLING, SPREC)
    if STAGE == 0:
        tl.debug_barrier()
    if STAGE == 0 or STAGE == 3:
        _prep_wu_blk(k, v, g, beta, Tout, Wbuf, Ubuf, Kd, RK, blk, bos, nval, ihv, ih, H, HV, K, V, BT, BK, BV, L2,
                     PREC, LOWP, KD if STAGE == 3 else 0)


# ---------------------------------------------------------------------------------------------------------------
# A and its solve in one launch (gdn.TUNE["prep_kkt"]), by [16, 16] blocks. The split prep stages A in memory
# (fp32, 16 KB per chunk and head) and solves it in a second launch whose block rows are [16, BT] ieee dots, mostly
# on zero blocks. Here the ten lower blocks A_IJ of a 64-token chunk are summed over K in registers (one [16, BK]
# tile of k per row block and K block, so K is read once), the diagonal blocks are inverted by doubling
# (`_solve_doubling` at BT = 16: four steps of two [16, 16] tensor-core dots, no per-row steps) and the rest is
# the block recursion of a lower-triangular inverse:
#     T_II = (I + A_II)^{-1},   T_IJ = -T_II sum_{J <= M < I} A_IM T_MJ   (I > J)
# Only T goes to memory. Stage 1 then makes Qg, Kd and P alone.
# ---------------------------------------------------------------------------------------------------------------


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
    SPREC: tl.constexpr, DPREC: tl.constexpr,
):
    """T = (I + A)^{-1}, A = strict_lower(beta_i rk_i rk_j (K K^T)_ij e^{b_i - b_j}), of one chunk and value head
    (grid chunks x HV), written to Tout ([chunks, HV, BT, BT] row-major, its dtype; upper blocks 0). BT in
    {16, 32, 64}: NB = BT / 16 row blocks; blocks past NB stay zero and are never stored. K K^T is summed from
    raw input-dtype tiles (PREC), the l2 norms entering as row and column scales rk; the solve's dots are fp32
    at DPREC for the diagonal blocks' doubling and SPREC for the block rows ("tf32x3": tensor cores at about fp32
    accuracy; "tf32": one pass, ~1e-3)."""
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
                   hi1, lo1, bb1 * rk1, rk1, hi2, lo2, bb2 * rk2, rk2, hi3, lo3, bb3 * rk3, rk3, BT, DPREC, SPREC)


@triton.jit
def _t_from_blocks(p_T, A00, A10, A11, A20, A21, A22, A30, A31, A32, A33, hi0, lo0, r0, c0, hi1, lo1, r1, c1,
                   hi2, lo2, r2, c2, hi3, lo3, r3, c3, BT: tl.constexpr, DPREC: tl.constexpr, SPREC: tl.constexpr):
    """T = (I + A)^{-1} from the ten lower [16, 16] blocks of an unscaled A (blocks past BT / 16 unused): block IJ
    is first scaled by `_kkt_scale` (rows r_I, columns c_J, decays e^{b_i - b_j} from the hi/lo parts; the diagonal
    blocks strictly lower), then T is stored to the chunk's row-major [BT, BT] slot p_T with zeros above the
    diagonal blocks: the diagonal blocks by doubling at DPREC, block row I from the rows above it at SPREC. Each
    block is scaled where it is first needed (measured order: scaling all ten first took 255 registers instead of
    240 at one warp, sm_90)."""
    z = tl.zeros([16, 16], dtype=tl.float32)
    A00 = _kkt_scale(A00, hi0, lo0, r0, hi0, lo0, c0, True)
    T00 = _solve_doubling(A00, 16, DPREC)
    _put16(p_T, T00, 0, 0, BT)
    if BT >= 32:
        A10 = _kkt_scale(A10, hi1, lo1, r1, hi0, lo0, c0, False)
        A11 = _kkt_scale(A11, hi1, lo1, r1, hi1, lo1, c1, True)
        T11 = _solve_doubling(A11, 16, DPREC)
        T10 = -tl.dot(T11, tl.dot(A10, T00, input_precision=SPREC), input_precision=SPREC)
        _put16(p_T, T10, 16, 0, BT)
        _put16(p_T, T11, 16, 16, BT)
        _put16(p_T, z, 0, 16, BT)
    if BT == 64:
        A20 = _kkt_scale(A20, hi2, lo2, r2, hi0, lo0, c0, False)
        A21 = _kkt_scale(A21, hi2, lo2, r2, hi1, lo1, c1, False)
        A22 = _kkt_scale(A22, hi2, lo2, r2, hi2, lo2, c2, True)
        T22 = _solve_doubling(A22, 16, DPREC)
        T21 = -tl.dot(T22, tl.dot(A21, T11, input_precision=SPREC), input_precision=SPREC)
        T20 = -tl.dot(T22, tl.dot(A20, T00, input_precision=SPREC) + tl.dot(A21, T10, input_precision=SPREC),
                      input_precision=SPREC)
        A30 = _kkt_scale(A30, hi3, lo3, r3, hi0, lo0, c0, False)
        A31 = _kkt_scale(A31, hi3, lo3, r3, hi1, lo1, c1, False)
        A32 = _kkt_scale(A32, hi3, lo3, r3, hi2, lo2, c2, False)
        A33 = _kkt_scale(A33, hi3, lo3, r3, hi3, lo3, c3, True)
        T33 = _solve_doubling(A33, 16, DPREC)
        T32 = -tl.dot(T33, tl.dot(A32, T22, input_precision=SPREC), input_precision=SPREC)
        T31 = -tl.dot(T33, tl.dot(A31, T11, input_precision=SPREC) + tl.dot(A32, T21, input_precision=SPREC),
                      input_precision=SPREC)
        T30 = -tl.dot(T33, tl.dot(A30, T00, input_precision=SPREC) + tl.dot(A31, T10, input_precision=SPREC)
                      + tl.dot(A32, T20, input_precision=SPREC), input_precision=SPREC)
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
def _solve_blocks(Tbuf, HV, BT: tl.constexpr, DPREC: tl.constexpr, SPREC: tl.constexpr):
    """T = (I + A)^{-1} in place of A (fp32, one row-major [BT, BT] slot per chunk and value head; grid chunks x
    HV), by `_t_from_blocks` (its scales all 1, its exponents 0): A's ten lower [16, 16] blocks are read into
    registers first, so T can overwrite them; entries on and above the diagonal are ignored. For a prep that
    stages A in memory (KDA's: kda.TUNE solve_blocks), in place of `_solve_ut`'s row substitution and [16, BT]
    ieee block rows."""
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
                   o, o, u, u, BT, DPREC, SPREC)


# ---------------------------------------------------------------------------------------------------------------
# Inference forward (gdn.TUNE["fwd_variant"] = "lean", used when no backward will follow): nothing is kept for a
# backward, so the prep makes only what the state pass needs (W, U) and the later kernels read q and k themselves
# (their l2 norms and gate scales are cheap elementwise work beside the tiles they load anyway). Per chunk and head
# (K=V=128, bf16) that moves ~270 KB instead of ~380 KB: no Qg, Kd, P written and read back, no T round trip.
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _prep_lean(
    k, v, g, beta, Tbuf, Wbuf, Ubuf, RK, cu, chunk_seq, chunk_start,
    H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2: tl.constexpr, PREC: tl.constexpr, INTERLEAVE: tl.constexpr, LOWP: tl.constexpr, STAGE: tl.constexpr = 0,
    DOUBLING: tl.constexpr = 0, SPREC: tl.constexpr = "ieee",
):
    """W = T diag(beta rk gamma) K and U = T diag(beta) V of one chunk (grid chunks x HV), and the keys' inverse
    norms rk to RK [tokens, HV] (fp32; ones without L2) for the later kernels.
    A = strict_lower(diag(beta rk) (K K^T) diag(rk) e^{b_i - b_j}) from raw K blocks is staged in Tbuf only so the
    solve can read its rows; T = (I + A)^{-1} stays in registers (`_solve_tile`). STAGE 0: all in one launch;
    1: A and rk only; 2: the rest (two launches, the first light, so more of its programs share a multiprocessor)."""
    ic = tl.program_id(0)
    ihv = tl.program_id(1)
    ih = ihv // (HV // H)
    n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
    gc, gcl, _gL, _ged, bb = _chunk_gates(g, beta, r64, rmask, ihv, HV)
    p_T = Tbuf + (ic * HV + ihv).to(tl.int64) * BT * BT
    if STAGE < 2:
        rk = _row_inv_norms(k, r64, rmask, H * K, ih * K, K, BK, BT, L2)
        tl.store(RK + r64 * HV + ihv, rk, mask=rmask)
        b_A = tl.zeros([BT, BT], dtype=tl.float32)
        for k0 in range(0, K, BK):
            b_k = _load_raw(k, r64, rmask, H * K, ih * K, k0 + tl.arange(0, BK))
            b_A += tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
        strict = rows[:, None] > rows[None, :]
        D = tl.exp(_pair_exponent(gc, gcl, strict))
        b_A = tl.where(strict, b_A * D * (bb * rk)[:, None] * rk[None, :], 0.0)
        if STAGE == 1 or DOUBLING != 1:  # the block solve reads A's rows from memory
            tl.store(p_T + rows[:, None] * BT + rows[None, :], b_A)
    else:
        rk = tl.load(RK + r64 * HV + ihv, mask=rmask, other=0.0)
        b_A = tl.load(p_T + rows[:, None] * BT + rows[None, :])
    if STAGE == 1:
        return
    if DOUBLING == 1:  # A stays in registers
        Tm = _solve_doubling(b_A, BT, SPREC)
    else:
        tl.debug_barrier()  # A's rows are in memory before the solve reads them
        Tm = _solve_tile(p_T, BT, INTERLEAVE, DOUBLING == 2, SPREC)
    _wu_from_t(Tm, k, v, Wbuf, Ubuf, r64, rmask, bb * rk * tl.exp(gc), bb, ihv, ih, H, HV, K, V, BK, BV, PREC, LOWP,
               Wbuf, bb, False)


@triton.jit
def _q_raw_scaled(q, b_k, rk, gc, gcl, bos, Tn, t0, col0, stride, scale, K: tl.constexpr, BT: tl.constexpr,
                  L2: tl.constexpr, PREC: tl.constexpr):
    """Of one chunk, from the raw q rows and the raw k tile b_k [BT, K]: (Q raw, its row scales qs = scale rq e^b, and
    P = scale rq_i rk_j (Q K^T)_ij e^{b_i - b_j} for j <= i, [BT, BT] fp32). Q S is then (Q_raw S) * qs: the raw
    16-bit rows are exact dot operands (no rounding of a scaled copy), as in the K-blocked prep's Q K^T."""
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
    """`_out_fwd` from the raw q and k and the key norms RK (the lean forward keeps no Qg or P):
    O = diag(qs) Q S + P Vn of one chunk and V block (grid V/BV x chunks x HV; `_q_raw_scaled`). STORE_P (the
    raw-output training forward): the first V block's program also writes P to Pb for the backward."""
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
def _recur_fwd(
    g, Wbuf, Ubuf, Qg, Kd, Pb, o, h0, ht, hbuf, vnbuf, cu, chunk_off, NCH, scale,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE: tl.constexpr, LOWP: tl.constexpr,
    CHANNEL: tl.constexpr = False, OUT: tl.constexpr = True, RAWK: tl.constexpr = False, L2: tl.constexpr = False,
    SK: tl.constexpr = False,
):
    """Carries the state S [K, BV] over one sequence's chunks, streaming the tiles `_prep_fwd` made:
    Vn = U - W S, O = Qg S + P Vn, S <- e^{bL} S + Kd^T Vn. With LOWP the dot operands are in the 16-bit
    storage dtype (tensor-core rate); otherwise fp32 (PREC: tf32 or ieee). The state and every accumulator stay
    fp32. CHANNEL (KDA): g is the per-chunk total log-decay per key channel, [chunks, HV, K], and S decays by
    row. Without OUT the output is left to `_out_fwd` (all chunks in parallel, from the stored chunk-initial
    states and Vn; needs STORE): the serial path then holds two dots per chunk instead of four. RAWK (the lean
    inference forward, not with CHANNEL): Kd and Qg are the raw k and q ([tokens, H, K]) and Pb the keys' inverse
    norms [tokens, HV] fp32 (`_prep_lean`'s RK); the key scales rk e^{bL - b} multiply Vn's rows in the state update,
    and with OUT, Q's scales and P are made here (`_q_raw_scaled`). SK (the training forward with gdn.TUNE
    state_raw_k, state only): Kd is the raw k [tokens, H, K] and Pb the key scales s_k = rk e^{bL - b} [tokens, HV]
    fp32 that W/U's launch wrote; they multiply Vn's rows in the state update, one [BT, BV] product per chunk."""
    tl.static_assert(not (SK and (RAWK or CHANNEL or OUT)), "SK is the state-only GDN pass")
    DT: tl.constexpr = Wbuf.dtype.element_ty
    iv = tl.program_id(0)
    inh = tl.program_id(1)
    n = inh // HV
    ihv = inh % HV
    ih = ihv // (HV // H)
    bos = tl.load(cu + n).to(tl.int64)
    eos = tl.load(cu + n + 1).to(tl.int64)
    Tn = (eos - bos).to(tl.int32)
    c0 = tl.load(chunk_off + n).to(tl.int64)
    rows = tl.arange(0, BT)
    offs_k = tl.arange(0, K)
    offs_v = iv * BV + tl.arange(0, BV)
    s_off = offs_k[:, None] * V + offs_v[None, :]
    if HAS_H0:
        S = tl.load(h0 + (n * HV + ihv).to(tl.int64) * K * V + s_off)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    # loop bound is the longest sequence's chunk count (a launch argument); chunks past this sequence's end
    # have no valid rows and leave S unchanged
    for c in range(NCH):
        t0 = c * BT
        nval = Tn - t0
        live = nval > 0  # chunks past this sequence's end touch no memory (their tiles are empty)
        if STORE:
            tl.store(hbuf + ((c0 + c) * HV + ihv) * K * V + s_off, S.to(hbuf.dtype.element_ty),
                     mask=(offs_k < tl.where(live, K, 0))[:, None])
        if CHANNEL:
            dec = tl.exp(tl.load(g + ((c0 + c) * HV + ihv) * K + offs_k, mask=offs_k < tl.where(live, K, 0),
                                 other=0.0))[:, None]
        else:
            gs = tl.load(g + (bos + t0 + rows) * HV + ihv, mask=rows < nval, other=0.0).to(tl.float32)
            dec = tl.exp(tl.sum(gs, 0))
        W = _seq_load(Wbuf, bos, Tn, t0, ihv * K, HV * K, BT, K)
        if RAWK:  # raw keys: their scales rk e^{bL - b} go onto Vn's rows in the state update instead
            gc, gcl, _gL, ged = _cum_split(gs)
            rk = tl.load(Pb + (bos + t0 + rows) * HV + ihv, mask=rows < nval, other=0.0)
            sk = rk * tl.exp(ged)
        if SK:  # raw keys, their scales made by W/U's launch
            sk = tl.load(Pb + (bos + t0 + rows) * HV + ihv, mask=rows < nval, other=0.0)
        kd = _seq_load(Kd, bos, Tn, t0, (ih if RAWK or SK else ihv) * K, (H if RAWK or SK else HV) * K, BT, K)
        U = _seq_load(Ubuf, bos, Tn, t0, ihv * V + iv * BV, HV * V, BT, BV)
        S_d = _op(S, DT, LOWP)
        vn = U.to(tl.float32) - tl.dot(_op(W, DT, LOWP), S_d, input_precision=PREC)
        vn_d = _op(vn, DT, LOWP)
        if STORE:
            _seq_store(vnbuf, vn, bos, Tn, t0, ihv * V + iv * BV, HV * V, BT, BV)
        if OUT:
            if RAWK:
                b_q, qs, P = _q_raw_scaled(Qg, kd, rk, gc, gcl, bos, Tn, t0, ih * K, H * K, scale, K, BT, L2, PREC)
                oo = tl.dot(_op(b_q, DT, LOWP), S_d, input_precision=PREC) * qs[:, None]
            else:
                qg = _seq_load(Qg, bos, Tn, t0, ihv * K, HV * K, BT, K)
                P = _chunk_p(Pb, c0 + c, HV, ihv, live, rows, BT)
                oo = tl.dot(_op(qg, DT, LOWP), S_d, input_precision=PREC)
            oo += tl.dot(_op(P, DT, LOWP), vn_d, input_precision=PREC)
            _seq_store(o, oo, bos, Tn, t0, ihv * V + iv * BV, HV * V, BT, BV)
        if RAWK or SK:
            S = S * dec + tl.dot(tl.trans(_op(kd, DT, LOWP)), _op(vn * sk[:, None], DT, LOWP), input_precision=PREC)
        else:
            S = S * dec + tl.dot(tl.trans(_op(kd, DT, LOWP)), vn_d, input_precision=PREC)
    if STORE_HT:
        tl.store(ht + (n * HV + ihv).to(tl.int64) * K * V + s_off, S)


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


@triton.jit
def _raw_row_scales(qr, kr, gs, scale, L2: tl.constexpr):
    """Row scales of one chunk's raw q and k rows [BT, K] (0 past the end), from its log-decays gs [BT]:
    (qs, sk) with Qg = diag(qs) Q, qs = scale rq e^b, and Kd = diag(sk) K, sk = rk e^{bL - b} (rq, rk: inverse
    l2 norms when L2, else 1), as the prep's stage 1 scales them."""
    gc, _gcl, _gL, ged = _cum_split(gs)
    qs = scale * tl.exp(gc)
    sk = tl.exp(ged)
    if L2:
        qs *= _inv_norms(qr)
        sk *= _inv_norms(kr)
    return qs, sk


@triton.jit
def _recur_bwd(
    g, Wbuf, Qg, Kd, Pb, do, dht, dh0, dhbuf, dvnbuf, cu, chunk_off, NCH,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, LOWP: tl.constexpr, CHANNEL: tl.constexpr = False,
    scale=1.0, L2: tl.constexpr = False, RAW: tl.constexpr = False,
):
    """Reverse recurrence of the state gradient dS [K, BV] over the forward's tiles (Qg, Kd, P, W):
    dVn = P^T dO + Kd dS', dS <- e^{bL} dS' + Qg^T dO - W^T dVn. Stores dS' of every chunk and dVn.
    RAW (GDN's scalar decay only): Qg and Kd are the raw q and k ([tokens, H, K]), so the forward need not keep
    its scaled copies for the backward; their row scales (`_raw_row_scales`) go onto dO's rows (Qg^T dO =
    Q^T (qs dO)) and onto the rows of K dS' (Kd dS' = sk K dS'), and the raw 16-bit rows are exact dot operands."""
    tl.static_assert(not (RAW and CHANNEL), "RAW takes GDN's scalar decay only")
    DT: tl.constexpr = dhbuf.dtype.element_ty
    iv = tl.program_id(0)
    inh = tl.program_id(1)
    n = inh // HV
    ihv = inh % HV
    bos = tl.load(cu + n).to(tl.int64)
    eos = tl.load(cu + n + 1).to(tl.int64)
    Tn = (eos - bos).to(tl.int32)
    c0 = tl.load(chunk_off + n).to(tl.int64)
    rows = tl.arange(0, BT)
    offs_k = tl.arange(0, K)
    offs_v = iv * BV + tl.arange(0, BV)
    if HAS_DHT:
        dS = tl.load(dht + (n * HV + ihv).to(tl.int64) * K * V + offs_k[:, None] * V + offs_v[None, :])
    else:
        dS = tl.zeros([K, BV], dtype=tl.float32)
    for ci in range(NCH):
        c = NCH - 1 - ci
        t0 = c * BT
        nval = Tn - t0
        live = nval > 0
        # gradient of the state after chunk c
        tl.store(dhbuf + ((c0 + c) * HV + ihv) * K * V + offs_k[:, None] * V + offs_v[None, :],
                 dS.to(dhbuf.dtype.element_ty), mask=(offs_k < tl.where(live, K, 0))[:, None])
        if CHANNEL:  # KDA: g is the per-chunk total log-decay per key channel [chunks, HV, K]
            dec = tl.exp(tl.load(g + ((c0 + c) * HV + ihv) * K + offs_k, mask=offs_k < tl.where(live, K, 0),
                                 other=0.0))[:, None]
        else:
            gs = tl.load(g + (bos + t0 + rows) * HV + ihv, mask=rows < nval, other=0.0).to(tl.float32)
            dec = tl.exp(tl.sum(gs, 0))
        W = _seq_load(Wbuf, bos, Tn, t0, ihv * K, HV * K, BT, K)
        dO = _seq_load(do, bos, Tn, t0, ihv * V + iv * BV, HV * V, BT, BV)
        P = _chunk_p(Pb, c0 + c, HV, ihv, live, rows, BT)
        dO_d = _op(dO, DT, LOWP)
        if RAW:
            ih = ihv // (HV // H)
            kd = _seq_load(Kd, bos, Tn, t0, ih * K, H * K, BT, K)
            qg = _seq_load(Qg, bos, Tn, t0, ih * K, H * K, BT, K)
            qs, sk = _raw_row_scales(qg, kd, gs, scale, L2)
            dvn = tl.dot(tl.trans(_op(P, DT, LOWP)), dO_d, input_precision=PREC) + \
                tl.dot(_op(kd, DT, LOWP), _op(dS, DT, LOWP), input_precision=PREC) * sk[:, None]
            dQ_d = _op(dO * qs[:, None], DT, LOWP)
        else:
            kd = _seq_load(Kd, bos, Tn, t0, ihv * K, HV * K, BT, K)
            qg = _seq_load(Qg, bos, Tn, t0, ihv * K, HV * K, BT, K)
            dvn = tl.dot(tl.trans(_op(P, DT, LOWP)), dO_d, input_precision=PREC) + \
                tl.dot(_op(kd, DT, LOWP), _op(dS, DT, LOWP), input_precision=PREC)
            dQ_d = dO_d
        _seq_store(dvnbuf, dvn, bos, Tn, t0, ihv * V + iv * BV, HV * V, BT, BV)
        dS = (dS * dec + tl.dot(tl.trans(_op(qg, DT, LOWP)), dQ_d, input_precision=PREC)
              - tl.dot(tl.trans(_op(W, DT, LOWP)), _op(dvn, DT, LOWP), input_precision=PREC))
    if STORE_DH0:
        tl.store(dh0 + (n * HV + ihv).to(tl.int64) * K * V + offs_k[:, None] * V + offs_v[None, :], dS)


@triton.jit
def _bwd_out_loop(hbuf, vnbuf, do, hb, r64, rmask, ihv, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                  BV: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr):
    """Phase 1 of a chunk backward, over V blocks: dQS = dO S^T [BT, K] (the output read of the chunk-initial
    state S) and dP = dO Vn^T [BT, BT] (the intra-chunk attention)."""
    DT: tl.constexpr = hbuf.dtype.element_ty
    offs_k = tl.arange(0, K)
    dQS = tl.zeros([BT, K], dtype=tl.float32)
    dP = tl.zeros([BT, BT], dtype=tl.float32)
    for v0 in range(0, V, BV):
        offs_v = v0 + tl.arange(0, BV)
        vrow = (r64[:, None] * HV + ihv) * V + offs_v[None, :]
        S_d = _op(tl.load(hbuf + hb + offs_k[:, None] * V + offs_v[None, :]), DT, LOWP)
        vn_d = _op(tl.load(vnbuf + vrow, mask=rmask[:, None], other=0.0), DT, LOWP)
        dO_d = _op(tl.load(do + vrow, mask=rmask[:, None], other=0.0), DT, LOWP)
        dQS += tl.dot(dO_d, tl.trans(S_d), input_precision=PREC)
        dP += tl.dot(dO_d, tl.trans(vn_d), input_precision=PREC)
    return dQS, dP


@triton.jit
def _bwd_state_loop(hbuf, dhbuf, vnbuf, dvnbuf, v, dv, Tm_d, bb, hb, r64, rmask, ihv, HV, K: tl.constexpr,
                    V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr):
    """Phase 2 of a chunk backward, over V blocks, from S, dS' (the state gradient after the chunk), Vn, dVn:
    stores dv = diag(beta) T^T dVn and returns dKd = Vn dS'^T, dW = -dVn S^T, dT = dVn (diag(beta) V)^T,
    the beta gradient through U, and dSS = rowsum(S * dS') [K] (for the state's decay)."""
    DT: tl.constexpr = hbuf.dtype.element_ty
    offs_k = tl.arange(0, K)
    dKd = tl.zeros([BT, K], dtype=tl.float32)
    dW = tl.zeros([BT, K], dtype=tl.float32)
    dT = tl.zeros([BT, BT], dtype=tl.float32)
    dbeta = tl.zeros([BT], dtype=tl.float32)
    dSS = tl.zeros([K], dtype=tl.float32)
    for v0 in range(0, V, BV):
        offs_v = v0 + tl.arange(0, BV)
        s_off = offs_k[:, None] * V + offs_v[None, :]
        vrow = (r64[:, None] * HV + ihv) * V + offs_v[None, :]
        S = tl.load(hbuf + hb + s_off)
        dSn = tl.load(dhbuf + hb + s_off)
        vn_d = _op(tl.load(vnbuf + vrow, mask=rmask[:, None], other=0.0), DT, LOWP)
        dvn_d = _op(tl.load(dvnbuf + vrow, mask=rmask[:, None], other=0.0), DT, LOWP)
        vv = tl.load(v + vrow, mask=rmask[:, None], other=0.0).to(tl.float32)
        dKd += tl.dot(vn_d, tl.trans(_op(dSn, DT, LOWP)), input_precision=PREC)
        dW -= tl.dot(dvn_d, tl.trans(_op(S, DT, LOWP)), input_precision=PREC)
        dT += tl.dot(dvn_d, tl.trans(_op(vv * bb[:, None], DT, LOWP)), input_precision=PREC)
        dVb = tl.dot(tl.trans(Tm_d), dvn_d, input_precision=PREC)
        tl.store(dv + vrow, (dVb * bb[:, None]).to(dv.dtype.element_ty), mask=rmask[:, None])
        dbeta += tl.sum(vv * dVb, 1)
        dSS += tl.sum(S.to(tl.float32) * dSn.to(tl.float32), 1)
    return dKd, dW, dT, dbeta, dSS


@triton.jit
def _chunk_bwd(
    q, k, v, g, beta, Tbuf, hbuf, dhbuf, vnbuf, dvnbuf, do, dq, dk, dkp, dv, dg, dbeta,
    cu, chunk_seq, chunk_start, scale,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
    PHASE: tl.constexpr = 0,
):
    """dq, dk, dv, dg, dbeta of one chunk, in two phases so that few [BT, K] accumulators are live at once:
    1. the output's paths (through the chunk-initial state and the intra-chunk attention): dq complete, the
       partial dk and dg parked in their buffers; 2. the state write, W and the UT transform: dv, dbeta, dg, the
    rest of dk. PHASE 1 or 2 runs one phase per launch (each compiled kernel holds half the live tiles), 0 both.
    Dot operands are 16-bit when LOWP (PREC otherwise); accumulators fp32. dk's partial sum waits in dkp (fp32;
    may be dk itself when dk is fp32)."""
    DT: tl.constexpr = hbuf.dtype.element_ty
    ic = tl.program_id(0)
    ihv = tl.program_id(1)
    ih = ihv // (HV // H)
    n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
    offs_k = tl.arange(0, K)
    krow = (r64[:, None] * HV + ihv) * K + offs_k[None, :]
    hb = (ic * HV + ihv).to(tl.int64) * K * V
    gg = tl.load(g + r64 * HV + ihv, mask=rmask, other=0.0).to(tl.float32)
    bb = tl.load(beta + r64 * HV + ihv, mask=rmask, other=0.0).to(tl.float32)
    gc, gcl, gL, ged = _cum_split(gg)
    gam = tl.exp(gc)
    incl = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]

    kk = _load_rows(k, r64, rmask, H * K, ih * K, offs_k, L2)
    kk_d = _op(kk, DT, LOWP)
    if PHASE != 2:
        # phase 1: O = diag(scale gamma) Q S + P Vn with P = scale (Q K^T) e^{b_i - b_j} (j <= i)
        dQS, dP = _bwd_out_loop(hbuf, vnbuf, do, hb, r64, rmask, ihv, HV, K, V, BT, BV, PREC, LOWP)
        qr = _load_rows(q, r64, rmask, H * K, ih * K, offs_k, False)
        if L2:
            rq = _inv_norms(qr)
            qq = qr * rq[:, None]
        else:
            qq = qr
        qq_d = _op(qq, DT, LOWP)
        dqn = dQS * (scale * gam)[:, None]
        dgc = tl.sum(qq * dqn, 1)
        Gi = tl.exp(_pair_exponent(gc, gcl, incl))
        QK = tl.dot(qq_d, tl.trans(kk_d), input_precision=PREC)
        R = tl.where(incl, dP * QK * Gi * scale, 0.0)
        dPg_d = _op(tl.where(incl, dP * Gi * scale, 0.0), DT, LOWP)
        dqn += tl.dot(dPg_d, kk_d, input_precision=PREC)
        dgc += _row_minus_col(R, rows)
        if L2:
            dqn = (dqn - qq * tl.sum(qq * dqn, 1)[:, None]) * rq[:, None]
        tl.store(dq + krow, dqn, mask=rmask[:, None])
        # the keys' part of this phase waits in dk's buffer (read back by this same program below)
        tl.store(dkp + krow, tl.dot(tl.trans(dPg_d), qq_d, input_precision=PREC), mask=rmask[:, None])
        if PHASE == 1:
            tl.store(dg + r64 * HV + ihv, dgc, mask=rmask)
    if PHASE != 1:
        # phase 2: S' = e^{bL} S + (K e^{bL - b})^T Vn, Vn = U - W S with W = T diag(beta gamma) K, U = T diag(beta) V
        if PHASE == 2:
            dgc = tl.load(dg + r64 * HV + ihv, mask=rmask, other=0.0)
        Tm_d = _op(tl.load(Tbuf + ((ic * HV + ihv) * BT + rows[:, None]) * BT + rows[None, :]), DT, LOWP)
        dKd, dW, dT, db, dSS = _bwd_state_loop(hbuf, dhbuf, vnbuf, dvnbuf, v, dv, Tm_d, bb, hb, r64, rmask, ihv, HV,
                                               K, V, BT, BV, PREC, LOWP)
        ed = tl.exp(ged)
        if PHASE == 0:
            tl.debug_barrier()  # dkp was stored above by this program's other threads (one-launch plan)
        dkn = tl.load(dkp + krow, mask=rmask[:, None], other=0.0) + dKd * ed[:, None]
        r = tl.sum(kk * dKd, 1) * ed
        c = tl.exp(gL) * tl.sum(dSS, 0)
        # W = T Kb with Kb = diag(beta gamma) K
        bg = bb * gam
        dW_d = _op(dW, DT, LOWP)
        dT += tl.dot(dW_d, tl.trans(_op(kk * bg[:, None], DT, LOWP)), input_precision=PREC)
        dKb = tl.dot(tl.trans(Tm_d), dW_d, input_precision=PREC)
        dkn += dKb * bg[:, None]
        t = tl.sum(kk * dKb, 1)
        db += t * gam
        dgc += t * bg
        # T = (I + A)^{-1}: dA = -T^T dT T^T on the strict lower part; A = strict(diag(beta) K K^T e^{b_i - b_j})
        dA = -tl.dot(_op(tl.dot(tl.trans(Tm_d), _op(dT, DT, LOWP), input_precision=PREC), DT, LOWP), tl.trans(Tm_d),
                     input_precision=PREC)
        Gs = tl.exp(_pair_exponent(gc, gcl, strict))
        dAG = tl.where(strict, dA * Gs, 0.0)
        dKK_d = _op(dAG * bb[:, None], DT, LOWP)
        dkn += tl.dot(dKK_d, kk_d, input_precision=PREC) + tl.dot(tl.trans(dKK_d), kk_d, input_precision=PREC)
        RA = dAG * tl.dot(kk_d, tl.trans(kk_d), input_precision=PREC)
        db += tl.sum(RA, 1)
        RA = RA * bb[:, None]
        dgc += tl.sum(RA, 1) - tl.sum(RA, 0)
        dgg = _dg_rows(tl.where(rmask, dgc, 0.0), r, c)
        if L2:
            kr = _load_rows(k, r64, rmask, H * K, ih * K, offs_k, False)
            rk = _inv_norms(kr)
            dkn = (dkn - kk * tl.sum(kk * dkn, 1)[:, None]) * rk[:, None]
        tl.store(dk + krow, dkn, mask=rmask[:, None])
        tl.store(dg + r64 * HV + ihv, dgg, mask=rmask)
        tl.store(dbeta + r64 * HV + ihv, db, mask=rmask)


@triton.jit
def _chunk_bwd_onephase(
    q, k, v, g, beta, Tbuf, hbuf, dhbuf, vnbuf, dvnbuf, do, dq, dk, dkp, dv, dg, dbeta,
    cu, chunk_seq, chunk_start, scale,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
):
    """Variant of `_chunk_bwd` with one loop over V blocks (more accumulators live at once); kept while the GPU
    sweep (scripts/gpu_tune_gdn.py, TUNE["bwd_variant"]) decides between them. 16-bit dot operands when LOWP.
    dkp is unused (same arguments as `_chunk_bwd`)."""
    DT: tl.constexpr = hbuf.dtype.element_ty
    ic = tl.program_id(0)
    ihv = tl.program_id(1)
    ih = ihv // (HV // H)
    n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
    offs_k = tl.arange(0, K)
    Tm_d = _op(tl.load(Tbuf + ((ic * HV + ihv) * BT + rows[:, None]) * BT + rows[None, :]), DT, LOWP)
    bb = tl.load(beta + r64 * HV + ihv, mask=rmask, other=0.0).to(tl.float32)
    hb = (ic * HV + ihv).to(tl.int64) * K * V

    dQS = tl.zeros([BT, K], dtype=tl.float32)
    dKd = tl.zeros([BT, K], dtype=tl.float32)
    dW = tl.zeros([BT, K], dtype=tl.float32)
    dP = tl.zeros([BT, BT], dtype=tl.float32)
    dT = tl.zeros([BT, BT], dtype=tl.float32)
    db = tl.zeros([BT], dtype=tl.float32)
    dSS = tl.zeros([K], dtype=tl.float32)
    for v0 in range(0, V, BV):
        offs_v = v0 + tl.arange(0, BV)
        s_off = offs_k[:, None] * V + offs_v[None, :]
        S = tl.load(hbuf + hb + s_off)
        dSn = tl.load(dhbuf + hb + s_off)
        vrow = (r64[:, None] * HV + ihv) * V + offs_v[None, :]
        vn = tl.load(vnbuf + vrow, mask=rmask[:, None], other=0.0)
        dvn = tl.load(dvnbuf + vrow, mask=rmask[:, None], other=0.0)
        dO = tl.load(do + vrow, mask=rmask[:, None], other=0.0)
        vv = tl.load(v + vrow, mask=rmask[:, None], other=0.0).to(tl.float32)
        S_d, dSn_d, vn_d, dvn_d, dO_d = (_op(S, DT, LOWP), _op(dSn, DT, LOWP), _op(vn, DT, LOWP),
                                         _op(dvn, DT, LOWP), _op(dO, DT, LOWP))
        dQS += tl.dot(dO_d, tl.trans(S_d), input_precision=PREC)
        dP += tl.dot(dO_d, tl.trans(vn_d), input_precision=PREC)
        dKd += tl.dot(vn_d, tl.trans(dSn_d), input_precision=PREC)
        dW -= tl.dot(dvn_d, tl.trans(S_d), input_precision=PREC)
        dT += tl.dot(dvn_d, tl.trans(_op(vv * bb[:, None], DT, LOWP)), input_precision=PREC)
        dVb = tl.dot(tl.trans(Tm_d), dvn_d, input_precision=PREC)
        tl.store(dv + vrow, (dVb * bb[:, None]).to(dv.dtype.element_ty), mask=rmask[:, None])
        db += tl.sum(vv * dVb, 1)
        dSS += tl.sum(S.to(tl.float32) * dSn.to(tl.float32), 1)

    # q, k, T and the decays are loaded only now: keeping them out of the V loop keeps its registers free
    qr = _load_rows(q, r64, rmask, H * K, ih * K, offs_k, False)
    kr = _load_rows(k, r64, rmask, H * K, ih * K, offs_k, False)
    if L2:
        rq = _inv_norms(qr)
        rk = _inv_norms(kr)
        qq = qr * rq[:, None]
        kk = kr * rk[:, None]
    else:
        qq = qr
        kk = kr
    gg = tl.load(g + r64 * HV + ihv, mask=rmask, other=0.0).to(tl.float32)
    gc, gcl, gL, ged = _cum_split(gg)
    gam = tl.exp(gc)
    # output through the chunk-initial state: O += diag(scale gamma) Q S
    qq_d, kk_d = _op(qq, DT, LOWP), _op(kk, DT, LOWP)
    dqn = dQS * (scale * gam)[:, None]
    dgc = tl.sum(qq * dqn, 1)
    # intra-chunk attention P = scale (Q K^T) * e^{b_i - b_j}, j <= i
    incl = rows[:, None] >= rows[None, :]
    Gi = tl.exp(_pair_exponent(gc, gcl, incl))
    QK = tl.dot(qq_d, tl.trans(kk_d), input_precision=PREC)
    R = tl.where(incl, dP * QK * Gi * scale, 0.0)
    dPg = tl.where(incl, dP * Gi * scale, 0.0)
    dqn += tl.dot(_op(dPg, DT, LOWP), kk_d, input_precision=PREC)
    dkn = tl.dot(tl.trans(_op(dPg, DT, LOWP)), qq_d, input_precision=PREC)
    dgc += _row_minus_col(R, rows)
    # state write S' = e^{bL} S + (K e^{bL - b})^T Vn
    ed = tl.exp(ged)
    dkn += dKd * ed[:, None]
    r = tl.sum(kk * dKd, 1) * ed
    c = tl.exp(gL) * tl.sum(dSS, 0)
    # W = T Kb with Kb = diag(beta gamma) K
    bg = bb * gam
    kb = kk * bg[:, None]
    dW_d = _op(dW, DT, LOWP)
    dT += tl.dot(dW_d, tl.trans(_op(kb, DT, LOWP)), input_precision=PREC)
    dKb = tl.dot(tl.trans(Tm_d), dW_d, input_precision=PREC)
    dkn += dKb * bg[:, None]
    t = tl.sum(kk * dKb, 1)
    db += t * gam
    dgc += t * bg
    # T = (I + A)^{-1}: dA = -T^T dT T^T on the strict lower part
    dA = -tl.dot(_op(tl.dot(tl.trans(Tm_d), _op(dT, DT, LOWP), input_precision=PREC), DT, LOWP), tl.trans(Tm_d),
                 input_precision=PREC)
    strict = rows[:, None] > rows[None, :]
    Gs = tl.exp(_pair_exponent(gc, gcl, strict))
    KK = tl.dot(kk_d, tl.trans(kk_d), input_precision=PREC)
    dAG = tl.where(strict, dA * Gs, 0.0)
    dKK = dAG * bb[:, None]
    dKK_d = _op(dKK, DT, LOWP)
    dkn += tl.dot(dKK_d, kk_d, input_precision=PREC) + tl.dot(tl.trans(dKK_d), kk_d, input_precision=PREC)
    RA = dAG * KK
    db += tl.sum(RA, 1)
    RA = RA * bb[:, None]
    dgc += tl.sum(RA, 1) - tl.sum(RA, 0)
    dgg = _dg_rows(tl.where(rmask, dgc, 0.0), r, c)
    if L2:
        dqn = (dqn - qq * tl.sum(qq * dqn, 1)[:, None]) * rq[:, None]
        dkn = (dkn - kk * tl.sum(kk * dkn, 1)[:, None]) * rk[:, None]
    krow = (r64[:, None] * HV + ihv) * K + offs_k[None, :]
    tl.store(dq + krow, dqn, mask=rmask[:, None])
    tl.store(dk + krow, dkn, mask=rmask[:, None])
    tl.store(dg + r64 * HV + ihv, dgg, mask=rmask)
    tl.store(dbeta + r64 * HV + ihv, db, mask=rmask)


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


@triton.jit
def _row_minus_col(R, rows):
    """sum_j R_ij - sum_j R_ji over j != i, R [BT, BT]: dg's part from a product with the decays e^{b_i - b_j}. The
    diagonal (exponent b_i - b_i, no g in it) cancels between the two sums, but in fp32 only to eps |R_ii|, which in
    a strongly decaying chunk is more than the off-diagonal part; so it is left out."""
    off = tl.where(rows[:, None] != rows[None, :], R, 0.0)
    return tl.sum(off, 1) - tl.sum(off, 0)


@triton.jit
def _pair_exponent(gc, gcl, mask):
    """[BT, BT] exponent b_i - b_j where mask (j <= i or j < i), 0 elsewhere so its exp never overflows; from the
    hi (gc) and lo (gcl) parts of `_cum_split`."""
    return tl.where(mask, (gc[:, None] - gc[None, :]) + (gcl[:, None] - gcl[None, :]), 0.0)


@triton.jit
def _load_unit_rows(ptr, rows64, rmask, stride, col0, offs, L2: tl.constexpr):
    """Rows as `_load_rows`, plus their inverse norms r [BT] (the l2norm backward needs them; 1 without L2)."""
    x = tl.load(ptr + rows64[:, None] * stride + col0 + offs[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    if L2:
        r = _inv_norms(x)
    else:
        r = tl.full([x.shape[0]], 1.0, dtype=tl.float32)
    return x * r[:, None], r


@triton.jit
def _chunk_bwd_state(
    k, v, g, beta, Tbuf, hbuf, dhbuf, vnbuf, dvnbuf, dkp, dv, dg, dbeta, dKKbuf,
    cu, chunk_seq, chunk_start,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
    UT_DOTS: tl.constexpr = True,
):
    """First launch of the state-first chunk backward (TUNE bwd_variant "statefirst"): every path of one chunk
    through the state write S' = e^{bL} S + Kd^T Vn and through Vn = U - W S, W = T diag(beta gamma) K,
    U = T diag(beta) V, T = (I + A)^{-1}. k is read only after the V loop, so the loop holds just its own
    accumulators. Non-standard outputs, finished by `_chunk_bwd_out`: dv and dbeta are final; dk's part goes to
    dkp (fp32), dg's part of these paths, finished (`_dg_rows`), to dg. The UT transform's
    dKK = strict(dA e^{b_i - b_j}) beta [BT, BT] enters dk through two [BT, BT] x [BT, K] dots: here (UT_DOTS),
    or parked in dKKbuf (dot operand dtype) for the second launch."""
    DT: tl.constexpr = hbuf.dtype.element_ty
    ic = tl.program_id(0)
    ihv = tl.program_id(1)
    ih = ihv // (HV // H)
    n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
    offs_k = tl.arange(0, K)
    p_TT = (ic * HV + ihv).to(tl.int64) * BT * BT + rows[:, None] * BT + rows[None, :]
    gc, gcl, gL, ged, bb = _chunk_gates(g, beta, r64, rmask, ihv, HV)
    Tm_d = _op(tl.load(Tbuf + p_TT), DT, LOWP)
    hb = (ic * HV + ihv).to(tl.int64) * K * V
    dKd, dW, dT, db, dSS = _bwd_state_loop(hbuf, dhbuf, vnbuf, dvnbuf, v, dv, Tm_d, bb, hb, r64, rmask, ihv, HV,
                                           K, V, BT, BV, PREC, LOWP)
    kk = _load_rows(k, r64, rmask, H * K, ih * K, offs_k, L2)
    # the state write: Kd = K e^{bL - b}, and S' decays by e^{bL}
    ed = tl.exp(ged)
    b_dk = dKd * ed[:, None]
    r = tl.sum(kk * dKd, 1) * ed
    c = tl.exp(gL) * tl.sum(dSS, 0)
    # W = T Kb with Kb = diag(beta gamma) K
    gam = tl.exp(gc)
    bg = bb * gam
    dW_d = _op(dW, DT, LOWP)
    dT += tl.dot(dW_d, tl.trans(_op(kk * bg[:, None], DT, LOWP)), input_precision=PREC)
    dKb = tl.dot(tl.trans(Tm_d), dW_d, input_precision=PREC)
    b_dk += dKb * bg[:, None]
    t = tl.sum(kk * dKb, 1)
    db += t * gam
    dgc = t * bg
    # T = (I + A)^{-1}: dA = -T^T dT T^T on the strict lower part; A = strict(diag(beta) K K^T e^{b_i - b_j})
    dA = -tl.dot(_op(tl.dot(tl.trans(Tm_d), _op(dT, DT, LOWP), input_precision=PREC), DT, LOWP), tl.trans(Tm_d),
                 input_precision=PREC)
    strict = rows[:, None] > rows[None, :]
    dAG = tl.where(strict, dA * tl.exp(_pair_exponent(gc, gcl, strict)), 0.0)
    kk_d = _op(kk, DT, LOWP)
    RA = dAG * tl.dot(kk_d, tl.trans(kk_d), input_precision=PREC)
    db += tl.sum(RA, 1)
    RA = RA * bb[:, None]
    dgc += tl.sum(RA, 1) - tl.sum(RA, 0)
    dKK_d = _op(dAG * bb[:, None], DT, LOWP)
    if UT_DOTS:
        b_dk += tl.dot(dKK_d, kk_d, input_precision=PREC) + tl.dot(tl.trans(dKK_d), kk_d, input_precision=PREC)
    else:
        tl.store(dKKbuf + p_TT, dKK_d.to(dKKbuf.dtype.element_ty))
    krow = (r64[:, None] * HV + ihv) * K + offs_k[None, :]
    tl.store(dkp + krow, b_dk, mask=rmask[:, None])
    tl.store(dg + r64 * HV + ihv, _dg_rows(tl.where(rmask, dgc, 0.0), r, c), mask=rmask)
    tl.store(dbeta + r64 * HV + ihv, db, mask=rmask)


@triton.jit
def _chunk_bwd_out(
    q, k, g, beta, hbuf, vnbuf, do, dq, dk, dkp, dg, dKKbuf,
    cu, chunk_seq, chunk_start, scale,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
    UT_DOTS: tl.constexpr = True,
):
    """Second launch of the state-first chunk backward: the output's paths O = diag(scale gamma) Q S + P Vn,
    P = scale (Q K^T) e^{b_i - b_j} (j <= i), then it finishes what `_chunk_bwd_state` left: dk = its part (dkp)
    + this one (+ dKK K + dKK^T K from dKKbuf unless UT_DOTS), dg = the reverse cumsum of this launch's per-row
    part + the state launch's finished part, the l2norm backward.
    q and k are read after the V loop."""
    DT: tl.constexpr = hbuf.dtype.element_ty
    ic = tl.program_id(0)
    ihv = tl.program_id(1)
    ih = ihv // (HV // H)
    n, bos, nval, rows, rmask, r64 = _chunk_rows(cu, chunk_seq, chunk_start, ic, BT)
    offs_k = tl.arange(0, K)
    hb = (ic * HV + ihv).to(tl.int64) * K * V
    dQS, dP = _bwd_out_loop(hbuf, vnbuf, do, hb, r64, rmask, ihv, HV, K, V, BT, BV, PREC, LOWP)
    # (beta is not needed here: its load is dropped)
    gc, gcl, _gL, _ged, _bb = _chunk_gates(g, beta, r64, rmask, ihv, HV)
    qq, rq = _load_unit_rows(q, r64, rmask, H * K, ih * K, offs_k, L2)
    kk, rk = _load_unit_rows(k, r64, rmask, H * K, ih * K, offs_k, L2)
    qq_d, kk_d = _op(qq, DT, LOWP), _op(kk, DT, LOWP)
    # through the chunk-initial state, then the intra-chunk attention
    dqn = dQS * (scale * tl.exp(gc))[:, None]
    dgc = tl.sum(qq * dqn, 1)
    incl = rows[:, None] >= rows[None, :]
    dPg = tl.where(incl, dP * tl.exp(_pair_exponent(gc, gcl, incl)) * scale, 0.0)
    R = dPg * tl.dot(qq_d, tl.trans(kk_d), input_precision=PREC)
    dgc += _row_minus_col(R, rows)
    dPg_d = _op(dPg, DT, LOWP)
    dqn += tl.dot(dPg_d, kk_d, input_precision=PREC)
    if L2:
        dqn = (dqn - qq * tl.sum(qq * dqn, 1)[:, None]) * rq[:, None]
    krow = (r64[:, None] * HV + ihv) * K + offs_k[None, :]
    tl.store(dq + krow, dqn.to(dq.dtype.element_ty), mask=rmask[:, None])
    # dk: this launch's part + the state launch's
    b_dk = tl.dot(tl.trans(dPg_d), qq_d, input_precision=PREC) + tl.load(dkp + krow, mask=rmask[:, None], other=0.0)
    if not UT_DOTS:
        p_TT = (ic * HV + ihv).to(tl.int64) * BT * BT + rows[:, None] * BT + rows[None, :]
        dKK_d = _op(tl.load(dKKbuf + p_TT), DT, LOWP)
        b_dk += tl.dot(dKK_d, kk_d, input_precision=PREC) + tl.dot(tl.trans(dKK_d), kk_d, input_precision=PREC)
    if L2:
        b_dk = (b_dk - kk * tl.sum(kk * b_dk, 1)[:, None]) * rk[:, None]
    tl.store(dk + krow, b_dk.to(dk.dtype.element_ty), mask=rmask[:, None])
    dgc = tl.where(rmask, dgc, 0.0)
    dg_state = tl.load(dg + r64 * HV + ihv, mask=rmask, other=0.0)  # finished by the state launch (`_dg_rows`)
    tl.store(dg + r64 * HV + ihv, tl.cumsum(dgc, 0, reverse=True) + dg_state, mask=rmask)


# ---------------------------------------------------------------------------------------------------------------
# K-blocked state-first chunk backward (gdn.TUNE["bwd_variant"] = "kblock"). `_chunk_bwd_state` and `_chunk_bwd_out`
# hold [BT, K] fp32 tiles (dKd, dW, dQS, the normalised q and k) and sit at 255 and 225 registers at 8 warps (sm_90,
# K=V=128 bf16): one program per multiprocessor. As in the K-blocked prep and KDA backward, everything per key
# channel (dKd, dW, dQS, dq, dk) is local to a block of BK channels, and everything that mixes channels is a sum
# over them: dT += dW Kb^T, K K^T, Q K^T, and the row sums that the decay gradient and the l2 norm's backward need.
# q and k enter the dots raw (16-bit inputs: exact products) with the norms as row/column scales of the [BT, BT]
# operands. Two facts keep the HBM bytes those of the whole-K plan (the extra reads are of the chunk's own tiles,
# from cache):
# - the l2 norm's backward dx = (dx^ - x^ s) r needs s_i = sum_d x^_id dx^_id before any block is final. For dk,
#   every term of s is already a [BT] sum of the state launch (r, t bg, the UT part) or of the output launch's
#   R = dPg * Q^K^^T (column sums): the state launch passes its share on in a [BT] vector per chunk (dsk);
# - for dq, s_i = scale gamma_i q^_i . dQS_i + rowsum(R)_i: the output launch walks K twice, the first pass for
#   q^ . dQS and Q K^T, the second (dQS = dO S^T again, from cache) for dq and dk.
# The UT transform's dKK (needed by dk only after every K block has added to dT) is parked as dKK + dKK^T
# ([BT, BT] in the dot operand dtype) for the output launch, which applies it in its K walk.
# ---------------------------------------------------------------------------------------------------------------


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
    """The K-blocked `_chunk_bwd_state` (same paths: the state write S' = e^{bL} S + Kd^T Vn, Vn = U - W S,
    W = T diag(beta gamma) K^, U = T diag(beta) V, T = (I + A)^{-1}), in three parts: 1. over V blocks, through U
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
    """The K-blocked `_chunk_bwd_out`: the output's paths O = diag(scale gamma) Q^ S + P Vn,
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


@triton.jit
def _decode_step(
    q, k, v, g, beta, pool, idx, o, scale,
    H, HV, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, CHANNEL: tl.constexpr = False,
):
    iv = tl.program_id(0)
    inh = tl.program_id(1)
    n = inh // HV
    ihv = inh % HV
    ih = ihv // (HV // H)
    offs_k = tl.arange(0, K)
    offs_v = iv * BV + tl.arange(0, BV)
    slot = tl.load(idx + n).to(tl.int64)
    sp = pool + (slot * HV + ihv) * K * V + offs_k[:, None] * V + offs_v[None, :]
    S = tl.load(sp)
    qq = tl.load(q + (n * H + ih) * K + offs_k).to(tl.float32)
    kk = tl.load(k + (n * H + ih) * K + offs_k).to(tl.float32)
    if L2:
        qq = qq * tl.rsqrt(tl.sum(qq * qq, 0) + 1e-6)
        kk = kk * tl.rsqrt(tl.sum(kk * kk, 0) + 1e-6)
    vv = tl.load(v + (n * HV + ihv) * V + offs_v).to(tl.float32)
    if CHANNEL:  # KDA: one log-decay per key channel, g [N, HV, K]
        dec = tl.exp(tl.load(g + (n * HV + ihv) * K + offs_k).to(tl.float32))[:, None]
    else:
        dec = tl.exp(tl.load(g + n * HV + ihv).to(tl.float32))
    bb = tl.load(beta + n * HV + ihv).to(tl.float32)
    S = S * dec
    u = bb * (vv - tl.sum(S * kk[:, None], 0))
    S = S + kk[:, None] * u[None, :]
    oo = tl.sum(S * qq[:, None], 0) * scale
    tl.store(sp, S)
    tl.store(o + (n * HV + ihv) * V + offs_v, oo.to(o.dtype.element_ty))
