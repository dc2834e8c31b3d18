"""The CPU interpreter's bf16 as the tests' patch fixes it (tests/ops/triton/interp_patches.py): without it a bf16
tl.dot multiplies bit patterns and an fp32 -> bf16 cast truncates (Triton 3.6), so no bf16 path of our kernels could
be tested on the CPU. One tiny kernel in a subprocess under TRITON_INTERPRET=1 against torch's bf16 (what the GPU
computes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "triton" / "interp_bf16.py"


def test_interpreter_bf16_dot_and_casts_match_torch():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
    # bf16 products are exact in fp32; the two sides may add them in another order: a few fp32 ulps of sums ~10
    assert res["dot"] <= 1e-5, res
    assert res["cast"] == 0.0 and res["widen"] == 0.0, res
    # ties go to the even neighbour, as torch and the GPU round
    assert res["ties"] == [1.0, 1.015625, -1.0, 1.0], res
