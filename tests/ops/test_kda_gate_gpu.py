"""Kimi's gate inside the Triton KDA kernels on a GPU, bf16 and fp16: `kda(q, k, v, g=raw, beta=, A_log=, dt_bias=,
lower_bound=, impl="triton")` against the float64 chunk path with PyTorch's gate applied before the recurrence
(`hybridlm.ops.kda_gate`), at K = V = 128 with a freshly initialised layer's gates (raw ~ N(0, 1), A = e^A_log ~
U(1, 16), dt_bias 0 as `KimiDeltaAttention` makes it: log-decays of ~-5.5 a step, most chunks by the 16-row block
launches), varlen documents, GVA 2 and an initial state, both gate forms. Bars: the GPU check's 16-bit ones, 5e-3
(outputs) and 1e-2 (gradients, raw included); dA_log and ddt_bias, sums over every token, 1e-2 of the magnitudes
of the terms they add up (`float64_check.gate_sum_errors`: an error eps in each term moves the sum by at most eps
times that). A second call gives bitwise the same results (fp32
partial sums on the host, no atomics)."""

from __future__ import annotations

import pytest
import torch
from float64_check import gate_sum_errors

from hybridlm.ops import kda
from hybridlm.ops.kda_gate import kda_gate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

F64 = torch.float64
CU = [0, 700, 763, 1536]  # three documents in one packed row
NAMES = ["q", "k", "v", "raw", "beta", "A_log", "dt_bias", "h0"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.to(F64), b.to(F64)
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _inputs(seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, H, HV, K, V = CU[-1], 2, 4, 128, 128
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    return {"q": r(1, T, H, K).to(dtype), "k": r(1, T, H, K).to(dtype), "v": r(1, T, HV, V).to(dtype),
            "raw": r(1, T, HV, K).to(dtype), "beta": torch.rand(1, T, HV, device="cuda", generator=gen).to(dtype),
            "A_log": (1 + 15 * torch.rand(HV, device="cuda", generator=gen)).log(),
            "dt_bias": torch.zeros(HV * K, device="cuda"), "h0": 0.1 * r(len(CU) - 1, HV, K, V)}


def _run(x: dict, lower_bound, impl: str, do, dht, g=None):
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    cu = torch.tensor(CU, device="cuda", dtype=torch.int32)
    gate = dict(A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], lower_bound=lower_bound) if g is None else {}
    o, ht = kda(leaves["q"], leaves["k"], leaves["v"], g=leaves["raw"] if g is None else g, beta=leaves["beta"],
                **gate, initial_state=leaves["h0"], output_final_state=True, cu_seqlens=cu, use_qk_l2norm=True,
                impl=impl)
    wrt = list(leaves.values()) if g is None else [g]
    grads = torch.autograd.grad((o.to(F64) * do).sum() + (ht.to(F64) * dht).sum(), wrt)
    return [o.detach(), ht.detach(), *grads]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "lower_bound"])
def test_gate_in_kernels_matches_float64(lower_bound, dtype, seed):
    x = _inputs(seed, dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    do = torch.randn(x["v"].shape, device="cuda", generator=gen, dtype=F64)
    dht = torch.randn(x["h0"].shape, device="cuda", generator=gen, dtype=F64)
    got = _run(x, lower_bound, "triton", do, dht)
    again = _run(x, lower_bound, "triton", do, dht)
    x64 = {n: t.to(F64) for n, t in x.items()}
    want = _run(x64, lower_bound, "chunk", do, dht)
    names = ["o", "final_state", *("d" + n for n in NAMES)]
    for name, a, b in zip(names, got, want):
        if name in ("dA_log", "ddt_bias"):  # sums over every token: against their terms below
            continue
        bar = 1e-2 if name.startswith("d") else 5e-3
        err = rel(a, b)
        assert err <= bar, f"{name}: rel {err:.3g} > {bar} (seed {seed})"
    g = kda_gate(x64["raw"], x64["A_log"], x64["dt_bias"], lower_bound, dtype=F64).requires_grad_()
    (dg,) = _run(x64, lower_bound, "chunk", do, dht, g=g)[2:]
    sums = gate_sum_errors(got[7], want[7], got[8], want[8], x64["raw"], x64["A_log"], x64["dt_bias"], lower_bound,
                           dg)
    for name, err in sums.items():
        assert err <= 1e-2, f"{name}: {err:.3g} of its terms' magnitudes > 1e-2 (seed {seed})"
    for name, a, b in zip(names, again, got):
        assert torch.equal(a, b), f"{name}: the second call differs from the first (seed {seed})"
