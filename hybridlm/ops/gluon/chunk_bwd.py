"""The chunk-local part of the GDN backward for Hopper in Gluon: what the Triton `chunk_bwd._chunk_bwd_state_blk` and
`_chunk_bwd_out_blk` compute, in one launch: one program per (chunk, value head) holds the whole chunk (K and V up to
128) in shared memory and runs both launches' math on it, every product a warpgroup MMA.

The math is the Triton kernels' (their docstrings; docs/kernels.md "Training: the cap of this plan"), per chunk with
b the cumulative log-decay, gamma = e^b, rk and rq the l2 norms' factors, T = (I + A)^{-1} and S, dS' the chunk's
initial state and the gradient of the state after it:
  state part   dT = (dVn V^T) diag(beta), dv = diag(beta) T^T dVn; dKd = Vn dS'^T, dW = -dVn S^T,
               dT += (dW K^T) diag(rk beta gamma), dKb = T^T dW; dA = -T^T dT T^T with K K^T for A's gradient
  output part  dQS = dO S^T, Q K^T, dP = dO Vn^T; dq = dQS diag(scale gamma) + (dPg diag(rk)) K,
               dk = dkp + (diag(rq) dPg)^T Q + ((dKK + dKK^T) diag(rk)) K, the l2 norms' backward last.
Non-standard here:
- The Triton kernels walk K and V in blocks and round each [BT, BT] scale into a 16-bit operand; here the raw 16-bit
  tiles are the operands and the per-token scales (rk, beta, gamma) are applied to the fp32 products' rows or columns,
  so fewer products are rounded.
- One launch where the Triton path has two: k, S and Vn are read once for both parts, dKK stays in shared memory and
  the [C] sums (the l2 norm's share, dg's part) in registers; dk's [C, K] part (fp32; held in registers it would
  spill) waits in the dS' tile's shared memory, read by then (V >= 128: C K 4 <= K V 2 bytes), else goes out to dkp
  (the program's own rows, read back from cache).
- Two warpgroups, each computing half of every product's columns: one warpgroup alone needs more registers than a
  thread has for a whole chunk's gradients (it spilled 200-250 bytes a thread).
- The chunk's tiles arrive by masked asynchronous copies (rows past the sequence read as 0), each once, in three
  groups issued at the start, so the later groups land while the first part computes; transposed operands are
  permuted views of shared memory (right operands) or registers loaded through one (left operands).
- The cumulative log-decay is summed in fp64 over a [BT, BT] mask and kept as fp32 hi + lo parts, as the Triton
  kernels' `_cum_split` does, so a factor e^{b_i - b_j} keeps its own precision.
"""

from __future__ import annotations

from .parts import _IMPORT_ERROR, gl, gluon

if _IMPORT_ERROR is None:
    from .parts import async_copy, fence_async_shared, warpgroup_mma

CHUNK = 64
MAX_V = 128  # a chunk's [C, V] tiles and its [K, V] state and state gradient in one program's shared memory
NUM_WARPS = 8  # two warpgroups, each computing half of every product's columns (M = CHUNK rows)

if _IMPORT_ERROR is None:

    @gluon.jit
    def _issue_tile(x, x_smem, R: gl.constexpr, W: gl.constexpr):
        """Asynchronous copy of the contiguous [R, W] tile at x into x_smem."""
        LT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        r = gl.arange(0, R, layout=gl.SliceLayout(1, LT))
        c = gl.arange(0, W, layout=gl.SliceLayout(0, LT))
        async_copy.async_copy_global_to_shared(x_smem, x + (gl.expand_dims(r * W, 1) + gl.expand_dims(c, 0)))

    @gluon.jit
    def _issue_chunk_rows(x, x_smem, tok0, nval, i_h, H, W: gl.constexpr, C: gl.constexpr):
        """Asynchronous copies of the chunk's rows tok0.. tok0 + C of head i_h of x [Ttot, H, W] into x_smem [C, W];
        rows from nval on are zero-filled (the next sequence's)."""
        LR: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
        t = gl.arange(0, C, layout=gl.SliceLayout(1, LR))
        col = gl.arange(0, W, layout=gl.SliceLayout(0, LR))
        p = gl.expand_dims(t * (H * W), 1) + gl.expand_dims(col, 0)
        async_copy.async_copy_global_to_shared(x_smem, x + (tok0.to(gl.int64) * H + i_h) * W + p,
                                               mask=gl.expand_dims(t < nval, 1))

    @gluon.jit
    def _chunk_of(cu, chunk_seq, chunk_start, ic, C: gl.constexpr):
        """(first token, valid rows) of global chunk ic."""
        n = gl.load(chunk_seq + ic)
        tok0 = gl.load(chunk_start + ic)
        nval = gl.minimum(gl.load(cu + n + 1) - tok0, C)
        return tok0, nval

    @gluon.jit
    def _gates(g, tok0, nval, i_hv, HV, C: gl.constexpr, MT: gl.constexpr):
        """Of one chunk, as vectors along the rows of MT: b (fp32 hi and lo parts) and bL - b, and bL. The sums are
        fp64 (`chunk_jit._cum_split`); rows past nval add nothing."""
        ROW: gl.constexpr = gl.SliceLayout(1, MT)
        COL: gl.constexpr = gl.SliceLayout(0, MT)
        i_r = gl.arange(0, C, layout=ROW)
        j_c = gl.arange(0, C, layout=COL)
        g_c = gl.load(g + (tok0 + j_c).to(gl.int64) * HV + i_hv, mask=j_c < nval, other=0.0).to(gl.float64)
        causal = gl.expand_dims(i_r, 1) >= gl.expand_dims(j_c, 0)
        b = gl.sum(gl.where(causal, gl.expand_dims(g_c, 0), 0.0), axis=1)
        tot = gl.sum(g_c, axis=0)
        hi = b.to(gl.float32)
        return hi, (b - hi.to(gl.float64)).to(gl.float32), (tot - b).to(gl.float32), tot.to(gl.float32)

    @gluon.jit
    def _pair_decay(hi, lo, mask, MT: gl.constexpr):
        """[C, C] e^{b_i - b_j} where mask, 1 elsewhere (the exponent is 0 there, so it never overflows)."""
        COL: gl.constexpr = gl.SliceLayout(0, MT)
        hc = gl.convert_layout(hi, COL)
        lc = gl.convert_layout(lo, COL)
        d = (gl.expand_dims(hi, 1) - gl.expand_dims(hc, 0)) + (gl.expand_dims(lo, 1) - gl.expand_dims(lc, 0))
        return gl.exp(gl.where(mask, d, 0.0))

    @gluon.jit
    def _row_sq(x_smem, ROWL: gl.constexpr, W: gl.constexpr):
        """Squared l2 norms of the rows of a 16-bit [C, W] tile in shared memory, fp32, in layout ROWL."""
        LB: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        x = x_smem.load(LB).to(gl.float32)
        return gl.convert_layout(gl.sum(x * x, axis=1), ROWL)

    @gluon.jit
    def _tt(t_s, MT: gl.constexpr, A: gl.constexpr):
        """T^T as a left operand of layout A, loaded through the permuted view of T (reloaded at each use: held, it
        would take registers the products need)."""
        return gl.convert_layout(t_s.permute((1, 0)).load(MT), A)

    @gluon.jit
    def _col(x, MT: gl.constexpr):
        """A row vector of MT as a column vector of MT."""
        return gl.convert_layout(x, gl.SliceLayout(0, MT))

    @gluon.jit
    def _rows_of(x, L: gl.constexpr):
        """A row vector, in the row layout of L."""
        return gl.convert_layout(x, gl.SliceLayout(1, L))

    @gluon.jit
    def _row_mask_store(ptr, x, tok0, nval, i_hv, HV, W: gl.constexpr, C: gl.constexpr):
        """x [C, W] into the rows tok0.. tok0 + nval of ptr [Ttot, HV, W] at head i_hv; through a blocked layout of
        16-byte rows a thread (the MMA layout's element pairs would each take an address)."""
        LS: gl.constexpr = gl.BlockedLayout([1, 128 // ptr.dtype.element_ty.primitive_bitwidth], [8, 4], [8, 1],
                                            [1, 0])
        y = gl.convert_layout(x.to(ptr.dtype.element_ty), LS)
        r = gl.arange(0, C, layout=gl.SliceLayout(1, LS))
        c = gl.arange(0, W, layout=gl.SliceLayout(0, LS))
        p = ptr + ((tok0 + r).to(gl.int64) * HV + i_hv) * W
        gl.store(gl.expand_dims(p, 1) + gl.expand_dims(c, 0), y, mask=gl.expand_dims(r < nval, 1))

    @gluon.jit
    def _row_mask_load(ptr, tok0, nval, i_hv, HV, W: gl.constexpr, C: gl.constexpr, L: gl.constexpr):
        """fp32 [C, W] (layout L) from the rows tok0.. tok0 + nval of ptr [Ttot, HV, W] at head i_hv (0 past)."""
        r = gl.arange(0, C, layout=gl.SliceLayout(1, L))
        c = gl.arange(0, W, layout=gl.SliceLayout(0, L))
        p = ptr + ((tok0 + r).to(gl.int64) * HV + i_hv) * W
        return gl.load(gl.expand_dims(p, 1) + gl.expand_dims(c, 0), mask=gl.expand_dims(r < nval, 1),
                       other=0.0).to(gl.float32)

    @gluon.jit
    def _vec_store(ptr, x, tok0, nval, i_hv, HV, C: gl.constexpr, L: gl.constexpr):
        """x [C] (rows of L) into ptr [Ttot, HV] at the chunk's valid rows."""
        r = gl.arange(0, C, layout=gl.SliceLayout(1, L))
        gl.store(ptr + (tok0 + r).to(gl.int64) * HV + i_hv, x, mask=r < nval)

    @gluon.jit
    def _vec_load(ptr, tok0, nval, i_hv, HV, C: gl.constexpr, L: gl.constexpr):
        """fp32 [C] (rows of L) from ptr [Ttot, HV] at the chunk's valid rows (0 past them)."""
        r = gl.arange(0, C, layout=gl.SliceLayout(1, L))
        return gl.load(ptr + (tok0 + r).to(gl.int64) * HV + i_hv, mask=r < nval, other=0.0).to(gl.float32)

    @gluon.jit
    def _dkp_view(ds_s, C: gl.constexpr, K: gl.constexpr):
        """dS' tile [K, V] (16-bit, V >= 128) reused, once read, as dk's part [C, K] fp32 between the two parts:
        C K 4 <= K V 2 bytes."""
        return ds_s._reinterpret(gl.float32, [C, K], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

    @gluon.jit
    def _masked_sum(x, mask, MT: gl.constexpr):
        """sum_j where(mask[i, j], x_j) for x a vector along the rows of MT: a cumulative sum through a [C, C] mask
        (reverse for mask j >= i, exclusive for j < i)."""
        xc = gl.convert_layout(x, gl.SliceLayout(0, MT))
        return gl.sum(gl.where(mask, gl.expand_dims(xc, 0), 0.0), axis=1)

    @gluon.jit
    def _state_part(k_s, v_s, vn_s, dvn_s, s_s, ds_s, t_s, w_s, x_s, g, beta, dkp, dv, dbeta, tok0, nval, i_hv, HV,
                    K: gl.constexpr, V: gl.constexpr, C: gl.constexpr, L2: gl.constexpr):
        """`chunk_bwd._chunk_bwd_state_blk`'s math for one (chunk, value head) on its tiles in shared memory (the
        caller's three copy groups: k, dVn, v, T first, then S, dS', Vn, then q, dO): writes dv, dbeta and dkp (dk's
        part through the state write and W, fp32), leaves dKK (A's gradient in K^ K^^T, 16-bit) in x_s, and
        returns what `_out_part` needs: b's hi and lo parts, rk, this part's share of sum_d k^_id dk^_id (l2 norm)
        and dg's part of these paths (`chunk_jit._dg_rows`)."""
        dt: gl.constexpr = k_s.dtype
        MT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, C // 2, 16])
        MK: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, K // 2, 16])
        MV: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, V // 2, 16])
        A_T: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MT, k_width=2)
        A_K: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MK, k_width=2)
        A_V: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MV, k_width=2)
        ROW: gl.constexpr = gl.SliceLayout(1, MT)
        COL: gl.constexpr = gl.SliceLayout(0, MT)
        hi, lo, ged, bL = _gates(g, tok0, nval, i_hv, HV, C, MT)
        bb = _vec_load(beta, tok0, nval, i_hv, HV, C, MT)
        i_r = gl.arange(0, C, layout=ROW)
        j_c = gl.arange(0, C, layout=COL)
        async_copy.wait_group(2)
        gl.thread_barrier()
        fence_async_shared()

        zt = gl.zeros([C, C], gl.float32, MT)
        if L2:
            rk = gl.rsqrt(_row_sq(k_s, ROW, K) + 1e-6)
        else:
            rk = gl.full([C], 1.0, gl.float32, ROW)
        # 1. U = T diag(beta) V: dv = diag(beta) T^T dVn (its dT below)
        dVb = warpgroup_mma(_tt(t_s, MT, A_V), dvn_s, gl.zeros([C, V], gl.float32, MV), use_acc=False)
        _row_mask_store(dv, dVb * gl.expand_dims(_rows_of(bb, MV), 1), tok0, nval, i_hv, HV, V, C)
        db = _rows_of(gl.sum(v_s.load(MV).to(gl.float32) * dVb, axis=1), MT)

        async_copy.wait_group(1)
        gl.thread_barrier()
        fence_async_shared()
        # the state's decay e^{bL}: the sum of S * dS' over the whole tile, in slices of 32 rows
        LB: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        sds = 0.0
        for i in gl.static_range(K // 32):
            s_sl = s_s.slice(32 * i, 32, dim=0).load(LB).to(gl.float32)
            sds += gl.sum(gl.sum(s_sl * ds_s.slice(32 * i, 32, dim=0).load(LB).to(gl.float32), axis=1), axis=0)
        gam = gl.exp(hi)
        bg = bb * gam
        # 2. Vn = U - W S: dW = -dVn S^T; W = T diag(beta gamma) K^: dKb = T^T dW (dk's part through W; dT below)
        zk = gl.zeros([C, K], gl.float32, MK)
        w_s.store((-warpgroup_mma(dvn_s, s_s.permute((1, 0)), zk, use_acc=False)).to(dt))
        fence_async_shared()
        dk_acc = warpgroup_mma(_tt(t_s, MT, A_K), w_s, zk, use_acc=False)  # dKb
        t = _rows_of(gl.sum(k_s.load(MK).to(gl.float32) * dk_acc, axis=1), MT) * rk
        dk_acc = dk_acc * gl.expand_dims(_rows_of(bg, MK), 1)  # dk^ (the normalised keys' gradient) as dkp keeps it
        # the state write S' = e^{bL} S + Kd^T Vn: dKd = Vn dS'^T (dk's part through Kd = K^ e^{bL - b})
        dKd = warpgroup_mma(vn_s, ds_s.permute((1, 0)), zk, use_acc=False)
        ed = gl.exp(ged)
        r = _rows_of(gl.sum(k_s.load(MK).to(gl.float32) * dKd, axis=1), MT) * (rk * ed)
        dk_acc = dk_acc + dKd * gl.expand_dims(_rows_of(ed, MK), 1)
        if V >= 128:  # dS' is read (the MMA above is synchronous): its tile holds dk's part, fp32, for `_out_part`
            gl.thread_barrier()  # both warpgroups are past their reads of dS'
            _dkp_view(ds_s, C, K).store(dk_acc)
        else:
            _row_mask_store(dkp, dk_acc, tok0, nval, i_hv, HV, K, C)
        c = gl.exp(bL) * sds
        db = db + t * gam
        dgc = t * bg
        # 3. dT = (dVn V^T) diag(beta) (through U) + (dW K^T) diag(rk beta gamma) (through W), after the [C, K]
        # products so that it holds no registers beside them
        dT = warpgroup_mma(dvn_s, v_s.permute((1, 0)), zt, use_acc=False) * gl.expand_dims(_col(bb, MT), 0) \
            + warpgroup_mma(w_s, k_s.permute((1, 0)), zt, use_acc=False) * gl.expand_dims(_col(rk * bg, MT), 0)
        # T = (I + A)^{-1}: dA = -T^T dT T^T on the strict lower part; A = strict(diag(beta) K^ K^^T e^{b_i - b_j})
        x_s.store(dT.to(dt))
        fence_async_shared()
        X = warpgroup_mma(_tt(t_s, MT, A_T), x_s, zt, use_acc=False)
        dA = -warpgroup_mma(gl.convert_layout(X.to(dt), A_T), t_s.permute((1, 0)), zt, use_acc=False)
        strict = gl.expand_dims(i_r, 1) > gl.expand_dims(j_c, 0)
        KK = warpgroup_mma(k_s, k_s.permute((1, 0)), zt, use_acc=False)  # on the raw rows
        dAG = gl.where(strict, dA * _pair_decay(hi, lo, strict, MT), 0.0)
        RA = dAG * KK * gl.expand_dims(rk, 1) * gl.expand_dims(_col(rk, MT), 0)
        db = db + gl.sum(RA, axis=1)
        RA = RA * gl.expand_dims(bb, 1)  # = dKK * K^K^^T, dKK = diag(beta) dAG (A's gradient in K^ K^^T)
        dKK = dAG * gl.expand_dims(bb, 1)
        x_s.store(dKK.to(dt))  # X has read x_s (a synchronous MMA); `_out_part` reads dKK and its transpose
        rsA = gl.sum(RA, axis=1)
        csA = gl.convert_layout(gl.sum(RA, axis=0), ROW)
        dgc = dgc + rsA - csA
        dgc = gl.where(i_r < nval, dgc, 0.0)
        # `chunk_jit._dg_rows`: the reverse cumsum of dgc, the exclusive cumsum of r, and c on every row
        dgr = _masked_sum(dgc, gl.expand_dims(j_c, 0) >= gl.expand_dims(i_r, 1), MT) \
            + _masked_sum(r, gl.expand_dims(j_c, 0) < gl.expand_dims(i_r, 1), MT) + c
        _vec_store(dbeta, db, tok0, nval, i_hv, HV, C, MT)
        return hi, lo, rk, r + t * bg + rsA + csA, dgr


    @gluon.jit
    def _out_part(q_s, k_s, do_s, vn_s, s_s, ds_s, x_s, t_s, hi, lo, rk, sk0, dg0, dq, dk, dkp, dg, scale, tok0,
                  nval, i_hv, HV, K: gl.constexpr, V: gl.constexpr, C: gl.constexpr, L2: gl.constexpr):
        """`chunk_bwd._chunk_bwd_out_blk`'s math for one (chunk, value head) on its tiles in shared memory, after
        `_state_part` (what it returned; dKK in x_s, dkp read back: the program's own writes, from cache; t_s is
        free): the output's paths O = diag(scale gamma) Q^ S + P Vn, P = scale (Q^ K^^T) e^{b_i - b_j} (j <= i);
        finishes dk (the l2 norm's backward) and dg."""
        dt: gl.constexpr = q_s.dtype
        MT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, C // 2, 16])
        MK: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, K // 2, 16])
        A_K: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MK, k_width=2)
        ROW: gl.constexpr = gl.SliceLayout(1, MT)
        COL: gl.constexpr = gl.SliceLayout(0, MT)
        i_r = gl.arange(0, C, layout=ROW)
        j_c = gl.arange(0, C, layout=COL)
        s_q = scale * gl.exp(hi)  # row scale of the state read: O += diag(scale gamma) Q^ S
        async_copy.wait_group(0)
        gl.thread_barrier()  # also: the state part's global writes visible to every thread of the program
        fence_async_shared()
        if L2:
            rq = gl.rsqrt(_row_sq(q_s, ROW, K) + 1e-6)
        else:
            rq = gl.full([C], 1.0, gl.float32, ROW)
        zt = gl.zeros([C, C], gl.float32, MT)
        zk = gl.zeros([C, K], gl.float32, MK)
        # x_s: dKK from `_state_part` -> (dKK + dKK^T) diag(rk), the left operand of dk's last product, first (it
        # then holds no registers)
        M = (x_s.load(MT).to(gl.float32) + x_s.permute((1, 0)).load(MT).to(gl.float32)) \
            * gl.expand_dims(_col(rk, MT), 0)
        gl.thread_barrier()
        x_s.store(M.to(dt))
        fence_async_shared()
        QK = warpgroup_mma(q_s, k_s.permute((1, 0)), zt, use_acc=False)
        dQS = warpgroup_mma(do_s, s_s.permute((1, 0)), zk, use_acc=False)
        # sum_d q^_id dq^_id through the state read
        a = _rows_of(gl.sum(q_s.load(MK).to(gl.float32) * dQS, axis=1), MT) * rq * s_q
        dP = warpgroup_mma(do_s, vn_s.permute((1, 0)), zt, use_acc=False)
        incl = gl.expand_dims(i_r, 1) >= gl.expand_dims(j_c, 0)
        dPg = gl.where(incl, dP * _pair_decay(hi, lo, incl, MT) * scale, 0.0)
        rk_c = _col(rk, MT)
        R = dPg * QK * gl.expand_dims(rq, 1) * gl.expand_dims(rk_c, 0)
        diag = gl.expand_dims(i_r, 1) == gl.expand_dims(j_c, 0)
        rd = gl.sum(gl.where(diag, R, 0.0), axis=1)
        R = gl.where(diag, 0.0, R)
        rs = gl.sum(R, axis=1)
        cs = gl.convert_layout(gl.sum(R, axis=0), ROW)
        dgc = a + rs - cs
        # dq^ = dQS diag(s_q) + (dPg diag(rk)) K, the l2 norm's backward after
        dq_acc = warpgroup_mma(gl.convert_layout((dPg * gl.expand_dims(rk_c, 0)).to(dt), A_K), k_s,
                               dQS * gl.expand_dims(_rows_of(s_q, MK), 1), use_acc=True)
        if L2:
            sq = a + rs + rd  # sum_d q^_id dq^_id
            qf = q_s.load(MK).to(gl.float32)  # loaded again: held since `a`, it would take 64 registers
            dq_acc = (dq_acc - qf * gl.expand_dims(_rows_of(rq * sq, MK), 1)) * gl.expand_dims(_rows_of(rq, MK), 1)
        _row_mask_store(dq, dq_acc, tok0, nval, i_hv, HV, K, C)
        # dk^ = dkp + (diag(rq) dPg)^T Q + ((dKK + dKK^T) diag(rk)) K: the transposed left operand through t_s
        t_s.store((dPg * gl.expand_dims(rq, 1)).to(dt))
        gl.thread_barrier()
        if V >= 128:
            dkp_part = _dkp_view(ds_s, C, K).load(MK)
        else:
            dkp_part = _row_mask_load(dkp, tok0, nval, i_hv, HV, K, C, MK)
        dk_acc = warpgroup_mma(gl.convert_layout(t_s.permute((1, 0)).load(MT), A_K), q_s, dkp_part, use_acc=True)
        dk_acc = warpgroup_mma(x_s, k_s, dk_acc, use_acc=True)
        if L2:
            sk = sk0 + cs + rd
            kf = k_s.load(MK).to(gl.float32)
            dk_acc = (dk_acc - kf * gl.expand_dims(_rows_of(rk * sk, MK), 1)) * gl.expand_dims(_rows_of(rk, MK), 1)
        _row_mask_store(dk, dk_acc, tok0, nval, i_hv, HV, K, C)
        dgc = gl.where(i_r < nval, dgc, 0.0)
        _vec_store(dg, _masked_sum(dgc, gl.expand_dims(j_c, 0) >= gl.expand_dims(i_r, 1), MT) + dg0,
                   tok0, nval, i_hv, HV, C, MT)

    @gluon.jit
    def _chunk_bwd_kernel(
        q, k, v, g, beta, Tbuf, hbuf, dhbuf, vnbuf, dvnbuf, do, dq, dk, dkp, dv, dg, dbeta, cu, chunk_seq, chunk_start,
        scale, H, HV,
        K: gl.constexpr, V: gl.constexpr, C: gl.constexpr, L2: gl.constexpr,
    ):
        """The chunk backward of one (chunk, value head): grid (chunks, HV). Every tile of the chunk is copied into
        shared memory once, in three groups issued at the start (what `_state_part` needs first, then the state and
        its gradient, then what only `_out_part` reads), then the two parts run one after the other."""
        ic = gl.program_id(0)
        i_hv = gl.program_id(1)
        i_h = i_hv // (HV // H)
        dt: gl.constexpr = k.dtype.element_ty
        tok0, nval = _chunk_of(cu, chunk_seq, chunk_start, ic, C)
        blk = ic.to(gl.int64) * HV + i_hv
        k_s = gl.allocate_shared_memory(dt, [C, K], gl.NVMMASharedLayout.get_default_for([C, K], dt))
        q_s = gl.allocate_shared_memory(dt, [C, K], gl.NVMMASharedLayout.get_default_for([C, K], dt))
        v_s = gl.allocate_shared_memory(dt, [C, V], gl.NVMMASharedLayout.get_default_for([C, V], dt))
        vn_s = gl.allocate_shared_memory(dt, [C, V], gl.NVMMASharedLayout.get_default_for([C, V], dt))
        dvn_s = gl.allocate_shared_memory(dt, [C, V], gl.NVMMASharedLayout.get_default_for([C, V], dt))
        do_s = gl.allocate_shared_memory(dt, [C, V], gl.NVMMASharedLayout.get_default_for([C, V], dt))
        s_s = gl.allocate_shared_memory(dt, [K, V], gl.NVMMASharedLayout.get_default_for([K, V], dt))
        ds_s = gl.allocate_shared_memory(dt, [K, V], gl.NVMMASharedLayout.get_default_for([K, V], dt))
        t_s = gl.allocate_shared_memory(dt, [C, C], gl.NVMMASharedLayout.get_default_for([C, C], dt))
        w_s = gl.allocate_shared_memory(dt, [C, K], gl.NVMMASharedLayout.get_default_for([C, K], dt))  # dW
        x_s = gl.allocate_shared_memory(dt, [C, C], gl.NVMMASharedLayout.get_default_for([C, C], dt))  # [C, C]

        _issue_chunk_rows(k, k_s, tok0, nval, i_h, H, K, C)
        _issue_chunk_rows(dvnbuf, dvn_s, tok0, nval, i_hv, HV, V, C)
        _issue_chunk_rows(v, v_s, tok0, nval, i_hv, HV, V, C)
        _issue_tile(Tbuf + blk * C * C, t_s, C, C)
        async_copy.commit_group()
        _issue_tile(hbuf + blk * K * V, s_s, K, V)
        _issue_tile(dhbuf + blk * K * V, ds_s, K, V)
        _issue_chunk_rows(vnbuf, vn_s, tok0, nval, i_hv, HV, V, C)
        async_copy.commit_group()
        _issue_chunk_rows(q, q_s, tok0, nval, i_h, H, K, C)
        _issue_chunk_rows(do, do_s, tok0, nval, i_hv, HV, V, C)
        async_copy.commit_group()
        hi, lo, rk, sk0, dg0 = _state_part(k_s, v_s, vn_s, dvn_s, s_s, ds_s, t_s, w_s, x_s, g, beta, dkp, dv, dbeta,
                                           tok0, nval, i_hv, HV, K, V, C, L2)
        _out_part(q_s, k_s, do_s, vn_s, s_s, ds_s, x_s, t_s, hi, lo, rk, sk0, dg0, dq, dk, dkp, dg, scale, tok0,
                  nval, i_hv, HV, K, V, C, L2)
