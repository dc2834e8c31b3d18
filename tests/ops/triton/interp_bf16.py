"""Under TRITON_INTERPRET=1: one bf16 dot and the fp32 <-> bf16 casts of a tiny kernel against torch (what the GPU
computes), with the tests' interpreter fixes (interp_patches.py) applied. Prints one RESULT line of JSON: each
check's largest absolute difference."""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interp_patches import patch_interpreter  # noqa: E402

patch_interpreter()


@triton.jit
def _bf16_probe(a, b, x, c, y, z, N: tl.constexpr):
    """c = a @ b (bf16 operands, fp32 accumulator); y = x rounded to bf16 (a store into a bf16 buffer); z = that
    bf16 value widened back to fp32 in the kernel."""
    r = tl.arange(0, N)
    ta = tl.load(a + r[:, None] * N + r[None, :])
    tb = tl.load(b + r[:, None] * N + r[None, :])
    tl.store(c + r[:, None] * N + r[None, :], tl.dot(ta, tb))
    tx = tl.load(x + r[:, None] * N + r[None, :])
    xb = tx.to(tl.bfloat16)
    tl.store(y + r[:, None] * N + r[None, :], xb)
    tl.store(z + r[:, None] * N + r[None, :], xb.to(tl.float32) * 2.0)


def main() -> int:
    gen = torch.Generator().manual_seed(0)
    N = 16
    a = torch.randn(N, N, generator=gen).bfloat16()
    b = torch.randn(N, N, generator=gen).bfloat16()
    # values with bits below bf16's mantissa, among them exact ties (x.5 ulp): round to nearest even, not toward 0
    x = torch.randn(N, N, generator=gen) * torch.logspace(-20, 20, N * N).view(N, N)
    x[0, :4] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 1.0 + 2**-9])
    c = torch.empty(N, N)
    y = torch.empty(N, N, dtype=torch.bfloat16)
    z = torch.empty(N, N)
    _bf16_probe[(1,)](a, b, x, c, y, z, N=N)
    ref_y = x.bfloat16()
    out = {"dot": (c - a.float() @ b.float()).abs().max().item(),
           "cast": (y.float() - ref_y.float()).abs().max().item(),
           "widen": (z - 2.0 * ref_y.float()).abs().max().item(),
           "ties": [float(v) for v in y[0, :4].float()]}
    print("RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
