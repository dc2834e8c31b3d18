"""The transposed state chain with its output in a second warpgroup (chain "ws" of `gdn_fwd`, not yet run on a GPU).

Chain "t" holds the state path and the output products in one warpgroup and spills (the state path alone takes 249
registers a thread). Here the default partition (4 warps) runs the state path of chain "t" and hands each chunk's
S^T (before its update) and V'^T over through shared memory as 16-bit hi + lo; a worker partition (4 warps) builds
P = (Qn Kn^T) * e^{b_i - b_j} (i >= j) in registers and writes O = (Qn S) diag(gamma) + P V' with P as the register
A operand. Barriers, two slots each (chunk n uses slot n % 2):
- ld[s]: the TMA of a chunk's q, k, v, T (hi, lo) landed; both partitions wait on it.
- hand[s]: the state partition stored S^T and V'^T of the chunk (fenced for the async proxy).
- done[s]: the output partition is done with the chunk's inputs and hand-over; the state partition waits on it
  before it loads chunk n + 2 into the slot or hands chunk n + 2 over (a fresh barrier's phase 1 passes at once).
"""

from __future__ import annotations

from .chain_t import _tma_chunk
from .parts import _IMPORT_ERROR, _chain_program, _row_norms, _split_operand, gl, gluon

if _IMPORT_ERROR is None:
    from .parts import fence_async_shared, mbarrier, warpgroup_mma

if _IMPORT_ERROR is None:

    @gluon.jit
    def _ws_state(q_desc, k_desc, v_desc, t_desc, Bbuf, h0, ht, row, bos, seq_len, t_first, i_hv, HV, qk_col, v_col,
                  col0, q_st, k_st, v_st, t_st, hs, hv, nk, ld, hand, done,
                  K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr, L2: gl.constexpr,
                  HAS_H0: gl.constexpr, STORE_HT: gl.constexpr):
        """Default partition: the state path of chain "t", and the hand-over of S^T and V'^T a chunk."""
        dt: gl.constexpr = q_st.dtype
        MS: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
        MT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
        A_T: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MT, k_width=2)
        A_S: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MS, k_width=2)
        TOK: gl.constexpr = gl.SliceLayout(0, MT)
        i_t = gl.arange(0, C, layout=TOK)
        r_v = gl.arange(0, BV, layout=gl.SliceLayout(1, MS))
        c_k = gl.arange(0, K, layout=gl.SliceLayout(0, MS))
        if HAS_H0:
            St = gl.load(h0 + (row * HV + i_hv) * K * V + col0 + (gl.expand_dims(c_k, 0) * V + gl.expand_dims(r_v, 1)))
        else:
            St = gl.zeros([BV, K], gl.float32, MS)
        _tma_chunk(q_desc, k_desc, v_desc, t_desc, ld.index(0), q_st.index(0), k_st.index(0), v_st.index(0),
                   t_st.index(0), t_st.index(1), bos, qk_col, v_col, (t_first * HV + i_hv) * 2 * C, seq_len > 0, C)
        for c0 in range(0, seq_len, C):
            n = c0 // C
            buf = n % 2
            nxt = c0 + C
            gl.thread_barrier()  # every warp of this partition is past its reads of slot 1 - buf (chunk n - 1)
            # slot 1 - buf is free once the output partition is done with chunk n - 1
            mbarrier.wait(done.index(1 - buf), (((n + 1) // 2) & 1) ^ 1, pred=nxt < seq_len)
            _tma_chunk(q_desc, k_desc, v_desc, t_desc, ld.index(1 - buf), q_st.index(1 - buf), k_st.index(1 - buf),
                       v_st.index(1 - buf), t_st.index(2 - 2 * buf), t_st.index(3 - 2 * buf), bos + nxt, qk_col,
                       v_col, ((t_first + n + 1) * HV + i_hv) * 2 * C, nxt < seq_len, C)
            b_base = Bbuf + ((t_first + n) * HV + i_hv).to(gl.int64) * C
            b = gl.load(b_base + i_t)
            b_last = gl.load(b_base + C - 1)
            mbarrier.wait(ld.index(buf), (n // 2) & 1)
            kb = k_st.index(buf)
            if L2:
                _row_norms(kb, nk, K, C)
                rk = gl.rsqrt(nk.load(TOK) + 1e-6)
            else:
                rk = gl.full([C], 1.0, gl.float32, TOK)
            ks_scale = gl.exp(b) * rk
            u_scale = gl.exp(b_last - b) * rk
            zt = gl.zeros([BV, C], gl.float32, MT)

            # S^T as hi + lo: the register operands of S^T K^T, and the output partition's copy of the state
            s_hi = St.to(dt)
            s_lo = (St - s_hi.to(gl.float32)).to(dt)
            hs.index(2 * buf).store(s_hi)
            hs.index(2 * buf + 1).store(s_lo)
            kT = kb.permute((1, 0))
            ks = warpgroup_mma(gl.convert_layout(s_hi, A_T), kT, zt, use_acc=False)
            ks = warpgroup_mma(gl.convert_layout(s_lo, A_T), kT, ks)

            # V'^T = R^T (T diag(beta))^T, R^T = V^T - (S^T K^T) diag(gamma rk)
            vt = v_st.index(buf).permute((1, 0)).load(MT).to(gl.float32)
            r_hi, r_lo = _split_operand(vt - ks * gl.expand_dims(ks_scale, 0), A_T, dt)
            t_hi = t_st.index(2 * buf).permute((1, 0))
            t_lo = t_st.index(2 * buf + 1).permute((1, 0))
            Vn = warpgroup_mma(r_hi, t_lo, warpgroup_mma(r_lo, t_hi, warpgroup_mma(r_hi, t_hi, zt, use_acc=False)))
            v_hi = Vn.to(dt)
            hv.index(2 * buf).store(v_hi)
            hv.index(2 * buf + 1).store((Vn - v_hi.to(gl.float32)).to(dt))
            fence_async_shared()
            gl.thread_barrier()  # every thread's stores fenced before the one arrival
            mbarrier.arrive(hand.index(buf), count=1)

            # S^T = e^{b_last} S^T + U^T K, U^T = V'^T diag(rk e^{b_last - b})
            u_hi, u_lo = _split_operand(Vn * gl.expand_dims(u_scale, 0), A_S, dt)
            St = warpgroup_mma(u_lo, kb, warpgroup_mma(u_hi, kb, St * gl.exp(b_last)))
        if STORE_HT:
            ht_tile = ht + ((row * HV + i_hv) * K * V + col0)
            gl.store(ht_tile + (gl.expand_dims(r_v, 1) + gl.expand_dims(c_k * V, 0)), St)

    @gluon.jit
    def _ws_output(Bbuf, o, bos, seq_len, t_first, i_hv, HV, col0, scale, q_st, k_st, hs, hv, nq, nk, ld, hand, done,
                   K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr, L2: gl.constexpr):
        """Worker partition: O = (Qn S) diag(gamma) + P V' of every chunk, from the state partition's hand-over."""
        dt: gl.constexpr = q_st.dtype
        MO: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
        A_O: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MO, k_width=2)
        ROW: gl.constexpr = gl.SliceLayout(1, MO)  # tokens i (queries)
        COL: gl.constexpr = gl.SliceLayout(0, MO)  # tokens j (keys)
        LST: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        i_r = gl.arange(0, C, layout=ROW)
        j_c = gl.arange(0, C, layout=COL)
        t_o = gl.arange(0, C, layout=gl.SliceLayout(1, LST))
        c_o = gl.arange(0, BV, layout=gl.SliceLayout(0, LST))
        for c0 in range(0, seq_len, C):
            n = c0 // C
            buf = n % 2
            b_base = Bbuf + ((t_first + n) * HV + i_hv).to(gl.int64) * C
            b_i = gl.load(b_base + i_r)
            b_j = gl.load(b_base + j_c)
            mbarrier.wait(ld.index(buf), (n // 2) & 1)
            qb = q_st.index(buf)
            kb = k_st.index(buf)
            if L2:
                _row_norms(qb, nq, K, C)
                _row_norms(kb, nk, K, C)
                rq = gl.rsqrt(nq.load(ROW) + 1e-6) * scale
                rk = gl.rsqrt(nk.load(COL) + 1e-6)
            else:
                rq = gl.full([C], 1.0, gl.float32, ROW) * scale
                rk = gl.full([C], 1.0, gl.float32, COL)
            zo = gl.zeros([C, BV], gl.float32, MO)
            qk = warpgroup_mma(qb, kb.permute((1, 0)), zo, use_acc=False)  # [i, j] = q_i . k_j
            causal = gl.expand_dims(i_r, 1) >= gl.expand_dims(j_c, 0)
            decay = gl.exp(gl.where(causal, gl.expand_dims(b_i, 1) - gl.expand_dims(b_j, 0), float("-inf")))
            p_hi, p_lo = _split_operand(qk * decay * gl.expand_dims(rq, 1) * gl.expand_dims(rk, 0), A_O, dt)
            mbarrier.wait(hand.index(buf), (n // 2) & 1)
            s_hi = hs.index(2 * buf).permute((1, 0))  # [K, BV]
            s_lo = hs.index(2 * buf + 1).permute((1, 0))
            out = warpgroup_mma(qb, s_lo, warpgroup_mma(qb, s_hi, zo, use_acc=False))
            out = out * gl.expand_dims(gl.exp(b_i) * rq, 1)
            v_hi = hv.index(2 * buf).permute((1, 0))  # [C, BV]
            v_lo = hv.index(2 * buf + 1).permute((1, 0))
            out = warpgroup_mma(p_hi, v_lo, warpgroup_mma(p_lo, v_hi, warpgroup_mma(p_hi, v_hi, out)))
            gl.thread_barrier()  # every warp is past its reads of the slot and the hand-over
            mbarrier.arrive(done.index(buf), count=1)
            o_chunk = o + ((bos + c0).to(gl.int64) * HV + i_hv) * V + col0
            gl.store(o_chunk + gl.expand_dims(t_o * (HV * V), 1) + gl.expand_dims(c_o, 0),
                     gl.convert_layout(out.to(dt), LST), mask=gl.expand_dims(c0 + t_o < seq_len, 1))

    @gluon.jit
    def _gdn_chain_ws_kernel(
        q_desc, k_desc, v_desc, t_desc, Bbuf, o, h0, ht, rows, cu, chunk_off, scale, H, HV,
        K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr,
        L2: gl.constexpr, HAS_H0: gl.constexpr, STORE_HT: gl.constexpr, POOL: gl.constexpr,
    ):
        """Chain "ws": arguments and grid as `_gdn_chain_t_kernel` (always with its output); launched with 4 warps,
        the output partition adds 4 more."""
        i_v, i_n, i_hv, i_h, bos, seq_len, t_first, row = _chain_program(cu, chunk_off, rows, H, HV, POOL)
        dt: gl.constexpr = o.dtype.element_ty
        col0 = i_v * BV

        SL_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BV, K], dt)
        SL_V: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BV, C], dt)
        PLAIN1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        q_st = gl.allocate_shared_memory(dt, [2, C, K], q_desc.layout)
        k_st = gl.allocate_shared_memory(dt, [2, C, K], k_desc.layout)
        v_st = gl.allocate_shared_memory(dt, [2, C, BV], v_desc.layout)
        t_st = gl.allocate_shared_memory(dt, [4, C, C], t_desc.layout)
        hs = gl.allocate_shared_memory(dt, [4, BV, K], SL_S)  # S^T hi, lo of two chunks
        hv = gl.allocate_shared_memory(dt, [4, BV, C], SL_V)  # V'^T hi, lo of two chunks
        nk_s = gl.allocate_shared_memory(gl.float32, [C], PLAIN1)
        nq_o = gl.allocate_shared_memory(gl.float32, [C], PLAIN1)
        nk_o = gl.allocate_shared_memory(gl.float32, [C], PLAIN1)
        ld = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        hand = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2):
            mbarrier.init(ld.index(s), count=1)
            mbarrier.init(hand.index(s), count=1)
            mbarrier.init(done.index(s), count=1)
        gl.warp_specialize([
            (_ws_state, (q_desc, k_desc, v_desc, t_desc, Bbuf, h0, ht, row, bos, seq_len, t_first, i_hv, HV,
                         i_h * K, i_hv * V + col0, col0, q_st, k_st, v_st, t_st, hs, hv, nk_s, ld, hand, done,
                         K, V, BV, C, L2, HAS_H0, STORE_HT)),
            (_ws_output, (Bbuf, o, bos, seq_len, t_first, i_hv, HV, col0, scale, q_st, k_st, hs, hv, nq_o, nk_o,
                          ld, hand, done, K, V, BV, C, L2)),
        ], [4], [168])
        for s in gl.static_range(2):
            mbarrier.invalidate(ld.index(s))
            mbarrier.invalidate(hand.index(s))
            mbarrier.invalidate(done.index(s))
