"""The segment-parallel prefill (`hybridlm.ops.split_prefill`): a sequence cut into segments run side by side in
one call with widened values, then chained, equals the unsplit recurrence (float64: 1e-10 relative, outputs and
final states, against the token loop); in bf16 its error against float64 stays within 1.5x the unsplit call's;
the choice of the segment count; the Gluon backend's automatic split (on the CPU through a stand-in forward);
bad input refused in one line. The Gluon kernels themselves: tests/ops/test_split_prefill_gpu.py."""

from __future__ import annotations

import dataclasses
import logging
import types

import pytest
import torch
import torch.nn.functional as F
from float64_check import F64, draw_seed, rel, rel_f64

from hybridlm.ops import dispatch, gated_delta_rule
from hybridlm.ops import split_prefill as sp
from hybridlm.ops.split_prefill import choose_segments, split_prefill

TOL = 1e-10


def _inputs(gen, B, T, H, HV, K, V, dtype=F64, gate=2.0):
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float32)  # noqa: E731
    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=F.logsigmoid(r(B, T, HV) + gate),
             beta=torch.sigmoid(r(B, T, HV)))
    return {n: t.to(dtype) if n != "g" else t.to(F64 if dtype == F64 else torch.float32) for n, t in x.items()}


def _check(got, want, seed, what):
    (o, f), (o_ref, f_ref) = got, want
    assert rel(o, o_ref) <= TOL, f"{what}: outputs differ by {rel(o, o_ref):.2e}, seed {seed}"
    if f_ref is not None:
        assert rel(f, f_ref) <= TOL, f"{what}: final states differ by {rel(f, f_ref):.2e}, seed {seed}"


@pytest.mark.parametrize("impl", ["naive", "chunk"])
@pytest.mark.parametrize("case", ["plain", "gva", "l2norm", "initial_state"])
@pytest.mark.parametrize("segments", [2, 3, 5])
def test_split_equals_the_token_loop_in_float64(impl, case, segments):
    """B2 T96 (segments 2, 3: a reshape into equal segments; 5: packed segments of 20 and a last of 16)."""
    seed = draw_seed()
    gen = torch.Generator().manual_seed(seed)
    HV = 4 if case == "gva" else 2
    x = _inputs(gen, 2, 96, 2, HV, 16, 8)
    kw = dict(use_qk_l2norm=case == "l2norm", output_final_state=True)
    if case == "initial_state":
        kw["initial_state"] = torch.randn(2, HV, 16, 8, generator=gen, dtype=F64)
    want = gated_delta_rule(**x, impl="naive", **kw)
    _check(split_prefill(**x, segments=segments, impl=impl, **kw), want, seed, f"{case}, {segments} segments")


@pytest.mark.parametrize("with_h0", [False, True])
def test_varlen_documents_shorter_and_longer_than_a_segment(with_h0):
    """Documents of 5, 0, 90, 31, 40 tokens cut at 30: an empty one, ones that stay whole (5, and 31 -> 30 + 1)
    and ones split in three; each from its own initial state."""
    seed = draw_seed()
    gen = torch.Generator().manual_seed(seed)
    lens = [5, 0, 90, 31, 40]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    x = _inputs(gen, 1, sum(lens), 1, 2, 16, 8)
    h0 = torch.randn(len(lens), 2, 16, 8, generator=gen, dtype=F64) if with_h0 else None
    kw = dict(cu_seqlens=cu, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    want = gated_delta_rule(**x, impl="naive", **kw)
    _check(split_prefill(**x, segments=3, impl="chunk", **kw), want, seed, "varlen")
    with torch.inference_mode():  # serving stacks call under inference mode, with inference-mode offsets
        got = split_prefill(**x, segments=3, impl="chunk", **{**kw, "cu_seqlens": cu.clone()})
    _check(got, want, seed, "varlen under inference_mode")


def test_state_pool_rows_are_read_and_written_back():
    seed = draw_seed()
    gen = torch.Generator().manual_seed(seed)
    x = _inputs(gen, 1, 70, 2, 2, 16, 8)
    cu = torch.tensor([0, 50, 70], dtype=torch.int32)
    pool0 = torch.randn(5, 2, 16, 8, generator=gen, dtype=F64)
    rows = torch.tensor([3, 1])
    o_want, f_want = gated_delta_rule(**x, impl="naive", cu_seqlens=cu, initial_state=pool0[rows].clone(),
                                      output_final_state=True)
    pool = pool0.clone()
    o, f = split_prefill(**x, segments=4, impl="chunk", cu_seqlens=cu, state_pool=pool, state_indices=rows,
                         output_final_state=True)
    _check((o, f), (o_want, f_want), seed, "pool")
    assert rel(pool[rows], f_want) <= TOL, f"pool rows not written back, seed {seed}"
    assert torch.equal(pool[[0, 2, 4]], pool0[[0, 2, 4]]), f"rows nobody owns changed, seed {seed}"


@pytest.mark.parametrize("gate", [3.0, 6.0])
def test_bf16_error_is_within_1_5x_the_unsplit_calls(gate):
    """bf16 on the chunkwise path (float32 inside): the split rounds o_local and q_eff to bf16 before the
    correction, the unsplit call rounds o once. At 4 segments of 256 the extra error is 1.1x (decay about -0.05 a
    step, gate 3) to 1.3x (about -0.0025, gate 6: the transition M_t outlives a segment's first tokens)."""
    seed = draw_seed()
    gen = torch.Generator().manual_seed(seed)
    x = _inputs(gen, 1, 1024, 2, 2, 64, 64, dtype=torch.bfloat16, gate=gate)
    x64 = {n: t.to(F64) for n, t in x.items()}
    h0 = torch.randn(1, 2, 64, 64, generator=gen)
    kw = dict(use_qk_l2norm=True, output_final_state=True)
    o64, f64 = gated_delta_rule(**x64, impl="chunk", initial_state=h0.to(F64), **kw)
    o1, f1 = gated_delta_rule(**x, impl="chunk", initial_state=h0, **kw)
    o4, f4 = split_prefill(**x, segments=4, impl="chunk", initial_state=h0, **kw)
    assert o4.dtype == torch.bfloat16 and f4.dtype == torch.float32
    e1, e4 = rel_f64(o1, o64), rel_f64(o4, o64)
    assert e4 <= 1.5 * e1, f"split error {e4:.2e} vs unsplit {e1:.2e}, seed {seed}"
    assert rel_f64(f4, f64) <= 1.5 * rel_f64(f1, f64) + 1e-6, f"final state, seed {seed}"


# ------------------------------------------------------------------------------------------------- the choice

# (grid, wide_grid, T) of the few-heads prefill shapes at K = V = 128 (two value blocks, four when widened)
SHAPES = {"B1 T32768 H8": (16, 32, 32768), "B2 T16384 H8": (32, 64, 16384), "B1 T8192 H16": (32, 64, 8192),
          "B1 T4096 H16": (32, 64, 4096)}


@pytest.mark.parametrize("sms", [132, 114])
def test_choice_splits_small_grids_into_one_or_two_waves(sms):
    """On an H100 SXM / H200 (132 multiprocessors) each of the few-heads shapes is split; a split (on a PCIe
    H100's 114 too) has segments of whole chunks, at least MIN_SEGMENT long, in at most two waves of programs."""
    for name, (grid, wide, T) in SHAPES.items():
        s = choose_segments(grid, wide, T, sms)
        assert s > 1 or sms != 132, (name, s)
        if s > 1:
            length = sp.segment_length(T, s)
            assert length >= sp.MIN_SEGMENT and length % 64 == 0, (name, s, length)
            assert s * wide <= 2 * sms, f"{name}: {s} segments make {s * wide} programs on {sms}"


def test_choice_keeps_full_grids_and_short_sequences_whole():
    assert choose_segments(128, 256, 4096, 132) == 1  # B4 T4096 H16: one wave already
    assert choose_segments(512, 1024, 32768, 132) == 1  # B1 T32768 H32 (several waves)
    assert choose_segments(16, 32, 2 * sp.MIN_SEGMENT - 64, 132) == 1  # too short for two segments
    assert choose_segments(1, 2, 10**6, 132) <= sp.MAX_SEGMENTS
    assert choose_segments(0, 0, 4096, 132) == 1


def _fake_gluon(monkeypatch, calls, sms=132, widths=(32, 64)):
    """dispatch's Gluon module replaced by a stand-in whose forward is the chunkwise PyTorch path, recording the
    shapes it is called with."""

    def fwd(q, k, v, *, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
            state_pool, state_indices, checked):
        calls.append((tuple(v.shape), None if cu_seqlens is None else cu_seqlens.numel() - 1))
        return gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                use_qk_l2norm=use_qk_l2norm, impl="chunk")

    mod = types.SimpleNamespace(gated_delta_rule_fwd=fwd, _multiprocessors=lambda dev: sms, SUPPORTED_V=widths)
    monkeypatch.setattr(dispatch, "_gdn_fwd", lambda: mod)


def _prepared(x, **kw):
    return dispatch.prepare("gated_delta_rule", "scalar", True, x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"],
                            scale=None, output_final_state=True, use_qk_l2norm=True, chunk_size=64, impl="chunk",
                            recompute=False, state_pool=None, state_indices=None,
                            **{"initial_state": None, "cu_seqlens": None, **kw})


def test_gluon_backend_splits_when_the_choice_says_so(monkeypatch, caplog):
    """B1 T4096 H1 K=V=16 on 132 multiprocessors: one program; the backend runs one call of 2 segments of 2048
    with V + K = 32 and matches the unsplit float64 call; the choice is logged once."""
    seed = draw_seed()
    x = _inputs(torch.Generator().manual_seed(seed), 1, 2 * sp.MIN_SEGMENT, 1, 1, 16, 16, gate=4.0)
    h0 = torch.randn(1, 1, 16, 16, dtype=F64)
    calls = []
    _fake_gluon(monkeypatch, calls)
    monkeypatch.setattr(sp, "_LOGGED", set())
    xp = _prepared(x, initial_state=h0)
    want = dispatch._run_torch(xp, dispatch.recurrence_chunk, chunk_size=64)
    with caplog.at_level(logging.INFO, logger="hybridlm.ops"):
        got = dispatch._run_gluon(xp)
        dispatch._run_gluon(xp)
    assert calls == [((2, sp.MIN_SEGMENT, 1, 32), None)] * 2, calls
    _check(got, want, seed, "automatic split")
    lines = [r.getMessage() for r in caplog.records if "split into" in r.getMessage()]
    assert len(lines) == 1 and "split into 2 segments of up to 2048 tokens" in lines[0], lines


def test_gluon_backend_keeps_unsupported_widths_and_full_grids_whole(monkeypatch):
    calls = []
    x = _inputs(torch.Generator().manual_seed(draw_seed()), 1, 2 * sp.MIN_SEGMENT, 1, 1, 16, 16)
    _fake_gluon(monkeypatch, calls, widths=(64,))  # V + K = 32 not taken
    dispatch._run_gluon(_prepared(x))
    _fake_gluon(monkeypatch, calls, sms=1)  # one program fills the device
    dispatch._run_gluon(_prepared(x))
    assert calls == [((1, 2 * sp.MIN_SEGMENT, 1, 16), None)] * 2, calls


def test_bad_input_is_refused_in_one_line():
    x = _inputs(torch.Generator().manual_seed(0), 1, 8, 1, 1, 8, 8)
    for bad in (0, -2, 2.0, True, None):
        with pytest.raises(ValueError, match=r"^segments: expected a positive int, got ") as e:
            split_prefill(**x, segments=bad, impl="chunk")
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^impl: expected one of .*got 'fast'$"):
        split_prefill(**x, segments=2, impl="fast")
    leaf = x["q"].clone().requires_grad_()
    with pytest.raises(RuntimeError, match=r"^split_prefill: expected inputs without gradients"):
        split_prefill(**{**x, "q": leaf}, segments=2, impl="chunk")
    widened = dataclasses.replace(dispatch._BY_NAME["chunk"], supports=lambda xi: None if xi.v.shape[-1] == 8 else
                                  f"V={xi.v.shape[-1]} not taken")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch, "_BY_NAME", {**dispatch._BY_NAME, "chunk": widened})
        with pytest.raises(ValueError, match=r"^v: the split widens the values to V \+ K = 16, which the chunkwise "
                                             r"PyTorch form does not take: V=16 not taken$"):
            split_prefill(**x, segments=2, impl="chunk")


def test_one_segment_and_empty_inputs_are_the_unsplit_call():
    x = _inputs(torch.Generator().manual_seed(draw_seed()), 2, 20, 1, 1, 8, 8)
    want = gated_delta_rule(**x, impl="chunk", output_final_state=True)
    got = split_prefill(**x, segments=1, impl="chunk", output_final_state=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    empty = {n: t[:, :0] for n, t in x.items()}
    o, f = split_prefill(**empty, segments=3, impl="chunk", output_final_state=True)
    assert o.shape == (2, 0, 1, 8) and torch.equal(f, torch.zeros(2, 1, 8, 8, dtype=F64))
