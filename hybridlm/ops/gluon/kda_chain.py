"""The state chain of the Gluon KDA forward: one program per (value block of 64, sequence x value head) walks its
sequence in 64-token chunks, the state in registers, in two warpgroups (`gl.warp_specialize`), as the GDN chain
(`chain.py`) does.

Non-standard here: the chain computes none of the per-channel decay products. The Triton KDA prep
(`triton/kda_prep.py`, its bounded decay forms by chunk) has already written, per chunk and value head,
Qg = scale Q^ e^b, Kd = K^ e^{bL - b}, W = T diag(beta) (K^ e^b), U = T diag(beta) V, P (the causal decayed Q K^T,
scale in it) and bL, so every product the chain runs is a plain matmul of 16-bit operands with fp32 accumulation:
    Vn^T = U^T - S^T W^T                            (state warpgroup; columns past the sequence zeroed)
    S^T  = S^T diag(e^{bL}) + Vn^T Kd               (state warpgroup; the fp32 state stays in registers)
    O    = Qg S + P Vn                              (output warpgroup, from the hand-over of S^T and Vn^T)
The per-channel decay of the state is a scale of S^T's columns. Rows past a sequence's end come in by TMA from the
next sequence (or as zeros past the tensor): Vn's columns there are zeroed before the hand-over and the update, so
W's and Kd's rows there weigh nothing; P's columns there are zero (the prep loads them masked), and those output
rows are never stored.
Barriers (two of each, chunk n uses slot n % 2): ld[s] (the TMA of a chunk's inputs landed), hand[s] (the state
warpgroup stored S^T and Vn^T), done[s] (both warpgroups are done with the slot; the load warp waits on it before
loading chunk n + 2, the state warpgroup before handing chunk n + 2 over).
"""

from __future__ import annotations

from .parts import _IMPORT_ERROR, _chain_program, gl, gluon

if _IMPORT_ERROR is None:
    from .parts import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

CHUNK = 64

if _IMPORT_ERROR is None:

    @gluon.jit
    def _kda_loads(qg_desc, kd_desc, w_desc, u_desc, p_desc, bos, seq_len, t_first, i_hv, HV, k_col, v_col,
                   qg_st, kd_st, w_st, u_st, p_st, ld, done, C: gl.constexpr):
        """Worker partition (one warp): each chunk's Qg, Kd, W, U rows and P by TMA into slot n % 2 once both
        warpgroups are done with chunk n - 2 there."""
        nbytes: gl.constexpr = (3 * qg_desc.block_type.nbytes + u_desc.block_type.nbytes
                                + p_desc.block_type.nbytes)
        for c0 in range(0, seq_len, C):
            n = c0 // C
            buf = n % 2
            slot = (t_first + n) * HV + i_hv
            bar = ld.index(buf)
            mbarrier.wait(done.index(buf), ((n // 2) & 1) ^ 1)
            mbarrier.expect(bar, nbytes)
            tok = bos + c0
            tma.async_copy_global_to_shared(qg_desc, [tok, k_col], bar, qg_st.index(buf))
            tma.async_copy_global_to_shared(kd_desc, [tok, k_col], bar, kd_st.index(buf))
            tma.async_copy_global_to_shared(w_desc, [tok, k_col], bar, w_st.index(buf))
            tma.async_copy_global_to_shared(u_desc, [tok, v_col], bar, u_st.index(buf))
            tma.async_copy_global_to_shared(p_desc, [slot * C, 0], bar, p_st.index(buf))

    @gluon.jit
    def _kda_state(bl, h0, ht, row, seq_len, t_first, i_hv, HV, col0, kd_st, w_st, u_st, hs, hv, ld, hand, done,
                   K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr,
                   HAS_H0: gl.constexpr, STORE_HT: gl.constexpr):
        """Default partition: the state path, and the hand-over of S^T and Vn^T a chunk."""
        dt: gl.constexpr = w_st.dtype
        MS: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
        MT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
        A_T: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MT, k_width=2)
        A_S: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MS, k_width=2)
        r_v = gl.arange(0, BV, layout=gl.SliceLayout(1, MS))
        c_k = gl.arange(0, K, layout=gl.SliceLayout(0, MS))
        j_c = gl.arange(0, C, layout=gl.SliceLayout(0, MT))
        if HAS_H0:
            St = gl.load(h0 + (row * HV + i_hv) * K * V + col0 + (gl.expand_dims(c_k, 0) * V + gl.expand_dims(r_v, 1)))
        else:
            St = gl.zeros([BV, K], gl.float32, MS)
        for c0 in range(0, seq_len, C):
            n = c0 // C
            buf = n % 2
            # e^{bL} per key channel, loaded before the waits so that its latency hides behind them
            slot = (t_first + n) * HV + i_hv
            decay = gl.exp(gl.load(bl + slot.to(gl.int64) * K + c_k))
            mbarrier.wait(done.index(1 - buf), (((n + 1) // 2) & 1) ^ 1, pred=c0 + C < seq_len)
            mbarrier.wait(ld.index(buf), (n // 2) & 1)
            zt = gl.zeros([BV, C], gl.float32, MT)

            # S^T W^T from S^T in 16 bits, which is also the output partition's copy of the state
            s16 = St.to(dt)
            s_op = gl.convert_layout(s16, A_T)
            sw = warpgroup_mma(s_op, w_st.index(buf).permute((1, 0)), zt, use_acc=False, is_async=True)
            hs.index(buf).store(s16)

            # Vn^T = U^T - S^T W^T, zero in the columns of tokens past the sequence
            ut = u_st.index(buf).permute((1, 0)).load(MT).to(gl.float32)
            sw, s_op = warpgroup_mma_wait(0, deps=[sw, s_op])
            vn = gl.where(gl.expand_dims(c0 + j_c < seq_len, 0), ut - sw, 0.0).to(dt)
            hv.index(buf).store(vn)
            fence_async_shared()
            gl.thread_barrier()  # every thread's stores fenced before the one arrival
            mbarrier.arrive(hand.index(buf), count=1)

            # S^T = S^T diag(e^{bL}) + Vn^T Kd
            v_op = gl.convert_layout(vn, A_S)
            St = warpgroup_mma(v_op, kd_st.index(buf), St * gl.expand_dims(decay, 0), use_acc=True)
            gl.thread_barrier()  # every warp of this partition is past its reads of the slot
            mbarrier.arrive(done.index(buf), count=1)
        if STORE_HT:
            ht_tile = ht + ((row * HV + i_hv) * K * V + col0)
            gl.store(ht_tile + (gl.expand_dims(r_v, 1) + gl.expand_dims(c_k * V, 0)), St)

    @gluon.jit
    def _kda_output(o_desc, o, bos, seq_len, i_hv, HV, col0, v_col, qg_st, p_st, hs, hv, o_st, ld, hand, done,
                    K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr):
        """Worker partition: O = Qg S + P Vn of every chunk, from the state partition's hand-over."""
        dt: gl.constexpr = qg_st.dtype
        MO: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
        LST: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        for c0 in range(0, seq_len, C):
            n = c0 // C
            buf = n % 2
            mbarrier.wait(ld.index(buf), (n // 2) & 1)
            mbarrier.wait(hand.index(buf), (n // 2) & 1)
            zo = gl.zeros([C, BV], gl.float32, MO)
            qs = warpgroup_mma(qg_st.index(buf), hs.index(buf).permute((1, 0)), zo, use_acc=False, is_async=True)
            out = warpgroup_mma(p_st.index(buf), hv.index(buf).permute((1, 0)), qs, use_acc=True, is_async=True)
            out = warpgroup_mma_wait(0, deps=[out])
            gl.thread_barrier()  # every warp is past its reads of the slot and the hand-over
            mbarrier.arrive(done.index(buf), count=1)

            tma.store_wait(0)  # the previous chunk's store has read o_st
            gl.thread_barrier()
            o_st.store(out.to(dt))
            fence_async_shared()
            gl.thread_barrier()  # every thread's part of o_st written before the one TMA store
            if c0 + C <= seq_len:
                tma.async_copy_shared_to_global(o_desc, [bos + c0, v_col], o_st)
            else:  # a whole-chunk store would write into the next sequence's rows
                t_o = gl.arange(0, C, layout=gl.SliceLayout(1, LST))
                c_o = gl.arange(0, BV, layout=gl.SliceLayout(0, LST))
                o_chunk = o + ((bos + c0).to(gl.int64) * HV + i_hv) * V + col0
                gl.store(o_chunk + gl.expand_dims(t_o * (HV * V), 1) + gl.expand_dims(c_o, 0), o_st.load(LST),
                         mask=gl.expand_dims(c0 + t_o < seq_len, 1))
        tma.store_wait(0)

    @gluon.jit
    def _kda_chain_kernel(
        qg_desc, kd_desc, w_desc, u_desc, p_desc, o_desc, o, bl, h0, ht, rows, cu, chunk_off, HV,
        K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr,
        HAS_H0: gl.constexpr, STORE_HT: gl.constexpr, POOL: gl.constexpr,
    ):
        """Grid (V / BV, sequences x HV); launched with 4 warps, the output partition adds 4 more and the loads one.
        Descriptors (`kda_fwd._descriptors`): Qg, Kd, W over [Ttot, HV * K] in [C, K] boxes; U, o over
        [Ttot, HV * V] in [C, BV] boxes; P over [chunks * HV * C, C]. bl: [chunks, HV, K] fp32; o: [Ttot, HV, V]
        (the masked stores); h0, ht: [N, HV, K, V] fp32; cu, chunk_off: [N + 1] int32. POOL: h0 and ht are one
        state pool [P, HV, K, V] and sequence n reads and writes its row rows[n] (int32 [N]); each program touches
        only its own [K, BV] slice of that row, read first and written last, so the update in place is safe."""
        # every prepped tensor is per value head: the key head of _chain_program is not used
        i_v, i_n, i_hv, i_h, bos, seq_len, t_first, row = _chain_program(cu, chunk_off, rows, HV, HV, POOL)
        dt: gl.constexpr = o.dtype.element_ty
        col0 = i_v * BV
        v_col = i_hv * V + col0

        SL_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BV, K], dt)
        SL_V: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BV, C], dt)
        qg_st = gl.allocate_shared_memory(dt, [2, C, K], qg_desc.layout)
        kd_st = gl.allocate_shared_memory(dt, [2, C, K], kd_desc.layout)
        w_st = gl.allocate_shared_memory(dt, [2, C, K], w_desc.layout)
        u_st = gl.allocate_shared_memory(dt, [2, C, BV], u_desc.layout)
        p_st = gl.allocate_shared_memory(dt, [2, C, C], p_desc.layout)
        hs = gl.allocate_shared_memory(dt, [2, BV, K], SL_S)  # S^T of two chunks
        hv = gl.allocate_shared_memory(dt, [2, BV, C], SL_V)  # Vn^T of two chunks
        o_st = gl.allocate_shared_memory(dt, [C, BV], o_desc.layout)
        ld = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        hand = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2):
            mbarrier.init(ld.index(s), count=1)
            mbarrier.init(hand.index(s), count=1)
            mbarrier.init(done.index(s), count=2)  # the state and the output partition
        gl.warp_specialize([
            (_kda_state, (bl, h0, ht, row, seq_len, t_first, i_hv, HV, col0, kd_st, w_st, u_st, hs, hv, ld, hand,
                          done, K, V, BV, C, HAS_H0, STORE_HT)),
            (_kda_output, (o_desc, o, bos, seq_len, i_hv, HV, col0, v_col, qg_st, p_st, hs, hv, o_st, ld, hand,
                           done, K, V, BV, C)),
            (_kda_loads, (qg_desc, kd_desc, w_desc, u_desc, p_desc, bos, seq_len, t_first, i_hv, HV, i_hv * K,
                          v_col, qg_st, kd_st, w_st, u_st, p_st, ld, done, C)),
        ], [4, 1], [168, 40])
        for s in gl.static_range(2):
            mbarrier.invalidate(ld.index(s))
            mbarrier.invalidate(hand.index(s))
            mbarrier.invalidate(done.index(s))
