"""The Gluon kernels compile for an H100 (sm_90a) on a CPU-only machine, and use warpgroup MMA.

Numerics need the GPU (tests/ops/test_gluon_gdn.py); this catches Gluon API drift and shared-memory overflow in CI.
Each kernel is compiled through `triton.compile` with a CUDA `GPUTarget` of capability 90, its arguments typed as
the host wrapper passes them (16-byte aligned pointers, as torch allocations are): both kernels in bf16 with l2norm
and both states (the chain at value block 64), the chain once more in fp16 without them at value block 32, once
without its output (the form the stage timing launches), and once with its states in a pool.
About 10 s a compile on one core.
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
FP32_PTRS = ("g", "h0", "ht", "Tbuf", "Bbuf")
INT_PTRS = ("cu", "chunk_off", "rows")
INTS = ("H", "HV")


def _desc_type(dtype: str, box: list[int]) -> str:
    """The signature type of a TMA descriptor argument over a 16-bit tensor with [box] blocks, as the launcher
    specialises it."""
    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    tdt, gdt = (torch.bfloat16, gl.bfloat16) if dtype == "bf16" else (torch.float16, gl.float16)
    x = torch.empty(box[0] * 2, box[1] * 2, dtype=tdt)
    return mangle_type(TensorDescriptor.from_tensor(x, box, gl.NVMMASharedLayout.get_default_for(box, gdt)))


DESCS = {"q_desc": [64, 128], "k_desc": [64, 128], "v_desc": [64, 64], "t_desc": [64, 64]}


def compile_kernel(name: str, dtype: str, *, bv: int, l2: bool, state: bool, output: bool = True,
                   pool: bool = False, t16: bool = False):
    """Compile one kernel of gdn_fwd for sm_90: pointers typed by name (q, k, v, beta, o in the input dtype; T in
    it too when t16, the solve's 16-bit hi + lo form)."""
    fn = getattr(gdn_fwd, name)
    consts = dict(K=128, V=128, BV=bv, C=gdn_fwd.CHUNK, L2=l2, HAS_H0=state, STORE_HT=state, OUTPUT=output,
                  POOL=pool, T16=t16)
    sig, ptrs = {}, []
    for n in fn.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in INTS:
            sig[n] = "i32"
        elif n == "scale":
            sig[n] = "fp32"
        elif n in DESCS:
            sig[n] = _desc_type(dtype, DESCS[n])
        else:
            fp32 = n in FP32_PTRS and not (t16 and n == "Tbuf")
            sig[n] = "*" + ("fp32" if fp32 else "i32" if n in INT_PTRS else dtype)
            ptrs.append(n)
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    consts = {n: c for n, c in consts.items() if n in fn.arg_names}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": gdn_fwd.NUM_WARPS})


CASES = [
    ("_gdn_solve_kernel", "bf16", 64, True, True, True, False, False),
    ("_gdn_solve_kernel", "bf16", 64, True, True, True, False, True),
    ("_gdn_chain_kernel", "bf16", 64, True, True, True, False, False),
    ("_gdn_chain_kernel", "fp16", 32, False, False, True, False, False),
    ("_gdn_chain_kernel", "bf16", 32, True, False, False, False, False),
    ("_gdn_chain_kernel", "bf16", 64, True, True, True, True, False),  # states read from / written to a pool's rows
    ("_gdn_chain_t_kernel", "bf16", 64, True, True, True, False, True),
    ("_gdn_chain_t_kernel", "fp16", 64, False, False, True, False, True),
    ("_gdn_chain_t_kernel", "bf16", 64, True, True, False, True, True),
    ("_gdn_chain_ws_kernel", "bf16", 64, True, True, True, False, True),
    ("_gdn_chain_ws_kernel", "fp16", 64, False, False, True, True, True),
]


@pytest.mark.parametrize("name,dtype,bv,l2,state,output,pool,t16", CASES)
def test_kernel_compiles_for_sm90(name, dtype, bv, l2, state, output, pool, t16):
    assert bv in gdn_fwd.BV_CHOICES
    k = compile_kernel(name, dtype, bv=bv, l2=l2, state=state, output=output, pool=pool, t16=t16)
    assert "wgmma.mma_async" in k.asm["ptx"], "expected warpgroup MMA (wgmma) in the PTX"
    assert "ttng.warp_group_dot" in k.asm["ttgir"], "expected warpgroup MMA ops in the TTGIR"
    assert k.metadata.shared <= SMEM_LIMIT, f"shared memory {k.metadata.shared} B > the H100's {SMEM_LIMIT} B"
