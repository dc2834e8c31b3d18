"""The Gluon kernels compile for an H100 (sm_90a) on a CPU-only machine, and use warpgroup MMA.

Numerics need the GPU (tests/ops/test_gluon_gdn.py); this catches Gluon API drift and shared-memory overflow in CI.
Each kernel is compiled through `triton.compile` with a CUDA `GPUTarget` of capability 90, its arguments typed as
the host wrapper passes them (16-byte aligned pointers, as torch allocations are): the solve with and without
l2norm (with it, under the host's register cap), the chain in bf16 with both states, in fp16 without them, and with
its states in a pool; K 128, and 64 in fp16; the KDA chain (`kda_fwd`) the same ways.
About 10 s a compile on one core.

A Triton without the Gluon API the kernels are written against fails here (it is the drift this file exists to
catch; the pinned Triton, README and .ci/run, has it), it is not skipped.
"""

from __future__ import annotations

import pytest
import triton
from triton.backends.compiler import GPUTarget

try:  # a Triton without Gluon breaks this import: each test below fails with it instead of the file not loading
    from hybridlm.ops.gluon import gdn_fwd, kda_fwd

    GLUON_ERROR = gdn_fwd._IMPORT_ERROR
except ImportError as e:
    gdn_fwd, kda_fwd, GLUON_ERROR = None, None, e

SMEM_LIMIT = 232448  # bytes of shared memory one H100 program may use
FP32_PTRS = ("g", "h0", "ht", "Gbuf", "bl")
INT_PTRS = ("cu", "chunk_off", "rows", "flags")
INTS = ("H", "HV")
FP32S = ("scale",)


def _desc_type(dtype: str, box: list[int]) -> str:
    """The signature type of a TMA descriptor argument over a [box]-blocked tensor of dtype ("bf16", "fp16" or
    "fp32", the last unswizzled as the gate rows are), as the launcher specialises it."""
    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    if dtype == "fp32":
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        return mangle_type(TensorDescriptor.from_tensor(torch.empty(box[0] * 2, box[1] * 2), box, layout))
    tdt, gdt = (torch.bfloat16, gl.bfloat16) if dtype == "bf16" else (torch.float16, gl.float16)
    x = torch.empty(box[0] * 2, box[1] * 2, dtype=tdt)
    return mangle_type(TensorDescriptor.from_tensor(x, box, gl.NVMMASharedLayout.get_default_for(box, gdt)))


DESCS = {"q_desc": [64, 128], "k_desc": [64, 128], "v_desc": [64, 64], "t_desc": [64, 64], "o_desc": [64, 64],
         "g_desc": [8, 64], "qg_desc": [64, 128], "kd_desc": [64, 128], "w_desc": [64, 128], "u_desc": [64, 64],
         "p_desc": [64, 64]}
KEY_WIDE = ("q_desc", "k_desc", "qg_desc", "kd_desc", "w_desc")  # boxes [64, K]


def _require_gluon() -> None:
    assert gdn_fwd is not None and gdn_fwd.gluon_available(), (
        f"Triton {triton.__version__} lacks the Gluon API hybridlm.ops.gluon is written against: {GLUON_ERROR!r}")


def test_installed_triton_has_the_gluon_api():
    _require_gluon()


def compile_kernel(name: str, dtype: str, *, l2: bool = True, state: bool = True, pool: bool = False, K: int = 128,
                   overlap: bool = False):
    """Compile one kernel of the Gluon forward for sm_90: pointers typed by name (q, k, v, beta, o and T in the
    input dtype; g, the states and the gate rows in fp32)."""
    _require_gluon()
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = getattr(kda_fwd if name.startswith("_kda") else gdn_fwd, name)
    consts = dict(K=K, V=128, BV=gdn_fwd.BV, C=gdn_fwd.CHUNK, R=gdn_fwd.GATE_ROWS, L2=l2, HAS_H0=state,
                  STORE_HT=state, POOL=pool, FLAG=overlap, WAIT=overlap)
    sig, ptrs = {}, []
    for n in fn.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in INTS:
            sig[n] = "i32"
        elif n in FP32S:
            sig[n] = "fp32"
        elif n in DESCS:
            box = [DESCS[n][0], K] if n in KEY_WIDE else DESCS[n]
            sig[n] = _desc_type("fp32" if n == "g_desc" else dtype, box)
        else:
            sig[n] = "*" + ("fp32" if n in FP32_PTRS else "i32" if n in INT_PTRS else dtype)
            ptrs.append(n)
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    consts = {n: c for n, c in consts.items() if n in fn.arg_names}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    options = {"num_warps": gdn_fwd.NUM_WARPS}
    if name == "_gdn_solve_kernel" and l2:  # as the host launches it
        options["maxnreg"] = gdn_fwd.SOLVE_REGS
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


CASES = [  # name, dtype, l2, state, pool, K, overlap (the solve publishes chunk flags, the chain waits on them)
    ("_gdn_solve_kernel", "bf16", True, False, False, 128, True),
    ("_gdn_solve_kernel", "fp16", False, False, False, 64, False),
    ("_gdn_chain_kernel", "bf16", True, True, False, 128, True),
    ("_gdn_chain_kernel", "fp16", True, False, False, 64, False),
    ("_gdn_chain_kernel", "bf16", True, True, True, 128, False),  # states read from / written to a pool's rows
    ("_kda_chain_kernel", "bf16", True, True, False, 128, False),
    ("_kda_chain_kernel", "fp16", True, False, False, 64, False),
    ("_kda_chain_kernel", "bf16", True, True, True, 128, False),
]


@pytest.mark.parametrize("name,dtype,l2,state,pool,K,overlap", CASES)
def test_kernel_compiles_for_sm90(name, dtype, l2, state, pool, K, overlap):
    k = compile_kernel(name, dtype, l2=l2, state=state, pool=pool, K=K, overlap=overlap)
    assert "wgmma.mma_async" in k.asm["ptx"], "expected warpgroup MMA (wgmma) in the PTX"
    assert "ttng.warp_group_dot" in k.asm["ttgir"], "expected warpgroup MMA ops in the TTGIR"
    assert k.metadata.shared <= SMEM_LIMIT, f"shared memory {k.metadata.shared} B > the H100's {SMEM_LIMIT} B"
    if name == "_gdn_solve_kernel" and l2:
        assert f".maxnreg {gdn_fwd.SOLVE_REGS}" in k.asm["ptx"], "expected the solve's register cap in the PTX"
