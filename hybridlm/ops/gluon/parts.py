"""What the Gluon kernels share: the import of Triton's Gluon API (absent from older Tritons: `gluon_available`)
and small device helpers (a warpgroup MMA, row copies, what a chain program works on), and the pipeline the two
forward chains (GDN's `chain.py`, KDA's `kda_chain.py`) have in common.

The forward chains' pipeline: a program's chunks go through two slots (chunk n uses slot n % 2), with two barriers
of each kind: ld[s] (the TMA of a chunk's inputs landed), hand[s] (the state warpgroup stored S^T and its new values
V'^T for the output warpgroup) and done[s] (both warpgroups are done with the slot's inputs and hand-over; the load
warp waits on it before it loads chunk n + 2 there, the state warpgroup before it hands chunk n + 2 over). A slot's
barrier completes a phase once per use of the slot and chunk n is the slot's use n // 2, so chunk n waits for the
phase of parity (n // 2) & 1 of its slot's ld or hand, and for the slot to be free (chunk n - 2 done) for parity
((n // 2) & 1) ^ 1 of done: a fresh barrier's parity 1 passes at once.
"""

from __future__ import annotations

import functools

try:  # the names the kernel files import from here
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401
        async_copy,
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401

    _IMPORT_ERROR = None
except ImportError as e:  # pragma: no cover - depends on the installed Triton
    gluon = gl = None
    _IMPORT_ERROR = e


@functools.cache
def gluon_available() -> bool:
    """True when the installed Triton has the Gluon API this kernel is written against (Triton 3.6's
    `triton.experimental.gluon` with Hopper warpgroup MMA and NVMMA layouts). Cached: the dispatch asks per call."""
    if _IMPORT_ERROR is not None:
        return False
    needed = (gl, ("NVMMADistributedLayout", "NVMMASharedLayout", "SwizzledSharedLayout", "BlockedLayout",
                   "SliceLayout", "allocate_shared_memory"))
    return all(hasattr(needed[0], n) for n in needed[1])


if _IMPORT_ERROR is None:

    @gluon.jit
    def _mma(a_smem, b_smem, acc, USE_ACC: gl.constexpr):
        """acc (+)= a @ b with fp32 accumulation; fp32 operands run as tf32 (the compile option's default input
        precision, which the host leaves as is); the caller has fenced its shared-memory stores."""
        return warpgroup_mma(a_smem, b_smem, acc, use_acc=USE_ACC)

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
    def _chain_program(cu, chunk_off, rows, H, HV, POOL: gl.constexpr):
        """What a chain program (grid: value blocks, sequences x value heads) works on: (value block, sequence,
        value head, key head, first token, length, first chunk (int32), state row (int64): the pool row rows[n]
        when POOL, else n)."""
        i_v = gl.program_id(0)
        i_nh = gl.program_id(1)
        i_n = i_nh // HV
        i_hv = i_nh % HV
        bos = gl.load(cu + i_n)
        seq_len = gl.load(cu + i_n + 1) - bos
        if POOL:
            row = gl.load(rows + i_n).to(gl.int64)
        else:
            row = i_n.to(gl.int64)
        return i_v, i_n, i_hv, i_hv // (HV // H), bos, seq_len, gl.load(chunk_off + i_n), row

    @gluon.jit
    def _chain_shared(dt: gl.constexpr, o_desc, K: gl.constexpr, BV: gl.constexpr, C: gl.constexpr):
        """A forward chain's shared memory past its inputs: the hand-over of two chunks (S^T [BV, K] and V'^T
        [BV, C], 16-bit), the output tile [C, BV] a chunk leaves through, and the ld, hand and done barrier pairs,
        initialised (done counts the state and the output warpgroup)."""
        hs = gl.allocate_shared_memory(dt, [2, BV, K], gl.NVMMASharedLayout.get_default_for([BV, K], dt))
        hv = gl.allocate_shared_memory(dt, [2, BV, C], gl.NVMMASharedLayout.get_default_for([BV, C], dt))
        o_st = gl.allocate_shared_memory(dt, [C, BV], o_desc.layout)
        ld = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        hand = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2):
            mbarrier.init(ld.index(s), count=1)
            mbarrier.init(hand.index(s), count=1)
            mbarrier.init(done.index(s), count=2)
        return hs, hv, o_st, ld, hand, done

    @gluon.jit
    def _chain_invalidate(ld, hand, done):
        """The barriers of `_chain_shared`, invalidated once every partition has returned."""
        for s in gl.static_range(2):
            mbarrier.invalidate(ld.index(s))
            mbarrier.invalidate(hand.index(s))
            mbarrier.invalidate(done.index(s))

    @gluon.jit
    def _wait_chunk(bars, n):
        """Wait for chunk n's arrival on its slot's barrier of the pair `bars` (ld or hand)."""
        mbarrier.wait(bars.index(n % 2), (n // 2) & 1)

    @gluon.jit
    def _wait_free(done, n, pred=True):
        """Wait (if pred) until slot n % 2 is free for chunk n: both warpgroups are done with chunk n - 2 there."""
        mbarrier.wait(done.index(n % 2), ((n // 2) & 1) ^ 1, pred=pred)

    @gluon.jit
    def _arrive(bar):
        """One arrival on bar for the whole partition, once every warp of it is past its accesses of the slot."""
        gl.thread_barrier()
        mbarrier.arrive(bar, count=1)

    @gluon.jit
    def _issue_st_product(St, x_s, hs_s, zt, A_T: gl.constexpr):
        """S^T X^T [BV, C] (X: a chunk's rows [C, K] in shared memory) from S^T in 16 bits, issued asynchronously;
        that 16-bit S^T is also the output warpgroup's copy of the state, stored to hs_s meanwhile. Returns the
        product in flight and its register operand (both for `warpgroup_mma_wait`)."""
        s16 = St.to(hs_s.dtype)
        s_op = gl.convert_layout(s16, A_T)
        acc = warpgroup_mma(s_op, x_s.permute((1, 0)), zt, use_acc=False, is_async=True)
        hs_s.store(s16)
        return acc, s_op

    @gluon.jit
    def _hand_over(hv_s, vt, hand_bar):
        """Store the chunk's new values V'^T (16-bit) for the output warpgroup and signal hand_bar once every
        thread's stores (and its earlier store of S^T) are fenced for the async proxy."""
        hv_s.store(vt)
        fence_async_shared()
        _arrive(hand_bar)

    @gluon.jit
    def _state_ptrs(state, row, i_hv, HV, col0, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                    MS: gl.constexpr):
        """Pointers to the program's S^T [BV, K] (layout MS) in a state [N, HV, K, V] fp32: the value block at col0
        of row `row` (int64) and head i_hv, transposed."""
        r_v = gl.arange(0, BV, layout=gl.SliceLayout(1, MS))
        c_k = gl.arange(0, K, layout=gl.SliceLayout(0, MS))
        tile = state + ((row * HV + i_hv) * K * V + col0)
        return tile + (gl.expand_dims(r_v, 1) + gl.expand_dims(c_k * V, 0))

    @gluon.jit
    def _store_out(o_desc, o, o_st, out, bos, c0, seq_len, i_hv, HV, col0, v_col, V: gl.constexpr,
                   BV: gl.constexpr, C: gl.constexpr):
        """A chunk's output rows [C, BV] (fp32 registers) to o [Ttot, HV, V] through o_st: by TMA for a whole
        chunk, by masked stores for a sequence's last partial one (a whole-chunk store would write into the next
        sequence's rows). The caller waits `tma.store_wait(0)` after its last chunk."""
        tma.store_wait(0)  # the previous chunk's store has read o_st
        gl.thread_barrier()
        o_st.store(out.to(o_st.dtype))
        fence_async_shared()
        gl.thread_barrier()  # every thread's part of o_st written before the one TMA store
        if c0 + C <= seq_len:
            tma.async_copy_shared_to_global(o_desc, [bos + c0, v_col], o_st)
        else:  # the sequence's last, partial chunk
            LST: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
            t_o = gl.arange(0, C, layout=gl.SliceLayout(1, LST))
            c_o = gl.arange(0, BV, layout=gl.SliceLayout(0, LST))
            o_chunk = o + ((bos + c0).to(gl.int64) * HV + i_hv) * V + col0
            gl.store(o_chunk + gl.expand_dims(t_o * (HV * V), 1) + gl.expand_dims(c_o, 0), o_st.load(LST),
                     mask=gl.expand_dims(c0 + t_o < seq_len, 1))
