"""Gated DeltaNet forward for Hopper (sm_90) in Gluon: a parallel T solve, then one state chain per head.

Not used by `impl="auto"` or any dispatch yet. Forward ms on an H100 in one run (torch 2.11, Triton 3.6, fla-core
0.6.0; bf16, D 128, l2norm in the kernel; relative difference from our Triton forward 4e-3):
    shape               ours (Triton)   fla     this: chain "t" / "split"   (the rule's pick first)
    B4 T4096 H16        0.614           0.750   0.554 / 0.833
    B1 T32768 H32       2.821           2.574   3.013 (split) / 3.700 (t)
Plans that lost are deleted (git history keeps them): "simple" (every product in tf32, synchronous loads),
"prefetch" (T solved inline in the chain) and "ws" (one launch: a worker partition solving T into mbarrier-guarded
slots beside the chain; its shared memory forced value block 32 and the chain shared its multiprocessor).

Roles:
- `_gdn_solve_kernel`, one program per (chunk, sequence x value head), all chunks in parallel: with b the
  in-chunk cumulative log-decay (docs/math.md),
      A = strict_lower(diag(beta) Kn Kn^T * e^{b_i - b_j}),  T = (I + A)^{-1}
  Kn Kn^T is one 16-bit product of the raw keys (exact); the l2 norms, beta and the decays enter as fp32 row and
  column scales. The four diagonal [16, 16] blocks of I + A are inverted exactly in fp32 registers by forward
  substitution (one warp a block); with Td that block-diagonal inverse and L the strictly block-lower part of A,
  N = Td L is nilpotent (N^4 = 0), so T = (I - N)(I + N^2) Td: four tf32 64x64 products. For the "split" chain it
  writes T in fp32; for "t" it writes T diag(beta) as 16-bit hi + lo and b.
- `_gdn_chain_t_kernel` ("t", in chain_t.py), one program per (value block of 64, sequence x value head), walking
  its sequence in 64-token chunks with the state kept transposed, S^T [64, K] fp32, in the registers of one
  warpgroup. Every state-path product takes its left operand from registers (S^T, R^T, V'^T, U^T split into 16-bit
  hi + lo: wgmma's A operand) against q, k, T and P^T in shared memory, so nothing of the state path round-trips
  through shared memory; q, k, v and T of the next chunk arrive by TMA into a double buffer (mbarriers). Per chunk,
  gamma = e^b:
      R^T  = V^T - (S^T K^T) diag(gamma rk)             V'^T = R^T (T diag(beta))^T
      O^T  = (S^T Q^T) diag(gamma rq) + V'^T P^T        S^T  = e^{b_last} S^T + (V'^T diag(rk e^{b_last - b})) K
  Thirteen 16-bit products a chunk. Registers bound it: a [64] per-token vector in the product layout holds 16
  registers a thread, so the gates are read per chunk, not a chunk ahead, and scales are folded early.
- `_gdn_chain_kernel` ("split"), value block 32 or 64: the first chain, the state [K, BV] as the accumulator and
  every state-path operand stored to shared memory (fenced) before the next product; cp.async double buffer; tf32
  for T R and P V'. It stays for few programs: "t" needs value blocks of 64 (one warpgroup's M), so at
  B1 T32768 H32 it runs 64 programs on 132 multiprocessors where "split" runs 128 at 32 (`_plan`).

Where the time goes (`python tests/ops/test_gluon_gdn.py`: each launch against its byte floor, and each chain's
time a chunk against a model of its MMAs): "t" runs its state path in 1.56 us a chunk (model 1.26) but 6.0 us
with the output products (model 2.31): with output it still spills (ptxas -v: 140 bytes a thread). The next step
is the output products in a second warpgroup (warp specialisation: the state warpgroup hands V'^T and S^T Q^T
over in shared memory), which both frees the registers and overlaps the two paths; then the solve as a partition
of the same kernel. K and V other than 128 and fp32 inputs are refused by the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton

from ..validate import Dims, check_state_pool
from .chain_t import _descriptors
from .parts import _IMPORT_ERROR, gl, gluon, gluon_available  # noqa: F401  (gluon_available: the public check)

if _IMPORT_ERROR is None:
    from .chain_t import _gdn_chain_t_kernel
    from .chain_ws import _gdn_chain_ws_kernel
    from .parts import _chain_program, _issue_rows, _mma, _row_norms, _split_store, async_copy, fence_async_shared

CHUNK = 64  # tokens per chunk (four 16-row blocks of the solve)
BV_CHOICES = (64, 32)  # value blocks (shared memory: one program per multiprocessor either way); see _plan
PLANS = ("t", "split", "ws")  # the transposed chain, the first one, "t" with its output in a 2nd warpgroup
NUM_WARPS = 4  # one warpgroup
POISON = False  # tests set it: outputs start as NaN, so an element the kernel never writes fails the check
SUPPORTED_K = (128,)
SUPPORTED_V = (128,)


if _IMPORT_ERROR is None:

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
    def _gates(g, beta, bos, c0, seq_len, i_hv, HV, i_c, j_c):
        """g of the chunk at c0 as columns (j_c's layout) and beta as rows (i_c's), fp32, zero past the sequence."""
        g_c = gl.load(g + (bos + c0 + j_c).to(gl.int64) * HV + i_hv, mask=c0 + j_c < seq_len,
                      other=0.0).to(gl.float32)
        b_r = gl.load(beta + (bos + c0 + i_c).to(gl.int64) * HV + i_hv, mask=c0 + i_c < seq_len,
                      other=0.0).to(gl.float32)
        return g_c, b_r

    @gluon.jit
    def _gdn_solve_kernel(
        k, g, beta, Tbuf, Bbuf, cu, chunk_off, H, HV,
        K: gl.constexpr, C: gl.constexpr, L2: gl.constexpr, T16: gl.constexpr,
    ):
        """T = (I + A)^{-1} of every chunk, in parallel: grid (most chunks of a sequence, sequences x HV); T of
        chunk c of sequence n and value head hv goes to Tbuf[chunk_off[n] + c, hv] ([chunks, HV, C, C] fp32).
        A from the raw keys in one 16-bit product (exact); k: [Ttot, H, K]; g, beta: [Ttot, HV]."""
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
            if T16:  # T diag(beta), as hi + lo in 16 bits: the transposed chain's register-operand products read it
                T = T * gl.expand_dims(gl.convert_layout(bi, COL_C), 0)
                gl.store(Bbuf + slot * C + i_c, b_r)  # the in-chunk cumulative log-decay, for the chain
                t_hi = T.to(Tbuf.dtype.element_ty)
                gl.store(Tbuf + slot * 2 * C * C + p_t, t_hi)
                gl.store(Tbuf + slot * 2 * C * C + C * C + p_t, (T - t_hi.to(gl.float32)).to(Tbuf.dtype.element_ty))
            else:
                gl.store(Tbuf + slot * C * C + p_t, T)

    @gluon.jit
    def _gdn_chain_kernel(
        q, k, v, g, beta, Tbuf, o, h0, ht, rows, cu, chunk_off, scale, H, HV,
        K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr,
        L2: gl.constexpr, HAS_H0: gl.constexpr, STORE_HT: gl.constexpr, OUTPUT: gl.constexpr, POOL: gl.constexpr,
    ):
        """The state chain: grid (V / BV, sequences x HV), one program walking its sequence chunk by chunk with
        the state [K, BV] in registers; T of each chunk is read from Tbuf (written by `_gdn_solve_kernel` before
        it) and copied in asynchronously with the next chunk's q, k, v (double buffer). q, k: [Ttot, H, K];
        v, o: [Ttot, HV, V]; g, beta: [Ttot, HV]; h0, ht: [N, HV, K, V] fp32; cu, chunk_off: [N + 1] int32.
        OUTPUT False skips the output products and o (only for timing the state path). POOL: h0 and ht are one
        state pool [P, HV, K, V] and sequence n reads and writes its row rows[n] (int32 [N]); each program touches
        only its own [K, BV] slice of that row, read first and written last, so the update in place is safe."""
        i_v, i_n, i_hv, i_h, bos, seq_len, t_first, row = _chain_program(cu, chunk_off, rows, H, HV, POOL)
        t_first = t_first.to(gl.int64)
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
            p_h = (row * HV + i_hv) * K * V + gl.expand_dims(r_k, 1) * V + col0 + gl.expand_dims(c_v, 0)
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

            # 2. output: gamma Qn S + P V' (OUTPUT False: skipped, to time the state path alone)
            if OUTPUT:
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
        if STORE_HT:  # the offsets again, not kept across the loop (they would hold K * BV / 128 registers)
            p_h = (row * HV + i_hv) * K * V + gl.expand_dims(r_k, 1) * V + col0 + gl.expand_dims(c_v, 0)
            gl.store(ht + p_h, S)



def unsupported_reason(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when `gated_delta_rule_fwd` takes inputs like q [B, T, H, K] and v [B, T, HV, V] on this machine, else
    why not, in a few words (the dispatch logs it once and falls back to the Triton kernels)."""
    if not gluon_available():
        return f"Triton {triton.__version__} has no Gluon API"
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return "needs a device of compute capability 9.0 (Hopper)"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (bfloat16 and float16 only)"
    K, V = q.shape[-1], v.shape[-1]
    if K not in SUPPORTED_K or V not in SUPPORTED_V:
        return f"head dims K={K} V={V} (K in {SUPPORTED_K}, V in {SUPPORTED_V})"
    return None


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


def _check_pool(q, v, state_pool, state_indices, initial_state, cu_seqlens) -> bool:
    """True when a state pool is given (and well formed); see `hybridlm.ops.validate.check_state_pool`."""
    if state_pool is None and state_indices is None:
        return False
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    check_state_pool(state_pool, state_indices, initial_state=initial_state,
                     dims=Dims(B=B, T=T, H=H, HV=HV, K=K, V=V, N=N), dtype=torch.float32, device=q.device)
    if not state_pool.is_contiguous():
        raise ValueError("state_pool: expected a contiguous tensor (the kernel updates its rows in place)")
    return True


def _plan(heads: int, V: int, dev: torch.device) -> tuple[str, int]:
    """(chain, value block) for `heads` = sequences x value heads. Each program walks its whole sequence, so the
    number of programs bounds the run: "t" (the transposed chain, value block 64, 2.3x faster a chunk at B4 T4096
    H16) when its programs fill at least half the multiprocessors; else "split" at value block 32 (twice the
    programs; B1 T32768 H32: 64 transposed programs ran 3.09 ms, 128 split ones 2.47), or 64 when 32 would need
    more than one wave."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    if 2 * heads * (V // 64) >= sms:
        return "t", 64
    return "split", 32 if heads * (V // 32) <= sms else 64


def gated_delta_rule_fwd(
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
    state_pool: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    plan: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule forward in two launches, T solve then state chain (Hopper only; no autograd).

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H (value head hv reads key head hv // (HV // H));
    g (log-decay), beta: [B, T, HV]; initial_state: [N, HV, K, V] (N = B, or len(cu_seqlens) - 1 with B = 1);
    cu_seqlens: [N + 1] token offsets of packed sequences. Returns o [B, T, HV, V] in q's dtype and the final
    state [N, HV, K, V] in fp32 (None unless output_final_state). state_pool [P, HV, K, V] fp32 and state_indices
    [N] (instead of initial_state): sequence n starts from pool row state_indices[n], and the kernel writes its
    final state back to that row in place (chunked prefill; rows distinct and in range, not checked). Same
    contract as `hybridlm.ops.gated_delta_rule` for these arguments. plan: "t" or "split" (default: `_plan`).
    """
    launch = forward_launches(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                              output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                              use_qk_l2norm=use_qk_l2norm, state_pool=state_pool, state_indices=state_indices,
                              plan=plan)
    launch.solve()
    launch.chain()
    if state_pool is not None and output_final_state:
        return launch.o, state_pool.index_select(0, state_indices.long())
    return launch.o, launch.ht


class Launches(NamedTuple):
    """The forward's two launches, bound to their buffers: `solve()` writes T of every chunk into Tbuf, `chain()`
    reads it and writes o (and ht); the chain needs the solve's T, and either may be rerun alone (timing)."""

    solve: Callable[[], None]
    chain: Callable[[], None]
    o: torch.Tensor
    ht: torch.Tensor | None
    Tbuf: torch.Tensor
    BV: int
    programs: tuple[int, int]  # (solve, chain)
    plan: str  # the chain: "t" (transposed) or "split"


def forward_launches(q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None, use_qk_l2norm=False, state_pool=None, state_indices=None,
                     bv: int | None = None, output: bool = True, plan: str | None = None) -> Launches:
    """Check the inputs of `gated_delta_rule_fwd` (same arguments), allocate o, ht and T and bind the two launches
    without running them. plan, bv: the chain and its value block (default: `_plan`'s rule); output False: the chain
    skips the output (o stays unwritten), for timing the state path alone."""
    if not gluon_available():
        raise ValueError(f"triton: expected the Gluon API of Triton 3.6, got Triton {triton.__version__}")
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    pool = _check_pool(q, v, state_pool, state_indices, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    scale = K**-0.5 if scale is None else scale
    dev = q.device
    if cu_seqlens is None:  # equal lengths: the chunk offsets follow without reading anything back
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=dev)
        most = -(-T // CHUNK)
        chunk_off = torch.arange(0, (B + 1) * most, most, dtype=torch.int32, device=dev)
        total = B * most
    else:
        cu = cu_seqlens.to(device=dev, dtype=torch.int32)
        nch = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK
        chunk_off = torch.cat([nch.new_zeros(1), nch.cumsum(0)]).to(torch.int32)
        host = nch.tolist()  # the grid needs the longest sequence: one host sync
        most, total = max(host, default=0), sum(host)
    N = cu.numel() - 1
    qc, kc, vc = (x.contiguous() for x in (q, k, v))
    gc, bc = g.contiguous(), beta.contiguous()
    alloc = torch.full if POISON else lambda shape, _, **kw: torch.empty(shape, **kw)
    o = alloc(vc.shape, float("nan"), dtype=vc.dtype, device=dev)
    if pool:  # the kernel reads and writes the pool's rows; ht (if asked) is a copy of them afterwards
        h0 = ht = state_pool
        rows = state_indices.to(torch.int32).contiguous()
    else:
        ht = alloc((N, HV, K, V), float("nan"), dtype=torch.float32, device=dev) if output_final_state else None
        h0 = initial_state.to(torch.float32).contiguous() if initial_state is not None else None
        rows = cu  # never read: POOL is compiled out
    picked, picked_bv = _plan(N * HV, V, dev)
    plan = picked if plan is None else plan
    if plan not in PLANS:
        raise ValueError(f"plan: expected one of {PLANS}, got {plan!r}")
    BV = (picked_bv if plan == picked else 64) if bv is None else bv
    if BV not in BV_CHOICES or (plan != "split" and BV != 64):
        raise ValueError(f"bv: expected one of {BV_CHOICES} (64 with plans 't' and 'ws'), got {BV}")
    t16 = plan != "split"
    if t16:  # T diag(beta) as 16-bit hi + lo, and the in-chunk cumulative log-decays
        Tbuf = torch.empty(max(total, 1), HV, 2, CHUNK, CHUNK, dtype=q.dtype, device=dev)
    else:
        Tbuf = torch.empty(max(total, 1), HV, CHUNK, CHUNK, dtype=torch.float32, device=dev)
    dummy = o  # never read: the HAS_H0 / STORE_HT branches are compiled out
    states = (h0 if h0 is not None else dummy, ht if ht is not None else dummy)
    l2 = bool(use_qk_l2norm)
    solve_grid, chain_grid = (most, N * HV), (V // BV, N * HV)

    descs = _descriptors(qc, kc, vc, Tbuf, BV) if t16 else None
    Bbuf = torch.empty(max(total, 1), HV, CHUNK, dtype=torch.float32, device=dev) if t16 else Tbuf

    def solve():
        if most > 0:
            _gdn_solve_kernel[solve_grid](kc, gc, bc, Tbuf, Bbuf, cu, chunk_off, H, HV, K=K, C=CHUNK, L2=l2, T16=t16,
                                          num_warps=NUM_WARPS)

    def chain():
        if plan == "ws":
            _gdn_chain_ws_kernel[chain_grid](*descs, Bbuf, o, *states, rows, cu, chunk_off, float(scale), H, HV,
                                             K=K, V=V, BV=BV, C=CHUNK, L2=l2, HAS_H0=h0 is not None,
                                             STORE_HT=ht is not None, POOL=pool, num_warps=NUM_WARPS)
            return
        if t16:
            _gdn_chain_t_kernel[chain_grid](*descs, Bbuf, o, *states, rows, cu, chunk_off, float(scale), H, HV,
                                            K=K, V=V, BV=BV, C=CHUNK, L2=l2, HAS_H0=h0 is not None,
                                            STORE_HT=ht is not None, OUTPUT=output, POOL=pool, num_warps=NUM_WARPS)
            return
        _gdn_chain_kernel[chain_grid](qc, kc, vc, gc, bc, Tbuf, o, *states, rows, cu, chunk_off, float(scale), H,
                                      HV, K=K, V=V, BV=BV, C=CHUNK, L2=l2, HAS_H0=h0 is not None,
                                      STORE_HT=ht is not None, OUTPUT=output, POOL=pool, num_warps=NUM_WARPS)

    # with a pool the final states are its rows (gated_delta_rule_fwd copies them out when asked)
    return Launches(solve, chain, o, None if pool else ht, Tbuf, BV, (most * N * HV, (V // BV) * N * HV), plan)
