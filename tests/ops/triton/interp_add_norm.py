"""Cases for the fused residual add + RMSNorm (hybridlm/ops/triton/add_norm.py), run in a child process under
TRITON_INTERPRET=1 (CPU).

    python tests/ops/triton/interp_add_norm.py SEED

Run by tests/ops/test_add_rms_norm.py (the variable must be set before triton decorates the kernels). Prints one
JSON line "RESULT {case: {check: value}}"; the parent asserts. Inputs are drawn from SEED (the suite's seed for
the test); kernel outputs start as NaN (POISON) so an unwritten element fails. Per case: the relative L2 error of
y, x_new and every gradient (dx, dbranch, dweight) against float64 (`hybridlm.ops.add_rms_norm` on the inputs as
float64, the same cotangents), y against the PyTorch op on the same dtypes (`y_vs_same_dtype_op`: the float64
reference adds exactly, so only this sees whether the norm reads x_new rounded), and exact checks: x_new equals
torch's own add bit for bit, the dtypes are torch's promoted ones, and dbranch is dx rounded to branch's dtype
(one d_total, two casts).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interp_patches import patch_interpreter  # noqa: E402  (the interpreter's fixes, before any kernel runs)

patch_interpreter()

import torch  # noqa: E402

from hybridlm.layers.norm import RMSNorm  # noqa: E402
from hybridlm.ops import add_rms_norm  # noqa: E402
from hybridlm.ops.triton import add_norm as tadd  # noqa: E402
from hybridlm.ops.triton import norm as tnorm  # noqa: E402
from hybridlm.ops.triton.tune import tuned  # noqa: E402

tnorm.POISON = True
F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
KW = {"zero_centered": {"zero_centered": True}, "llama": {"cast_before_weight": True},
      "fp32_weight": {"cast_before_weight": False}, "noweight": {}}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to(F64), b.detach().to(F64)
    if a.shape != b.shape or not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def case(gen, kind: str, shape, x_dtype, b_dtype, *, out_dtype=None, use_xn=True) -> dict:
    """One call of the kernel and of the float64 reference on the same inputs and cotangents."""
    D = shape[-1]
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x, b = (2 * r(*shape)).to(x_dtype), r(*shape).to(b_dtype)
    w = None if kind == "noweight" else 0.3 * r(D) + (0.0 if kind == "zero_centered" else 1.0)
    leaves = [t.clone().requires_grad_() for t in ((x, b) if w is None else (x, b, w))]
    refs = [t.to(F64).requires_grad_() for t in leaves]
    y, xn = tadd.add_rms_norm(leaves[0], leaves[1], leaves[2] if w is not None else None, 1e-6, **KW[kind],
                              out_dtype=out_dtype)
    y2, xn2 = add_rms_norm(refs[0], refs[1], refs[2] if w is not None else None, 1e-6, **KW[kind])
    xn_dtype = torch.promote_types(x_dtype, b_dtype)
    with torch.no_grad():  # the float64 norm adds exactly: x_new's rounding (bf16) shows only against the same op
        y_same = add_rms_norm(x, b, w, 1e-6, **KW[kind], out_dtype=out_dtype)[0]
    res = {"y": rel(y, y2), "x_new": rel(xn, xn2), "y_vs_same_dtype_op": rel(y, y_same),
           "x_new_is_torch_add": float(torch.equal(xn, x + b)),
           "dtypes_ok": float(xn.dtype == xn_dtype and y.dtype == (out_dtype or xn_dtype))}
    gy, gx = r(*shape), r(*shape)
    loss = (y.float() * gy).sum() + ((xn.float() * gx).sum() if use_xn else 0)
    loss2 = (y2 * gy.to(F64)).sum() + ((xn2 * gx.to(F64)).sum() if use_xn else 0)
    grads, grads2 = torch.autograd.grad(loss, leaves), torch.autograd.grad(loss2, refs)
    for name, g, g2 in zip(("dx", "dbranch", "dweight"), grads, grads2):
        res[name] = rel(g, g2)
    res["grad_dtypes_ok"] = float(all(g.dtype == t.dtype for g, t in zip(grads, leaves)))
    res["dbranch_is_dx_cast"] = float(torch.equal(grads[1], grads[0].to(b_dtype)) if x_dtype == xn_dtype else 1.0)
    return res


def module_case(gen, kind: str) -> dict:
    """RMSNorm(x, branch) on Triton under CPU autocast bf16 (the model's path) vs the same module on PyTorch:
    bf16 y, float32 x_new, within one bf16 rounding of y; x_new and its gradient bit for bit."""
    D = 80
    m = RMSNorm(D, 1e-6, kind, impl="triton")
    with torch.no_grad():
        m.weight.add_(0.3 * torch.randn(D, generator=gen))
    x, b = torch.randn(3, 7, D, generator=gen), torch.randn(3, 7, D, generator=gen).to(BF16)
    out = {}
    for impl in ("triton", "torch"):
        m.impl = impl
        xl, bl = x.clone().requires_grad_(), b.clone().requires_grad_()
        with torch.autocast("cpu", dtype=BF16):
            y, xn = m(xl, bl)
        (y.float().square().sum() + xn.sum()).backward()
        out[impl] = (y, xn, xl.grad, bl.grad)
    (y, xn, dx, db), (y2, xn2, dx2, db2) = out["triton"], out["torch"]
    types_ok = y.dtype == y2.dtype == BF16 and xn.dtype == F32
    y, y2 = y.detach().float(), y2.detach().float()
    return {"y_bf16_xn_f32": float(types_ok), "x_new_equal": float(torch.equal(xn, xn2)),
            "y_ulps": float(((y - y2).abs() / y2.abs().clamp_min(1e-30)).max()),
            "dx": rel(dx, dx2), "dbranch": rel(db, db2)}


def compiled_case(gen) -> dict:
    """Two fused norms in a row (one's x_new feeding the next, the last x_new unused, as in the model) under
    torch.compile(fullgraph=True, aot_eager) against eager: the custom ops' fake kernels trace, both ways."""
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x, b1, w = r(2, 7, 48).requires_grad_(), r(2, 7, 48).to(BF16).requires_grad_(), r(48).requires_grad_()
    b2 = r(2, 7, 48).to(BF16).requires_grad_()

    def f(x, b1, b2, w):
        h, xn = tadd.add_rms_norm(x, b1, w, out_dtype=BF16)
        return tadd.add_rms_norm(xn, b2 * h, w, zero_centered=True)[0]

    out = torch.compile(f, backend="aot_eager", fullgraph=True)(x, b1, b2, w)
    ref = f(x, b1, b2, w)
    res = {"y": rel(out, ref)}
    gr = torch.autograd.grad(out.sum(), [x, b1, b2, w])
    gr2 = torch.autograd.grad(ref.sum(), [x, b1, b2, w])
    res.update({n: rel(p, q) for n, p, q in zip(["dx", "dbranch1", "dbranch2", "dweight"], gr, gr2)})
    return res


def cases(gen) -> dict:
    res = {}
    for kind in ("zero_centered", "llama", "fp32_weight", "noweight"):
        res[f"{kind}_f32_f32"] = case(gen, kind, (5, 9, 96), F32, F32)
        res[f"{kind}_f32_bf16"] = case(gen, kind, (37, 160), F32, BF16)
    res["llama_bf16_bf16"] = case(gen, "llama", (4, 11, 64), BF16, BF16)
    res["zero_centered_bf16_bf16"] = case(gen, "zero_centered", (45, 48), BF16, BF16)
    res["fp32_weight_f32_bf16_out_bf16"] = case(gen, "fp32_weight", (2, 21, 128), F32, BF16, out_dtype=BF16)
    res["llama_bf16_bf16_out_f32"] = case(gen, "llama", (19, 40), BF16, BF16, out_dtype=F32)
    res["zero_centered_f32_bf16_xn_unused"] = case(gen, "zero_centered", (33, 72), F32, BF16, use_xn=False)
    with tuned(tnorm.TUNE, bwd_programs_per_sm=2, fwd_elems=128):  # several blocks per program, short forward blocks
        res["llama_f32_bf16_looped"] = case(gen, "llama", (61, 48), F32, BF16)
    for kind in ("zero_centered", "llama", "fp32_weight"):
        res[f"module_autocast_{kind}"] = module_case(gen, kind)
    res["compiled"] = compiled_case(gen)
    return res


def main() -> int:
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else torch.seed() % 2**31
    res = {"seed": seed}
    res.update(cases(torch.Generator().manual_seed(seed)))
    print("RESULT " + json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
