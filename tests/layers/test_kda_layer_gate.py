"""KimiDeltaAttention hands its forget gate to the op (`kda(..., A_log=, dt_bias=)`): the layer's output and every
parameter gradient equal those of the same layer with the gate computed outside the op (the layer's former
path, Kimi's formula written here, in float64 instead of the float32 the glue rounded it to), in float64 (relative
error <= 1e-12 per tensor); with a cache, a prefill and a decode token give the same outputs and states."""

from __future__ import annotations

import copy

import pytest
import torch

from hybridlm.layers import KimiDeltaAttention
from hybridlm.layers import kda as kda_mod
from hybridlm.model.cache import LinearState
from hybridlm.ops import kda

F64 = torch.float64
TOL = 1e-12


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def gate_outside(q, k, v, *, g, beta, A_log=None, dt_bias=None, **kw):
    """kda with the gate applied before the op: -exp(A_log) * softplus(g + dt_bias), softplus(u) = u above 20."""
    if A_log is not None:
        H, K = g.shape[-2:]
        u = g + dt_bias.view(H, K)
        g = -A_log.exp().view(H, 1) * torch.where(u > 20.0, u, torch.log1p(torch.exp(u)))
    return kda(q, k, v, g=g, beta=beta, **kw)


def _layer(seed):
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(24, 2, 8).to(F64)
    with torch.no_grad():  # a gate input spread over softplus' both regimes
        layer.dt_bias.normal_(0, 2)
    return layer


def test_layer_gate_in_op_equals_gate_outside_fp64(monkeypatch):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    ours = _layer(seed)
    ref = copy.deepcopy(ours)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 19, 24, generator=gen, dtype=F64)
    do = torch.randn(2, 19, 24, generator=gen, dtype=F64)
    (ours(x) * do).sum().backward()
    monkeypatch.setattr(kda_mod, "kda", gate_outside)
    (ref(x) * do).sum().backward()
    for (n, p), (_, p2) in zip(ours.named_parameters(), ref.named_parameters()):
        err = rel(p.grad, p2.grad)
        assert err <= TOL, f"d{n}: rel err {err:.3g} > {TOL} (seed {seed})"
    monkeypatch.undo()
    with torch.no_grad():
        err = rel(ours(x), ref(x))
    assert err <= TOL, f"o: rel err {err:.3g} (seed {seed})"


@pytest.mark.parametrize("T", [1, 5])
def test_layer_cached_steps_match_fp64(monkeypatch, T):
    """Prefill of T tokens then one decode token through a LinearState: the cached decode token computes g itself
    (for the step kernel), the prefill hands it to the op; both match the gate applied outside."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    ours = _layer(seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T + 1, 24, generator=gen, dtype=F64)

    def run():
        cache = LinearState()
        with torch.no_grad():
            y = torch.cat([ours(x[:, :T], cache=cache), ours(x[:, T:], cache=cache)], 1)
        return y, cache.recurrent

    y, s = run()
    monkeypatch.setattr(kda_mod, "kda", gate_outside)
    y2, s2 = run()
    assert rel(y, y2) <= TOL and rel(s, s2) <= TOL, f"seed {seed}"
