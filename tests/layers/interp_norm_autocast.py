"""RMSNorm under autocast, the fused Triton norm run by the interpreter (TRITON_INTERPRET=1, CPU autocast bf16).

    python tests/layers/interp_norm_autocast.py [seed]

Run by tests/layers/test_norm_autocast.py in a child process (the variable must be set before triton decorates
the kernels). Prints one JSON line "RESULT {case: {check: value}}"; the parent asserts. Fresh random inputs every
run (seed printed); kernel outputs start as NaN (POISON) so an unwritten element fails. Triton 3.6's interpreter
rounds float32 -> bfloat16 by truncation; hybridlm.ops.triton replaces that cast with round-to-nearest-even
(interp_patches._patch_bf16), so the fused output is checked against round-to-nearest here too
(`y_equal_rtne_y32`; `y_is_rounded_y32` accepts either rounding) as on a GPU (test_norm_autocast.py's CUDA test).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ops", "triton"))
from interp_patches import patch_interpreter  # noqa: E402  (the interpreter's fixes, before any kernel runs)

patch_interpreter()

import torch  # noqa: E402

from hybridlm.layers.norm import NORM_KINDS, RMSNorm  # noqa: E402
from hybridlm.ops import rms_norm  # noqa: E402
from hybridlm.ops.triton import norm as tnorm  # noqa: E402

tnorm.POISON = True
BF16, F64 = torch.bfloat16, torch.float64


def trunc_bf16(y: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 by dropping the low 16 bits (what the interpreter's cast does)."""
    return (y.contiguous().view(torch.int32) & -65536).view(torch.float32).to(BF16)


def max_rel_elem(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / |ref| over the elements (ref float64, no zeros in random data)."""
    return float(((y.to(F64) - ref).abs() / ref.abs().clamp_min(1e-30)).max())


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to(F64), b.detach().to(F64)
    return float((a - b).norm() / b.norm())


def ref_kw(kind: str) -> dict:
    return {"zero_centered": True} if kind == "zero_centered" else {"cast_before_weight": kind == "llama"}


def case(gen, kind: str, shape: tuple[int, ...], compiled: bool = False) -> dict:
    D = shape[-1]
    x0 = torch.randn(*shape, generator=gen) * (0.1 + 3 * torch.rand((), generator=gen))
    w0 = 0.3 * torch.randn(D, generator=gen) + (0.0 if kind == "zero_centered" else 1.0)
    g = torch.randn(*shape, generator=gen)  # the cotangent as the next layers would send it in float32
    res: dict = {}
    for impl in ("triton", "naive"):
        m = RMSNorm(D, eps=1e-6, kind=kind, impl=impl)
        with torch.no_grad():
            m.weight.copy_(w0)
        x = x0.clone().requires_grad_()
        y32 = m(x)  # no autocast: float32, as before
        with torch.autocast("cpu", dtype=BF16):
            yb = m(x)
        # backward of the autocast output with the cotangent in its dtype, and of the float32 output with the same
        # (rounded) numbers: the norm's backward sees the same values, so the gradients must be the same bits
        dx, dw = torch.autograd.grad(yb, (x, m.weight), g.to(BF16))
        dx32, dw32 = torch.autograd.grad(y32, (x, m.weight), g.to(BF16).float())
        # float64 reference of the values and of the gradients with the unrounded cotangent
        xr, wr = x0.to(F64).requires_grad_(), w0.to(F64).requires_grad_()
        yr = rms_norm(xr, wr, 1e-6, **ref_kw(kind))
        dxr, dwr = torch.autograd.grad(yr, (xr, wr), g.to(F64))
        r = {
            "dtypes_ok": y32.dtype == torch.float32 and yb.dtype == BF16 and dx.dtype == dw.dtype == torch.float32,
            "y_rel_elem": max_rel_elem(yb, yr.detach()),
            "y32_rel_l2": rel_l2(y32, yr),
            "dx_equal_fp32_path": torch.equal(dx, dx32),
            "dw_equal_fp32_path": torch.equal(dw, dw32),
            "dx_rel_l2": rel_l2(dx, dxr),
            "dweight_rel_l2": rel_l2(dw, dwr),
        }
        rn, tr = y32.detach().to(BF16), trunc_bf16(y32.detach())
        r["y_is_rounded_y32"] = bool(((yb == rn) | (yb == tr)).all())
        r["y_equal_rtne_y32"] = torch.equal(yb, rn)
        # x already in a low precision: bf16 stays as it was; fp16 gets its own result cast to bf16
        xl = x0.to(BF16)
        with torch.autocast("cpu", dtype=BF16):
            yl = m(xl)
        r["bf16_x_unchanged"] = yl.dtype == BF16 and torch.equal(yl, m(xl))
        xh = x0.to(torch.float16)
        with torch.autocast("cpu", dtype=BF16):
            yh = m(xh)
        r["fp16_x_cast_last"] = yh.dtype == BF16 and torch.equal(yh, m(xh).to(BF16))
        if compiled:  # the autocast dtype rule and the out_dtype op under torch.compile(fullgraph=True)
            torch._dynamo.reset()
            mc = torch.compile(m, fullgraph=True, backend="aot_eager")
            with torch.autocast("cpu", dtype=BF16):
                yc = mc(x)
            dxc, dwc = torch.autograd.grad(yc, (x, m.weight), g.to(BF16))
            r["compiled_equal"] = yc.dtype == BF16 and torch.equal(yc, yb) and torch.equal(dxc, dx) \
                and torch.equal(dwc, dw) and mc(x).dtype == torch.float32
        res[impl] = r
    return res


def main() -> None:
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    out: dict = {"seed": seed}
    for kind in NORM_KINDS:
        for shape in ((2, 9, 64), (37, 200)):
            out[f"{kind}_{'x'.join(map(str, shape))}"] = case(gen, kind, shape, compiled=shape == (2, 9, 64))
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
