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
The slots, barriers and hand-over buffers are the GDN chain's (`parts._chain_shared`), Vn^T in the place of V'^T.
"""

from __future__ import annotations

from .parts import _IMPORT_ERROR, _chain_program, gl, gluon

if _IMPORT_ERROR is None:
    from .parts import (
        _arrive,
        _chain_invalidate,
        _chain_shared,
        _hand_over,
        _issue_st_product,
        _state_ptrs,
        _store_out,
        _wait_chunk,
        _wait_free,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

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
            _wait_free(done, n)
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
        c_k = gl.arange(0, K, layout=gl.SliceLayout(0, MS))
        j_c = gl.arange(0, C, layout=gl.SliceLayout(0, MT))
        if HAS_H0:
            St = gl.load(_state_ptrs(h0, row, i_hv, HV, col0, K, V, BV, MS))
        else:
            St = gl.zeros([BV, K], gl.float32, MS)
        for c0 in range(0, seq_len, C):
            n = c0 // C
            buf = n % 2
            # e^{bL} per key channel, loaded before the waits so that its latency hides behind them
            slot = (t_first + n) * HV + i_hv
            decay = gl.exp(gl.load(bl + slot.to(gl.int64) * K + c_k))
            # hand-over slot 1 - buf is free once the output partition is done with chunk n - 1
            _wait_free(done, n + 1, pred=c0 + C < seq_len)
            _wait_chunk(ld, n)
            zt = gl.zeros([BV, C], gl.float32, MT)

            sw, s_op = _issue_st_product(St, w_st.index(buf), hs.index(buf), zt, A_T)  # S^T W^T

            # Vn^T = U^T - S^T W^T, zero in the columns of tokens past the sequence
            ut = u_st.index(buf).permute((1, 0)).load(MT).to(gl.float32)
            sw, s_op = warpgroup_mma_wait(0, deps=[sw, s_op])
            vn = gl.where(gl.expand_dims(c0 + j_c < seq_len, 0), ut - sw, 0.0).to(dt)
            _hand_over(hv.index(buf), vn, hand.index(buf))

            # S^T = S^T diag(e^{bL}) + Vn^T Kd
            v_op = gl.convert_layout(vn, A_S)
            St = warpgroup_mma(v_op, kd_st.index(buf), St * gl.expand_dims(decay, 0), use_acc=True)
            _arrive(done.index(buf))
        if STORE_HT:
            gl.store(_state_ptrs(ht, row, i_hv, HV, col0, K, V, BV, MS), St)

    @gluon.jit
    def _kda_output(o_desc, o, bos, seq_len, i_hv, HV, col0, v_col, qg_st, p_st, hs, hv, o_st, ld, hand, done,
                    K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr):
        """Worker partition: O = Qg S + P Vn of every chunk, from the state partition's hand-over."""
        MO: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
        for c0 in range(0, seq_len, C):
            n = c0 // C
            buf = n % 2
            _wait_chunk(ld, n)
            _wait_chunk(hand, n)
            zo = gl.zeros([C, BV], gl.float32, MO)
            qs = warpgroup_mma(qg_st.index(buf), hs.index(buf).permute((1, 0)), zo, use_acc=False, is_async=True)
            out = warpgroup_mma(p_st.index(buf), hv.index(buf).permute((1, 0)), qs, use_acc=True, is_async=True)
            out = warpgroup_mma_wait(0, deps=[out])
            _arrive(done.index(buf))
            _store_out(o_desc, o, o_st, out, bos, c0, seq_len, i_hv, HV, col0, v_col, V, BV, C)
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

        qg_st = gl.allocate_shared_memory(dt, [2, C, K], qg_desc.layout)
        kd_st = gl.allocate_shared_memory(dt, [2, C, K], kd_desc.layout)
        w_st = gl.allocate_shared_memory(dt, [2, C, K], w_desc.layout)
        u_st = gl.allocate_shared_memory(dt, [2, C, BV], u_desc.layout)
        p_st = gl.allocate_shared_memory(dt, [2, C, C], p_desc.layout)
        hs, hv, o_st, ld, hand, done = _chain_shared(dt, o_desc, K, BV, C)
        gl.warp_specialize([
            (_kda_state, (bl, h0, ht, row, seq_len, t_first, i_hv, HV, col0, kd_st, w_st, u_st, hs, hv, ld, hand,
                          done, K, V, BV, C, HAS_H0, STORE_HT)),
            (_kda_output, (o_desc, o, bos, seq_len, i_hv, HV, col0, v_col, qg_st, p_st, hs, hv, o_st, ld, hand,
                           done, K, V, BV, C)),
            (_kda_loads, (qg_desc, kd_desc, w_desc, u_desc, p_desc, bos, seq_len, t_first, i_hv, HV, i_hv * K,
                          v_col, qg_st, kd_st, w_st, u_st, p_st, ld, done, C)),
        ], [4, 1], [168, 40])
        _chain_invalidate(ld, hand, done)
