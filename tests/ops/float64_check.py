"""What the float64 equality tests of the ops share: the relative error they bound, the seed they draw, and the
naive-against-chunk comparison with gradients; also the outputs-and-gradients call of the GPU comparisons, the
marks of the Gluon kernels' GPU tests and the yardstick of KDA's gate-parameter gradients (`gate_sum_errors`).

Imported by the test modules beside it (tests/ops is on sys.path under pytest's default import mode).
"""

from __future__ import annotations

import torch

F64 = torch.float64


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (b == 0 gives ||a|| / 1e-300: any difference fails)."""
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def rel_f64(a: torch.Tensor, b: torch.Tensor) -> float:
    """`rel` in float64 of a 16-bit or fp32 result against a reference; inf when a holds a NaN or an inf."""
    a = a.double()
    return rel(a, b.double()) if torch.isfinite(a).all() else float("inf")


def gluon_gpu_marks() -> list:
    """Marks of a test of the Gluon kernels on the GPU: `gpu`, skipped without a device of compute capability 9.0
    or without the Gluon API the kernels are written against."""
    import pytest

    from hybridlm.ops.gluon import gdn_fwd

    sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    return [pytest.mark.gpu,
            pytest.mark.skipif(not sm90, reason="needs a CUDA device of compute capability 9.0 (Hopper)"),
            pytest.mark.skipif(not gdn_fwd.gluon_available(), reason="needs Triton's Gluon API")]


def gluon_gpu(f):
    """f with `gluon_gpu_marks` (for a module whose CPU tests stand beside its GPU ones)."""
    for m in gluon_gpu_marks():
        f = m(f)
    return f


def draw_seed() -> int:
    """A seed from torch's global RNG (which the suite seeds afresh for every test and reports)."""
    return int(torch.randint(0, 2**31 - 1, ()))


def count_calls(monkeypatch, module, fn_name: str) -> list:
    """module.fn_name counted (a host entry of the kernel under test: one entry a call), the Triton kernels' outputs
    NaN-poisoned and TF32 off, as the Gluon kernels' GPU tests run their float64 checks; monkeypatch undoes all."""
    from hybridlm.ops.triton import gdn

    calls = []
    real = getattr(module, fn_name)
    monkeypatch.setattr(module, fn_name, lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    monkeypatch.setattr(gdn, "POISON", True)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    return calls


def gpu_check_row(monkeypatch, module, fn_name: str, name: str, kw: dict) -> tuple[dict, list, int]:
    """One case of scripts/gpu_check_gdn.py (`check`) on a fresh seed under `count_calls`. Returns (the case's row,
    one entry per call of fn_name, the seed)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
    import gpu_check_gdn as check

    calls = count_calls(monkeypatch, module, fn_name)
    seed = draw_seed()
    row = check.check(torch.Generator(device="cuda").manual_seed(seed), name, **kw)
    return row, calls, seed


def check_cache_reuse(fresh, check) -> list[torch.Tensor]:
    """The calls a launch cache (cached plans, tensor maps, direct launches) must not serve stale: check(inputs,
    scale, label) on fresh inputs A, on other tensors B at another scale, then on A refilled in place (same
    addresses, new values). Returns A: the caller frees it and checks inputs allocated after (addresses reused)."""
    a = fresh()
    check(a, None, "first call")
    check(fresh(), 0.05, "other tensors")
    for x, y in zip(a, fresh()):
        x.copy_(y)
    check(a, None, "A refilled in place")
    return a


def check_chunk_equals_naive(run, x: dict, names, cot: torch.Tensor, tol: float, **kw) -> torch.Tensor:
    """run({**x, leaves}, impl=..., **kw) with impl "naive" and "chunk", the inputs `names` of x as leaves: the
    outputs and the gradients of (o * cot).sum() agree within `tol` (rel, per tensor). Returns chunk's output."""
    results = {}
    for impl in ("naive", "chunk"):
        leaves = {n: x[n].clone().requires_grad_(True) for n in names}
        o = run({**x, **leaves}, impl=impl, **kw)
        results[impl] = (o, torch.autograd.grad((o * cot).sum(), [leaves[n] for n in names],
                                                allow_unused=True, materialize_grads=True))
    (o_ref, g_ref), (o, gr) = results["naive"], results["chunk"]
    assert rel(o, o_ref) <= tol, rel(o, o_ref)
    for n, a, b in zip(names, gr, g_ref):
        assert rel(a, b) <= tol, (n, rel(a, b))
    return o


def outputs_and_grads(fn, x: dict[str, torch.Tensor], do: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"o": fn(**x), "d<name>": gradient of (o * do).sum() for every input}, each input a fresh leaf."""
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    o = fn(**leaves)
    got = torch.autograd.grad((o.to(do.dtype) * do).sum(), list(leaves.values()))
    return {"o": o.detach(), **{"d" + n: gr for n, gr in zip(leaves, got)}}


def gate_sum_errors(dA, dA_ref, ddt, ddt_ref, raw, A_log, dt_bias, lower_bound, dg) -> dict:
    """The errors of dA_log and ddt_bias over the norms of the sums of magnitudes of the terms they add up (float64:
    sum_{t, c} |dg dg/dA_log| per head, sum_t |dg dg/dx| per channel; dg the float64 gradient of the log-decay).
    Each is a sum of terms of both signs over every token, which cancel (under strong decay dA_log to a few
    percent of its terms' magnitudes), so its plain relative error measures that cancelling, not the code: the
    same fp32 dg gives the same errors with the gates kernel apart. None: the argument was not given."""
    HV, K = raw.shape[-2:]
    x = raw + (0.0 if dt_bias is None else dt_bias.view(HV, K))
    A = (torch.zeros(HV, dtype=F64) if A_log is None else A_log).exp().view(HV, 1)
    if lower_bound is None:
        dgdx = -A * torch.sigmoid(x) * (x <= 20) - A * (x > 20)
        dgdA = -A * torch.where(x > 20, x, torch.nn.functional.softplus(x))
    else:
        ds = lower_bound * torch.sigmoid(A * x) * torch.sigmoid(-A * x)
        dgdx, dgdA = ds * A, ds * A * x
    out = {}
    if dA is not None:
        terms = (dg * dgdA).abs().flatten(0, -3).sum((0, 2))
        out["dA_log_vs_terms"] = ((dA.to(F64) - dA_ref).norm() / terms.norm()).item()
    if ddt is not None:
        terms = (dg * dgdx).abs().flatten(0, -3).sum(0).flatten()
        out["ddt_bias_vs_terms"] = ((ddt.to(F64) - ddt_ref).norm() / terms.norm()).item()
    return out
