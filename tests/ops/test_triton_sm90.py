"""Every Triton launch of the GDN and KDA ops builds for an H100 (sm_90) through Triton's frontend and its TTIR and
TTGIR passes, on a CPU-only machine.

The rest of the CPU suite runs these kernels under TRITON_INTERPRET=1, which executes their Python bodies without the
compiler's checks: a loop-carried block re-assigned with a block of another shape, or a layout the TTGIR passes
refuse, runs in the interpreter and only fails at the GPU compile. The launches are `scripts/compile_sm90.py`'s job
tables (`all_jobs`, typed by its `launch` as Triton's launcher would type them), at the script's defaults: bf16,
K = V = 128, chunk 64, H = HV = 16, aligned pointers, each kernel at its table's warps and stages. The build stops at
TTGIR: type errors come from the frontend and layout errors from the TTGIR passes; LLVM, PTX and ptxas (registers,
spills, shared memory) stay with the script, which takes about 47 s for all to cubin. About 15 s here on one core.
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

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="under TRITON_INTERPRET=1 the kernels are the interpreter's, not compilable")
JOBS = sm90.all_jobs()


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


@pytest.mark.parametrize("name", list(JOBS))
def test_launch_builds_to_ttgir_for_sm90(name):
    fn, signature, constexprs, attrs, options = sm90.launch(JOBS, name)
    module, error = None, None
    try:
        module = build_ttgir(fn, signature, constexprs, attrs, options)
    except Exception as e:  # noqa: BLE001 (reported below, outside the handler: one message, no chained traceback)
        error = f"{type(e).__name__}: {e}"
    if error:
        pytest.fail(f"{name} (sm_90, bf16, K=V=128, BT=64, num_warps {options['num_warps']}) does not compile: "
                    f"{error}", pytrace=False)
    assert module.get_int_attr("ttg.num-warps") == options["num_warps"], f"{name}: not a TTGIR module"
    assert module.get_entry_func_name() == fn.__name__, name
