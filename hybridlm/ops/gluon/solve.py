"""The T solve of the Gluon GDN forward: one program per (chunk, sequence x value head), all chunks in parallel.

With b the in-chunk cumulative log-decay (docs/math.md),
    A = strict_lower(diag(beta) Kn Kn^T * e^{b_i - b_j}),  T = (I + A)^{-1}
Kn Kn^T is one 16-bit product of the raw keys (exact); the l2 norms, beta and the decays enter as fp32 row and column
scales, the squared norms read off the diagonals of K K^T and Q Q^T (one more product instead of a pass over q and k
in registers). The four diagonal [16, 16] blocks of I + A are inverted exactly in fp32 registers by forward
substitution (a thread a column of a block); with Td that block-diagonal inverse and L the strictly block-lower part
of A, N = Td L is nilpotent (N^4 = 0), so T = (I - N)(I + N^2) Td: four 64x64 products, left operands in registers,
fp32 accumulation. Their operands are fp16 when the kernel normalises the keys (|A| <= beta bounds every factor; fp16
has tf32's mantissa, and a 16-bit accumulator is its own left operand, so no layout conversion goes through shared
memory), tf32 otherwise (raw keys bound nothing).

Non-standard: besides T diag(beta) (rounded to the inputs' 16-bit dtype: the chain's operand) the solve writes
every per-token scale the chain needs, already multiplied out (`GATE_ROWS`), so the chain reads them with its chunk
by TMA and computes no norm and no exponential of a vector on its serial path.
"""

from __future__ import annotations

from .parts import _IMPORT_ERROR, _issue_rows, gl, gluon

if _IMPORT_ERROR is None:
    from .parts import _mma, async_copy, fence_async_shared, warpgroup_mma

# rows of a chunk's gate block [GATE_ROWS, C] fp32 (rk, rq: the l2-norm factors, rq with the scale; b as above):
#   0 b     1 e^b rk     2 e^{b_last - b} rk     3 e^b rq     4 rq     5 rk     6 e^{b_last} (every column)
GATE_ROWS = 8  # a TMA box side is a power of two; row 7 is never read

if _IMPORT_ERROR is None:

    @gluon.jit
    def _diag_inverse(a_smem, d3_smem, C: gl.constexpr):
        """Td = (I + D)^{-1} for the four diagonal [16, 16] blocks D of the strictly lower A in `a_smem` (plain
        [C, C] fp32), by forward substitution in fp32. A thread holds one column c of one block's inverse
        (x[blk, c, r] = Td[blk][r, c]) and, at step s, reads row s of its block's D (the same for the block's 16
        threads: one broadcast read), so every sum stays inside the thread. Returns Td as [4, 16, 16] (block, row,
        column)."""
        L16: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [4, 1], [1, 0])
        # threads: 2 blocks x 16 columns a warp, 2 warps cover the 4 blocks; the other 2 warps repeat them
        LX: gl.constexpr = gl.BlockedLayout([1, 1, 16], [2, 16, 1], [2, 2, 1], [2, 1, 0])
        for blk in gl.static_range(4):
            d = a_smem.slice(16 * blk, 16, dim=0).slice(16 * blk, 16, dim=1).load(L16)
            d3_smem.slice(16 * blk, 16, dim=0).store(d)  # D[blk, s, j]
        gl.thread_barrier()
        D3 = d3_smem.reshape([4, 16, 16])
        c3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, LX))), 0), 2)
        r3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, LX))), 0), 1)
        eye = gl.where(r3 == c3, 1.0, 0.0) + gl.zeros([4, 16, 16], gl.float32, LX)
        x = eye
        for s in gl.static_range(1, 16):
            row = gl.sum(D3.slice(s, 1, dim=1).load(LX) * x, axis=2)  # [4, 16 (c)]: sum_j D[s, j] x[c, j]
            x = gl.where(r3 == s, eye - gl.expand_dims(row, 2), x)
        gl.thread_barrier()  # every read of D done before the caller overwrites d3_smem
        return gl.permute(x, (0, 2, 1))

    @gluon.jit
    def _block_diag(Td, d3_smem, plain_smem, C: gl.constexpr, LAYOUT: gl.constexpr):
        """The [C, C] block-diagonal matrix of the four [16, 16] blocks Td, through plain shared memory."""
        L16: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [4, 1], [1, 0])
        d3_smem.reshape([4, 16, 16]).store(Td)
        plain_smem.store(gl.zeros([C, C], gl.float32, LAYOUT))
        gl.thread_barrier()  # every zero written before any block lands on it (write after write)
        for blk in gl.static_range(4):
            blk_val = d3_smem.slice(16 * blk, 16, dim=0).load(L16)
            plain_smem.slice(16 * blk, 16, dim=0).slice(16 * blk, 16, dim=1).store(blk_val)
        gl.thread_barrier()
        return plain_smem.load(LAYOUT)

    @gluon.jit
    def _t_matrix(A, plain, d3, m_t, i_c, j_c, C: gl.constexpr, MC: gl.constexpr, MP: gl.constexpr,
                  A_OP: gl.constexpr):
        """T = (I + A)^{-1} = (I - N)(I + N^2) Td for the strictly lower A [C, C] (fp32, layout MC): Td the exact
        inverse of the diagonal blocks, N = Td L with L the strictly block-lower part of A. Four products in m_t's
        dtype with fp32 accumulation (layout MP), left operands from registers (A_OP), right ones through the one
        [C, C] buffer m_t; plain and d3 are the solve's. fp16 (MP of a 16-bit product, A_OP k_width 2): the
        accumulator is its own left operand, no layout goes through shared memory; tf32 (MP = MC, k_width 1):
        each left operand is converted through shared memory."""
        dt: gl.constexpr = m_t.dtype
        zc = gl.zeros([C, C], gl.float32, MP)
        plain.store(A)
        Td = gl.convert_layout(_block_diag(_diag_inverse(plain, d3, C), d3, plain, C, MC), MP)
        block_lower = gl.expand_dims(i_c // 16, 1) > gl.expand_dims(j_c // 16, 0)
        m_t.store(gl.convert_layout(gl.where(block_lower, A, 0.0), MP).to(dt))
        fence_async_shared()
        N = warpgroup_mma(gl.convert_layout(Td.to(dt), A_OP), m_t, zc, use_acc=False)
        n_op = gl.convert_layout(N.to(dt), A_OP)
        m_t.store(N.to(dt))
        fence_async_shared()
        N2 = warpgroup_mma(n_op, m_t, zc, use_acc=False)
        m_t.store(Td.to(dt))
        fence_async_shared()
        P1 = warpgroup_mma(gl.convert_layout(N2.to(dt), A_OP), m_t, Td, use_acc=True)  # (I + N^2) Td
        m_t.store(P1.to(dt))
        fence_async_shared()
        return gl.convert_layout(P1 - warpgroup_mma(n_op, m_t, zc, use_acc=False), MC)

    @gluon.jit
    def _diagonal(x, i_c, j_c):
        """The diagonal of a square x as a vector along its rows."""
        return gl.sum(gl.where(gl.expand_dims(i_c, 1) == gl.expand_dims(j_c, 0), x, 0.0), axis=1)

    @gluon.jit
    def _publish(flag):
        """*flag = 1 once every thread's stores of the chunk are visible at GPU scope: each thread fences its own,
        the barrier waits for all of them, and the flag is written with release semantics."""
        gl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, 0;", "=r,l", [flag], dtype=gl.int32,
                                  is_pure=False, pack=1)
        gl.thread_barrier()
        gl.atomic_xchg(flag, 1, sem="release", scope="gpu")

    @gluon.jit
    def _chunk_scale(g_c, j_c):
        """m = 2^floor(log2 e^{g_0}) within [2^-60, 1], g_0 = g_c[0] the chunk's first log-decay
        (`chunk_jit._chunk_scale`)."""
        g0 = gl.sum(gl.where(j_c == 0, g_c, 0.0), axis=0)
        return gl.exp2(gl.minimum(gl.maximum(gl.floor(g0 * 1.4426950408889634), -60.0), 0.0))

    @gluon.jit
    def _store_w(T, gam, bi, rk_r, g_c, j_c, k_st, Wbuf, bos, c0, seq_len, i_hv, HV, K: gl.constexpr,
                 C: gl.constexpr, MC: gl.constexpr):
        """W / m = (T diag(beta rk gamma / m)) K of one chunk into its rows of Wbuf [Ttot, HV, K] (the rows past the
        sequence left alone): the column-scaled T as a 16-bit left operand against the raw keys in k_st; m as
        `_chunk_scale`."""
        dt: gl.constexpr = k_st.dtype
        MK: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
        COL_C: gl.constexpr = gl.SliceLayout(0, MC)
        m = _chunk_scale(g_c, j_c)
        s_w = gl.convert_layout(bi * rk_r * gam, COL_C) / m
        t_op = gl.convert_layout((T * gl.expand_dims(s_w, 0)).to(dt),
                                 gl.DotOperandLayout(operand_index=0, parent=MK, k_width=2))
        W = warpgroup_mma(t_op, k_st, gl.zeros([C, K], gl.float32, MK), use_acc=False)
        LS: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        Wl = gl.convert_layout(W.to(Wbuf.dtype.element_ty), LS)
        r = gl.arange(0, C, layout=gl.SliceLayout(1, LS))
        c = gl.arange(0, K, layout=gl.SliceLayout(0, LS))
        p = Wbuf + ((bos + c0 + r).to(gl.int64) * HV + i_hv) * K
        gl.store(gl.expand_dims(p, 1) + gl.expand_dims(c, 0), Wl, mask=gl.expand_dims(c0 + r < seq_len, 1))

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _store_bwd_rows(rows, g_c, rq, rk_r, valid, i_c, j_c, C: gl.constexpr, MC: gl.constexpr):
        """The backward chain's gate rows of one chunk (what `state_pass._bwd_gate_rows` computes from q, k and g)
        into rows [4, C] fp32: qs / m = e^b rq / m (rq with the scale), sk = rk e^{bL - b}, e^{bL} / m in every
        column, and m on the sequence's tokens (rows 0, 1 and 3 zero past them). b is an fp64 running sum and
        bL - b its fp64 difference from the total, as exact as `chunk_jit._cum_split`'s masked sums: fp32 running
        sums would carry |b| x 6e-8 into the factors' exponents under strong decay. A scan of the C log-decays, not
        a [C, C] masked sum, so the training solve keeps its registers (a masked fp64 sum took 45 more a thread)."""
        ROW_C: gl.constexpr = gl.SliceLayout(1, MC)
        SCAN: gl.constexpr = gl.BlockedLayout([2], [32], [gl.num_warps()], [0])  # a warp's lanes hold all C
        g64 = gl.convert_layout(g_c, SCAN).to(gl.float64)
        tot = gl.sum(g64, axis=0)
        b64 = gl.convert_layout(gl.associative_scan(g64, 0, _add), ROW_C)
        m = _chunk_scale(g_c, j_c)
        gl.store(rows + i_c, gl.where(valid, gl.exp(b64.to(gl.float32)) * rq / m, 0.0))
        gl.store(rows + C + i_c, gl.where(valid, gl.exp((tot - b64).to(gl.float32)) * rk_r, 0.0))
        gl.store(rows + 2 * C + i_c, gl.zeros_like(rk_r) + gl.exp(tot.to(gl.float32)) / m)
        gl.store(rows + 3 * C + i_c, gl.where(valid, m, 0.0))

    @gluon.jit
    def _gdn_solve_kernel(
        q, k, g, beta, Tbuf, Gbuf, cu, chunk_off, flags, scale, H, HV,
        K: gl.constexpr, C: gl.constexpr, R: gl.constexpr, L2: gl.constexpr, FLAG: gl.constexpr,
    ):
        """T diag(beta) and the gate rows of every chunk, in parallel: grid (sequences x HV, most chunks of a
        sequence), heads first, so that programs start in chunk order. Chunk c of sequence n and value head hv is
        slot (chunk_off[n] + c) * HV + hv: Tbuf [slots, C, C] (q's dtype), Gbuf [slots, R, C] fp32 (R = GATE_ROWS).
        q, k: [Ttot, H, K]; g, beta: [Ttot, HV]; tokens past the sequence get g = beta = 0 (unit rows of T, zero
        weight in the chain). FLAG: flags[slot] (int32) is set to 1 once the slot is written, for a chain that runs
        beside this launch."""
        _solve_body(q, k, g, beta, Tbuf, Gbuf, cu, chunk_off, flags, scale, H, HV, Tbuf, Tbuf, Gbuf, K, C, R, L2,
                    FLAG, False)

    @gluon.jit
    def _gdn_solve_train_kernel(
        q, k, g, beta, Tbuf, Gbuf, Tsave, Wbuf, Gsave, cu, chunk_off, flags, scale, H, HV,
        K: gl.constexpr, C: gl.constexpr, R: gl.constexpr, L2: gl.constexpr, FLAG: gl.constexpr,
    ):
        """`_gdn_solve_kernel` for a training forward: also the plain T into Tsave [slots, C, C], W / m =
        T diag(beta rk gamma / m) K (m: the chunk's power-of-two scale, `chunk_jit._chunk_scale`) into Wbuf
        [Ttot, HV, K] (q's dtype), what the Triton forward keeps for the backward (`wy._wu_fwd`), and the backward
        chain's gate rows into Gsave [slots, 4, C] fp32 (`_store_bwd_rows`). FLAG: flags[slot] set once the slot's
        Tbuf and Gbuf rows are written, for a training chain beside this launch."""
        _solve_body(q, k, g, beta, Tbuf, Gbuf, cu, chunk_off, flags, scale, H, HV, Tsave, Wbuf, Gsave, K, C, R, L2,
                    FLAG, True)

    @gluon.jit
    def _solve_body(q, k, g, beta, Tbuf, Gbuf, cu, chunk_off, flags, scale, H, HV, Tsave, Wbuf, Gsave,
                    K: gl.constexpr, C: gl.constexpr, R: gl.constexpr, L2: gl.constexpr, FLAG: gl.constexpr,
                    SAVE: gl.constexpr):
        """The solve of one program (`_gdn_solve_kernel`); SAVE: also Tsave, Wbuf and Gsave
        (`_gdn_solve_train_kernel`)."""
        i_nh = gl.program_id(0)
        i_c0 = gl.program_id(1)
        i_n = i_nh // HV
        i_hv = i_nh % HV
        i_h = i_hv // (HV // H)
        bos = gl.load(cu + i_n)
        seq_len = gl.load(cu + i_n + 1) - bos
        c0 = i_c0 * C
        if c0 < seq_len:
            dt: gl.constexpr = k.dtype.element_ty
            MC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, C, 8])
            MC16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, C, 16])
            ROW_C: gl.constexpr = gl.SliceLayout(1, MC)
            COL_C: gl.constexpr = gl.SliceLayout(0, MC)
            SL_T: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2,
                                                      transposed=True)
            SL_QK: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, K], dt)
            PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
            k_st = gl.allocate_shared_memory(dt, [C, K], SL_QK)
            if L2:  # q is read once, by Q Q^T, before `plain` is first written: one buffer serves both
                q_st = gl.allocate_shared_memory(dt, [C, K], SL_QK)
                plain = q_st._reinterpret(gl.float32, [C, C], PLAIN2)
                m_t = gl.allocate_shared_memory(gl.float16, [C, C], gl.NVMMASharedLayout.get_default_for([C, C],
                                                                                                           gl.float16))
            else:
                m_t = gl.allocate_shared_memory(gl.float32, [C, C], SL_T)
                plain = gl.allocate_shared_memory(gl.float32, [C, C], PLAIN2)
            d3 = gl.allocate_shared_memory(gl.float32, [C, 16], PLAIN2)
            i_c = gl.arange(0, C, layout=ROW_C)
            j_c = gl.arange(0, C, layout=COL_C)

            _issue_rows(k, k_st, bos, c0, seq_len, i_h, H, K, C)
            if L2:
                _issue_rows(q, q_st, bos, c0, seq_len, i_h, H, K, C)
            async_copy.commit_group()
            g_c = gl.load(g + (bos + c0 + j_c).to(gl.int64) * HV + i_hv, mask=c0 + j_c < seq_len,
                          other=0.0).to(gl.float32)
            bi = gl.load(beta + (bos + c0 + i_c).to(gl.int64) * HV + i_hv, mask=c0 + i_c < seq_len,
                         other=0.0).to(gl.float32)
            async_copy.wait_group(0)
            gl.thread_barrier()
            causal = gl.expand_dims(i_c, 1) >= gl.expand_dims(j_c, 0)
            b_r = gl.sum(gl.where(causal, gl.expand_dims(g_c, 0), 0.0), axis=1)
            b_c = gl.convert_layout(b_r, COL_C)
            b_last = gl.sum(gl.where(i_c == C - 1, b_r, 0.0), axis=0)
            fence_async_shared()
            kk = gl.convert_layout(_mma(k_st, k_st.permute((1, 0)), gl.zeros([C, C], gl.float32, MC16), False), MC)
            if L2:  # the squared norms are the diagonals of K K^T and Q Q^T
                qq = gl.convert_layout(_mma(q_st, q_st.permute((1, 0)), gl.zeros([C, C], gl.float32, MC16), False),
                                       MC)
                rq = gl.rsqrt(_diagonal(qq, i_c, j_c) + 1e-6) * scale
                rk_r = gl.rsqrt(_diagonal(kk, i_c, j_c) + 1e-6)
                rk_c = gl.convert_layout(rk_r, COL_C)
            else:
                rq = gl.full([C], 1.0, gl.float32, ROW_C) * scale
                rk_r = gl.full([C], 1.0, gl.float32, ROW_C)
                rk_c = gl.full([C], 1.0, gl.float32, COL_C)
            slot = (gl.load(chunk_off + i_n) + i_c0).to(gl.int64) * HV + i_hv
            if SAVE:  # here, not with T and W: the scan's values then die before the inverse's products
                _store_bwd_rows(Gsave + slot * 4 * C, g_c, rq, rk_r, c0 + i_c < seq_len, i_c, j_c, C, MC)
            lower = gl.expand_dims(i_c, 1) > gl.expand_dims(j_c, 0)
            diff = gl.expand_dims(b_r, 1) - gl.expand_dims(b_c, 0)
            A = kk * gl.exp(gl.where(lower, diff, float("-inf"))) * gl.expand_dims(bi * rk_r, 1) \
                * gl.expand_dims(rk_c, 0)
            if L2:  # fp16 products: |A| <= beta bounds Td, N and N^2 far inside fp16's range
                T = _t_matrix(A, plain, d3, m_t, i_c, j_c, C, MC, MC16,
                              gl.DotOperandLayout(operand_index=0, parent=MC16, k_width=2))
            else:  # raw keys bound nothing: tf32
                T = _t_matrix(A, plain, d3, m_t, i_c, j_c, C, MC, MC,
                              gl.DotOperandLayout(operand_index=0, parent=MC, k_width=1))
            if SAVE:
                gl.store(Tsave + slot * C * C + gl.expand_dims(i_c, 1) * C + gl.expand_dims(j_c, 0),
                         T.to(Tsave.dtype.element_ty))
                _store_w(T, gl.exp(b_r), bi, rk_r, g_c, j_c, k_st, Wbuf, bos, c0, seq_len, i_hv, HV, K, C, MC)
            T = T * gl.expand_dims(gl.convert_layout(bi, COL_C), 0)
            p_t = gl.expand_dims(i_c, 1) * C + gl.expand_dims(j_c, 0)
            gl.store(Tbuf + slot * C * C + p_t, T.to(Tbuf.dtype.element_ty))
            gam = gl.exp(b_r)
            rows = Gbuf + slot * R * C + i_c
            gl.store(rows, b_r)
            gl.store(rows + C, gam * rk_r)
            gl.store(rows + 2 * C, gl.exp(b_last - b_r) * rk_r)
            gl.store(rows + 3 * C, gam * rq)
            gl.store(rows + 4 * C, rq)
            gl.store(rows + 5 * C, rk_r)
            gl.store(rows + 6 * C, gl.full([C], 1.0, gl.float32, ROW_C) * gl.exp(b_last))
            if FLAG:
                _publish(flags + slot)
