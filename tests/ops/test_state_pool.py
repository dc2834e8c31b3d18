"""`state_pool` / `state_indices` on the recurrences: chunked prefill as a server runs it.

Sequences of different lengths are cut into chunks; each call packs the next chunk of every unfinished sequence
(varlen), starts each from its row of the pool and writes its final state back. The outputs, concatenated per
sequence, and the pool's final rows must equal one whole-sequence call per sequence (float64: 1e-10 relative),
and rows no sequence owns must not change.
"""

from __future__ import annotations

import pytest
import torch
from float64_check import F64, draw_seed, rel

from hybridlm.ops import delta_rule, gated_delta_rule, kda

LENGTHS = [70, 1, 33, 129]  # rows 5, 0, 3, 6 of an 8-row pool
ROWS = [5, 0, 3, 6]


def _inputs(channel: bool, gen: torch.Generator, H=2, HV=4, K=16, V=24):
    seqs = []
    for n in LENGTHS:
        r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
        g = -1.5 * torch.rand(1, n, HV, *((K,) if channel else ()), generator=gen, dtype=F64)
        seqs.append(dict(q=r(1, n, H, K), k=r(1, n, H, K), v=r(1, n, HV, V), g=g,
                         beta=torch.rand(1, n, HV, generator=gen, dtype=F64)))
    pool = torch.randn(8, HV, K, V, generator=gen, dtype=F64)
    return seqs, pool


def _call(fn, x, **kw):
    return fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], use_qk_l2norm=True, **kw)


@pytest.mark.parametrize("impl", ["naive", "chunk"])
@pytest.mark.parametrize("fn,channel", [(gated_delta_rule, False), (kda, True)])
@pytest.mark.parametrize("chunk", [16, 37])
def test_chunked_prefill_through_the_pool_equals_whole_sequences(fn, channel, impl, chunk):
    seed = draw_seed()
    seqs, pool0 = _inputs(channel, torch.Generator().manual_seed(seed))
    want = [_call(fn, x, initial_state=pool0[r : r + 1], output_final_state=True, impl=impl) for x, r in
            zip(seqs, ROWS)]

    pool = pool0.clone()
    got = [[] for _ in seqs]
    start = 0
    while start < max(LENGTHS):
        live = [i for i, n in enumerate(LENGTHS) if n > start]
        parts = {key: torch.cat([seqs[i][key][:, start : start + chunk] for i in live], dim=1) for key in seqs[0]}
        lens = [min(chunk, LENGTHS[i] - start) for i in live]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        idx = torch.tensor([ROWS[i] for i in live], dtype=torch.int64)
        o, final = _call(fn, parts, cu_seqlens=cu, state_pool=pool, state_indices=idx, impl=impl)
        assert final is None
        for j, (i, s) in enumerate(zip(live, cu[:-1].tolist())):
            got[i].append(o[:, s : s + lens[j]])
        start += chunk

    for i, (o_want, s_want) in enumerate(want):
        o_got = torch.cat(got[i], dim=1)
        assert rel(o_got, o_want) <= 1e-10, f"sequence {i}: outputs differ by {rel(o_got, o_want):.2e}, seed {seed}"
        assert rel(pool[ROWS[i]], s_want[0]) <= 1e-10, f"sequence {i}: pooled state off, seed {seed}"
    untouched = [r for r in range(8) if r not in ROWS]
    assert torch.equal(pool[untouched], pool0[untouched]), f"rows nobody owns changed, seed {seed}"


def test_the_pool_returns_the_final_state_when_asked_and_int32_rows_work():
    seed = draw_seed()
    seqs, pool = _inputs(False, torch.Generator().manual_seed(seed))
    x = seqs[0]
    o_want, s_want = _call(gated_delta_rule, x, initial_state=pool[2:3].clone(), output_final_state=True)
    o, final = _call(gated_delta_rule, x, state_pool=pool, state_indices=torch.tensor([2], dtype=torch.int32),
                     output_final_state=True)
    assert rel(o, o_want) <= 1e-10 and rel(final, s_want) <= 1e-10 and torch.equal(pool[2], final[0]), seed


def _bad(**kw):
    q = torch.randn(1, 5, 2, 8, dtype=F64)
    v = torch.randn(1, 5, 2, 8, dtype=F64)
    beta = torch.rand(1, 5, 2, dtype=F64)
    base = dict(state_pool=torch.zeros(4, 2, 8, 8, dtype=F64), state_indices=torch.tensor([1]))
    base.update(kw)
    return delta_rule(q, q, v, beta=beta, **base)


@pytest.mark.parametrize("kw,match", [
    (dict(state_indices=None), r"state_indices: expected a tensor with state_pool"),
    (dict(state_pool=None), r"state_pool: expected a tensor with state_indices"),
    (dict(initial_state=torch.zeros(1, 2, 8, 8, dtype=F64)), r"initial_state: expected None with state_pool"),
    (dict(state_pool=torch.zeros(4, 2, 8, 9, dtype=F64)), r"state_pool: expected shape \[P, 2, 8, 8\]"),
    (dict(state_pool=torch.zeros(4, 2, 8, 8)), r"state_pool: expected dtype torch.float64"),
    (dict(state_pool=torch.zeros(4, 2, 8, 8, dtype=F64, requires_grad=True)), r"state_pool: .*without requires_grad"),
    (dict(state_indices=torch.tensor([1.0])), r"state_indices: expected an int32/int64 tensor, got torch.float32"),
    (dict(state_indices=torch.tensor([1, 2])), r"state_indices: expected shape \(1,\)"),
])
def test_bad_pools_get_one_line_errors(kw, match):
    with pytest.raises((ValueError, TypeError), match=match) as err:
        _bad(**kw)
    assert "\n" not in str(err.value)
