"""Chunked linear + cross-entropy against F.cross_entropy on the full logits (float64), values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridlm.ops.linear_ce import linear_cross_entropy

IGNORE = -100


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
