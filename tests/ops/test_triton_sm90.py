"""Every Triton launch of the GDN and KDA ops, and of the glue kernels, builds for an H100 (sm_90) through Triton's
frontend and its TTIR and TTGIR passes, on a CPU-only machine.

The rest of the CPU suite runs these kernels under TRITON_INTERPRET=1, which executes their Python bodies without the
compiler's checks: a loop-carried block re-assigned with a block of another shape, or a layout the TTGIR passes
refuse, runs in the interpreter and only fails at the GPU compile. The GDN and KDA launches are
`scripts/compile_sm90.py`'s job tables (`all_jobs`, typed by its `launch` as Triton's launcher would type them), at
the script's defaults: bf16, K = V = 128, chunk 64, H = HV = 16, aligned pointers, each kernel at its table's warps
and stages. The glue launches (norms, add-norm, cross-entropy, conv, gates, RoPE and its output gate, SwiGLU) are
`glue_jobs` here, each with its flags all on and all off. The build stops at TTGIR: type errors come from the
frontend and layout errors from the TTGIR passes; LLVM, PTX and ptxas (registers, spills, shared memory) stay with
the script, which takes about 47 s for the GDN and KDA kernels down to cubin. About 18 s here on one core (GDN and
KDA 13 s, two thirds of it the TTGIR passes; glue 5 s).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
# Triton's internals, kept to what `triton.compile` does before its later stages (`triton.compile` has no way to
# stop at TTGIR, and going down to cubin costs about three times as long): the backend of a target, the MLIR
# context with its dialects, the frontend (`ASTSource.make_ir`), then the backend's stages by name.
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import ir, make_backend  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
import compile_sm90 as sm90  # noqa: E402

from hybridlm.ops.triton import add_norm, ce, conv, gates, norm, rope, swiglu  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="under TRITON_INTERPRET=1 the kernels are the interpreter's, not compilable")


def glue_jobs() -> dict:
    """name -> (kernel, pointer dtypes, scalar types, constexprs, num_warps, num_stages) of the glue kernels' launches
    (the table format of `sm90.gdn_jobs`), bf16 activations, blocks as their host wrappers pick them: the norms at
    D 2048 (a model's width) and 128 (a head's, gated); every kernel with its optional-input and mode flags all on
    and all off. Sizes and strides are plain i32 (the flags, not the ints, pick the code paths)."""
    bf, f32, i32 = "bf16", "fp32", "i32"
    jobs = {}
    for on in (False, True):
        tag = " on" if on else " off"
        flags = dict(HAS_W=on, ZC=on, CAST_Y=on, W_LOWP=on)
        for D, ACT in ((2048, 0), (128, 2 if on else 1)):
            BD, BM, nw = norm._blocks(D)
            jobs[f"_norm_fwd D{D}{tag}"] = (
                norm._norm_fwd, dict(x=bf, gate=bf, w=bf if on else f32, y=bf, rstd=f32),
                dict(M=i32, D=i32, eps=f32), dict(flags, BM=BM, BD=BD, ACT=ACT), nw, 3)
            BD, BM, nw = norm._blocks_bwd(D)
            jobs[f"_norm_bwd D{D}{tag}"] = (
                norm._norm_bwd, dict(x=bf, gate=bf, w=bf if on else f32, dy=bf, dx=bf, dg=bf, dwp=f32),
                dict(M=i32, D=i32, eps=f32, NP=i32), dict(flags, BM=BM, BD=BD, ACT=ACT), nw, 3)
        BD, BM, nw = norm._blocks(2048)
        jobs[f"_add_norm_fwd{tag}"] = (
            add_norm._add_norm_fwd, dict(x=bf, b=bf, w=bf if on else f32, y=bf, xn=f32 if on else bf),
            dict(M=i32, D=i32, eps=f32), dict(flags, BM=BM, BD=BD), nw, 3)
        BD, BM, nw = norm._blocks_bwd(2048)
        jobs[f"_add_norm_bwd{tag}"] = (
            add_norm._add_norm_bwd, dict(xn=bf, w=bf if on else f32, dy=bf, dxn=bf, dx=bf, db=bf, dwp=f32),
            dict(M=i32, D=i32, eps=f32, NP=i32), dict(flags, BM=BM, BD=BD, HAS_DXN=on), nw, 3)
        jobs[f"_ce_rows{tag}"] = (ce._ce_rows, dict(z=bf, dz=bf, t="i64", loss=f32), dict(V=i32, ignore_index=i32),
                                  dict(BLOCK=ce.TUNE.block, GRAD=on), ce.TUNE.num_warps, 3)
        W, T = 4, conv.TUNE
        cflags = dict(HAS_BIAS=on, SILU=on, SPLIT=on)
        cints = dict(C=i32, C0=i32, C1=i32)
        jobs[f"_conv_fwd{tag}"] = (
            conv._conv_fwd, dict(x=bf, w=bf, bias=bf, h0=bf, y=bf, y1=bf, y2=bf, cu=i32), cints,
            dict(cflags, W=W, BT=T.fwd_bt, BC=T.fwd_bc, HAS_H0=on), T.fwd_warps, 3)
        jobs[f"_conv_final_state{tag}"] = (
            conv._conv_final_state, dict(x=bf, h0=bf, ht=bf, cu=i32), dict(C=i32),
            dict(W=W, WP=W, BC=conv.BC, HAS_H0=on), 4, 3)
        jobs[f"_conv_bwd{tag}"] = (
            conv._conv_bwd, dict(x=bf, w=bf, bias=bf, h0=bf, dy=bf, dy1=bf, dy2=bf, dx=bf, dwp=f32, dbp=f32, cu=i32),
            dict(cints, NS=i32, CH=i32), dict(cflags, W=W, WP=W, BT=T.bwd_bt, BC=T.bwd_bc, HAS_H0=on), T.bwd_warps, 1)
        jobs[f"_conv_bwd_h0{tag}"] = (
            conv._conv_bwd_h0, dict(x=bf, w=bf, bias=bf, h0=bf, dy=bf, dy1=bf, dy2=bf, dh0=bf, cu=i32), cints,
            dict(cflags, W=W, WP=W, BC=T.bwd_bc), 4, 3)
        jobs[f"_conv_decode{tag}"] = (
            conv._conv_decode, dict(x=bf, state=bf, idx=i32, w=bf, bias=bf, y=bf), dict(C=i32),
            dict(W=W, WP=W, BC=conv.BC, HAS_IDX=on, HAS_BIAS=on, SILU=on), 4, 3)
        HV, KG = 16, 128 if on else 1  # KG: gate channels a head (KDA's per-channel decay; GDN's one)
        BD, BH, BM = gates._blocks(HV * KG, HV)
        gints = dict(M=i32, D=i32, HV=i32, KG=i32, scale=f32)
        jobs[f"_gates_fwd{tag}"] = (gates._gates_fwd, dict(a=bf, A_log=f32, dt_bias=f32, b=bf, g=f32, beta=bf),
                                    gints, dict(BM=BM, BD=BD, BH=BH), 4, 3)
        jobs[f"_gates_bwd{tag}"] = (
            gates._gates_bwd, dict(a=bf, A_log=f32, dt_bias=f32, b=bf, dg=f32, dbeta=bf, da=bf, db=bf, dAp=f32,
                                   ddtp=f32), dict(gints, NP=i32), dict(BM=BM, BD=BD, BH=BH), 4, 3)
        half = 32 if on else 64  # partial rotary (rd 64 of hd 128: the rest copied) or full
        rints = {n: i32 for n in ("M", "T", "sqb", "sqt", "sqh", "skb", "skt", "skh", "spb", "spt", "NH", "NKV",
                                  "HD", "HALF")}
        rcx = dict(BT=rope.TUNE.bt, BH=half, BR=128 - 2 * half if on else 1, HG=rope.TUNE.heads, HAS_REST=on)
        for fn in (rope._rope_fwd, rope._rope_bwd):
            jobs[f"{fn.__name__}{tag}"] = (fn, dict(q=bf, k=bf, qo=bf, ko=bf, pos="i64", freq=f32), rints, rcx,
                                           rope.TUNE.warps, 3)
        BR = rope.TUNE.gate_rows
        strides = {n: i32 for n in ("sob", "sot", "soh", "sgb", "sgt", "sgh")}
        jobs[f"_gate_fwd{tag}"] = (rope._gate_fwd, dict(o=bf, g=bf, y=bf), dict(strides, R=i32, T=i32, NH=i32, D=i32),
                                   dict(BR=BR, BD=128, HEADWISE=on), rope.TUNE.warps, 3)
        jobs[f"_gate_bwd{tag}"] = (
            rope._gate_bwd, dict(o=bf, g=bf, dy=bf, do=bf, dg=bf),
            dict(strides, R=i32, T=i32, NH=i32, D=i32, syb=i32, syt=i32, syh=i32),
            dict(BR=BR, BD=128, HEADWISE=on), rope.TUNE.warps, 3)
    jobs["_swiglu_fwd"] = (swiglu._swiglu_fwd, dict(gate=bf, up=bf, y=bf), dict(N=i32), dict(BLOCK=swiglu.BLOCK), 8, 3)
    jobs["_swiglu_bwd"] = (swiglu._swiglu_bwd, dict(gate=bf, up=bf, dy=bf, dgate=bf, dup=bf), dict(N=i32),
                           dict(BLOCK=swiglu.BLOCK), 8, 3)
    return jobs


JOBS = sm90.all_jobs()
GLUE = glue_jobs()


def build_ttgir(fn, signature, constexprs, attrs, options):
    """The kernel's TTGIR module for sm_90 (`sm90.TARGET`), built as `triton.compile` builds it up to that stage,
    without its cache."""
    backend = make_backend(sm90.TARGET)
    opts = backend.parse_options(options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    module = src.make_ir(sm90.TARGET, opts, backend.get_codegen_implementation(opts), backend.get_module_map(),
                         context)
    stages = {}
    backend.add_stages(stages, opts, src.language)
    metadata = {}
    for stage in ("ttir", "ttgir"):
        module = stages[stage](module, metadata)
    return module


def _check_builds(jobs: dict, name: str, shape: str) -> None:
    fn, signature, constexprs, attrs, options = sm90.launch(jobs, name)
    module, error = None, None
    try:
        module = build_ttgir(fn, signature, constexprs, attrs, options)
    except Exception as e:  # noqa: BLE001 (reported below, outside the handler: one message, no chained traceback)
        error = f"{type(e).__name__}: {e}"
    if error:
        pytest.fail(f"{name} (sm_90, {shape}, num_warps {options['num_warps']}) does not compile: "
                    f"{error}", pytrace=False)
    assert module.get_int_attr("ttg.num-warps") == options["num_warps"], f"{name}: not a TTGIR module"
    assert module.get_entry_func_name() == fn.__name__, name


@pytest.mark.parametrize("name", list(JOBS))
def test_launch_builds_to_ttgir_for_sm90(name):
    _check_builds(JOBS, name, "bf16, K=V=128, BT=64")


@pytest.mark.parametrize("name", list(GLUE))
def test_glue_launch_builds_to_ttgir_for_sm90(name):
    _check_builds(GLUE, name, "bf16")
