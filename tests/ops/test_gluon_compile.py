"""The Gluon kernels compile for an H100 (sm_90a) on a CPU-only machine, and use warpgroup MMA.

Numerics need the GPU (tests/ops/test_gluon_gdn.py); this catches Gluon API drift and shared-memory overflow in CI.
Each kernel is compiled through `triton.compile` with a CUDA `GPUTarget` of capability 90, its arguments typed as
the host wrapper passes them (16-byte aligned pointers, as torch allocations are): the solve with and without
l2norm (with it, under the host's register cap), the chain in bf16 with both states, in fp16 without them, and with
its states in a pool; K 128, and 64 in fp16; the KDA chain (`kda_fwd`) the same ways. The backward's state-gradient
chain (`chain_bwd`) in bf16 with the final-state cotangent and the initial-state gradient, in fp16 at K 64 without
them, and at V 256: it must also compile without spills (no local memory: its state gradient and products fill a
warpgroup's registers), and its gate rows launch (Triton) for sm_90. The chunk backward (`chunk_bwd`) in bf16 at
K = V = 128 with l2norm, in fp16 at K 64 without, and at K 64 V 128 with an fp32 dk (grouped value heads), without
spills (its two warpgroups split every product's columns so that a whole chunk's gradients fit their registers).
About 10 s a compile on one core (the backward chain about 1 s).

A Triton without the Gluon API the kernels are written against fails here (it is the drift this file exists to
catch; the pinned Triton, README and .ci/run, has it), it is not skipped.
"""

from __future__ import annotations

import pytest
import triton
from triton.backends.compiler import GPUTarget

try:  # a Triton without Gluon breaks this import: each test below fails with it instead of the file not loading
    from hybridlm.ops.gluon import chain_bwd, chunk_bwd, gdn_fwd, kda_fwd

    GLUON_ERROR = gdn_fwd._IMPORT_ERROR
except ImportError as e:
    gdn_fwd = chain_bwd = chunk_bwd = kda_fwd = None
    GLUON_ERROR = e

SMEM_LIMIT = 232448  # bytes of shared memory one H100 program may use
FP32_PTRS = ("g", "h0", "ht", "Gbuf", "bl", "Gsave")
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
         "p_desc": [64, 64], "vn_desc": [64, 64], "hb_desc": [128, 64]}
KEY_WIDE = ("q_desc", "k_desc", "qg_desc", "kd_desc", "w_desc")  # boxes [64, K]
KEY_TALL = ("hb_desc",)  # boxes [K, 64]


def _require_gluon() -> None:
    assert gdn_fwd is not None and gdn_fwd.gluon_available(), (
        f"Triton {triton.__version__} lacks the Gluon API hybridlm.ops.gluon is written against: {GLUON_ERROR!r}")


def test_installed_triton_has_the_gluon_api():
    _require_gluon()


def _gluon_source(fn, consts: dict, arg_type):
    """fn as the launcher specialises it: the constexprs of consts that fn takes, every other argument typed by
    arg_type(name) ("i32", "fp32", a TMA descriptor's type, or "*dtype" for a pointer, marked 16-byte aligned as
    torch allocations are)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    consts = {n: c for n, c in consts.items() if n in fn.arg_names}
    sig = {n: "constexpr" if n in consts else arg_type(n) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    return GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)


def compile_kernel(name: str, dtype: str, *, l2: bool = True, state: bool = True, pool: bool = False, K: int = 128,
                   overlap: bool = False):
    """Compile one kernel of the Gluon forward for sm_90: pointers typed by name (q, k, v, beta, o and T in the
    input dtype; g, the states and the gate rows in fp32)."""
    _require_gluon()
    fn = getattr(kda_fwd if name.startswith("_kda") else gdn_fwd, name)
    consts = dict(K=K, V=128, BV=gdn_fwd.BV, C=gdn_fwd.CHUNK, R=gdn_fwd.GATE_ROWS, L2=l2, HAS_H0=state,
                  STORE_HT=state, POOL=pool, FLAG=overlap, WAIT=overlap)

    def arg_type(n: str) -> str:
        if n in INTS:
            return "i32"
        if n in FP32S:
            return "fp32"
        if n in DESCS:
            box = [DESCS[n][0], K] if n in KEY_WIDE else DESCS[n]
            return _desc_type("fp32" if n == "g_desc" else dtype, box)
        return "*" + ("fp32" if n in FP32_PTRS else "i32" if n in INT_PTRS else dtype)

    src = _gluon_source(fn, consts, arg_type)
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
    ("_gdn_solve_train_kernel", "bf16", True, False, False, 128, True),  # also the plain T, W / m, gate rows
    ("_gdn_solve_train_kernel", "fp16", False, False, False, 64, False),
    ("_gdn_chain_train_kernel", "bf16", True, True, False, 128, True),  # also S, V' and P
    ("_gdn_chain_train_kernel", "fp16", False, False, False, 64, False),
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


BWD_FP32_PTRS = ("dht", "dh0")


def compile_bwd_chain(dtype: str, *, K: int = 128, V: int = 128, dht: bool = True, dh0: bool = True):
    """Compile `chain_bwd._gdn_chain_bwd_kernel` for sm_90 as `gdn_bwd.state_grad_chain` launches it."""
    _require_gluon()
    fn = chain_bwd._gdn_chain_bwd_kernel
    C, BV, R = chain_bwd.CHUNK, chain_bwd.BV, chain_bwd.GATE_ROWS
    consts = dict(K=K, V=V, BV=BV, C=C, R=R, HAS_DHT=dht, STORE_DH0=dh0)
    boxes = {"w_desc": [C, K], "q_desc": [C, K], "k_desc": [C, K], "do_desc": [C, BV], "p_desc": [C, C],
             "g_desc": [R, C], "dhb_desc": [K, BV], "dvn_desc": [C, BV]}

    def arg_type(n: str) -> str:
        if n in INTS:
            return "i32"
        if n in boxes:
            return _desc_type("fp32" if n == "g_desc" else dtype, boxes[n])
        return "*" + ("fp32" if n in BWD_FP32_PTRS else "i32" if n in INT_PTRS else dtype)

    src = _gluon_source(fn, consts, arg_type)
    from hybridlm.ops.gluon import gdn_bwd

    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": gdn_bwd.NUM_WARPS})


def _resources(k) -> dict[str, int]:
    """REG (registers a thread) and STACK (local memory a thread: spills) of a compiled kernel, from cuobjdump."""
    import os
    import re
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.cubin")
        with open(p, "wb") as f:
            f.write(k.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        out = subprocess.run([tool, "-res-usage", p], capture_output=True, text=True, check=True).stdout
    return {key: int(re.search(rf"{key}:(\d+)", out).group(1)) for key in ("REG", "STACK")}


BWD_CASES = [  # dtype, K, V, dht, dh0
    ("bf16", 128, 128, True, True),
    ("fp16", 64, 64, False, False),
    ("bf16", 128, 256, False, True),
]


@pytest.mark.parametrize("dtype,K,V,dht,dh0", BWD_CASES)
def test_bwd_chain_compiles_for_sm90_without_spills(dtype, K, V, dht, dh0):
    k = compile_bwd_chain(dtype, K=K, V=V, dht=dht, dh0=dh0)
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx, "expected warpgroup MMA (wgmma) in the PTX"
    assert "cp.async.bulk.tensor" in ptx, "expected TMA copies in the PTX"
    assert "setmaxnreg.dec" in ptx, "expected the load partition to give its registers back (warp specialisation)"
    assert k.metadata.shared <= SMEM_LIMIT, f"shared memory {k.metadata.shared} B > the H100's {SMEM_LIMIT} B"
    res = _resources(k)
    assert res["STACK"] == 0, f"expected no spills (local memory), got {res}"
    assert res["REG"] <= 255, res


def test_bwd_gate_rows_compile_for_sm90():
    """The Triton launch before the chain (`state_pass._bwd_gate_rows`), with and without l2norm."""
    from triton.compiler import ASTSource

    from hybridlm.ops.triton import state_pass

    assert state_pass.BWD_GATE_ROWS == chain_bwd.GATE_ROWS
    fn = state_pass._bwd_gate_rows
    for l2 in (True, False):
        sig = {"q": "*bf16", "k": "*bf16", "g": "*fp32", "G": "*fp32", "cu": "*i32", "chunk_seq": "*i32",
               "chunk_start": "*i32", "scale": "fp32", "H": "i32", "HV": "i32", "K": "constexpr",
               "BT": "constexpr", "L2": "constexpr"}
        src = ASTSource(fn=fn, signature=sig, constexprs=dict(K=128, BT=chain_bwd.CHUNK, L2=l2))
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert _resources(k)["STACK"] == 0


CHUNK_FP32_PTRS = ("g", "dkp", "dg", "dbeta", "dsk")


def compile_chunk_bwd(name: str, dtype: str, *, K: int = 128, V: int = 128, l2: bool = True, dk: str | None = None):
    """Compile a kernel of `chunk_bwd` (the Gluon chunk backward) for sm_90 as `gdn_bwd.chunk_grads` launches it:
    the 16-bit tensors in dtype, dk in `dk` (fp32 with grouped value heads), the gates and fp32 buffers fp32."""
    _require_gluon()
    fn = getattr(chunk_bwd, name)

    def arg_type(n: str) -> str:
        if n in INTS:
            return "i32"
        if n in FP32S:
            return "fp32"
        if n == "dk" and dk:
            return "*" + dk
        return "*" + ("fp32" if n in CHUNK_FP32_PTRS else "i32" if n in ("cu", "chunk_seq", "chunk_start") else dtype)

    src = _gluon_source(fn, dict(K=K, V=V, C=chunk_bwd.CHUNK, L2=l2), arg_type)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": chunk_bwd.NUM_WARPS})


CHUNK_CASES = [  # kernel, dtype, K, V, l2, dk's dtype
    ("_chunk_bwd_kernel", "bf16", 128, 128, True, None),
    ("_chunk_bwd_kernel", "fp16", 64, 64, False, None),
    ("_chunk_bwd_kernel", "bf16", 64, 128, True, "fp32"),
]


@pytest.mark.parametrize("name,dtype,K,V,l2,dk", CHUNK_CASES)
def test_chunk_bwd_compiles_for_sm90(name, dtype, K, V, l2, dk):
    k = compile_chunk_bwd(name, dtype, K=K, V=V, l2=l2, dk=dk)
    assert "wgmma.mma_async" in k.asm["ptx"], "expected warpgroup MMA (wgmma) in the PTX"
    assert k.metadata.shared <= SMEM_LIMIT, f"shared memory {k.metadata.shared} B > the H100's {SMEM_LIMIT} B"
    res = _resources(k)
    assert res["REG"] <= 255 and res["STACK"] == 0, f"expected no spills (local memory), got {res}"
