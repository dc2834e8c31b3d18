"""The GPU kernels take what fla's callers pass (tests/ops/test_caller_inputs.py's cases, on CUDA): inference
tensors with int32 / int64 cu_seqlens, float32 q and k beside bf16 v, and a bf16 initial_state; for the Triton
kernels (GDN and KDA, gradients included) and the Gluon forward (GDN, sm_90, no gradients).

GPU only (`@pytest.mark.gpu`). Fresh random inputs, the seed in every failure message. Reference: the float64
chunk form (equal to the token loop in float64, tests/ops/test_recurrence.py) on the same rounded values, q and k
rounded to v's dtype (the ops' rule). Bars, relative per tensor: 5e-3 for bf16 outputs and the final state, 1e-2
for gradients (the bf16 bars of the GPU check, tests/ops/test_gpu_check.py).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from float64_check import rel_f64

from hybridlm.ops import gated_delta_rule, kda

pytest.importorskip("triton")
from float64_check import gluon_gpu_marks  # noqa: E402

BF16, F64 = torch.bfloat16, torch.float64
BAR_OUT, BAR_GRAD = 5e-3, 1e-2
LENS = [100, 1, 300]
OPS = {"gdn": gated_delta_rule, "kda": kda}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BACKENDS = [pytest.param("gdn", "triton", marks=[pytest.mark.gpu, cuda]),
            pytest.param("kda", "triton", marks=[pytest.mark.gpu, cuda]),
            pytest.param("gdn", "gluon", marks=gluon_gpu_marks())]


def draw(op: str, seed: int, H=2, HV=4, K=128, V=128) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, N = sum(LENS), len(LENS)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    g = torch.nn.functional.logsigmoid(r(1, T, HV, *((K,) if op == "kda" else ())) + 3.0)
    return dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, HV, V).to(BF16), g=g,
                beta=torch.sigmoid(r(1, T, HV)).to(BF16), h0=r(N, HV, K, V))


def call(op, x, **kw):
    return OPS[op](x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["h0"], use_qk_l2norm=True,
                   output_final_state=True, **kw)


def cu_of(dtype):
    return torch.tensor([0, *itertools.accumulate(LENS)], dtype=dtype, device="cuda")


def reference(op, x, cot=None):
    """The float64 chunk form on x's values, q and k rounded to v's dtype: (o, final state, grads or None)."""
    vd = x["v"].dtype
    leaves = {n: (t.to(vd) if n in ("q", "k") else t).detach().double().requires_grad_(cot is not None)
              for n, t in x.items()}
    o, h = call(op, leaves, cu_seqlens=cu_of(torch.int64), impl="chunk")
    if cot is None:
        return o, h, None
    return o, h, torch.autograd.grad((o * cot[0]).sum() + (h * cot[1]).sum(), list(leaves.values()))


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("op,impl", BACKENDS)
def test_inference_tensors_and_int_offsets(op, impl, idx_dtype):
    seed = torch.seed() % 2**31
    x = draw(op, seed)
    x["q"], x["k"] = x["q"].to(BF16), x["k"].to(BF16)
    with torch.inference_mode():
        xi = {n: t.clone() for n, t in x.items()}
        o, h = call(op, xi, cu_seqlens=cu_of(idx_dtype), impl=impl)
    assert o.is_inference() and o.dtype == BF16 and h.dtype == torch.float32, seed
    o_ref, h_ref, _ = reference(op, x)
    errs = {"o": rel_f64(o, o_ref), "final_state": rel_f64(h, h_ref)}
    assert all(e <= BAR_OUT for e in errs.values()), (seed, errs)


@pytest.mark.parametrize("case", ["qk_fp32_v_bf16", "h0_bf16"])
@pytest.mark.parametrize("op,impl", BACKENDS)
def test_mixed_dtypes(op, impl, case):
    """float32 q, k beside bf16 v (o in bf16, computed in bf16), or everything bf16 with a bf16 initial_state
    (upcast; the final state float32); gradients in each input's dtype where the impl has a backward."""
    seed = torch.seed() % 2**31
    x = draw(op, seed)
    if case == "h0_bf16":
        x = {n: (t if n == "g" else t.to(BF16)) for n, t in x.items()}
    grads = impl != "gluon"
    leaves = {n: t.clone().requires_grad_(grads) for n, t in x.items()}
    with torch.set_grad_enabled(grads):
        o, h = call(op, leaves, cu_seqlens=cu_of(torch.int32), impl=impl)
    assert o.dtype == BF16 and h.dtype == torch.float32, (seed, o.dtype, h.dtype)
    cot = None
    if grads:
        gen = torch.Generator(device="cuda").manual_seed(seed + 1)
        cot = (torch.randn(o.shape, device="cuda", generator=gen, dtype=F64),
               torch.randn(h.shape, device="cuda", generator=gen, dtype=F64))
        got = torch.autograd.grad((o.double() * cot[0]).sum() + (h.double() * cot[1]).sum(), list(leaves.values()))
    o_ref, h_ref, refs = reference(op, x, cot)
    errs = {"o": rel_f64(o, o_ref), "final_state": rel_f64(h, h_ref)}
    assert all(e <= BAR_OUT for e in errs.values()), (seed, errs)
    if grads:
        assert all(d.dtype == t.dtype for d, t in zip(got, leaves.values())), seed
        errs = {"d" + n: rel_f64(d, r) for n, d, r in zip(leaves, got, refs)}
        assert all(e <= BAR_GRAD for e in errs.values()), (seed, errs)
