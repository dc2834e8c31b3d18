"""The float64 GPU check (scripts/gpu_check_gdn.py) as pytest tests: every awkward-shape case of the GDN and KDA
kernels (bf16, fp16 and fp32, with and without autograd, varlen, GVA 1/2/4, K=V=256, the zero-padded head dims
K=96 V=192, 48 and 32/16, strong decay, a fresh layer's gates, recompute, torch.compile, one chunk a sequence
without an initial state, no final state asked for) and both decode steps
(K=V=128 and the masked K=96 V=192), each against the float64 reference at the check's bars (bf16 and fp16: 5e-3
outputs, 1e-2 gradients; fp32: 1e-5, TF32 off). The benchmark shapes stay in the script (`--quick` leaves them
out as these tests do).
One fresh seed per session, printed in every failure."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
import gpu_check_gdn as check  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SEED = torch.seed() % 2**31


@pytest.fixture
def gen():
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield torch.Generator(device="cuda").manual_seed(SEED)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _assert_pass(row: dict) -> None:
    assert row["pass"], f"{row['case']} {row['dtype']}: worst {row['worst']} {row['worst_rel']:.3g}, " \
                        f"errors {row['errors']} (seed {SEED})"


@pytest.mark.parametrize(("name", "kw"), check.cases(quick=True),
                         ids=[f"{n} {str(kw['dtype'])[6:]}" for n, kw in check.cases(quick=True)])
def test_chunk_case_matches_float64(gen, name, kw):
    _assert_pass(check.run_case(gen, name, kw))


@pytest.mark.parametrize("dims", check.DECODE_DIMS, ids=[f"K{k}V{v}" for k, v in check.DECODE_DIMS])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_decode_step_matches_float64(gen, kda, dtype, dims):
    _assert_pass(check.run_decode(gen, kda, dtype, *dims))
