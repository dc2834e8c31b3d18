"""The sequence cut inside one GPU (hybridlm.ops.split) on the CPU: the orchestration is the same for any backend, so
it runs here on the PyTorch forms in float64 (the token loop, faster than the chunkwise form at these sizes; the
chunkwise form in one case) against the same op uncut -- outputs and final states, B > 1,
packed documents long and short (and empty), an initial state, a state pool, GVA, gated_delta_rule and kda, 2 to 5
segments, the last segment not a multiple of the chunk, the pre-pass as one call at width V + K and as two calls.
Then the choice (`segment_counts`: no cut at wide grids, B1 T32768 H8 on 132 multiprocessors cut, the segment
floor), and the Gluon backend's runner taking the cut (its kernel call replaced by the chunkwise form), logged once
and turned off by `split.disabled()`.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import pytest
import torch
from float64_check import rel

from hybridlm.ops import dispatch, split
from hybridlm.ops.recurrence import gated_delta_rule, kda

F64 = torch.float64
TOL = 1e-12  # float64: rounding only; a wrong chain term or segment offset is O(1)
H, HV, K, V = 2, 4, 8, 6  # GVA (HV = 2H); V != K so that a transposed map fails
RUNNERS = {b.name: b.run for b in dispatch.BACKENDS if b.name in ("naive", "chunk")}
OPS = {"gated_delta_rule": (gated_delta_rule, "scalar"), "kda": (kda, "channel")}


def _inputs(op: str, B: int, T: int, N: int, seed: int, h0: bool) -> dict:
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    gshape = (B, T, HV) if op == "gated_delta_rule" else (B, T, HV, K)
    return {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, HV, V),
            # long memory (~-0.007 a step, beta ~0.1): a segment's map M stays O(1), so the chain through it counts
            "g": torch.nn.functional.logsigmoid(r(*gshape) + 5.0), "beta": torch.sigmoid(r(B, T, HV)) * 0.2,
            "initial_state": r(N, HV, K, V) if h0 else None}


def _prepared(op: str, x: dict, cu, *, final: bool = True, pool=None, rows=None) -> dispatch.Inputs:
    return dispatch.prepare(op, OPS[op][1], True, x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], scale=None,
                            initial_state=x["initial_state"], output_final_state=final, cu_seqlens=cu,
                            use_qk_l2norm=True, chunk_size=64, impl="chunk", recompute=False, state_pool=pool,
                            state_indices=rows)


def _reference(op: str, x: dict, cu, impl: str = "naive"):
    return OPS[op][0](x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["initial_state"],
                      output_final_state=True, cu_seqlens=cu, use_qk_l2norm=True, impl=impl)


def _layout(B: int, T: int, lens):
    if lens is None:
        return B, T, B, None
    return 1, sum(lens), len(lens), torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


# (B, T, document lengths, segments per document, initial state, pre-pass at width V + K, backend)
CASES = {
    "B2_T337_5seg": (2, 5 * 64 + 17, None, (5, 5), True, True, "naive"),
    "B1_T200_3seg_two_calls_chunkwise": (1, 200, None, (3,), False, False, "chunk"),
    "varlen_long_short_empty": (None, None, [400, 30, 0, 300, 130], (4, 1, 1, 3, 2), True, True, "naive"),
    "varlen_two_calls": (None, None, [257, 300, 70], (2, 4, 1), True, False, "naive"),
}


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("case", list(CASES))
def test_split_equals_the_uncut_op(op, case, seed):
    B, T, lens, counts, h0, wide, impl = CASES[case]
    B, T, N, cu = _layout(B, T, lens)
    x = _inputs(op, B, T, N, seed, h0)
    o, final = split.run(_prepared(op, x, cu), RUNNERS[impl], counts, wide=wide)
    o_ref, final_ref = _reference(op, x, cu, impl)
    errs = {"o": rel(o, o_ref), "final": rel(final, final_ref)}
    assert o.shape == o_ref.shape and all(e <= TOL for e in errs.values()), f"seed {seed}: {op} {case}: {errs}"


@pytest.mark.parametrize("op", list(OPS))
def test_split_reads_and_writes_a_state_pool(op, seed):
    """Documents start from pool rows (in another order) and their final states go back there; the other rows
    stay; output_final_state=False returns None."""
    lens = [300, 40, 260]
    _, T, N, cu = _layout(None, None, lens)
    x = _inputs(op, 1, T, N, seed, h0=False)
    gen = torch.Generator().manual_seed(seed + 1)
    pool = torch.randn(5, HV, K, V, generator=gen, dtype=F64)
    rows = torch.tensor([3, 0, 4])
    start = pool.clone()
    o, final = split.run(_prepared(op, x, cu, final=False, pool=pool, rows=rows), RUNNERS["naive"], (4, 1, 3),
                             wide=True)
    o_ref, final_ref = _reference(op, {**x, "initial_state": start[rows]}, cu)
    errs = {"o": rel(o, o_ref), "pool rows": rel(pool[rows], final_ref)}
    assert final is None, f"seed {seed}"
    assert all(e <= TOL for e in errs.values()), f"seed {seed}: {op}: {errs}"
    assert torch.equal(pool[[1, 2]], start[[1, 2]]), f"seed {seed}: rows outside state_indices changed"


def test_choice_cuts_a_long_sequence_with_few_heads():
    """B1 T32768 HV8 K=V=128 on 132 multiprocessors: 16 chain programs; 32 pre-pass programs a segment, so 4 of them
    fill the GPU once: 5 segments."""
    assert split.segment_counts([32768], HV=8, K=128, V=128, sms=132) == (5,)
    assert split.segment_counts([16384] * 2, HV=4, K=128, V=128, sms=132) == (5, 5)  # the same grids
    assert split.segment_counts([8192], HV=4, K=128, V=128, sms=132) == (8,)  # 9 would fit: 8192 / 1024 = 8


def test_choice_leaves_wide_grids_and_short_documents_whole():
    # B4 T4096 H16: 128 chain programs already fill 132 multiprocessors
    assert split.segment_counts([4096] * 4, HV=16, K=128, V=128, sms=132) is None
    # B1 T32768 H32: 64 programs leave half idle, but a cut would be in two (no gain); B2 T16384 H8 and B1 T8192
    # H16 (32 programs): in three, under MIN_SEGMENTS
    assert split.segment_counts([32768], HV=32, K=128, V=128, sms=132) is None
    assert split.segment_counts([16384] * 2, HV=8, K=128, V=128, sms=132) is None
    assert split.segment_counts([8192], HV=16, K=128, V=128, sms=132) is None
    # documents under MIN_DOC tokens stay whole; nothing long: no cut
    assert split.segment_counts([split.MIN_DOC - 1] * 3, HV=1, K=64, V=64, sms=132) is None
    assert split.segment_counts([300, 32768, 4095], HV=8, K=128, V=128, sms=132) == (1, 5, 1)


def test_choice_keeps_segments_above_the_floor():
    """Many multiprocessors for one head: the count is bounded by length / MIN_SEGMENT, and every segment starts on
    a chunk boundary and is at least MIN_SEGMENT long."""
    for length in (4096, 5000, 12345):
        (count,) = split.segment_counts([length], HV=1, K=128, V=128, sms=132)
        assert count == length // split.MIN_SEGMENT
        segs = split.segment_lengths(length, count)
        assert sum(segs) == length and len(segs) == count
        assert all(s >= split.MIN_SEGMENT for s in segs) and all(s % split.CHUNK == 0 for s in segs[:-1])


def test_gluon_runner_cuts_logs_once_and_can_be_turned_off(monkeypatch, caplog, seed):
    """dispatch's Gluon runner with its kernel call replaced by the token loop (this is the CPU): the cut is
    chosen from the lengths and the device's multiprocessors, runs three calls (not on sm_90 here, so the pre-pass
    is two), equals the uncut op, is logged once; under split.disabled() the runner makes one call."""
    calls = []

    def fake_call(x):
        calls.append(x.dims.N)
        return RUNNERS["naive"](x)

    monkeypatch.setattr(dispatch, "_gluon_call", fake_call)
    monkeypatch.setattr(split, "_multiprocessors", lambda dev: 132)
    monkeypatch.setattr(split, "MIN_DOC", 256)
    monkeypatch.setattr(split, "MIN_SEGMENT", 64)
    monkeypatch.setattr(split, "_LOGGED", set())
    lens = [600, 100]
    _, T, N, cu = _layout(None, None, lens)
    x = _inputs("gated_delta_rule", 1, T, N, seed, h0=True)
    o_ref, final_ref = _reference("gated_delta_rule", x, cu)
    with caplog.at_level("INFO", logger="hybridlm.ops"):
        for _ in range(2):
            o, final = dispatch._run_gluon(_prepared("gated_delta_rule", x, cu))
            errs = {"o": rel(o, o_ref), "final": rel(final, final_ref)}
            assert all(e <= TOL for e in errs.values()), f"seed {seed}: {errs}"
    # 600 tokens in 600 // 64 = 9 segments (8 pre-pass segments, in two calls), then the main pass over 10
    assert calls == [8, 8, 10] * 2, calls
    logged = [r.getMessage() for r in caplog.records if "segments" in r.getMessage()]
    assert len(logged) == 1 and "cuts 1 of 2 sequences into up to 9 segments" in logged[0], logged
    calls.clear()
    with split.disabled():
        o, _ = dispatch._run_gluon(_prepared("gated_delta_rule", x, cu))
    assert calls == [2] and rel(o, o_ref) <= TOL, (calls, f"seed {seed}")


def test_a_repeat_call_reads_nothing_back(monkeypatch, seed):
    """Under inference_mode the layout's offsets are still normal tensors with their host copies recorded, kept per
    lengths: a second call with the same lengths reads no tensor back to the host (a CUDA graph can capture it)."""
    monkeypatch.setattr(split, "_LAYOUTS", OrderedDict())  # made here, under inference_mode
    lens = [300, 40, 260]
    _, T, N, cu = _layout(None, None, lens)
    x = _inputs("kda", 1, T, N, seed, h0=True)
    o_ref, final_ref = _reference("kda", x, cu)
    with torch.inference_mode():
        split.run(_prepared("kda", x, cu), RUNNERS["naive"], (4, 1, 3), wide=True)
        again = _prepared("kda", x, cu)
        with monkeypatch.context() as m:
            for name in ("tolist", "item"):
                m.setattr(torch.Tensor, name, lambda self, *a: pytest.fail(f"read a tensor back ({tuple(self.shape)})"))
            o, final = split.run(again, RUNNERS["naive"], (4, 1, 3), wide=True)
    errs = {"o": rel(o, o_ref), "final": rel(final, final_ref)}
    assert all(e <= TOL for e in errs.values()), f"seed {seed}: {errs}"
