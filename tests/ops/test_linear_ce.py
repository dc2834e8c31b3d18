"""Chunked linear + cross-entropy against F.cross_entropy on the full logits (float64), values and gradients.

The PyTorch path: float64 to 1e-12, float32 and bf16 autocast to their rounding. The Triton cross-entropy kernel
(hybridlm/ops/triton/ce.py) on the CPU (CI): under TRITON_INTERPRET=1 in a child process
(tests/ops/triton/interp_ce.py, seeded from the suite's seed, NaN-poisoned outputs, blocks of 32 logits so a row
takes several and a partial last one); see that script for the cases. Tolerances:
- kernel rows against float64 on the same stored logits: loss 1e-6 of max(1, |loss|) (fp32 arithmetic; the max
  kept apart from log(sum exp) makes rows shifted by 3e4 exact too: measured <= 1.9e-7); dlogits elementwise
  (at the target beyond 2^-22: softmax - 1 keeps the fp32 error of a softmax value near 1) within the dtype's
  rounding of the value plus fp32 error: 2^-8 + 1e-5 (bf16), 2^-11 + 1e-5 (fp16), 2e-5
  (fp32: exp(x) for x near -100 carries x's rounding, 100 * 2^-24), measured over 8 seeds 3.8e-3, 4.9e-4,
  1.5e-6 (both bounds are strict: half an ulp of the dtype plus the fp32 error).
- the op on float32 inputs against float64: loss 2e-6, gradients 5e-6 (measured 1e-7 and 2.1e-7). Under CPU bf16
  autocast against float64 the bf16 bars of the glue (5e-3 the loss, 1e-2 gradients; measured 3.6e-4, 5.1e-3), and
  against the PyTorch path under the same autocast, which rounds at the same points: loss 1e-6 (summation
  order), gradients 1e-3 (an fp32 exp one ulp apart may flip a bf16 rounding; measured 0).
- the model's head with impl="triton" against impl="naive" (float32): loss 2e-6, every gradient 5e-6.
The `gpu` tests run the kernel on CUDA at vocabulary sizes that are not a multiple of the default block.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hybridlm.ops.linear_ce import linear_cross_entropy

IGNORE = -100
HERE = Path(__file__).parent
ROOT = HERE.parents[1]
ROWS = [f"rows_{d}_V{v}" for d in ("f32", "bf16", "f16") for v in (100, 32, 7)]
ROW_BARS = {"f32": 2e-5, "bf16": 2.0**-8 + 1e-5, "f16": 2.0**-11 + 1e-5}
OPS = [f"op_{d}_{r}" for d in ("f32", "bf16") for r in ("sum", "mean")]


def _inputs(seed, n, d, v, dtype=torch.float64, ignored=0.3):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g, dtype=torch.float64) * 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignored] = IGNORE
    return h, w, t


def _reference(h, w, t, reduction):
    return F.cross_entropy(F.linear(h, w).double(), t, ignore_index=IGNORE, reduction=reduction)


@pytest.mark.parametrize("n,d,v,chunk", [(37, 13, 29, 5), (64, 16, 256, None), (7, 3, 11, 1), (50, 8, 17, 50),
                                         (50, 8, 17, 64)])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_matches_full_logits_float64(n, d, v, chunk, reduction):
    seed = n * 1000 + v
    h, w, t = _inputs(seed, n, d, v)
    got = linear_cross_entropy(h, w, t, ignore_index=IGNORE, reduction=reduction, chunk_size=chunk)
    want = _reference(h, w, t, reduction)
    assert got.dtype == torch.float64
    assert abs(got.item() - want.item()) <= 1e-12 * max(1.0, abs(want.item())), f"seed {seed}"
    gw = torch.randn((), generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    a = torch.autograd.grad(got * gw, (h, w))
    b = torch.autograd.grad(want * gw, (h, w))
    for name, x, y in zip(("hidden", "weight"), a, b):
        err = (x - y).abs().max().item()
        assert err <= 1e-12, f"seed {seed}: d{name} error {err}"


def test_all_ignored_and_no_grad():
    h, w, t = _inputs(5, 9, 4, 7, ignored=1.0)
    s = linear_cross_entropy(h, w, t)
    assert s.item() == 0.0
    gh, gwt = torch.autograd.grad(s, (h, w))
    assert not gh.any() and not gwt.any()
    assert torch.isnan(linear_cross_entropy(h, w, t, reduction="mean"))
    with torch.no_grad():
        h2, w2, t2 = _inputs(6, 9, 4, 7)
        assert not linear_cross_entropy(h2, w2, t2).requires_grad


def test_float32_and_bf16_autocast_follow_the_unfused_dtypes():
    """fp32 inputs: float32 loss and grads close to the float64 reference; under bf16 autocast the matmuls are
    bf16 as with F.linear under autocast, the loss float32 (tolerance: bf16 rounding of hidden and weight)."""
    h, w, t = _inputs(11, 40, 16, 33)
    ref = _reference(h, w, t, "sum")
    hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    got = linear_cross_entropy(hf, wf, t)
    assert got.dtype == torch.float32 and abs(got.item() - ref.item()) <= 1e-4 * abs(ref.item())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got16 = linear_cross_entropy(hf, wf, t)
    assert got16.dtype == torch.float32 and abs(got16.item() - ref.item()) <= 2e-2 * abs(ref.item())
    got16.backward()
    assert wf.grad.dtype == torch.float32 and hf.grad.dtype == torch.float32


def test_bad_input_is_refused():
    h, w, t = _inputs(3, 4, 5, 6)
    with pytest.raises(ValueError, match="reduction: expected"):
        linear_cross_entropy(h, w, t, reduction="none")
    with pytest.raises(ValueError, match="targets: expected shape"):
        linear_cross_entropy(h, w, t[:2])
    with pytest.raises(ValueError, match="hidden, weight"):
        linear_cross_entropy(h, w[:, :2], t)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(h, w, t, chunk_size=0)


def test_impl_is_checked():
    h, w, t = _inputs(3, 4, 5, 6)
    with pytest.raises(ValueError, match="impl: expected"):
        linear_cross_entropy(h, w, t, impl="fast")
    if pytest.importorskip("triton"):
        with pytest.raises(TypeError, match="hidden: expected dtype"):
            linear_cross_entropy(h, w, t, impl="triton")  # float64 stays on PyTorch
    got = linear_cross_entropy(h, w, t, impl="auto")  # the CPU: the PyTorch path, float64 exact
    assert abs(got.item() - _reference(h, w, t, "sum").item()) <= 1e-12 * abs(got.item())


@pytest.fixture(scope="module")
def interp_results(interp_job):
    """interp_ce.py's results (started at collection in the suite's second lane: tests/conftest.py)."""
    pytest.importorskip("triton")
    return interp_job("ce")


@pytest.mark.parametrize("case", ROWS)
def test_triton_kernel_rows_match_float64(interp_results, case):
    """Loss and dlogits of the kernel against float64 on the same logits: ignored tokens, targets at the max and at
    either end of the row, a row shifted by 3e4, a steep row; in place equals out of place; loss only; NaN for a
    target out of range."""
    res, seed = dict(interp_results[case]), interp_results["seed"]
    for exact in ("ignored_zero", "in_place_equal", "loss_only_equal", "out_of_range_nan"):
        assert res.pop(exact) == 1.0, f"{case}: {exact} fails (seed {seed})"
    assert res["loss"] <= 1e-6, f"{case} loss: {res['loss']:.3g} (seed {seed})"
    bar = ROW_BARS[case.split("_")[1]]
    assert res["dlogits"] <= bar, f"{case} dlogits: {res['dlogits']:.3g} > {bar:.3g} (seed {seed})"


@pytest.mark.parametrize("case", OPS)
def test_triton_op_matches_float64(interp_results, case):
    """linear_cross_entropy(impl="triton"), 37 tokens in chunks of 10: loss and both gradients against float64;
    under bf16 autocast also against the PyTorch path under the same autocast."""
    res, seed = dict(interp_results[case]), interp_results["seed"]
    assert res.pop("dtypes_ok") == 1.0, f"{case}: dtypes (seed {seed})"
    bf16 = "bf16" in case
    bars = {"loss": 5e-3 if bf16 else 2e-6, "grad_hidden": 1e-2 if bf16 else 5e-6,
            "grad_weight": 1e-2 if bf16 else 5e-6, "loss_vs_torch": 1e-6, "grad_hidden_vs_torch": 1e-3,
            "grad_weight_vs_torch": 1e-3}
    assert len(res) == (6 if bf16 else 3)
    for name, err in res.items():
        assert err <= bars[name], f"{case} {name}: {err:.3g} > {bars[name]} (seed {seed})"


def test_triton_op_edges_model_head_and_compile(interp_results):
    """no_grad, all tokens ignored, no tokens, a target out of range (NaN); the model's head on the kernel; the op
    under torch.compile(fullgraph=True, aot_eager) as eager (float32 rounding)."""
    res, seed = interp_results["op_edges"], interp_results["seed"]
    assert all(v == 1.0 for v in res.values()), (res, seed)
    res = interp_results["model_head"]
    assert res["loss"] <= 2e-6 and res["grads"] <= 5e-6, (res, seed)
    res = interp_results["compiled"]
    assert len(res) == 3 and all(v <= 2e-6 for v in res.values()), (res, seed)


def _cuda_case(n, d, v, dtype, ignored=0.2):
    g = torch.Generator(device="cuda").manual_seed(n + v)
    h = torch.randn(n, d, device="cuda", generator=g).to(dtype)
    w = (torch.randn(v, d, device="cuda", generator=g) / d**0.5 * 3).to(dtype)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[torch.rand(n, device="cuda", generator=g) < ignored] = IGNORE
    return h, w, t


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("v", [5003, 32000])
def test_gpu_kernel_path_matches_float64(autocast, v):
    """impl="auto" on CUDA (the kernel; float32 inputs, or bf16 autocast) against float64 on the same inputs and
    against impl="torch": 2500 tokens in chunks of 700."""
    h, w, t = _cuda_case(2500, 256, v, torch.float32)
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    hd_in, wd_in = (hd.bfloat16().double(), wd.bfloat16().double()) if autocast else (hd, wd)  # autocast's inputs
    ref = F.cross_entropy(F.linear(hd_in, wd_in), t, ignore_index=IGNORE, reduction="sum")
    rh, rw = torch.autograd.grad(ref, (hd, wd))
    out = {}
    for impl in ("auto", "torch"):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = linear_cross_entropy(hh, ww, t, chunk_size=700, impl=impl)
        loss.backward()
        out[impl] = (loss.detach(), hh.grad, ww.grad)
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()  # noqa: E731
    (lk, ghk, gwk), (lt, ght, gwt) = out["auto"], out["torch"]
    bar_l, bar_g = (5e-3, 1e-2) if autocast else (1e-5, 2e-5)
    assert abs(lk.item() - ref.item()) <= bar_l * abs(ref.item())
    assert rel(ghk, rh) <= bar_g and rel(gwk, rw) <= bar_g, (rel(ghk, rh), rel(gwk, rw))
    assert abs(lk.item() - lt.item()) <= 1e-5 * abs(lt.item())
    assert rel(ghk, ght) <= (1e-3 if autocast else 2e-5), rel(ghk, ght)
    assert rel(gwk, gwt) <= (5e-3 if autocast else 2e-5), rel(gwk, gwt)  # the same GEMMs; d may differ by an ulp


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_kernel_rows(dtype):
    """The kernel on CUDA at the default block, vocabulary 32000 + 77 (a partial last block), NaN-poisoned
    outputs, with ignored rows and a row shifted by 3e4, against float64 on the same logits."""
    from hybridlm.ops.triton import ce

    v, c = 32077, 64
    g = torch.Generator(device="cuda").manual_seed(v)
    z = 3 * torch.randn(c, v, device="cuda", generator=g)
    z[5] += 3e4
    t = torch.randint(0, v, (c,), device="cuda", generator=g)
    t[[1, 8]] = IGNORE
    z = z.to(dtype)
    t[2] = z[2].float().argmax()
    out, loss = torch.full_like(z, float("nan")), torch.full((c,), float("nan"), device="cuda")
    ce.launch(z, t, out, loss, IGNORE)
    valid = t != IGNORE
    zd = z.double()
    ref = F.cross_entropy(zd, t, ignore_index=IGNORE, reduction="none")
    p = torch.softmax(zd, -1)
    p[torch.arange(c, device="cuda")[valid], t[valid]] -= 1
    p *= valid[:, None]
    assert torch.isfinite(out).all() and torch.isfinite(loss).all()
    assert ((loss.double() - ref).abs() / ref.abs().clamp_min(1)).max().item() <= 1e-5
    bar = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 0.0}[dtype] + 2e-5
    floor = max(torch.finfo(dtype).tiny, 1e-30)  # float32: below 1e-30 exp's argument (< -69) rounds coarser
    at_t = torch.zeros_like(p)  # softmax - 1 at the target keeps the fp32 error of a softmax value near 1
    at_t[torch.arange(c, device="cuda")[valid], t[valid]] = 2.0**-22
    err = (((out.double() - p).abs() - at_t).clamp_min(0) / (p.abs() + floor)).max().item()
    assert err <= bar, err
