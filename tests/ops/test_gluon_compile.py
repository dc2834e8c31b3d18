"""The Gluon kernels compile for an H100 (sm_90a) on a CPU-only machine, and use warpgroup MMA.

Numerics need the GPU (tests/ops/test_gluon_gdn.py); this catches Gluon API drift and shared-memory overflow in CI.
Each kernel variant is compiled once through `triton.compile` with a CUDA `GPUTarget` of capability 90, its
arguments typed as the host wrapper passes them (16-byte aligned pointers, as torch allocations are). About 12 s
a variant on one core (both kernels, two variants each).
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from hybridlm.ops.gluon import gdn_fwd  # noqa: E402

if not gdn_fwd.gluon_available():
    pytest.skip("the installed Triton has no Gluon API of the kind gdn_fwd is written against",
                allow_module_level=True)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

SMEM_LIMIT = 232448  # bytes of shared memory one H100 program may use


KERNELS = {"simple": "_gdn_fwd_kernel", "prefetch": "_gdn_fwd_prefetch_kernel"}


def compile_fwd(kernel: str, dtype: str, *, bv: int, l2: bool, h0: bool, ht: bool):
    fn = getattr(gdn_fwd, KERNELS[kernel])
    ptrs = dict(q=dtype, k=dtype, v=dtype, g="fp32", beta=dtype, o=dtype, h0="fp32", ht="fp32", cu="i32")
    sig = {n: "*" + t for n, t in ptrs.items()}
    sig.update(scale="fp32", H="i32", HV="i32")
    consts = dict(K=128, V=128, BV=bv, C=gdn_fwd.CHUNK, L2=l2, HAS_H0=h0, STORE_HT=ht)
    sig.update({n: "constexpr" for n in consts})
    assert list(sig) == fn.arg_names, "the test's signature is out of date with the kernel's arguments"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": gdn_fwd.NUM_WARPS})


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("dtype,bv,l2,state", [("bf16", 64, True, True), ("fp16", 32, False, False)])
def test_fused_fwd_compiles_for_sm90(kernel, dtype, bv, l2, state):
    assert bv in gdn_fwd.BV_CHOICES
    k = compile_fwd(kernel, dtype, bv=bv, l2=l2, h0=state, ht=state)
    assert "wgmma.mma_async" in k.asm["ptx"], "expected warpgroup MMA (wgmma) in the PTX"
    assert "ttng.warp_group_dot" in k.asm["ttgir"], "expected warpgroup MMA ops in the TTGIR"
    assert k.metadata.shared <= SMEM_LIMIT, f"shared memory {k.metadata.shared} B > the H100's {SMEM_LIMIT} B"
