"""What the Gluon kernels share: the import of Triton's Gluon API (absent from older Tritons: `gluon_available`)
and small device helpers (a warpgroup MMA, row copies, what a chain program works on).
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
