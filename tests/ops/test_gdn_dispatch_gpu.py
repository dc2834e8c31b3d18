"""`gated_delta_rule(impl="auto")` on an H100: the Gluon forward where no gradient is needed, the Triton kernels
where one is, and a state pool handed to the Gluon forward as it is (no gather, no scatter).

GPU only (`@pytest.mark.gpu`; skipped without CUDA, without compute capability 9.0, or without Gluon). Fresh random
inputs from the suite's seed (tests/conftest.py), the seed in every failure message. The reference is always the
float64 chunk form on the same (rounded) inputs, never a Gluon or Triton call. Bar: 5e-3 relative
(||a - b|| / ||b||), the 16-bit bar of the kernels' own checks (tests/ops/test_gluon_gdn.py).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import hybridlm.ops.dispatch as dispatch
from hybridlm.ops import gated_delta_rule

pytest.importorskip("triton")
from float64_check import gluon_gpu_marks, rel_f64  # noqa: E402

from hybridlm.ops.gluon import gdn_fwd  # noqa: E402

BAR = 5e-3


pytestmark = gluon_gpu_marks()


def _float64_chunk(q, k, v, g, beta, h0, cu=None):
    """The reference: o and the final state of the float64 chunk form (no Gluon, no Triton)."""
    d = lambda x: x.double()  # noqa: E731
    return gated_delta_rule(d(q), d(k), d(v), g=d(g), beta=d(beta), initial_state=d(h0), output_final_state=True,
                            cu_seqlens=cu, use_qk_l2norm=True, impl="chunk")


def _inputs(B, T, H, HV, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, 128).bfloat16(), r(B, T, H, 128).bfloat16(), r(B, T, HV, 128).bfloat16()
    g = torch.nn.functional.logsigmoid(r(B, T, HV) + 3.0)
    beta = torch.sigmoid(r(B, T, HV)).bfloat16()
    return q, k, v, g, beta


@pytest.fixture
def picks(caplog, monkeypatch):
    """The impls impl="auto" logged for gated_delta_rule in this test (every choice logs: _LOGGED starts empty)."""
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    caplog.set_level("INFO", logger="hybridlm.ops")
    return lambda: [r.getMessage().split("picked ")[1].split("'")[1] for r in caplog.records
                    if r.getMessage().startswith("hybridlm.ops.gated_delta_rule: impl='auto' picked")]


def test_auto_runs_gluon_without_gradients_and_matches_float64(picks, seed):
    q, k, v, g, beta = _inputs(2, 1000, 2, 4, seed)
    h0 = torch.randn(2, 4, 128, 128, device="cuda")
    kw = dict(g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    with torch.no_grad():
        o, ht = gated_delta_rule(q, k, v, **kw)
        o_ref, ht_ref = _float64_chunk(q, k, v, g, beta, h0)
    assert picks() == ["gluon"], (seed, picks())
    errs = {"o": rel_f64(o, o_ref), "final_state": rel_f64(ht, ht_ref)}
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    assert all(e <= BAR for e in errs.values()), (seed, errs)


def test_auto_keeps_triton_when_gradients_are_needed(picks, seed):
    q, k, v, g, beta = (x.requires_grad_() for x in _inputs(1, 200, 2, 2, seed))
    o, _ = gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm=True)
    o.float().sum().backward()
    assert picks() == ["triton"], (seed, picks())
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v, g, beta)), seed


def test_pool_prefill_in_two_chunks_through_gluon_matches_float64(picks, monkeypatch, seed):
    """Three sequences in rows 4, 0, 2 of a pool of 5, each prefilled in two chunks (varlen calls); the pool is
    handed to the Gluon forward itself (recorded), and the outputs and final rows match the float64 chunk form's
    whole call from the same rows. Rows 1 and 3 stay as they were."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lens, cuts = [300, 130, 65], [128, 64, 1]
    q, k, v, g, beta = _inputs(1, sum(lens), 2, 4, seed)
    pool = torch.randn(5, 4, 128, 128, device="cuda", generator=gen)
    rows = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    start = pool.clone()
    seen = []
    fwd = gdn_fwd.gated_delta_rule_fwd
    monkeypatch.setattr(gdn_fwd, "gated_delta_rule_fwd",
                        lambda *a, **kw: seen.append(kw.get("state_pool") is pool) or fwd(*a, **kw))

    def offsets(ls):
        return torch.tensor([0, *itertools.accumulate(ls)], dtype=torch.int32, device="cuda")

    bounds = offsets(lens).tolist()
    firsts = [list(range(s, s + c)) for s, c in zip(bounds, cuts)]
    seconds = [list(range(s + c, e)) for s, c, e in zip(bounds, cuts, bounds[1:])]
    o_whole = torch.empty_like(v)
    with torch.no_grad():
        o_ref, ht_ref = _float64_chunk(q, k, v, g, beta, start[rows.long()], offsets(lens))
        for parts in (firsts, seconds):
            idx = torch.tensor(sum(parts, []), device="cuda")
            sub = [x[:, idx] for x in (q, k, v, g, beta)]
            o, ht = gated_delta_rule(*sub[:3], g=sub[3], beta=sub[4], state_pool=pool, state_indices=rows,
                                     output_final_state=True, cu_seqlens=offsets([len(p) for p in parts]),
                                     use_qk_l2norm=True)
            o_whole[:, idx] = o
    assert set(picks()) == {"gluon"} and seen == [True, True], (seed, picks(), seen)
    errs = {"o": rel_f64(o_whole, o_ref), "final_state": rel_f64(pool[rows.long()], ht_ref),
            "returned_state": rel_f64(ht, ht_ref)}
    assert all(e <= BAR for e in errs.values()), (seed, errs)
    assert torch.equal(pool[[1, 3]], start[[1, 3]]), seed
