"""The transposed state chain of the Gluon GDN forward (chain "t" of `gdn_fwd`): the state kept as S^T in
registers, so that every state-path product takes a register operand (wgmma's A) and nothing of the state path
goes through shared memory; q, k, v and T by TMA. The math and the measured times are in gdn_fwd's docstring.
"""

from __future__ import annotations

import torch

from .parts import _IMPORT_ERROR, _chain_program, _row_norms, _split_operand, _split_store, gl, gluon

if _IMPORT_ERROR is None:
    from .parts import TensorDescriptor, fence_async_shared, mbarrier, tma, warpgroup_mma

CHUNK = 64

if _IMPORT_ERROR is None:

    @gluon.jit
    def _tma_chunk(q_desc, k_desc, v_desc, t_desc, bar, q_s, k_s, v_s, t_hi, t_lo, tok, qk_col, v_col, t_row,
                   pred, C: gl.constexpr):
        """One chunk's q, k, v rows and T (hi, lo) by TMA into one buffer set, completing on `bar`. Rows past the
        sequence are the next sequence's (or zeros past the tensor): every product the chain keeps gives them
        weight zero (beta and g are loaded masked, so their T rows are unit rows and their V' rows zero)."""
        nbytes: gl.constexpr = 2 * q_desc.block_type.nbytes + v_desc.block_type.nbytes + 2 * t_desc.block_type.nbytes
        mbarrier.expect(bar, nbytes, pred=pred)
        tma.async_copy_global_to_shared(q_desc, [tok, qk_col], bar, q_s, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [tok, qk_col], bar, k_s, pred=pred)
        tma.async_copy_global_to_shared(v_desc, [tok, v_col], bar, v_s, pred=pred)
        tma.async_copy_global_to_shared(t_desc, [t_row, 0], bar, t_hi, pred=pred)
        tma.async_copy_global_to_shared(t_desc, [t_row + C, 0], bar, t_lo, pred=pred)

    @gluon.jit
    def _gdn_chain_t_kernel(
        q_desc, k_desc, v_desc, t_desc, Bbuf, o, h0, ht, rows, cu, chunk_off, scale, H, HV,
        K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr,
        L2: gl.constexpr, HAS_H0: gl.constexpr, STORE_HT: gl.constexpr, OUTPUT: gl.constexpr, POOL: gl.constexpr,
    ):
        """The state chain with the state kept transposed, S^T [BV, K] in fp32 registers, so that every product on
        the state path takes a register operand (S^T, R^T, V'^T, U^T as 16-bit hi + lo, wgmma's A) against q, k,
        T and P in shared memory: S, R, V' and U never go through shared memory. Per chunk, with Kn, Qn the
        normalised keys and queries (scale in Qn), gamma = e^b:
            R^T  = (V^T - (S^T K^T) diag(gamma rk)) diag(beta)
            V'^T = R^T T^T
            O^T  = (S^T Q^T) diag(gamma rq) + V'^T P^T,   P^T[j, i] = kn_j . qn_i e^{b_i - b_j}  (i >= j)
            S^T  = e^{b_last} S^T + (V'^T diag(rk e^{b_last - b})) K
        q, k, v arrive by TMA (descriptors over [Ttot, H * K] and [Ttot, HV * V]), T from the solve as 16-bit
        hi + lo rows (descriptor over Tbuf [chunks * HV * 2 * C, C]); BV == C == 64 (one warpgroup's M).
        Other arguments as `_gdn_chain_kernel`."""
        i_v, i_n, i_hv, i_h, bos, seq_len, t_first, row = _chain_program(cu, chunk_off, rows, H, HV, POOL)
        dt: gl.constexpr = o.dtype.element_ty

        # accumulators: S^T [BV, K]; every other product [BV, C] or [C, C], both [64, 64]
        MS: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
        MT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
        A_T: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MT, k_width=2)  # A of a [64, 64] result
        A_S: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MS, k_width=2)  # A of the [BV, K] update
        TOK: gl.constexpr = gl.SliceLayout(0, MT)  # along the columns: tokens i
        ROWJ: gl.constexpr = gl.SliceLayout(1, MT)  # along the rows of P^T: tokens j
        LST: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])

        SL_CC: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, C], dt)
        PLAIN1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        q_st = gl.allocate_shared_memory(dt, [2, C, K], q_desc.layout)
        k_st = gl.allocate_shared_memory(dt, [2, C, K], k_desc.layout)
        v_st = gl.allocate_shared_memory(dt, [2, C, BV], v_desc.layout)
        t_st = gl.allocate_shared_memory(dt, [4, C, C], t_desc.layout)  # T hi, lo of this chunk and the next
        p_st = gl.allocate_shared_memory(dt, [2, C, C], SL_CC)  # P^T hi, lo
        nq = gl.allocate_shared_memory(gl.float32, [C], PLAIN1)
        nk = gl.allocate_shared_memory(gl.float32, [C], PLAIN1)
        bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(bar.index(0), count=1)
        mbarrier.init(bar.index(1), count=1)

        i_t = gl.arange(0, C, layout=TOK)
        j_t = gl.arange(0, C, layout=ROWJ)
        col0 = i_v * BV
        qk_col = i_h * K
        v_col = i_hv * V + col0

        r_v = gl.arange(0, BV, layout=gl.SliceLayout(1, MS))
        c_k = gl.arange(0, K, layout=gl.SliceLayout(0, MS))
        if HAS_H0:
            St = gl.load(h0 + (row * HV + i_hv) * K * V + col0 + (gl.expand_dims(c_k, 0) * V + gl.expand_dims(r_v, 1)))
        else:
            St = gl.zeros([BV, K], gl.float32, MS)

        _tma_chunk(q_desc, k_desc, v_desc, t_desc, bar.index(0), q_st.index(0), k_st.index(0), v_st.index(0),
                   t_st.index(0), t_st.index(1), bos, qk_col, v_col, (t_first * HV + i_hv) * 2 * C, seq_len > 0, C)

        for c0 in range(0, seq_len, C):
            n = c0 // C
            buf = n % 2
            gl.thread_barrier()  # every read of the other buffer set (the chunk before) is done
            nxt = c0 + C
            _tma_chunk(q_desc, k_desc, v_desc, t_desc, bar.index(1 - buf), q_st.index(1 - buf), k_st.index(1 - buf),
                       v_st.index(1 - buf), t_st.index(2 - 2 * buf), t_st.index(3 - 2 * buf), bos + nxt, qk_col,
                       v_col, ((t_first + n + 1) * HV + i_hv) * 2 * C, nxt < seq_len, C)
            # the in-chunk cumulative log-decay from the solve, read here, not a chunk ahead: each [C] vector in the
            # product layout holds 16 registers a thread
            b_base = Bbuf + ((t_first + n) * HV + i_hv).to(gl.int64) * C
            b = gl.load(b_base + i_t)
            b_last = gl.load(b_base + C - 1)
            mbarrier.wait(bar.index(buf), (n // 2) % 2)
            qb = q_st.index(buf)
            kb = k_st.index(buf)
            if L2:
                _row_norms(qb, nq, K, C)
                _row_norms(kb, nk, K, C)
                rq = gl.rsqrt(nq.load(TOK) + 1e-6) * scale
                rk = gl.rsqrt(nk.load(TOK) + 1e-6)
            else:
                rq = gl.full([C], 1.0, gl.float32, TOK) * scale
                rk = gl.full([C], 1.0, gl.float32, TOK)
            zt = gl.zeros([BV, C], gl.float32, MT)
            kT = kb.permute((1, 0))
            qT = qb.permute((1, 0))

            # registers bound the order: each [C] vector in the product layout holds 16 registers a thread, so P^T
            # (no state needed) is built and stored first and the per-token scales are folded as soon as they can be
            if OUTPUT:
                kq = warpgroup_mma(kb, qT, zt, use_acc=False)  # [j, i] = k_j . q_i
                if L2:
                    rk_j = gl.rsqrt(nk.load(ROWJ) + 1e-6)
                else:
                    rk_j = gl.full([C], 1.0, gl.float32, ROWJ)
                causal = gl.expand_dims(j_t, 1) <= gl.expand_dims(i_t, 0)  # [j, i]: i >= j
                decay = gl.exp(gl.where(causal, gl.expand_dims(b, 0) - gl.expand_dims(gl.convert_layout(b, ROWJ), 1),
                                        float("-inf")))
                _split_store(kq * decay * gl.expand_dims(rk_j, 1) * gl.expand_dims(rq, 0), p_st.index(0),
                             p_st.index(1))
                qs_scale = gl.exp(b) * rq
            ks_scale = gl.exp(b) * rk
            u_scale = gl.exp(b_last - b) * rk
            s_hi = St.to(dt)
            s_op = gl.convert_layout(s_hi, A_T)
            ks = warpgroup_mma(s_op, kT, zt, use_acc=False)
            if OUTPUT:
                qs = warpgroup_mma(s_op, qT, zt, use_acc=False)
            s_op = gl.convert_layout((St - s_hi.to(gl.float32)).to(dt), A_T)
            ks = warpgroup_mma(s_op, kT, ks)
            if OUTPUT:
                qs = warpgroup_mma(s_op, qT, qs) * gl.expand_dims(qs_scale, 0)

            # 1. V'^T = R^T (T diag(beta))^T, R^T = V^T - (S^T K^T) diag(gamma rk)  (the solve folded beta into T)
            vt = v_st.index(buf).permute((1, 0)).load(MT).to(gl.float32)
            r_hi, r_lo = _split_operand(vt - ks * gl.expand_dims(ks_scale, 0), A_T, dt)
            t_hi = t_st.index(2 * buf).permute((1, 0))
            t_lo = t_st.index(2 * buf + 1).permute((1, 0))
            Vn = warpgroup_mma(r_hi, t_lo, warpgroup_mma(r_lo, t_hi, warpgroup_mma(r_hi, t_hi, zt, use_acc=False)))

            # 2. O^T = (S^T Q^T) diag(gamma rq) + V'^T P^T
            if OUTPUT:
                v_hi, v_lo = _split_operand(Vn, A_T, dt)
                fence_async_shared()
                out = warpgroup_mma(v_hi, p_st.index(0), qs)
                out = warpgroup_mma(v_hi, p_st.index(1), warpgroup_mma(v_lo, p_st.index(0), out))
                out_tc = gl.convert_layout(gl.permute(out.to(dt), (1, 0)), LST)  # [C, BV]
                t_o = gl.arange(0, C, layout=gl.SliceLayout(1, LST))
                c_o = gl.arange(0, BV, layout=gl.SliceLayout(0, LST))
                o_chunk = o + ((bos + c0).to(gl.int64) * HV + i_hv) * V + col0
                gl.store(o_chunk + gl.expand_dims(t_o * (HV * V), 1) + gl.expand_dims(c_o, 0), out_tc,
                         mask=gl.expand_dims(c0 + t_o < seq_len, 1))

            # 3. S^T = e^{b_last} S^T + U^T K, U^T = V'^T diag(rk e^{b_last - b})
            u_hi, u_lo = _split_operand(Vn * gl.expand_dims(u_scale, 0), A_S, dt)
            St = warpgroup_mma(u_lo, kb, warpgroup_mma(u_hi, kb, St * gl.exp(b_last)))

        mbarrier.invalidate(bar.index(0))
        mbarrier.invalidate(bar.index(1))
        if STORE_HT:
            # offsets written unlike the load's: identical ones would be shared with it and held, K * BV / 128
            # 32-bit registers a thread, across the whole loop
            ht_tile = ht + ((row * HV + i_hv) * K * V + col0)
            gl.store(ht_tile + (gl.expand_dims(r_v, 1) + gl.expand_dims(c_k * V, 0)), St)


def _descriptors(q, k, v, Tbuf, BV: int) -> tuple:
    """TMA descriptors of the chain: q and k as [Ttot, H * K] in [CHUNK, K] boxes, v as [Ttot, HV * V] in
    [CHUNK, BV] boxes, T (hi, lo) as [chunks * HV * 2 * CHUNK, CHUNK] rows."""
    K, V = q.shape[-1], v.shape[-1]
    dt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16

    def desc(x2, box):
        return TensorDescriptor.from_tensor(x2, box, gl.NVMMASharedLayout.get_default_for(box, dt))

    q2, k2 = q.reshape(-1, q.shape[-2] * K), k.reshape(-1, k.shape[-2] * K)
    return (desc(q2, [CHUNK, K]), desc(k2, [CHUNK, K]), desc(v.reshape(-1, v.shape[-2] * V), [CHUNK, BV]),
            desc(Tbuf.reshape(-1, CHUNK), [CHUNK, CHUNK]))
