"""scripts/gpu_check_glue.py's correctness cases as a `gpu` test: every fused glue kernel (conv + decode step, norms,
gates, SwiGLU) in bfloat16 and float32 against float64 PyTorch on the same rounded inputs, NaN-poisoned outputs,
the script's bars (bf16 1e-2, fp32 1e-5), its --quick shapes, no timing. Skipped without CUDA."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_glue.py"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_check_glue_passes():
    pytest.importorskip("triton")
    spec = importlib.util.spec_from_file_location("gpu_check_glue", SCRIPT)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    seed = int.from_bytes(os.urandom(4), "little") % 2**31
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        rows, ok = check.run_checks(torch.Generator(device="cuda").manual_seed(seed), quick=True)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    failed = [(r["case"], r["dtype"], r.get("worst"), r.get("rel"), r.get("error")) for r in rows if not r["pass"]]
    assert ok and not failed, f"seed {seed}: {failed}"
    assert len(rows) >= 40, len(rows)  # every case in both dtypes
