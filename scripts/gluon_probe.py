"""Can Triton's own low-level dialect, Gluon, carry a warp-specialized GDN kernel that CI can test? CPU only.

Gluon (`triton.experimental.gluon`) is the one place in Triton where a kernel names its warp partitions, Hopper's
warpgroup MMA, TMA copies and mbarriers itself (the fused forward of docs/kernels.md "How far each plan is from its
bytes" needs them). Issue 5 and 6 ask for every kernel to run under TRITON_INTERPRET=1 in CI as well. This script
prints which of those Gluon names the installed Triton has, then runs a trivial Gluon kernel (y = 2 x) under
TRITON_INTERPRET=1 in a child process and prints what happens.

    python scripts/gluon_probe.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

KERNEL = '''
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def double(x, y, N: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, N, layout=layout)
    gl.store(y + offs, gl.load(x + offs) * 2)


x = torch.arange(128, dtype=torch.float32)
y = torch.zeros(128)
try:
    double[(1,)](x, y, N=128, num_warps=4)
    print("ran: y == 2 x" if torch.equal(y, 2 * x) else "ran, wrong result")
except Exception as e:  # noqa: BLE001 (the outcome is what is reported)
    print(f"did not run: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
'''


def main() -> int:
    import triton

    print(f"triton {triton.__version__}")
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia import hopper
    except ImportError as e:
        print(f"no Gluon Hopper module: {e}")
        return 0
    have = {"gl.warp_specialize": hasattr(gl, "warp_specialize")}
    for name in ("warpgroup_mma", "tma", "mbarrier", "fence_async_shared"):
        have[f"hopper.{name}"] = hasattr(hopper, name)
    print("Gluon names: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in have.items()))
    with tempfile.TemporaryDirectory() as d:  # @gluon.jit needs its function in a file
        path = os.path.join(d, "gluon_double.py")
        with open(path, "w") as f:
            f.write(KERNEL)
        env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
        r = subprocess.run([sys.executable, path], capture_output=True, text=True, env=env, timeout=300)
    print("a Gluon kernel under TRITON_INTERPRET=1 (no GPU): " + (r.stdout.strip() or r.stderr.strip()[-300:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
