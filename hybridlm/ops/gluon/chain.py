"""The state chain of the Gluon GDN forward: one program per (value block of 64, sequence x value head) walks its
sequence in 64-token chunks, in two warpgroups (`gl.warp_specialize`).

Non-standard here:
- The state is kept transposed, S^T [64, K] fp32, in the registers of the state warpgroup, so every state-path
  product takes its left operand from registers (S^T, R^T and U^T rounded to 16 bits: wgmma's A operand) against
  k and T in shared memory; nothing of the state path goes through shared memory. Operands are 16-bit and every
  product accumulates in fp32, as in the Triton kernels' 16-bit path; the state stays fp32 between chunks.
- The output products run in a second warpgroup: the state path alone needs most of a thread's registers. The
  state warpgroup hands each chunk's S^T (before its update) and V'^T over in shared memory (16-bit).
- q, k, v, T and the gate rows of the solve (`solve.GATE_ROWS`: every per-token scale, already multiplied out)
  arrive by TMA into two slots (issued by a one-warp partition); whole output chunks leave by TMA, a sequence's last
  partial chunk by masked stores.
- A training forward (`_gdn_chain_train_kernel`) also keeps each chunk's S and V' for the backward: the state
  warpgroup writes them untransposed into two staging tiles as it makes them and leaves them to TMA stores, which
  run while it goes on (the chain at B4 T4096 H16 on an H200: 152 us, against 194 storing them from its registers
  and 129 saving P alone). P leaves the output warpgroup by plain stores.

Per chunk, with Kn, Qn the normalised keys and queries (scale in Qn) and gamma = e^b:
    R^T  = V^T - (S^T K^T) diag(gamma rk)              V'^T = R^T (T diag(beta))^T
    S^T  = e^{b_last} S^T + (V'^T diag(rk e^{b_last - b})) K
    O    = diag(gamma rq) (Q S) + P V',   P[i, j] = q_i . k_j rq_i rk_j e^{b_i - b_j}  (i >= j)
The two slots, the ld, hand and done barriers and the hand-over buffers are `parts._chain_shared`'s, as in the KDA
chain. A one-warp partition issues the loads. With WAIT it first waits, chunk by chunk, for a flag the solve sets
once it has written that chunk's T and gate rows: the solve then runs beside the chain (gdn_fwd's overlapped form)
instead of before it.
"""

from __future__ import annotations

import functools

import torch

from .parts import _IMPORT_ERROR, _chain_program, gl, gluon

if _IMPORT_ERROR is None:
    from .parts import (
        TensorDescriptor,
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
    def _tma_chunk(q_desc, k_desc, v_desc, t_desc, g_desc, bar, q_s, k_s, v_s, t_s, g_s, tok, qk_col, v_col, slot,
                   pred, C: gl.constexpr, R: gl.constexpr):
        """One chunk's q, k, v rows, T and gate rows by TMA into one slot, completing on `bar`. Rows past
        the sequence are the next sequence's (or zeros past the tensor): every product the chain keeps gives them
        weight zero (the solve wrote zero gates for them)."""
        nbytes: gl.constexpr = (2 * q_desc.block_type.nbytes + v_desc.block_type.nbytes
                                + t_desc.block_type.nbytes + g_desc.block_type.nbytes)
        mbarrier.expect(bar, nbytes, pred=pred)
        tma.async_copy_global_to_shared(q_desc, [tok, qk_col], bar, q_s, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [tok, qk_col], bar, k_s, pred=pred)
        tma.async_copy_global_to_shared(v_desc, [tok, v_col], bar, v_s, pred=pred)
        tma.async_copy_global_to_shared(t_desc, [slot * C, 0], bar, t_s, pred=pred)
        tma.async_copy_global_to_shared(g_desc, [slot * R, 0], bar, g_s, pred=pred)

    @gluon.jit
    def _wait_ready(flag):
        """Spin until the solve has published this chunk (*flag != 0, read with acquire at GPU scope), then order
        the TMA reads that follow after it (a proxy fence: TMA reads through the async proxy). Traps after about
        2^24 polls: a chunk that never arrives fails the launch instead of hanging the GPU."""
        return gl.inline_asm_elementwise(
            """{ .reg .pred p; .reg .b32 n;
            mov.b32 n, 0;
            WAIT_${:uid}: ld.acquire.gpu.global.b32 $0, [$1];
            setp.ne.s32 p, $0, 0;
            @p bra READY_${:uid};
            add.s32 n, n, 1;
            setp.lt.s32 p, n, 16777216;
            @p bra WAIT_${:uid};
            trap;
            READY_${:uid}: fence.proxy.async.global; }""",
            "=r,l", [flag], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _chain_loads(q_desc, k_desc, v_desc, t_desc, g_desc, flags, bos, seq_len, t_first, i_hv, HV, qk_col, v_col,
                     q_st, k_st, v_st, t_st, g_st, ld, done, C: gl.constexpr, R: gl.constexpr, WAIT: gl.constexpr):
        """Worker partition (one warp): each chunk's inputs by TMA into slot n % 2 once both warpgroups are done with
        chunk n - 2 there; with WAIT, only after the solve running beside this launch published the chunk."""
        for c0 in range(0, seq_len, C):
            n = c0 // C
            buf = n % 2
            slot = (t_first + n) * HV + i_hv
            _wait_free(done, n)
            if WAIT:
                _wait_ready(flags + slot)
            _tma_chunk(q_desc, k_desc, v_desc, t_desc, g_desc, ld.index(buf), q_st.index(buf), k_st.index(buf),
                       v_st.index(buf), t_st.index(buf), g_st.index(buf), bos + c0, qk_col, v_col, slot, True, C, R)

    @gluon.jit
    def _gate_cols(g_s, r: gl.constexpr, LAYOUT: gl.constexpr):
        """Gate row r of a chunk ([R, C] in shared memory) as a [C] vector along the columns of LAYOUT (every thread
        reads the values it holds; max over the one row is the value itself)."""
        return gl.max(g_s.slice(r, 1).load(LAYOUT), axis=0)

    @gluon.jit
    def _gate_rows(g_s, r: gl.constexpr, LAYOUT: gl.constexpr):
        """The same along the rows of LAYOUT (a permuted view of the row reads the wrong elements: converted)."""
        return gl.convert_layout(_gate_cols(g_s, r, LAYOUT), gl.SliceLayout(1, LAYOUT))

    @gluon.jit
    def _chain_state(h0, ht, row, seq_len, i_hv, HV, col0, v_col, q_st, k_st, v_st, t_st, g_st, hs, hv, ld, hand,
                     done, hb_desc, vn_desc, hsv, vsv, vn, t_first, bos, K: gl.constexpr, V: gl.constexpr,
                     BV: gl.constexpr, C: gl.constexpr, HAS_H0: gl.constexpr, STORE_HT: gl.constexpr,
                     SAVE: gl.constexpr):
        """Default partition: the state path, and the hand-over of S^T and V'^T a chunk. SAVE (a training forward):
        also each chunk's S and V' for the backward, written untransposed into hsv [K, BV] and vsv [C, BV] as they
        are made and stored from there by TMA (`_stage`): the stores leave asynchronously, off this serial path and
        off the output warpgroup's; a sequence's last partial chunk's V' goes by masked stores (`_save_values`)."""
        dt: gl.constexpr = q_st.dtype
        MS: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
        MT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
        A_T: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MT, k_width=2)
        A_S: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MS, k_width=2)
        if HAS_H0:
            St = gl.load(_state_ptrs(h0, row, i_hv, HV, col0, K, V, BV, MS))
        else:
            St = gl.zeros([BV, K], gl.float32, MS)
        for c0 in range(0, seq_len, C):
            n = c0 // C
            buf = n % 2
            # hand-over slot 1 - buf is free once the output partition is done with chunk n - 1
            _wait_free(done, n + 1, pred=c0 + C < seq_len)
            _wait_chunk(ld, n)
            kb = k_st.index(buf)
            gb = g_st.index(buf)
            zt = gl.zeros([BV, C], gl.float32, MT)

            ks, s_op = _issue_st_product(St, kb, hs.index(buf), zt, A_T)  # S^T K^T
            if SAVE:
                _stage(hsv, St.to(dt))

            # V'^T = R^T (T diag(beta))^T, R^T = V^T - (S^T K^T) diag(gamma rk)
            vt = v_st.index(buf).permute((1, 0)).load(MT).to(gl.float32)
            gk = gl.expand_dims(_gate_cols(gb, 1, MT), 0)
            ks, s_op = warpgroup_mma_wait(0, deps=[ks, s_op])
            r_op = gl.convert_layout((vt - ks * gk).to(dt), A_T)
            Vn = warpgroup_mma(r_op, t_st.index(buf).permute((1, 0)), zt, use_acc=False)
            v16 = Vn.to(dt)
            if SAVE:
                vsv.permute((1, 0)).store(v16)
            _hand_over(hv.index(buf), v16, hand.index(buf))  # fences hsv and vsv too, after every thread wrote
            if SAVE:
                tma.async_copy_shared_to_global(hb_desc, [((t_first + n) * HV + i_hv) * K, col0], hsv)
                if c0 + C <= seq_len:
                    tma.async_copy_shared_to_global(vn_desc, [bos + c0, v_col], vsv)
                else:  # the sequence's last, partial chunk: a whole-chunk store would write the next one's rows
                    _save_values(Vn, vn, bos + c0, seq_len - c0, i_hv, HV, col0, V, BV, C, MT)

            # S^T = e^{b_last} S^T + U^T K, U^T = V'^T diag(rk e^{b_last - b})
            u_op = gl.convert_layout((Vn * gl.expand_dims(_gate_cols(gb, 2, MT), 0)).to(dt), A_S)
            decay = gl.max(_gate_cols(gb, 6, MT), axis=0)  # e^{b_last}, in every column of row 6
            St = warpgroup_mma(u_op, kb, St * decay, use_acc=True)
            _arrive(done.index(buf))
        if SAVE:
            tma.store_wait(0)
        if STORE_HT:
            gl.store(_state_ptrs(ht, row, i_hv, HV, col0, K, V, BV, MS), St)

    @gluon.jit
    def _save_p(pw, Pb, slot, nval, C: gl.constexpr, MO: gl.constexpr):
        """A chunk's P [C, C] (fp32, layout MO) into Pb[slot] (16-bit), its rows from nval on as zeros (the chain's
        rows past a sequence read the next one's q)."""
        LP: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        r = gl.arange(0, C, layout=gl.SliceLayout(1, LP))
        c = gl.arange(0, C, layout=gl.SliceLayout(0, LP))
        x = gl.convert_layout(pw.to(Pb.dtype.element_ty), LP)
        x = gl.where(gl.expand_dims(r < nval, 1), x, 0.0)
        gl.store(Pb + slot.to(gl.int64) * C * C + gl.expand_dims(r * C, 1) + gl.expand_dims(c, 0), x)

    @gluon.jit
    def _stage(buf, xt):
        """Write the transposed tile xt (registers, [cols, rows] of buf [rows, cols]) into buf once the previous
        chunk's TMA stores from this partition have read it (the first of the chunk's two staged tiles waits for
        both)."""
        tma.store_wait(0)
        gl.thread_barrier()  # only the issuing thread waits: the others write after it
        buf.permute((1, 0)).store(xt)

    @gluon.jit
    def _save_values(Vn, vn, tok, nval, i_hv, HV, col0, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr,
                     MT: gl.constexpr):
        """A chunk's V'^T [BV, C] (fp32, layout MT) as its valid rows (tokens tok.. tok + nval) of vn [Ttot, HV, V]
        at columns col0.. col0 + BV, in vn's 16-bit dtype."""
        r_v = gl.arange(0, BV, layout=gl.SliceLayout(1, MT))
        c_t = gl.arange(0, C, layout=gl.SliceLayout(0, MT))
        p = vn + ((tok + c_t).to(gl.int64) * HV + i_hv) * V + col0
        gl.store(gl.expand_dims(p, 0) + gl.expand_dims(r_v, 1), Vn.to(vn.dtype.element_ty),
                 mask=gl.expand_dims(c_t < nval, 0))

    @gluon.jit
    def _chain_output(o_desc, o, bos, seq_len, i_hv, HV, col0, v_col, q_st, k_st, g_st, hs, hv, o_st, ld, hand,
                      done, t_first, Pb, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr,
                      SAVE: gl.constexpr):
        """Worker partition: O = diag(gamma rq) (Q S) + P V' of every chunk, from the state partition's hand-over.
        SAVE (a training forward): also, from the first value block's program, each chunk's P (Pb [slots, C, C], rows
        past the sequence zero); S and V' leave from the state warpgroup."""
        dt: gl.constexpr = q_st.dtype
        MO: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
        A_O: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MO, k_width=2)
        i_r = gl.arange(0, C, layout=gl.SliceLayout(1, MO))  # tokens i (queries)
        j_c = gl.arange(0, C, layout=gl.SliceLayout(0, MO))  # tokens j (keys)
        causal = gl.expand_dims(i_r, 1) >= gl.expand_dims(j_c, 0)
        for c0 in range(0, seq_len, C):
            n = c0 // C
            buf = n % 2
            _wait_chunk(ld, n)
            qb = q_st.index(buf)
            gb = g_st.index(buf)
            zo = gl.zeros([C, BV], gl.float32, MO)
            # [i, j] = q_i . k_j, issued before the masks and scales it is multiplied by are computed
            qk = warpgroup_mma(qb, k_st.index(buf).permute((1, 0)), zo, use_acc=False, is_async=True)
            b_i = _gate_rows(gb, 0, MO)
            b_j = _gate_cols(gb, 0, MO)
            decay = gl.exp(gl.where(causal, gl.expand_dims(b_i, 1) - gl.expand_dims(b_j, 0), float("-inf")))
            decay = decay * gl.expand_dims(_gate_rows(gb, 4, MO), 1) * gl.expand_dims(_gate_cols(gb, 5, MO), 0)
            pw = warpgroup_mma_wait(0, deps=[qk]) * decay
            if SAVE:
                if col0 == 0:
                    _save_p(pw, Pb, (t_first + n) * HV + i_hv, seq_len - c0, C, MO)
            p_op = gl.convert_layout(pw.to(dt), A_O)
            _wait_chunk(hand, n)
            # Q S and P V' in two accumulators, both in flight at once (Q S is scaled by rows before the sum)
            qs = warpgroup_mma(qb, hs.index(buf).permute((1, 0)), zo, use_acc=False, is_async=True)
            pv = warpgroup_mma(p_op, hv.index(buf).permute((1, 0)), zo, use_acc=False, is_async=True)
            qs, pv, p_op = warpgroup_mma_wait(0, deps=[qs, pv, p_op])
            out = qs * gl.expand_dims(_gate_rows(gb, 3, MO), 1) + pv
            _arrive(done.index(buf))
            _store_out(o_desc, o, o_st, out, bos, c0, seq_len, i_hv, HV, col0, v_col, V, BV, C)
        tma.store_wait(0)

    @gluon.jit
    def _gdn_chain_kernel(
        q_desc, k_desc, v_desc, t_desc, g_desc, o_desc, o, h0, ht, rows, cu, chunk_off, flags, H, HV,
        K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr, R: gl.constexpr,
        HAS_H0: gl.constexpr, STORE_HT: gl.constexpr, POOL: gl.constexpr, WAIT: gl.constexpr,
    ):
        """Grid (V / BV, sequences x HV); launched with 4 warps, the output partition adds 4 more and the loads one.
        flags: [slots] int32, read only with WAIT (chunk slot s is ready once flags[s] != 0). Descriptors
        (`_descriptors`): q, k over [Ttot, H * K]; v, o over [Ttot, HV * V]; T over the solve's Tbuf as
        [slots * C, C]; gates over Gbuf as [slots * R, C]. o: [Ttot, HV, V] (the masked stores);
        h0, ht: [N, HV, K, V] fp32; cu, chunk_off: [N + 1] int32. POOL: h0 and ht are one state pool
        [P, HV, K, V] and sequence n reads and writes its row rows[n] (int32 [N]); each program touches only its
        own [K, BV] slice of that row, read first and written last, so the update in place is safe."""
        _chain_body(q_desc, k_desc, v_desc, t_desc, g_desc, o_desc, o_desc, o_desc, o, h0, ht, rows, cu, chunk_off,
                    flags, H, HV, o, o, K, V, BV, C, R, HAS_H0, STORE_HT, POOL, WAIT, False)

    @gluon.jit
    def _gdn_chain_train_kernel(
        q_desc, k_desc, v_desc, t_desc, g_desc, o_desc, hb_desc, vn_desc, o, h0, ht, vn, Pb, cu, chunk_off, flags,
        H, HV, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr, R: gl.constexpr,
        HAS_H0: gl.constexpr, STORE_HT: gl.constexpr, WAIT: gl.constexpr,
    ):
        """`_gdn_chain_kernel` for a training forward (no state pool): also what the Triton
        backward reads, each chunk's initial state S into hb [slots, K, V] (hb_desc: hb as [slots * K, V] in [K, BV]
        boxes), V' into vn [Ttot, HV, V] (vn_desc: as o_desc over vn), both in o's dtype (`_chain_state`), and P
        into Pb [slots, C, C] (`_chain_output`). WAIT: as `_gdn_chain_kernel`'s, beside the training solve."""
        _chain_body(q_desc, k_desc, v_desc, t_desc, g_desc, o_desc, hb_desc, vn_desc, o, h0, ht, cu, cu, chunk_off,
                    flags, H, HV, vn, Pb, K, V, BV, C, R, HAS_H0, STORE_HT, False, WAIT, True)

    @gluon.jit
    def _chain_body(q_desc, k_desc, v_desc, t_desc, g_desc, o_desc, hb_desc, vn_desc, o, h0, ht, rows, cu,
                    chunk_off, flags, H, HV, vn, Pb, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                    C: gl.constexpr, R: gl.constexpr, HAS_H0: gl.constexpr, STORE_HT: gl.constexpr,
                    POOL: gl.constexpr, WAIT: gl.constexpr, SAVE: gl.constexpr):
        """One chain program (`_gdn_chain_kernel`; SAVE: `_gdn_chain_train_kernel`)."""
        i_v, i_n, i_hv, i_h, bos, seq_len, t_first, row = _chain_program(cu, chunk_off, rows, H, HV, POOL)
        dt: gl.constexpr = o.dtype.element_ty
        col0 = i_v * BV
        v_col = i_hv * V + col0

        q_st = gl.allocate_shared_memory(dt, [2, C, K], q_desc.layout)
        k_st = gl.allocate_shared_memory(dt, [2, C, K], k_desc.layout)
        v_st = gl.allocate_shared_memory(dt, [2, C, BV], v_desc.layout)
        t_st = gl.allocate_shared_memory(dt, [2, C, C], t_desc.layout)
        g_st = gl.allocate_shared_memory(gl.float32, [2, R, C], g_desc.layout)
        hs, hv, o_st, ld, hand, done = _chain_shared(dt, o_desc, K, BV, C)
        if SAVE:  # the staging tiles of the saved S and V' (`_chain_state`)
            hsv = gl.allocate_shared_memory(dt, [K, BV], hb_desc.layout)
            vsv = gl.allocate_shared_memory(dt, [C, BV], vn_desc.layout)
        else:
            hsv, vsv = o_st, o_st
        gl.warp_specialize([
            (_chain_state, (h0, ht, row, seq_len, i_hv, HV, col0, v_col, q_st, k_st, v_st, t_st, g_st, hs, hv, ld,
                            hand, done, hb_desc, vn_desc, hsv, vsv, vn, t_first, bos, K, V, BV, C, HAS_H0, STORE_HT,
                            SAVE)),
            (_chain_output, (o_desc, o, bos, seq_len, i_hv, HV, col0, v_col, q_st, k_st, g_st, hs, hv, o_st, ld,
                             hand, done, t_first, Pb, K, V, BV, C, SAVE)),
            (_chain_loads, (q_desc, k_desc, v_desc, t_desc, g_desc, flags, bos, seq_len, t_first, i_hv, HV, i_h * K,
                            v_col, q_st, k_st, v_st, t_st, g_st, ld, done, C, R, WAIT)),
        ], [4, 1], [168, 40])
        _chain_invalidate(ld, hand, done)


@functools.lru_cache(maxsize=32)
def _smem_layout(rows: int, cols: int, dtype: torch.dtype):
    """The shared-memory layout of a [rows, cols] TMA box: the widest swizzle for 16-bit tiles, none for the fp32
    gate rows (read row by row). Cached: building it is a good part of a call's host time."""
    if dtype == torch.float32:
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def _tma_desc(x2: torch.Tensor, rows: int, cols: int):
    """A TMA descriptor over the 2-D x2 in [rows, cols] boxes, in `_smem_layout`'s layout."""
    return TensorDescriptor.from_tensor(x2, [rows, cols], _smem_layout(rows, cols, x2.dtype))


def _descriptors(q, k, v, o, Tbuf, Gbuf, BV: int) -> tuple:
    """TMA descriptors of the chain: q and k as [Ttot, H * K] in [CHUNK, K] boxes, v and o as [Ttot, HV * V] in
    [CHUNK, BV] boxes, T as [slots * CHUNK, CHUNK] rows, the gate rows as [slots * R, CHUNK]."""
    K, V = q.shape[-1], v.shape[-1]
    q2, k2 = q.reshape(-1, q.shape[-2] * K), k.reshape(-1, k.shape[-2] * K)
    v2, o2 = v.reshape(-1, v.shape[-2] * V), o.reshape(-1, o.shape[-2] * V)
    return (_tma_desc(q2, CHUNK, K), _tma_desc(k2, CHUNK, K), _tma_desc(v2, CHUNK, BV),
            _tma_desc(Tbuf.reshape(-1, CHUNK), CHUNK, CHUNK), _tma_desc(Gbuf.reshape(-1, CHUNK), Gbuf.shape[-2], CHUNK),
            _tma_desc(o2, CHUNK, BV))
