"""The serial state-gradient chain of the GDN backward for Hopper in Gluon: what `state_pass._recur_bwd` computes
(GDN, 16-bit), one program per (value block of 64, sequence x value head) walking its sequence's 64-token chunks in
reverse, the state gradient in registers for the whole sequence.

Per chunk, with dS' the gradient of the state after the chunk (what the chunk backward reads as dS) and the row
scales of `state_pass._raw_row_scales` (qs = scale rq e^b, sk = rk e^{bL - b}) on the raw q, k rows:
    dVn = P^T dO + diag(sk) K dS'                     dS = e^{bL} dS' + Q^T diag(qs) dO - W^T dVn
(W is stored as W / m and the gate rows hold qs / m and e^{bL} / m, m the chunk's power-of-two scale
`chunk_jit._chunk_scale`; the chain multiplies its dS by m once the chunk's products are done.)
Non-standard here:
- The state gradient is kept transposed, dS^T [64, K] fp32, in one warpgroup's registers, so every product takes
  its left operand from registers (dS'^T, dO^T and dVn^T rounded to 16 bits: wgmma's A operand) against k^T, P, q
  and W in shared memory, with fp32 accumulation, as the Triton kernel's 16-bit path; dS stays fp32 between chunks.
  The transposed products:
      dVn^T = (dS'^T K^T) diag(sk) + dO^T P           dS^T = e^{bL} dS'^T + (dO^T diag(qs)) Q - dVn^T W
  The products with Q and P need no dS', so all three (K, Q, P) are in flight at once; the W product then
  accumulates onto the Q one: two dependent steps a chunk.
- W, q, k, dO, P and the chunk's gate rows (`state_pass._bwd_gate_rows`: qs, sk, e^{bL} and a token mask, written
  by a small Triton launch before) arrive by TMA into two slots, issued by a one-warp partition
  (`gl.warp_specialize`). Rows past the sequence are the next sequence's (or zeros past the tensor): dO's are
  masked, qs and sk are 0 there, P is causal, so no product the chain keeps gives them weight.
- dS' (16-bit, [chunks, HV, K, V]) and dVn (16-bit, [tokens, HV, V]) leave by TMA stores from shared memory,
  written there transposed (`gl.permute` of the registers, free); a sequence's last, partial chunk stores its dVn
  rows masked instead (a whole-chunk store would write the next sequence's rows).
Barriers, two of each (chunk n of the walk uses slot n % 2): ld[s], the TMA of a chunk landed; done[s], the state
warpgroup is done with the slot (the load warp waits on it before it loads chunk n + 2 there; a fresh barrier's
phase 1 passes at once).
"""

from __future__ import annotations

from .parts import _IMPORT_ERROR, _chain_program, gl, gluon

if _IMPORT_ERROR is None:
    from .chain import _gate_cols
    from .parts import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

CHUNK = 64
BV = 64  # value block of a program: one warpgroup's M (the transposed state gradient's rows)
GATE_ROWS = 4  # rows of a chunk's gate block (`state_pass.BWD_GATE_ROWS`): qs, sk, e^{bL}, token mask

if _IMPORT_ERROR is None:

    @gluon.jit
    def _bwd_loads(w_desc, q_desc, k_desc, do_desc, p_desc, g_desc, bos, seq_len, t_first, i_hv, HV, qk_col, w_col,
                   do_col, w_st, q_st, k_st, do_st, p_st, g_st, ld, done, C: gl.constexpr, R: gl.constexpr):
        """Worker partition (one warp): the chunks' inputs by TMA in reverse order, chunk n of the walk into slot
        n % 2 once the state warpgroup is done with chunk n - 2 there."""
        nbytes: gl.constexpr = (w_desc.block_type.nbytes + 2 * q_desc.block_type.nbytes + do_desc.block_type.nbytes
                                + p_desc.block_type.nbytes + g_desc.block_type.nbytes)
        nch = (seq_len + C - 1) // C
        for n in range(nch):
            c = nch - 1 - n
            buf = n % 2
            slot = (t_first + c) * HV + i_hv
            tok = bos + c * C
            bar = ld.index(buf)
            mbarrier.wait(done.index(buf), ((n // 2) & 1) ^ 1)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(w_desc, [tok, w_col], bar, w_st.index(buf))
            tma.async_copy_global_to_shared(q_desc, [tok, qk_col], bar, q_st.index(buf))
            tma.async_copy_global_to_shared(k_desc, [tok, qk_col], bar, k_st.index(buf))
            tma.async_copy_global_to_shared(do_desc, [tok, do_col], bar, do_st.index(buf))
            tma.async_copy_global_to_shared(p_desc, [slot * C, 0], bar, p_st.index(buf))
            tma.async_copy_global_to_shared(g_desc, [slot * R, 0], bar, g_st.index(buf))

    @gluon.jit
    def _bwd_state(dht, dh0, dhb_desc, dvn_desc, dvn, row, bos, seq_len, t_first, i_hv, HV, col0, w_st, q_st, k_st,
                   do_st, p_st, g_st, hb_st, vn_st, ld, done, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                   C: gl.constexpr, HAS_DHT: gl.constexpr, STORE_DH0: gl.constexpr):
        """Default partition: dS^T through the chunks in reverse; stores dS' of every chunk and dVn."""
        dt: gl.constexpr = w_st.dtype
        MS: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
        MT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
        A_T: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MT, k_width=2)
        A_S: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MS, k_width=2)
        LST: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        r_v = gl.arange(0, BV, layout=gl.SliceLayout(1, MS))
        c_k = gl.arange(0, K, layout=gl.SliceLayout(0, MS))
        st_tile = (row * HV + i_hv) * K * V + col0  # int64: row is
        if HAS_DHT:
            dS = gl.load(dht + st_tile + (gl.expand_dims(c_k * V, 0) + gl.expand_dims(r_v, 1))).to(gl.float32)
        else:
            dS = gl.zeros([BV, K], gl.float32, MS)
        v_col = i_hv * V + col0
        nch = (seq_len + C - 1) // C
        for n in range(nch):
            c = nch - 1 - n
            buf = n % 2
            slot = (t_first + c) * HV + i_hv
            mbarrier.wait(ld.index(buf), (n // 2) & 1)
            gb = g_st.index(buf)
            zt = gl.zeros([BV, C], gl.float32, MT)

            # dS'^T in 16 bits (what dhb keeps, the left operand of dS'^T K^T) and e^{bL} dS'^T, before any product
            # is in flight (dS is the last product's result)
            s16 = dS.to(dt)
            # the chunk's scale m (`chunk_jit._chunk_scale`): the chunk's dS^T is m times the products below, whose
            # 16-bit operands carry qs / m and W / m, and whose accumulator starts at (e^{bL} / m) dS'^T
            m = gl.max(_gate_cols(gb, 3, MT), axis=0)  # m on the sequence's tokens, 0 past its end
            dS = dS * gl.max(_gate_cols(gb, 2, MT), axis=0)  # e^{bL} / m, in every column of row 2
            s_op = gl.convert_layout(s16, A_T)
            z = warpgroup_mma(s_op, k_st.index(buf).permute((1, 0)), zt, use_acc=False, is_async=True)
            # e^{bL} dS'^T + (dO^T diag(qs)) Q and dO^T P (dO's rows past the sequence masked), in flight beside it
            dot_t = do_st.index(buf).permute((1, 0)).load(MT).to(gl.float32)  # dO^T [BV, C]
            qs_op = gl.convert_layout((dot_t * gl.expand_dims(_gate_cols(gb, 0, MT), 0)).to(dt), A_S)
            acc = warpgroup_mma(qs_op, q_st.index(buf), dS, use_acc=True, is_async=True)
            live = gl.expand_dims(_gate_cols(gb, 3, MT), 0) > 0.0
            do_op = gl.convert_layout(gl.where(live, dot_t, 0.0).to(dt), A_T)
            x = warpgroup_mma(do_op, p_st.index(buf), zt, use_acc=False, is_async=True)
            # dS' leaves by TMA from hb_st (as [K, BV]) once the previous chunk's stores have read both buffers
            tma.store_wait(0)
            gl.thread_barrier()
            hb_st.store(gl.permute(s16, (1, 0)))
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(dhb_desc, [slot * K, col0], hb_st)

            # dVn^T = (dS'^T K^T) diag(sk) + dO^T P, once all three products are done
            acc, z, x, s_op, qs_op, do_op = warpgroup_mma_wait(0, deps=[acc, z, x, s_op, qs_op, do_op])
            dvn_t = z * gl.expand_dims(_gate_cols(gb, 1, MT), 0) + x
            d16 = dvn_t.to(dt)
            # dS^T = acc - dVn^T W (the 16-bit dVn^T negated: exact)
            n_op = gl.convert_layout(-d16, A_S)
            dS = warpgroup_mma(n_op, w_st.index(buf), acc, use_acc=True) * m
            gl.thread_barrier()  # every warp of this partition is past its reads of the slot
            mbarrier.arrive(done.index(buf), count=1)

            vn_st.store(gl.permute(d16, (1, 0)))
            fence_async_shared()
            gl.thread_barrier()  # every thread's part of vn_st written before the one TMA store
            tok = bos + c * C
            if c * C + C <= seq_len:
                tma.async_copy_shared_to_global(dvn_desc, [tok, v_col], vn_st)
            else:  # the sequence's last, partial chunk: a whole-chunk store would write the next sequence's rows
                t_o = gl.arange(0, C, layout=gl.SliceLayout(1, LST))
                c_o = gl.arange(0, BV, layout=gl.SliceLayout(0, LST))
                dvn_chunk = dvn + (tok.to(gl.int64) * HV + i_hv) * V + col0
                gl.store(dvn_chunk + gl.expand_dims(t_o * (HV * V), 1) + gl.expand_dims(c_o, 0), vn_st.load(LST),
                         mask=gl.expand_dims(c * C + t_o < seq_len, 1))
        tma.store_wait(0)
        if STORE_DH0:
            gl.store(dh0 + st_tile + (gl.expand_dims(c_k * V, 0) + gl.expand_dims(r_v, 1)), dS)

    @gluon.jit
    def _gdn_chain_bwd_kernel(
        w_desc, q_desc, k_desc, do_desc, p_desc, g_desc, dhb_desc, dvn_desc, dht, dh0, dvn, cu, chunk_off, H, HV,
        K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr, R: gl.constexpr,
        HAS_DHT: gl.constexpr, STORE_DH0: gl.constexpr,
    ):
        """Grid (V / BV, sequences x HV); launched with 4 warps, the load partition adds one. Descriptors
        (`gdn_bwd._descriptors`): W over [Ttot, HV * K], q and k over [Ttot, H * K] in [C, K] boxes; dO over
        [Ttot, HV * V] in [C, BV] boxes; P over [slots * C, C]; the gate rows over [slots * R, C] (fp32); dS'
        (dhb [chunks, HV, K, V]) over [chunks * HV * K, V] in [K, BV] boxes; dVn over [Ttot, HV * V] in [C, BV]
        boxes (dvn [Ttot, HV, V], also written by masked stores), both in the inputs' 16-bit dtype.
        dht, dh0: [N, HV, K, V] fp32 (dht any float dtype); cu, chunk_off: [N + 1] int32."""
        i_v, i_n, i_hv, i_h, bos, seq_len, t_first, row = _chain_program(cu, chunk_off, cu, H, HV, False)
        dt: gl.constexpr = dvn.dtype.element_ty
        col0 = i_v * BV
        w_st = gl.allocate_shared_memory(dt, [2, C, K], w_desc.layout)
        q_st = gl.allocate_shared_memory(dt, [2, C, K], q_desc.layout)
        k_st = gl.allocate_shared_memory(dt, [2, C, K], k_desc.layout)
        do_st = gl.allocate_shared_memory(dt, [2, C, BV], do_desc.layout)
        p_st = gl.allocate_shared_memory(dt, [2, C, C], p_desc.layout)
        g_st = gl.allocate_shared_memory(gl.float32, [2, R, C], g_desc.layout)
        hb_st = gl.allocate_shared_memory(dt, [K, BV], dhb_desc.layout)  # dS' of a chunk on its way out
        vn_st = gl.allocate_shared_memory(dt, [C, BV], dvn_desc.layout)  # dVn of a chunk on its way out
        ld = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2):
            mbarrier.init(ld.index(s), count=1)
            mbarrier.init(done.index(s), count=1)
        gl.warp_specialize([
            (_bwd_state, (dht, dh0, dhb_desc, dvn_desc, dvn, row, bos, seq_len, t_first, i_hv, HV, col0, w_st, q_st,
                          k_st, do_st, p_st, g_st, hb_st, vn_st, ld, done, K, V, BV, C, HAS_DHT, STORE_DH0)),
            (_bwd_loads, (w_desc, q_desc, k_desc, do_desc, p_desc, g_desc, bos, seq_len, t_first, i_hv, HV, i_h * K,
                          i_hv * K, i_hv * V + col0, w_st, q_st, k_st, do_st, p_st, g_st, ld, done, C, R)),
        ], [1], [40])
        for s in gl.static_range(2):
            mbarrier.invalidate(ld.index(s))
            mbarrier.invalidate(done.index(s))
