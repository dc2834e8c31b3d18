"""The fused Gated DeltaNet forward for Hopper (sm_90), in Gluon: one launch, the state on chip.

Non-standard here:
- One program per (value block, sequence, value head) walks its whole sequence in 64-token chunks and keeps the
  fp32 state [K, BV] in the registers of its warpgroup; nothing but q, k, v, g, beta is read and nothing but o and
  the final state is written (no T, W, U, chunk states or new values in memory).
- Per chunk, with b the in-chunk cumulative log-decay and gamma = e^b (docs/math.md):
      A  = strict_lower(diag(beta) Kn Kn^T * e^{b_i - b_j}),  T = (I + A)^{-1}
      V' = T (beta * (V - gamma * Kn S))                 (T applied after the state correction: W, U never exist)
      O  = gamma * Qn S + (Qn Kn^T * e^{b_i - b_j}, j <= i) V'
      S  = e^{b_last} S + (Kn * e^{b_last - b})^T V'
  where Qn, Kn are the (optionally l2-normalised, q also scaled) inputs. Every product is a warpgroup MMA on the
  RAW 16-bit inputs widened to fp32 in shared memory, so its tf32 operands hold them exactly; the l2 norms, beta
  and the decays enter as fp32 row and column scales of the results. Only the state, T and the new values are
  rounded to tf32 (~5e-4 relative) on their way into a product.
- T: the four diagonal [16, 16] blocks of I + A are inverted exactly in fp32 registers by forward substitution
  (all four at once, one warp per block); with Td that block-diagonal inverse and L the strictly block-lower part
  of A, N = Td L is nilpotent (N^4 = 0), so T = (I + N)^{-1} Td = (I - N)(I + N^2) Td: four 64x64 products.
- tf32 warpgroup MMAs read both operands K-major, so every matrix that enters as the right operand is stored
  through a transposed NVMMA shared layout, and k is copied transposed into q's buffer for the state update.
- Three plans, to be measured against each other (KERNEL picks; the losers go): `_gdn_fwd_kernel` ("simple")
  loads each chunk synchronously and runs every product in tf32 as above; `_gdn_fwd_prefetch_kernel`
  ("prefetch") copies the next chunk's q, k, v asynchronously (cp.async, double buffer) while this chunk computes,
  and runs the products that read q, k or the state with 16-bit operands: q and k as stored (exact), the state and
  the scaled new values split hi + lo into two 16-bit halves (~2^-16 relative, better than tf32), which also
  frees the fp32 copies of q and k for the copy buffers. Only T, P and the new values of V' = T R and P V' stay tf32.
  "split": two launches, `_gdn_t_kernel` solving T of every chunk in parallel (all multiprocessors, two programs
  each) into a [chunks, HV, 64, 64] fp32 buffer, then `_gdn_fwd_split_kernel`, the prefetch kernel reading T with
  the next chunk's inputs: the sequential chain per chunk keeps only the products that need the state, for 16 KB
  written and read again per chunk and value head (q, k, v bring 48 KB). Not the one-launch design, but the
  measure of what the T solve costs the sequential chain.
  "ws": `_gdn_fwd_ws_kernel`, the one-launch form of "split": warp-specialized, a worker partition (4 warps)
  solves T of the next chunks into a double buffer guarded by mbarriers (t_full / t_empty) while the default
  partition (4 warps) runs the state chain; value block 32, where both partitions' buffers fit (221 KB).

Not here yet (the host refuses the first two): K or V other than 128; fp32 inputs; the state pool form of chunked
prefill; a load warp (TMA) feeding both partitions of "ws" instead of their own asynchronous copies.
All plans hold one program per multiprocessor (shared memory) with 4 warps, so each runs its chunks as one
serial chain of products, solves and barriers: latency, not bandwidth or tensor-core throughput, bounds them.
"""

from __future__ import annotations

import torch
import triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
    )

    _IMPORT_ERROR = None
except ImportError as e:  # pragma: no cover - depends on the installed Triton
    gluon = gl = None
    _IMPORT_ERROR = e

CHUNK = 64  # tokens per chunk (four 16-row blocks of the solve)
BV_CHOICES = (64, 32)  # value blocks (shared memory: one program per multiprocessor either way); see _value_block
NUM_WARPS = 4  # one warpgroup
KERNEL = "simple"  # "simple", "prefetch", "split" or "ws" (see the module docstring): to be settled by measurement
POISON = False  # tests set it: outputs start as NaN, so an element the kernel never writes fails the check
SUPPORTED_K = (128,)
SUPPORTED_V = (128,)


def gluon_available() -> bool:
    """True when the installed Triton has the Gluon API this kernel is written against (Triton 3.6's
    `triton.experimental.gluon` with Hopper warpgroup MMA and NVMMA layouts)."""
    if _IMPORT_ERROR is not None:
        return False
    needed = (gl, ("NVMMADistributedLayout", "NVMMASharedLayout", "SwizzledSharedLayout", "BlockedLayout",
                   "SliceLayout", "allocate_shared_memory", "warp_specialize"))
    return all(hasattr(needed[0], n) for n in needed[1])


if _IMPORT_ERROR is None:

    @gluon.jit
    def _mma(a_smem, b_smem, acc, USE_ACC: gl.constexpr):
        """acc (+)= a @ b with fp32 accumulation; fp32 operands run as tf32 (the compile option's default input
        precision, which the host leaves as is); the caller has fenced its shared-memory stores."""
        return warpgroup_mma(a_smem, b_smem, acc, use_acc=USE_ACC)

    @gluon.jit
    def _diag_inverse(a_smem, d3_smem, C: gl.constexpr):
        """Td = (I + D)^{-1} for the four diagonal [16, 16] blocks D of the strictly lower A in `a_smem` (plain
        [C, C] fp32), by forward substitution in fp32: row s of every block at once, 15 steps. Returns Td as
        [4, 16, 16] (block, row, column) in a layout with one warp per block, so every reduction stays in a warp."""
        L3: gl.constexpr = gl.BlockedLayout([1, 4, 2], [1, 4, 8], [4, 1, 1], [2, 1, 0])
        L16: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [4, 1], [1, 0])
        for blk in gl.static_range(4):
            d = a_smem.slice(16 * blk, 16, dim=0).slice(16 * blk, 16, dim=1).load(L16)
            d3_smem.slice(16 * blk, 16, dim=0).store(gl.permute(d, (1, 0)))  # Dt[blk, j, i] = A_blk[i, j]
        gl.thread_barrier()
        Dt = d3_smem.reshape([4, 16, 16]).load(L3)
        ax1 = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        ax2 = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        r3 = gl.expand_dims(gl.expand_dims(ax1, 0), 2)  # [1, 16, 1]
        c3 = gl.expand_dims(gl.expand_dims(ax2, 0), 1)  # [1, 1, 16]
        zero = gl.zeros([4, 16, 16], gl.float32, L3)
        eye = gl.where(r3 == c3, 1.0, 0.0) + zero
        Td = eye
        for s in gl.static_range(1, 16):
            a = gl.sum(gl.where(c3 == s, Dt, 0.0), axis=2)  # [4, 16 (j)]: A[s, j] of every block
            row = gl.sum(gl.expand_dims(a, 2) * Td, axis=1)  # [4, 16 (c)]: sum_j A[s, j] Td[j, c]
            Td = gl.where(r3 == s, eye - gl.expand_dims(row, 1), Td)
        return Td

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
    def _t_matrix(A, plain, d3, m_row, m_t, i_c, j_c, C: gl.constexpr, MC: gl.constexpr):
        """T = (I + A)^{-1} = (I - N)(I + N^2) Td for the strictly lower A [C, C] (fp32, layout MC): Td the exact
        inverse of the diagonal blocks, N = Td L with L the strictly block-lower part of A. Four tf32 products
        through two [C, C] fp32 staging buffers, m_row (left operands) and m_t (right ones, transposed); plain and
        d3 are the solve's."""
        zc = gl.zeros([C, C], gl.float32, MC)
        plain.store(A)
        Td = _block_diag(_diag_inverse(plain, d3, C), d3, plain, C, MC)
        m_row.store(Td)
        block_lower = gl.expand_dims(i_c // 16, 1) > gl.expand_dims(j_c // 16, 0)
        m_t.store(gl.where(block_lower, A, 0.0))
        fence_async_shared()
        N = _mma(m_row, m_t, zc, False)
        m_row.store(N)
        m_t.store(N)
        fence_async_shared()
        N2 = _mma(m_row, m_t, zc, False)
        m_row.store(N2)
        m_t.store(Td)
        fence_async_shared()
        P1 = _mma(m_row, m_t, Td, True)  # (I + N^2) Td
        m_row.store(N)
        m_t.store(P1)
        fence_async_shared()
        return P1 - _mma(m_row, m_t, zc, False)

    @gluon.jit
    def _stage_rows(x, x_smem, nrm_smem, bos, c0, seq_len, i_h, H, K: gl.constexpr, C: gl.constexpr):
        """Rows c0.. c0 + C of one head of x ([Ttot, H, K], 16-bit) into x_smem as fp32, zero past the sequence,
        and their squared norms into nrm_smem [C]; 16 rows at a time, so the tile's pointers (64-bit each) never
        hold more than 32 registers a thread."""
        LR: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        t = gl.arange(0, 16, layout=gl.SliceLayout(1, LR))
        col = gl.arange(0, K, layout=gl.SliceLayout(0, LR))
        x_chunk = x + ((bos + c0).to(gl.int64) * H + i_h) * K  # scalar base, 32-bit offsets: few registers
        for r in gl.static_range(C // 16):
            row = 16 * r + t
            p = gl.expand_dims(row * (H * K), 1) + gl.expand_dims(col, 0)
            xr = gl.load(x_chunk + p, mask=gl.expand_dims(c0 + row < seq_len, 1), other=0.0).to(gl.float32)
            x_smem.slice(16 * r, 16, dim=0).store(xr)
            nrm_smem.slice(16 * r, 16, dim=0).store(gl.sum(xr * xr, axis=1))

    @gluon.jit
    def _gdn_fwd_kernel(
        q, k, v, g, beta, o, h0, ht, cu, scale, H, HV,
        K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr,
        L2: gl.constexpr, HAS_H0: gl.constexpr, STORE_HT: gl.constexpr,
    ):
        """Grid (V / BV, sequences x HV). q, k: [Ttot, H, K]; v, o: [Ttot, HV, V]; g, beta: [Ttot, HV];
        h0, ht: [N, HV, K, V] fp32; cu: [N + 1] int32 token offsets."""
        i_v = gl.program_id(0)
        i_nh = gl.program_id(1)
        i_n = i_nh // HV
        i_hv = i_nh % HV
        i_h = i_hv // (HV // H)
        bos = gl.load(cu + i_n)
        eos = gl.load(cu + i_n + 1)
        seq_len = eos - bos

        # register layouts: MMA accumulators (tf32: instruction k = 8), and a coalesced one for the loads
        MC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 8])
        MV: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 8])
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        LDV: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
        COL_C: gl.constexpr = gl.SliceLayout(0, MC)
        ROW_V: gl.constexpr = gl.SliceLayout(1, MV)

        # shared memory: left operands row-major, right operands transposed (K-major for tf32)
        SL_ROW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        SL_T: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2,
                                                  transposed=True)
        PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        q_s = gl.allocate_shared_memory(gl.float32, [C, K], SL_ROW)
        k_s = gl.allocate_shared_memory(gl.float32, [C, K], SL_ROW)
        kt_s = q_s._reinterpret(gl.float32, [K, C], SL_ROW)  # k^T for the state update, once q is used
        s_s = gl.allocate_shared_memory(gl.float32, [K, BV], SL_T)  # the state as a right operand
        v_s = gl.allocate_shared_memory(gl.float32, [C, BV], SL_T)  # beta (v - gamma K S), then V'
        m_row = gl.allocate_shared_memory(gl.float32, [C, C], SL_ROW)
        m_t1 = gl.allocate_shared_memory(gl.float32, [C, C], SL_T)
        plain = gl.allocate_shared_memory(gl.float32, [C, C], PLAIN2)
        PLAIN1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        nq = gl.allocate_shared_memory(gl.float32, [C], PLAIN1)  # squared row norms of q
        nk = gl.allocate_shared_memory(gl.float32, [C], PLAIN1)  # and of k
        d3 = gl.allocate_shared_memory(gl.float32, [C, 16], PLAIN2)  # four [16, 16] blocks

        # index vectors
        t_ldv = gl.arange(0, C, layout=gl.SliceLayout(1, LDV))
        c_ldv = gl.arange(0, BV, layout=gl.SliceLayout(0, LDV))
        i_c = gl.arange(0, C, layout=gl.SliceLayout(1, MC))
        j_c = gl.arange(0, C, layout=COL_C)
        t_v = gl.arange(0, C, layout=ROW_V)
        c_v = gl.arange(0, BV, layout=gl.SliceLayout(0, MV))
        r_k = gl.arange(0, K, layout=ROW_V)

        # the state, [K, BV] fp32 in registers for the whole sequence
        col0 = i_v * BV
        if HAS_H0:
            p_h = (i_n * HV + i_hv).to(gl.int64) * K * V + gl.expand_dims(r_k, 1) * V + col0 + gl.expand_dims(c_v, 0)
            S = gl.load(h0 + p_h)
        else:
            S = gl.zeros([K, BV], gl.float32, MV)

        for c0 in range(0, seq_len, C):
            # 1. raw inputs of the chunk, widened to fp32 in shared memory; rows past the sequence are zero (no
            #    write, no decay). Each product below is staged just before its use to keep few tiles live.
            _stage_rows(q, q_s, nq, bos, c0, seq_len, i_h, H, K, C)
            _stage_rows(k, k_s, nk, bos, c0, seq_len, i_h, H, K, C)
            if L2:  # the reference's l2norm: x * rsqrt(sum x^2 + 1e-6), as row and column scales
                rq = gl.rsqrt(nq.load(gl.SliceLayout(1, MC)) + 1e-6) * scale
                rk_r = gl.rsqrt(nk.load(gl.SliceLayout(1, MC)) + 1e-6)
                rk_c = gl.rsqrt(nk.load(COL_C) + 1e-6)
            else:
                rq = gl.full([C], 1.0, gl.float32, gl.SliceLayout(1, MC)) * scale
                rk_r = gl.full([C], 1.0, gl.float32, gl.SliceLayout(1, MC))
                rk_c = gl.full([C], 1.0, gl.float32, COL_C)
            s_s.store(S)
            ok_c = c0 + i_c < seq_len
            g_c = gl.load(g + (bos + c0 + j_c).to(gl.int64) * HV + i_hv, mask=c0 + j_c < seq_len,
                          other=0.0).to(gl.float32)
            bi = gl.load(beta + (bos + c0 + i_c).to(gl.int64) * HV + i_hv, mask=ok_c, other=0.0).to(gl.float32)
            causal = gl.expand_dims(i_c, 1) >= gl.expand_dims(j_c, 0)
            b_r = gl.sum(gl.where(causal, gl.expand_dims(g_c, 0), 0.0), axis=1)  # [C] rows: b_i = sum_{j<=i} g_j
            b_c = gl.convert_layout(b_r, COL_C)  # the same, as columns
            b_last = gl.sum(gl.where(i_c == C - 1, b_r, 0.0), axis=0)
            fence_async_shared()

            # 2. A = strict_lower(beta_i rk_i rk_j (K K^T)_ij e^{b_i - b_j}) from the raw keys
            zc = gl.zeros([C, C], gl.float32, MC)
            zv = gl.zeros([C, BV], gl.float32, MV)
            kk = _mma(k_s, k_s.permute((1, 0)), zc, False)
            lower = gl.expand_dims(i_c, 1) > gl.expand_dims(j_c, 0)
            diff = gl.expand_dims(b_r, 1) - gl.expand_dims(b_c, 0)
            A = kk * gl.exp(gl.where(lower, diff, float("-inf"))) * gl.expand_dims(bi * rk_r, 1) \
                * gl.expand_dims(rk_c, 0)

            # 3. T = (I + A)^{-1}
            T = _t_matrix(A, plain, d3, m_row, m_t1, i_c, j_c, C, MC)

            # 4. new values V' = T (beta (v - gamma Kn S)), the key scales entering on K S
            m_row.store(T)
            ks = _mma(k_s, s_s, zv, False)
            ok_v = gl.expand_dims(c0 + t_ldv < seq_len, 1)
            p_v = gl.expand_dims(t_ldv * (HV * V), 1) + gl.expand_dims(c_ldv, 0)
            v_chunk = v + ((bos + c0).to(gl.int64) * HV + i_hv) * V + col0
            vr = gl.convert_layout(gl.load(v_chunk + p_v, mask=ok_v, other=0.0).to(gl.float32), MV)
            b_v = gl.convert_layout(b_r, ROW_V)
            gam_v = gl.exp(b_v)
            rk_v = gl.convert_layout(rk_r, ROW_V)
            R = gl.expand_dims(gl.convert_layout(bi, ROW_V), 1) * (vr - gl.expand_dims(gam_v * rk_v, 1) * ks)
            v_s.store(R)
            fence_async_shared()
            Vn = _mma(m_row, v_s, zv, False)

            # 5. output: gamma Qn S + P V', P = (rq_i rk_j (Q K^T)_ij e^{b_i - b_j}, j <= i)
            qk = _mma(q_s, k_s.permute((1, 0)), zc, False)
            P = qk * gl.exp(gl.where(causal, diff, float("-inf"))) * gl.expand_dims(rq, 1) \
                * gl.expand_dims(rk_c, 0)
            m_row.store(P)
            v_s.store(Vn)
            fence_async_shared()
            qs = _mma(q_s, s_s, zv, False)
            out = _mma(m_row, v_s, gl.expand_dims(gam_v * gl.convert_layout(rq, ROW_V), 1) * qs, True)
            p_o = gl.expand_dims(t_v * (HV * V), 1) + gl.expand_dims(c_v, 0)
            o_chunk = o + ((bos + c0).to(gl.int64) * HV + i_hv) * V + col0
            gl.store(o_chunk + p_o, out.to(o.dtype.element_ty), mask=gl.expand_dims(c0 + t_v < seq_len, 1))

            # 6. state: S = e^{b_last} S + K^T (V' * rk * e^{b_last - b})
            v_s.store(Vn * gl.expand_dims(rk_v * gl.exp(b_last - b_v), 1))
            kt_s.store(gl.permute(k_s.load(LD), (1, 0)))
            fence_async_shared()
            S = _mma(kt_s, v_s, S * gl.exp(b_last), True)

        if STORE_HT:  # the offsets again: kept from before the loop they would hold 128 registers
            p_h = (i_n * HV + i_hv).to(gl.int64) * K * V + gl.expand_dims(r_k, 1) * V + col0 + gl.expand_dims(c_v, 0)
            gl.store(ht + p_h, S)

    @gluon.jit
    def _issue_rows(x, x_smem, bos, c0, seq_len, i_h, H, K: gl.constexpr, C: gl.constexpr):
        """Asynchronous copies of rows c0.. c0 + C of one head of x ([Ttot, H, K]) into x_smem [C, K]; rows past
        the sequence are zero-filled. One copy of the whole tile: copies into slices of one buffer would each be
        fenced from the next by a barrier (the compiler sees writes to one allocation)."""
        LR: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        t = gl.arange(0, C, layout=gl.SliceLayout(1, LR))
        col = gl.arange(0, K, layout=gl.SliceLayout(0, LR))
        x_chunk = x + ((bos + c0).to(gl.int64) * H + i_h) * K
        p = gl.expand_dims(t * (H * K), 1) + gl.expand_dims(col, 0)
        async_copy.async_copy_global_to_shared(x_smem, x_chunk + p, mask=gl.expand_dims(c0 + t < seq_len, 1))

    @gluon.jit
    def _row_norms(x_smem, nrm_smem, K: gl.constexpr, C: gl.constexpr):
        """Squared norms of the C rows of x_smem [C, K] (16-bit) into nrm_smem [C] fp32, in one pass (stores to
        slices of one buffer would each wait on a barrier)."""
        LR: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        xr = x_smem.load(LR).to(gl.float32)
        nrm_smem.store(gl.sum(xr * xr, axis=1))

    @gluon.jit
    def _split_store(x, hi_smem, lo_smem):
        """x (fp32) as hi + lo in the 16-bit dtype of the buffers (~2^-16 relative): two 16-bit products then
        carry an fp32 operand at better than tf32 accuracy."""
        hi = x.to(hi_smem.dtype)
        hi_smem.store(hi)
        lo_smem.store((x - hi.to(gl.float32)).to(lo_smem.dtype))

    @gluon.jit
    def _gates(g, beta, bos, c0, seq_len, i_hv, HV, i_c, j_c):
        """g of the chunk at c0 as columns (j_c's layout) and beta as rows (i_c's), fp32, zero past the sequence."""
        g_c = gl.load(g + (bos + c0 + j_c).to(gl.int64) * HV + i_hv, mask=c0 + j_c < seq_len,
                      other=0.0).to(gl.float32)
        b_r = gl.load(beta + (bos + c0 + i_c).to(gl.int64) * HV + i_hv, mask=c0 + i_c < seq_len,
                      other=0.0).to(gl.float32)
        return g_c, b_r

    @gluon.jit
    def _gdn_fwd_prefetch_kernel(
        q, k, v, g, beta, o, h0, ht, cu, scale, H, HV,
        K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr,
        L2: gl.constexpr, HAS_H0: gl.constexpr, STORE_HT: gl.constexpr,
    ):
        """`_gdn_fwd_kernel` with the next chunk's q, k, v copied asynchronously (double buffer) while this one
        computes, and the products that read q, k or the state in 16-bit: q and k as stored (exact), the state and
        the scaled new values split hi + lo. Same arguments and grid."""
        i_v = gl.program_id(0)
        i_nh = gl.program_id(1)
        i_n = i_nh // HV
        i_hv = i_nh % HV
        i_h = i_hv // (HV // H)
        bos = gl.load(cu + i_n)
        eos = gl.load(cu + i_n + 1)
        seq_len = eos - bos
        dt: gl.constexpr = q.dtype.element_ty

        # accumulators: tf32 products (instruction k 8) and 16-bit ones (k 16) share the register mapping
        MC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 8])
        MC16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
        MV: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 8])
        MV16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BV, 16])
        COL_C: gl.constexpr = gl.SliceLayout(0, MC)
        ROW_V: gl.constexpr = gl.SliceLayout(1, MV16)

        SL_ROW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        SL_T: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2,
                                                  transposed=True)
        SL_QK: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, K], dt)
        SL_V: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, BV], dt)
        PLAIN1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        q_st = gl.allocate_shared_memory(dt, [2, C, K], SL_QK)  # raw q of this chunk and the next
        k_st = gl.allocate_shared_memory(dt, [2, C, K], SL_QK)
        v_st = gl.allocate_shared_memory(dt, [2, C, BV], SL_V)
        s_hi = gl.allocate_shared_memory(dt, [K, BV], SL_V)  # the state, hi + lo
        s_lo = gl.allocate_shared_memory(dt, [K, BV], SL_V)
        u_hi = gl.allocate_shared_memory(dt, [C, BV], SL_V)  # the scaled new values of the state update, hi + lo
        u_lo = gl.allocate_shared_memory(dt, [C, BV], SL_V)
        v_s = gl.allocate_shared_memory(gl.float32, [C, BV], SL_T)  # beta (v - gamma K S), then V' (tf32)
        m_row = gl.allocate_shared_memory(gl.float32, [C, C], SL_ROW)
        m_t1 = gl.allocate_shared_memory(gl.float32, [C, C], SL_T)
        plain = gl.allocate_shared_memory(gl.float32, [C, C], PLAIN2)
        d3 = gl.allocate_shared_memory(gl.float32, [C, 16], PLAIN2)
        nq = gl.allocate_shared_memory(gl.float32, [C], PLAIN1)
        nk = gl.allocate_shared_memory(gl.float32, [C], PLAIN1)

        i_c = gl.arange(0, C, layout=gl.SliceLayout(1, MC))
        j_c = gl.arange(0, C, layout=COL_C)
        t_v = gl.arange(0, C, layout=ROW_V)
        c_v = gl.arange(0, BV, layout=gl.SliceLayout(0, MV16))
        r_k = gl.arange(0, K, layout=ROW_V)
        t_ldv = gl.arange(0, C, layout=gl.SliceLayout(1, gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])))
        c_ldv = gl.arange(0, BV, layout=gl.SliceLayout(0, gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])))
        col0 = i_v * BV

        if HAS_H0:
            p_h = (i_n * HV + i_hv).to(gl.int64) * K * V + gl.expand_dims(r_k, 1) * V + col0 + gl.expand_dims(c_v, 0)
            S = gl.load(h0 + p_h)
        else:
            S = gl.zeros([K, BV], gl.float32, MV16)

        # prologue: chunk 0 into buffer 0
        _issue_rows(q, q_st.index(0), bos, 0, seq_len, i_h, H, K, C)
        _issue_rows(k, k_st.index(0), bos, 0, seq_len, i_h, H, K, C)
        p_v = gl.expand_dims(t_ldv * (HV * V), 1) + gl.expand_dims(c_ldv, 0)
        v_base = v + i_hv * V + col0
        async_copy.async_copy_global_to_shared(v_st.index(0), v_base + bos.to(gl.int64) * HV * V + p_v,
                                               mask=gl.expand_dims(t_ldv < seq_len, 1))
        async_copy.commit_group()
        g_nxt, beta_nxt = _gates(g, beta, bos, 0, seq_len, i_hv, HV, i_c, j_c)  # in registers a chunk ahead

        for c0 in range(0, seq_len, C):
            buf = (c0 // C) % 2
            # 0. the next chunk's copies into the other buffer (its last readers finished with the previous
            #    chunk), then wait for this chunk's
            gl.thread_barrier()
            nxt = c0 + C
            _issue_rows(q, q_st.index(1 - buf), bos, nxt, seq_len, i_h, H, K, C)
            _issue_rows(k, k_st.index(1 - buf), bos, nxt, seq_len, i_h, H, K, C)
            async_copy.async_copy_global_to_shared(v_st.index(1 - buf),
                                                   v_base + (bos + nxt).to(gl.int64) * HV * V + p_v,
                                                   mask=gl.expand_dims(nxt + t_ldv < seq_len, 1))
            async_copy.commit_group()
            g_c, bi = g_nxt, beta_nxt
            g_nxt, beta_nxt = _gates(g, beta, bos, nxt, seq_len, i_hv, HV, i_c, j_c)
            _split_store(S, s_hi, s_lo)
            async_copy.wait_group(1)
            gl.thread_barrier()  # every thread's copies of this chunk have landed
            qb = q_st.index(buf)
            kb = k_st.index(buf)
            vb = v_st.index(buf)
            if L2:
                _row_norms(qb, nq, K, C)
                _row_norms(kb, nk, K, C)
                rq = gl.rsqrt(nq.load(gl.SliceLayout(1, MC)) + 1e-6) * scale
                rk_r = gl.rsqrt(nk.load(gl.SliceLayout(1, MC)) + 1e-6)
                rk_c = gl.rsqrt(nk.load(COL_C) + 1e-6)
            else:
                rq = gl.full([C], 1.0, gl.float32, gl.SliceLayout(1, MC)) * scale
                rk_r = gl.full([C], 1.0, gl.float32, gl.SliceLayout(1, MC))
                rk_c = gl.full([C], 1.0, gl.float32, COL_C)
            causal = gl.expand_dims(i_c, 1) >= gl.expand_dims(j_c, 0)
            b_r = gl.sum(gl.where(causal, gl.expand_dims(g_c, 0), 0.0), axis=1)  # b_i = sum_{j<=i} g_j
            b_c = gl.convert_layout(b_r, COL_C)
            b_last = gl.sum(gl.where(i_c == C - 1, b_r, 0.0), axis=0)
            fence_async_shared()

            # 1. A from the raw keys (16-bit products, exact)
            zc16 = gl.zeros([C, C], gl.float32, MC16)
            zv16 = gl.zeros([C, BV], gl.float32, MV16)
            kk = gl.convert_layout(_mma(kb, kb.permute((1, 0)), zc16, False), MC)
            lower = gl.expand_dims(i_c, 1) > gl.expand_dims(j_c, 0)
            diff = gl.expand_dims(b_r, 1) - gl.expand_dims(b_c, 0)
            A = kk * gl.exp(gl.where(lower, diff, float("-inf"))) * gl.expand_dims(bi * rk_r, 1) \
                * gl.expand_dims(rk_c, 0)

            # 2. T = (I + A)^{-1}
            T = _t_matrix(A, plain, d3, m_row, m_t1, i_c, j_c, C, MC)

            # 3. V' = T (beta (v - gamma Kn S)); K S from the state's hi + lo
            m_row.store(T)
            ks = _mma(kb, s_lo, _mma(kb, s_hi, zv16, False), True)
            b_v = gl.convert_layout(b_r, ROW_V)
            gam_v = gl.exp(b_v)
            rk_v = gl.convert_layout(rk_r, ROW_V)
            vr = vb.load(MV16).to(gl.float32)
            R = gl.expand_dims(gl.convert_layout(bi, ROW_V), 1) * (vr - gl.expand_dims(gam_v * rk_v, 1) * ks)
            v_s.store(R)
            fence_async_shared()
            Vn = gl.convert_layout(_mma(m_row, v_s, gl.zeros([C, BV], gl.float32, MV), False), MV16)

            # 4. output: gamma Qn S + P V'
            qk = gl.convert_layout(_mma(qb, kb.permute((1, 0)), zc16, False), MC)
            P = qk * gl.exp(gl.where(causal, diff, float("-inf"))) * gl.expand_dims(rq, 1) * gl.expand_dims(rk_c, 0)
            m_row.store(P)
            v_s.store(Vn)
            fence_async_shared()
            qs = _mma(qb, s_lo, _mma(qb, s_hi, zv16, False), True)
            acc = gl.convert_layout(gl.expand_dims(gam_v * gl.convert_layout(rq, ROW_V), 1) * qs, MV)
            out = gl.convert_layout(_mma(m_row, v_s, acc, True), MV16)
            p_o = gl.expand_dims(t_v * (HV * V), 1) + gl.expand_dims(c_v, 0)
            o_chunk = o + ((bos + c0).to(gl.int64) * HV + i_hv) * V + col0
            gl.store(o_chunk + p_o, out.to(o.dtype.element_ty), mask=gl.expand_dims(c0 + t_v < seq_len, 1))

            # 5. state: S = e^{b_last} S + K^T (V' * rk * e^{b_last - b}), the scaled values split hi + lo
            _split_store(Vn * gl.expand_dims(rk_v * gl.exp(b_last - b_v), 1), u_hi, u_lo)
            fence_async_shared()
            kt = kb.permute((1, 0))
            S = _mma(kt, u_lo, _mma(kt, u_hi, S * gl.exp(b_last), True), True)

        async_copy.wait_group(0)  # no copy may outlive the program
        if STORE_HT:  # the offsets again: kept from before the loop they would hold 128 registers
            p_h = (i_n * HV + i_hv).to(gl.int64) * K * V + gl.expand_dims(r_k, 1) * V + col0 + gl.expand_dims(c_v, 0)
            gl.store(ht + p_h, S)

    @gluon.jit
    def _gdn_t_kernel(
        k, g, beta, Tbuf, cu, chunk_off, H, HV,
        K: gl.constexpr, C: gl.constexpr, L2: gl.constexpr,
    ):
        """T = (I + A)^{-1} of every chunk, in parallel: grid (most chunks of a sequence, sequences x HV); T of
        chunk c of sequence n and value head hv goes to Tbuf[chunk_off[n] + c, hv] ([chunks, HV, C, C] fp32).
        A from the raw keys in 16-bit products (exact), as in `_gdn_fwd_prefetch_kernel`."""
        i_c0 = gl.program_id(0)
        i_nh = gl.program_id(1)
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
            COL_C: gl.constexpr = gl.SliceLayout(0, MC)
            SL_ROW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
            SL_T: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2,
                                                      transposed=True)
            SL_QK: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, K], dt)
            PLAIN1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
            PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
            k_st = gl.allocate_shared_memory(dt, [C, K], SL_QK)
            m_row = gl.allocate_shared_memory(gl.float32, [C, C], SL_ROW)
            m_t1 = gl.allocate_shared_memory(gl.float32, [C, C], SL_T)
            plain = gl.allocate_shared_memory(gl.float32, [C, C], PLAIN2)
            d3 = gl.allocate_shared_memory(gl.float32, [C, 16], PLAIN2)
            nk = gl.allocate_shared_memory(gl.float32, [C], PLAIN1)
            i_c = gl.arange(0, C, layout=gl.SliceLayout(1, MC))
            j_c = gl.arange(0, C, layout=COL_C)

            _issue_rows(k, k_st, bos, c0, seq_len, i_h, H, K, C)
            async_copy.commit_group()
            g_c = gl.load(g + (bos + c0 + j_c).to(gl.int64) * HV + i_hv, mask=c0 + j_c < seq_len,
                          other=0.0).to(gl.float32)
            bi = gl.load(beta + (bos + c0 + i_c).to(gl.int64) * HV + i_hv, mask=c0 + i_c < seq_len,
                         other=0.0).to(gl.float32)
            async_copy.wait_group(0)
            gl.thread_barrier()
            if L2:
                _row_norms(k_st, nk, K, C)
                rk_r = gl.rsqrt(nk.load(gl.SliceLayout(1, MC)) + 1e-6)
                rk_c = gl.rsqrt(nk.load(COL_C) + 1e-6)
            else:
                rk_r = gl.full([C], 1.0, gl.float32, gl.SliceLayout(1, MC))
                rk_c = gl.full([C], 1.0, gl.float32, COL_C)
            causal = gl.expand_dims(i_c, 1) >= gl.expand_dims(j_c, 0)
            b_r = gl.sum(gl.where(causal, gl.expand_dims(g_c, 0), 0.0), axis=1)
            b_c = gl.convert_layout(b_r, COL_C)
            fence_async_shared()
            kk = gl.convert_layout(_mma(k_st, k_st.permute((1, 0)), gl.zeros([C, C], gl.float32, MC16), False), MC)
            lower = gl.expand_dims(i_c, 1) > gl.expand_dims(j_c, 0)
            diff = gl.expand_dims(b_r, 1) - gl.expand_dims(b_c, 0)
            A = kk * gl.exp(gl.where(lower, diff, float("-inf"))) * gl.expand_dims(bi * rk_r, 1) \
                * gl.expand_dims(rk_c, 0)
            T = _t_matrix(A, plain, d3, m_row, m_t1, i_c, j_c, C, MC)
            slot = (gl.load(chunk_off + i_n) + i_c0).to(gl.int64) * HV + i_hv
            p_t = gl.expand_dims(i_c, 1) * C + gl.expand_dims(j_c, 0)
            gl.store(Tbuf + slot * C * C + p_t, T)

    @gluon.jit
    def _gdn_fwd_split_kernel(
        q, k, v, g, beta, Tbuf, o, h0, ht, cu, chunk_off, scale, H, HV,
        K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr,
        L2: gl.constexpr, HAS_H0: gl.constexpr, STORE_HT: gl.constexpr,
    ):
        """`_gdn_fwd_prefetch_kernel` with T read from Tbuf (written by `_gdn_t_kernel` before it) instead of
        solved here: the sequential chain per chunk keeps only the products that need the state, and T is copied
        in with the next chunk's q, k, v. Same grid."""
        i_v = gl.program_id(0)
        i_nh = gl.program_id(1)
        i_n = i_nh // HV
        i_hv = i_nh % HV
        i_h = i_hv // (HV // H)
        bos = gl.load(cu + i_n)
        eos = gl.load(cu + i_n + 1)
        seq_len = eos - bos
        t_first = gl.load(chunk_off + i_n).to(gl.int64)
        dt: gl.constexpr = q.dtype.element_ty

        MC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 8])
        MC16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
        MV: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 8])
        MV16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BV, 16])
        COL_C: gl.constexpr = gl.SliceLayout(0, MC)
        ROW_V: gl.constexpr = gl.SliceLayout(1, MV16)
        LT: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])

        SL_ROW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        SL_T: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2,
                                                  transposed=True)
        SL_QK: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, K], dt)
        SL_V: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, BV], dt)
        PLAIN1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        q_st = gl.allocate_shared_memory(dt, [2, C, K], SL_QK)
        k_st = gl.allocate_shared_memory(dt, [2, C, K], SL_QK)
        v_st = gl.allocate_shared_memory(dt, [2, C, BV], SL_V)
        t_st = gl.allocate_shared_memory(gl.float32, [2, C, C], SL_ROW)  # T of this chunk and the next
        s_hi = gl.allocate_shared_memory(dt, [K, BV], SL_V)
        s_lo = gl.allocate_shared_memory(dt, [K, BV], SL_V)
        u_hi = gl.allocate_shared_memory(dt, [C, BV], SL_V)
        u_lo = gl.allocate_shared_memory(dt, [C, BV], SL_V)
        v_s = gl.allocate_shared_memory(gl.float32, [C, BV], SL_T)
        m_row = gl.allocate_shared_memory(gl.float32, [C, C], SL_ROW)
        nq = gl.allocate_shared_memory(gl.float32, [C], PLAIN1)
        nk = gl.allocate_shared_memory(gl.float32, [C], PLAIN1)

        i_c = gl.arange(0, C, layout=gl.SliceLayout(1, MC))
        j_c = gl.arange(0, C, layout=COL_C)
        t_v = gl.arange(0, C, layout=ROW_V)
        c_v = gl.arange(0, BV, layout=gl.SliceLayout(0, MV16))
        r_k = gl.arange(0, K, layout=ROW_V)
        t_ldv = gl.arange(0, C, layout=gl.SliceLayout(1, gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])))
        c_ldv = gl.arange(0, BV, layout=gl.SliceLayout(0, gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])))
        p_t = gl.expand_dims(gl.arange(0, C, layout=gl.SliceLayout(1, LT)) * C, 1) \
            + gl.expand_dims(gl.arange(0, C, layout=gl.SliceLayout(0, LT)), 0)
        col0 = i_v * BV

        if HAS_H0:
            p_h = (i_n * HV + i_hv).to(gl.int64) * K * V + gl.expand_dims(r_k, 1) * V + col0 + gl.expand_dims(c_v, 0)
            S = gl.load(h0 + p_h)
        else:
            S = gl.zeros([K, BV], gl.float32, MV16)

        p_v = gl.expand_dims(t_ldv * (HV * V), 1) + gl.expand_dims(c_ldv, 0)
        v_base = v + i_hv * V + col0
        _issue_rows(q, q_st.index(0), bos, 0, seq_len, i_h, H, K, C)
        _issue_rows(k, k_st.index(0), bos, 0, seq_len, i_h, H, K, C)
        async_copy.async_copy_global_to_shared(v_st.index(0), v_base + bos.to(gl.int64) * HV * V + p_v,
                                               mask=gl.expand_dims(t_ldv < seq_len, 1))
        async_copy.async_copy_global_to_shared(t_st.index(0), Tbuf + (t_first * HV + i_hv) * C * C + p_t,
                                               mask=(p_t >= 0) & (seq_len > 0))
        async_copy.commit_group()
        g_nxt, beta_nxt = _gates(g, beta, bos, 0, seq_len, i_hv, HV, i_c, j_c)  # in registers a chunk ahead

        for c0 in range(0, seq_len, C):
            buf = (c0 // C) % 2
            gl.thread_barrier()
            nxt = c0 + C
            _issue_rows(q, q_st.index(1 - buf), bos, nxt, seq_len, i_h, H, K, C)
            _issue_rows(k, k_st.index(1 - buf), bos, nxt, seq_len, i_h, H, K, C)
            async_copy.async_copy_global_to_shared(v_st.index(1 - buf),
                                                   v_base + (bos + nxt).to(gl.int64) * HV * V + p_v,
                                                   mask=gl.expand_dims(nxt + t_ldv < seq_len, 1))
            slot = (t_first + nxt // C) * HV + i_hv
            async_copy.async_copy_global_to_shared(t_st.index(1 - buf), Tbuf + slot * C * C + p_t,
                                                   mask=(p_t >= 0) & (nxt < seq_len))
            async_copy.commit_group()
            g_c, bi = g_nxt, beta_nxt
            g_nxt, beta_nxt = _gates(g, beta, bos, nxt, seq_len, i_hv, HV, i_c, j_c)
            _split_store(S, s_hi, s_lo)
            async_copy.wait_group(1)
            gl.thread_barrier()
            qb = q_st.index(buf)
            kb = k_st.index(buf)
            vb = v_st.index(buf)
            if L2:
                _row_norms(qb, nq, K, C)
                _row_norms(kb, nk, K, C)
                rq = gl.rsqrt(nq.load(gl.SliceLayout(1, MC)) + 1e-6) * scale
                rk_r = gl.rsqrt(nk.load(gl.SliceLayout(1, MC)) + 1e-6)
                rk_c = gl.rsqrt(nk.load(COL_C) + 1e-6)
            else:
                rq = gl.full([C], 1.0, gl.float32, gl.SliceLayout(1, MC)) * scale
                rk_r = gl.full([C], 1.0, gl.float32, gl.SliceLayout(1, MC))
                rk_c = gl.full([C], 1.0, gl.float32, COL_C)
            causal = gl.expand_dims(i_c, 1) >= gl.expand_dims(j_c, 0)
            b_r = gl.sum(gl.where(causal, gl.expand_dims(g_c, 0), 0.0), axis=1)
            b_c = gl.convert_layout(b_r, COL_C)
            b_last = gl.sum(gl.where(i_c == C - 1, b_r, 0.0), axis=0)
            fence_async_shared()
            zc16 = gl.zeros([C, C], gl.float32, MC16)
            zv16 = gl.zeros([C, BV], gl.float32, MV16)

            # 1. V' = T (beta (v - gamma Kn S))
            ks = _mma(kb, s_lo, _mma(kb, s_hi, zv16, False), True)
            b_v = gl.convert_layout(b_r, ROW_V)
            gam_v = gl.exp(b_v)
            rk_v = gl.convert_layout(rk_r, ROW_V)
            vr = vb.load(MV16).to(gl.float32)
            R = gl.expand_dims(gl.convert_layout(bi, ROW_V), 1) * (vr - gl.expand_dims(gam_v * rk_v, 1) * ks)
            v_s.store(R)
            fence_async_shared()
            Vn = gl.convert_layout(_mma(t_st.index(buf), v_s, gl.zeros([C, BV], gl.float32, MV), False), MV16)

            # 2. output: gamma Qn S + P V'
            qk = gl.convert_layout(_mma(qb, kb.permute((1, 0)), zc16, False), MC)
            diff = gl.expand_dims(b_r, 1) - gl.expand_dims(b_c, 0)
            P = qk * gl.exp(gl.where(causal, diff, float("-inf"))) * gl.expand_dims(rq, 1) * gl.expand_dims(rk_c, 0)
            m_row.store(P)
            v_s.store(Vn)
            fence_async_shared()
            qs = _mma(qb, s_lo, _mma(qb, s_hi, zv16, False), True)
            acc = gl.convert_layout(gl.expand_dims(gam_v * gl.convert_layout(rq, ROW_V), 1) * qs, MV)
            out = gl.convert_layout(_mma(m_row, v_s, acc, True), MV16)
            p_o = gl.expand_dims(t_v * (HV * V), 1) + gl.expand_dims(c_v, 0)
            o_chunk = o + ((bos + c0).to(gl.int64) * HV + i_hv) * V + col0
            gl.store(o_chunk + p_o, out.to(o.dtype.element_ty), mask=gl.expand_dims(c0 + t_v < seq_len, 1))

            # 3. state
            _split_store(Vn * gl.expand_dims(rk_v * gl.exp(b_last - b_v), 1), u_hi, u_lo)
            fence_async_shared()
            kt = kb.permute((1, 0))
            S = _mma(kt, u_lo, _mma(kt, u_hi, S * gl.exp(b_last), True), True)

        async_copy.wait_group(0)
        if STORE_HT:
            p_h = (i_n * HV + i_hv).to(gl.int64) * K * V + gl.expand_dims(r_k, 1) * V + col0 + gl.expand_dims(c_v, 0)
            gl.store(ht + p_h, S)

    @gluon.jit
    def _ws_solve_partition(k, g, beta, bos, seq_len, i_h, i_hv, H, HV, k_w, m_row, m_t, plain, d3, nk, t_st, t_full,
                            t_empty, K: gl.constexpr, C: gl.constexpr, L2: gl.constexpr):
        """Worker partition of `_gdn_fwd_ws_kernel`: T of every chunk, in order, into t_st[n % 2] (fp32 [C, C]),
        signalling t_full[n % 2] and waiting on t_empty[n % 2] before it overwrites a slot; it runs up to two chunks
        ahead of the state chain. Its own copy of k (single buffer)."""
        MC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 8])
        MC16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
        COL_C: gl.constexpr = gl.SliceLayout(0, MC)
        i_c = gl.arange(0, C, layout=gl.SliceLayout(1, MC))
        j_c = gl.arange(0, C, layout=COL_C)
        for c0 in range(0, seq_len, C):
            n = c0 // C
            slot = n % 2
            _issue_rows(k, k_w, bos, c0, seq_len, i_h, H, K, C)
            async_copy.commit_group()
            g_c, bi = _gates(g, beta, bos, c0, seq_len, i_hv, HV, i_c, j_c)
            async_copy.wait_group(0)
            gl.thread_barrier()
            if L2:
                _row_norms(k_w, nk, K, C)
                rk_r = gl.rsqrt(nk.load(gl.SliceLayout(1, MC)) + 1e-6)
                rk_c = gl.rsqrt(nk.load(COL_C) + 1e-6)
            else:
                rk_r = gl.full([C], 1.0, gl.float32, gl.SliceLayout(1, MC))
                rk_c = gl.full([C], 1.0, gl.float32, COL_C)
            causal = gl.expand_dims(i_c, 1) >= gl.expand_dims(j_c, 0)
            b_r = gl.sum(gl.where(causal, gl.expand_dims(g_c, 0), 0.0), axis=1)
            b_c = gl.convert_layout(b_r, COL_C)
            fence_async_shared()
            kk = gl.convert_layout(_mma(k_w, k_w.permute((1, 0)), gl.zeros([C, C], gl.float32, MC16), False), MC)
            lower = gl.expand_dims(i_c, 1) > gl.expand_dims(j_c, 0)
            diff = gl.expand_dims(b_r, 1) - gl.expand_dims(b_c, 0)
            A = kk * gl.exp(gl.where(lower, diff, float("-inf"))) * gl.expand_dims(bi * rk_r, 1) \
                * gl.expand_dims(rk_c, 0)
            T = _t_matrix(A, plain, d3, m_row, m_t, i_c, j_c, C, MC)
            mbarrier.wait(t_empty.index(slot), ((n // 2) & 1) ^ 1)  # the chain is done with this slot's last T
            t_st.index(slot).store(T)
            fence_async_shared()
            mbarrier.arrive(t_full.index(slot), count=1)

    @gluon.jit
    def _ws_chain_partition(q, k, v, g, beta, o, h0, ht, bos, seq_len, i_n, i_h, i_hv, col0, scale, H, HV, q_st, k_st,
                            v_st, s_hi, s_lo, u_hi, u_lo, v_s, m_row, nq, nk, t_st, t_full, t_empty,
                            K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr, L2: gl.constexpr,
                            HAS_H0: gl.constexpr, STORE_HT: gl.constexpr):
        """Default partition of `_gdn_fwd_ws_kernel`: the state chain of `_gdn_fwd_split_kernel`, T taken from
        t_st[n % 2] once t_full[n % 2] says the solve partition wrote it, and the slot handed back after use."""
        MC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 8])
        MC16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
        MV: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 8])
        MV16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BV, 16])
        COL_C: gl.constexpr = gl.SliceLayout(0, MC)
        ROW_V: gl.constexpr = gl.SliceLayout(1, MV16)
        i_c = gl.arange(0, C, layout=gl.SliceLayout(1, MC))
        j_c = gl.arange(0, C, layout=COL_C)
        t_v = gl.arange(0, C, layout=ROW_V)
        c_v = gl.arange(0, BV, layout=gl.SliceLayout(0, MV16))
        r_k = gl.arange(0, K, layout=ROW_V)
        t_ldv = gl.arange(0, C, layout=gl.SliceLayout(1, gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])))
        c_ldv = gl.arange(0, BV, layout=gl.SliceLayout(0, gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])))
        if HAS_H0:
            p_h = (i_n * HV + i_hv).to(gl.int64) * K * V + gl.expand_dims(r_k, 1) * V + col0 + gl.expand_dims(c_v, 0)
            S = gl.load(h0 + p_h)
        else:
            S = gl.zeros([K, BV], gl.float32, MV16)
        p_v = gl.expand_dims(t_ldv * (HV * V), 1) + gl.expand_dims(c_ldv, 0)
        v_base = v + i_hv * V + col0
        _issue_rows(q, q_st.index(0), bos, 0, seq_len, i_h, H, K, C)
        _issue_rows(k, k_st.index(0), bos, 0, seq_len, i_h, H, K, C)
        async_copy.async_copy_global_to_shared(v_st.index(0), v_base + bos.to(gl.int64) * HV * V + p_v,
                                               mask=gl.expand_dims(t_ldv < seq_len, 1))
        async_copy.commit_group()
        g_nxt, beta_nxt = _gates(g, beta, bos, 0, seq_len, i_hv, HV, i_c, j_c)
        for c0 in range(0, seq_len, C):
            n = c0 // C
            buf = n % 2
            gl.thread_barrier()
            nxt = c0 + C
            _issue_rows(q, q_st.index(1 - buf), bos, nxt, seq_len, i_h, H, K, C)
            _issue_rows(k, k_st.index(1 - buf), bos, nxt, seq_len, i_h, H, K, C)
            async_copy.async_copy_global_to_shared(v_st.index(1 - buf),
                                                   v_base + (bos + nxt).to(gl.int64) * HV * V + p_v,
                                                   mask=gl.expand_dims(nxt + t_ldv < seq_len, 1))
            async_copy.commit_group()
            g_c, bi = g_nxt, beta_nxt
            g_nxt, beta_nxt = _gates(g, beta, bos, nxt, seq_len, i_hv, HV, i_c, j_c)
            _split_store(S, s_hi, s_lo)
            async_copy.wait_group(1)
            gl.thread_barrier()
            qb = q_st.index(buf)
            kb = k_st.index(buf)
            vb = v_st.index(buf)
            if L2:
                _row_norms(qb, nq, K, C)
                _row_norms(kb, nk, K, C)
                rq = gl.rsqrt(nq.load(gl.SliceLayout(1, MC)) + 1e-6) * scale
                rk_r = gl.rsqrt(nk.load(gl.SliceLayout(1, MC)) + 1e-6)
                rk_c = gl.rsqrt(nk.load(COL_C) + 1e-6)
            else:
                rq = gl.full([C], 1.0, gl.float32, gl.SliceLayout(1, MC)) * scale
                rk_r = gl.full([C], 1.0, gl.float32, gl.SliceLayout(1, MC))
                rk_c = gl.full([C], 1.0, gl.float32, COL_C)
            causal = gl.expand_dims(i_c, 1) >= gl.expand_dims(j_c, 0)
            b_r = gl.sum(gl.where(causal, gl.expand_dims(g_c, 0), 0.0), axis=1)
            b_c = gl.convert_layout(b_r, COL_C)
            b_last = gl.sum(gl.where(i_c == C - 1, b_r, 0.0), axis=0)
            fence_async_shared()
            zc16 = gl.zeros([C, C], gl.float32, MC16)
            zv16 = gl.zeros([C, BV], gl.float32, MV16)

            # 1. V' = T (beta (v - gamma Kn S)), T from the solve partition
            ks = _mma(kb, s_lo, _mma(kb, s_hi, zv16, False), True)
            b_v = gl.convert_layout(b_r, ROW_V)
            gam_v = gl.exp(b_v)
            rk_v = gl.convert_layout(rk_r, ROW_V)
            vr = vb.load(MV16).to(gl.float32)
            R = gl.expand_dims(gl.convert_layout(bi, ROW_V), 1) * (vr - gl.expand_dims(gam_v * rk_v, 1) * ks)
            v_s.store(R)
            fence_async_shared()
            slot = n % 2
            mbarrier.wait(t_full.index(slot), (n // 2) & 1)
            Vn = gl.convert_layout(_mma(t_st.index(slot), v_s, gl.zeros([C, BV], gl.float32, MV), False), MV16)
            mbarrier.arrive(t_empty.index(slot), count=1)

            # 2. output: gamma Qn S + P V'
            qk = gl.convert_layout(_mma(qb, kb.permute((1, 0)), zc16, False), MC)
            diff = gl.expand_dims(b_r, 1) - gl.expand_dims(b_c, 0)
            P = qk * gl.exp(gl.where(causal, diff, float("-inf"))) * gl.expand_dims(rq, 1) * gl.expand_dims(rk_c, 0)
            m_row.store(P)
            v_s.store(Vn)
            fence_async_shared()
            qs = _mma(qb, s_lo, _mma(qb, s_hi, zv16, False), True)
            acc = gl.convert_layout(gl.expand_dims(gam_v * gl.convert_layout(rq, ROW_V), 1) * qs, MV)
            out = gl.convert_layout(_mma(m_row, v_s, acc, True), MV16)
            p_o = gl.expand_dims(t_v * (HV * V), 1) + gl.expand_dims(c_v, 0)
            o_chunk = o + ((bos + c0).to(gl.int64) * HV + i_hv) * V + col0
            gl.store(o_chunk + p_o, out.to(o.dtype.element_ty), mask=gl.expand_dims(c0 + t_v < seq_len, 1))

            # 3. state
            _split_store(Vn * gl.expand_dims(rk_v * gl.exp(b_last - b_v), 1), u_hi, u_lo)
            fence_async_shared()
            kt = kb.permute((1, 0))
            S = _mma(kt, u_lo, _mma(kt, u_hi, S * gl.exp(b_last), True), True)
        async_copy.wait_group(0)
        if STORE_HT:
            p_h = (i_n * HV + i_hv).to(gl.int64) * K * V + gl.expand_dims(r_k, 1) * V + col0 + gl.expand_dims(c_v, 0)
            gl.store(ht + p_h, S)

    @gluon.jit
    def _gdn_fwd_ws_kernel(
        q, k, v, g, beta, o, h0, ht, cu, scale, H, HV,
        K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr,
        L2: gl.constexpr, HAS_H0: gl.constexpr, STORE_HT: gl.constexpr,
    ):
        """One launch, warp-specialized: the default partition (4 warps) runs the state chain of
        `_gdn_fwd_split_kernel` while a worker partition (4 warps) solves T of the next chunks into a double
        buffer guarded by mbarriers. Same arguments and grid as `_gdn_fwd_kernel`; value block 32 (the shared
        memory of both partitions)."""
        i_v = gl.program_id(0)
        i_nh = gl.program_id(1)
        i_n = i_nh // HV
        i_hv = i_nh % HV
        i_h = i_hv // (HV // H)
        bos = gl.load(cu + i_n)
        seq_len = gl.load(cu + i_n + 1) - bos
        dt: gl.constexpr = q.dtype.element_ty
        SL_ROW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        SL_T: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2,
                                                  transposed=True)
        SL_QK: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, K], dt)
        SL_V: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, BV], dt)
        PLAIN1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        # the chain's buffers
        q_st = gl.allocate_shared_memory(dt, [2, C, K], SL_QK)
        k_st = gl.allocate_shared_memory(dt, [2, C, K], SL_QK)
        v_st = gl.allocate_shared_memory(dt, [2, C, BV], SL_V)
        s_hi = gl.allocate_shared_memory(dt, [K, BV], SL_V)
        s_lo = gl.allocate_shared_memory(dt, [K, BV], SL_V)
        u_hi = gl.allocate_shared_memory(dt, [C, BV], SL_V)
        u_lo = gl.allocate_shared_memory(dt, [C, BV], SL_V)
        v_s = gl.allocate_shared_memory(gl.float32, [C, BV], SL_T)
        m_row = gl.allocate_shared_memory(gl.float32, [C, C], SL_ROW)
        nq = gl.allocate_shared_memory(gl.float32, [C], PLAIN1)
        nk = gl.allocate_shared_memory(gl.float32, [C], PLAIN1)
        # the solve's buffers, and the hand-over of T
        k_w = gl.allocate_shared_memory(dt, [C, K], SL_QK)
        m_row_w = gl.allocate_shared_memory(gl.float32, [C, C], SL_ROW)
        m_t_w = gl.allocate_shared_memory(gl.float32, [C, C], SL_T)
        plain = gl.allocate_shared_memory(gl.float32, [C, C], PLAIN2)
        d3 = gl.allocate_shared_memory(gl.float32, [C, 16], PLAIN2)
        nk_w = gl.allocate_shared_memory(gl.float32, [C], PLAIN1)
        t_st = gl.allocate_shared_memory(gl.float32, [2, C, C], SL_ROW)
        t_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        t_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(t_full.index(i), count=1)
            mbarrier.init(t_empty.index(i), count=1)
        col0 = i_v * BV
        gl.warp_specialize([
            (_ws_chain_partition, (q, k, v, g, beta, o, h0, ht, bos, seq_len, i_n, i_h, i_hv, col0, scale, H, HV,
                                   q_st, k_st, v_st, s_hi, s_lo, u_hi, u_lo, v_s, m_row, nq, nk, t_st, t_full,
                                   t_empty, K, V, BV, C, L2, HAS_H0, STORE_HT)),
            (_ws_solve_partition, (k, g, beta, bos, seq_len, i_h, i_hv, H, HV, k_w, m_row_w, m_t_w, plain, d3, nk_w,
                                   t_st, t_full, t_empty, K, C, L2)),
        ], [4], [152])  # registers a thread of the solve partition (the T kernel alone takes 122)
        for i in gl.static_range(2):
            mbarrier.invalidate(t_full.index(i))
            mbarrier.invalidate(t_empty.index(i))


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k: expected equal shapes [B, T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v: expected [B, T, HV, V] = [{B}, {T}, HV, V], got {tuple(v.shape)}")
    HV, V = v.shape[2:]
    if HV % H:
        raise ValueError(f"v: expected its heads HV a multiple of q's H = {H}, got HV = {HV}")
    if K not in SUPPORTED_K or V not in SUPPORTED_V:
        raise ValueError(f"q, v: expected head dims K in {SUPPORTED_K} and V in {SUPPORTED_V}, got K={K} V={V}")
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v: expected one dtype, bfloat16 or float16, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, x in (("g", g), ("beta", beta)):
        if x is None or tuple(x.shape) != (B, T, HV):
            raise ValueError(f"{name}: expected [B, T, HV] = [{B}, {T}, {HV}], got "
                             f"{None if x is None else tuple(x.shape)}")
    if not q.is_cuda:
        raise ValueError(f"q: expected a CUDA tensor, got device {q.device}")
    cap = torch.cuda.get_device_capability(q.device)
    if cap != (9, 0):
        raise ValueError(f"q: expected a device of compute capability (9, 0) (Hopper), got {cap}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens: expected B = 1 (sequences packed along T), got B = {B}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, HV, K, V):
        raise ValueError(f"initial_state: expected [N, HV, K, V] = [{N}, {HV}, {K}, {V}], "
                         f"got {tuple(initial_state.shape)}")


def _value_block(heads: int, V: int, dev: torch.device) -> int:
    """64, or 32 when even V / 32 x heads programs fit in one wave (one program per multiprocessor: its shared
    memory): each program walks the whole sequence, so at few heads only more programs shorten the run, although a
    smaller block repeats the chunk-local work (A, T, P) once more per value block."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    return 32 if heads * (V // 32) <= sms else 64


def fused_gated_delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule forward in one launch (Hopper only; no autograd).

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H (value head hv reads key head hv // (HV // H));
    g (log-decay), beta: [B, T, HV]; initial_state: [N, HV, K, V] (N = B, or len(cu_seqlens) - 1 with B = 1);
    cu_seqlens: [N + 1] token offsets of packed sequences. Returns o [B, T, HV, V] in q's dtype and the final
    state [N, HV, K, V] in fp32 (None unless output_final_state). Same contract as
    `hybridlm.ops.gated_delta_rule` for these arguments.
    """
    if not gluon_available():
        raise ValueError(f"triton: expected the Gluon API of Triton 3.6, got Triton {triton.__version__}")
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    if scale is None:
        scale = K**-0.5
    dev = q.device
    if cu_seqlens is None:
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=dev)
    else:
        cu = cu_seqlens.to(device=dev, dtype=torch.int32)
    N = cu.numel() - 1
    qc, kc, vc = (x.contiguous() for x in (q, k, v))
    gc, bc = g.contiguous(), beta.contiguous()
    alloc = torch.full if POISON else lambda shape, _, **kw: torch.empty(shape, **kw)
    o = alloc(vc.shape, float("nan"), dtype=vc.dtype, device=dev)
    ht = alloc((N, HV, K, V), float("nan"), dtype=torch.float32, device=dev) if output_final_state else None
    h0 = initial_state.to(torch.float32).contiguous() if initial_state is not None else None
    dummy = o  # never read: the HAS_H0 / STORE_HT branches are compiled out
    BV = 32 if KERNEL == "ws" else _value_block(N * HV, V, dev)  # ws: both partitions' buffers fit at 32 only
    grid = (V // BV, N * HV)
    states = (h0 if h0 is not None else dummy, ht if ht is not None else dummy)
    meta = dict(K=K, V=V, BV=BV, C=CHUNK, L2=bool(use_qk_l2norm), HAS_H0=h0 is not None, STORE_HT=ht is not None,
                num_warps=NUM_WARPS)
    if KERNEL == "split":
        Tbuf, chunk_off = _solve_all_chunks(kc, gc, bc, cu, T if cu_seqlens is None else None, H, HV, K,
                                                  bool(use_qk_l2norm))
        _gdn_fwd_split_kernel[grid](qc, kc, vc, gc, bc, Tbuf, o, *states, cu, chunk_off, float(scale), H, HV, **meta)
    else:
        kernel = {"simple": _gdn_fwd_kernel, "prefetch": _gdn_fwd_prefetch_kernel, "ws": _gdn_fwd_ws_kernel}[KERNEL]
        kernel[grid](qc, kc, vc, gc, bc, o, *states, cu, float(scale), H, HV, **meta)
    return o, ht


def _solve_all_chunks(k, g, beta, cu, T, H, HV, K, l2):
    """T of every chunk and value head by `_gdn_t_kernel`: ([chunks, HV, C, C] fp32, chunk offsets of the sequences
    [N + 1] int32). T: the common length of unpacked sequences, else None (the lengths are read from cu: one host
    sync)."""
    N = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    nch = (lens + CHUNK - 1) // CHUNK
    chunk_off = torch.cat([nch.new_zeros(1), nch.cumsum(0)]).to(torch.int32)
    if T is not None:
        most = -(-T // CHUNK)
        total = N * most
    else:
        host = nch.tolist()
        most, total = max(host, default=0), sum(host)
    Tbuf = torch.empty(max(total, 1), HV, CHUNK, CHUNK, dtype=torch.float32, device=k.device)
    if most > 0:
        _gdn_t_kernel[(most, N * HV)](k, g, beta, Tbuf, cu, chunk_off, H, HV, K=K, C=CHUNK, L2=l2,
                                      num_warps=NUM_WARPS)
    return Tbuf, chunk_off
