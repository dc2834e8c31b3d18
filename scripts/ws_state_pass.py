"""Does Triton's automatic warp specialization apply to our GDN state pass on sm_90? Compiled on the CPU (no GPU).

A forward that moves fewer bytes than today's four launches has to run the chunk-local work (K K^T, the solve, W,
U, the output) inside the serial state pass, where one program's chunk steps are dependent and it stalls unless
some warps load and compute the next chunk while others finish this one: warp specialization. Triton exposes it as
`tl.range(..., warp_specialize=True)`. This script copies `gdn_kernels.py` with the chunk loop of `_recur_fwd`
marked so, compiles the training forward's state pass (`_recur_fwd(state raw k)`, K = V = 128 bf16, V block 32)
for sm_90 at 4 and 8 warps, plain and marked, and reports for each: compiled or not, registers, shared memory,
and how many `ttg.warp_specialize` ops (the partitions the pass creates) its TTGIR holds.

    python scripts/ws_state_pass.py 2>/dev/null     (stderr: the MLIR reproducer of a failed compile)
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compile_sm90  # noqa: E402

from hybridlm.ops.triton import gdn_kernels as kern  # noqa: E402

LOOP = "    for c in range(NCH):\n        t0 = c * BT\n        nval = Tn - t0\n        live = nval > 0  # chunks past"


def marked_module(tmp: str):
    """gdn_kernels with `_recur_fwd`'s chunk loop as tl.range(NCH, warp_specialize=True), imported from tmp."""
    src = open(kern.__file__).read()
    if src.count(LOOP) != 1:
        raise SystemExit("the state pass's chunk loop is not where this script expects it: update LOOP")
    src = src.replace(LOOP, LOOP.replace("range(NCH)", "tl.range(NCH, warp_specialize=True)"))
    src = src.replace("from ..", "from hybridlm.ops.")
    path = os.path.join(tmp, "gdn_kernels_ws.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("gdn_kernels_ws", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gdn_kernels_ws"] = mod
    spec.loader.exec_module(mod)
    return mod


def compile_state_pass(fn, warps: int, dump: str) -> str:
    """One line: `compile_sm90`'s report of `_recur_fwd(state raw k)` compiled from fn, and how many
    `ttg.warp_specialize` ops its TTGIR holds."""
    os.makedirs(dump, exist_ok=True)
    plain, kern._recur_fwd = kern._recur_fwd, fn
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            compile_sm90.main(["--only", "_recur_fwd(state raw k)", "--bv", "32", "--warps", str(warps), "--dump",
                               dump])
    finally:
        kern._recur_fwd = plain
    line = out.getvalue().strip().splitlines()[-1].split(":", 1)[1].strip()
    ttgir = [f for f in os.listdir(dump) if f.endswith(".ttgir")]
    if "FAILED" in line or not ttgir:
        return line
    ops = len(re.findall(r"ttg\.warp_specialize", open(os.path.join(dump, ttgir[0])).read()))
    return f"{line}, ttg.warp_specialize ops {ops}"


def main() -> int:
    import triton

    print(f"triton {triton.__version__}, sm_90, _recur_fwd(state raw k), K = V = 128 bf16, V block 32, 2 stages")
    with tempfile.TemporaryDirectory() as tmp:
        ws = marked_module(tmp)
        for warps in (4, 8):
            for label, fn in (("plain", kern._recur_fwd), ("warp_specialize=True", ws._recur_fwd)):
                line = compile_state_pass(fn, warps, os.path.join(tmp, f"{label[:5]}{warps}"))
                print(f"{warps} warps, {label:<21} {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
