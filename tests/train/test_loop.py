"""The training loop's host side: metrics brought to the host every --log-every steps give the same records as
every step, and the FSDP call padding."""

from __future__ import annotations

import json

import pytest
import torch

from hybridlm.train.data import IGNORE, Stream, make_batch
from hybridlm.train.errors import TrainError
from hybridlm.train.main import _forward_calls, train

TIMING = ("tokens_per_s", "elapsed")


def _records(out):
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_log_every_changes_no_record(tmp_path, small_corpus, micro_args):
    """--log-every 3 (loss sums and norms kept on the device, one host copy per 3 steps, forced at the eval and
    save steps and the end) writes the same per-step records as --log-every 1, up to timing."""
    common = ("--max-steps", "7", "--eval-every", "5", "--save-every", "4", "--keep", "0")
    a = train(micro_args(small_corpus, str(tmp_path / "a"), *common, "--log-every", "1"))
    b = train(micro_args(small_corpus, str(tmp_path / "b"), *common, "--log-every", "3"))
    ra, rb = _records(tmp_path / "a"), _records(tmp_path / "b")
    assert [r["step"] for r in rb if "loss" in r] == list(range(1, 8))
    assert len(ra) == len(rb)
    for x, y in zip(ra, rb):
        assert {k: v for k, v in x.items() if k not in TIMING} == {k: v for k, v in y.items() if k not in TIMING}
    assert a["final_train_loss"] == b["final_train_loss"] and a["tokens_per_s_steps"] == b["tokens_per_s_steps"]
    # the flushes of b: after steps 3 and 4 (save), 5 (eval), 7 (end); a span's steps share its tokens/s
    tps = [r["tokens_per_s"] for r in rb if "loss" in r]
    assert tps[0] == tps[1] == tps[2] and tps[5] == tps[6] and all(t > 0 for t in tps)
    assert len({tps[2], tps[3], tps[4], tps[5]}) == 4


def test_log_every_must_be_positive(tmp_path, small_corpus, micro_args):
    with pytest.raises(TrainError, match="--log-every"):
        train(micro_args(small_corpus, str(tmp_path), "--max-steps", "1", "--log-every", "0"))


def test_forward_calls_pad_to_the_ranks_largest_count():
    docs = [torch.randint(0, 256, (n,), dtype=torch.int32) for n in (40, 100)]
    st = Stream.from_docs(docs, 140)
    T = 16
    plain = make_batch(st, [0, 1], T)  # inside the first document: one plain call
    assert len(plain.pieces("auto")) == 1
    calls = _forward_calls(plain, "auto", 2)
    assert len(calls) == 2
    ids, tg, cu = calls[1]  # the dummy: one row, no target
    assert ids.shape == (1, T) and cu is None and bool((tg == IGNORE).all())
    both = make_batch(st, [0, 2], T)  # row 2 holds the document start at 40: two calls
    assert len(both.pieces("auto")) == 2
    with pytest.raises(RuntimeError, match="forward calls"):
        _forward_calls(both, "auto", 1)


def test_profile_steps_writes_a_summary_and_a_trace(tmp_path, small_corpus, micro_args):
    """--profile-steps 1:2 profiles steps 1 and 2 only: OUT/profile/rank0.txt names them and lists the top ops by
    host time, rank0.trace.json.gz is a Chrome trace; training goes on to its last step; bad specs are refused."""
    import gzip

    out = tmp_path / "run"
    s = train(micro_args(small_corpus, str(out), "--max-steps", "4", "--profile-steps", "1:2"))
    assert s["final_step"] == 4
    text = (out / "profile" / "rank0.txt").read_text()
    assert text.startswith("rank 0: steps 1..2 (2 steps)") and "top ops by host time" in text, text[:300]
    with gzip.open(out / "profile" / "rank0.trace.json.gz", "rt") as f:
        assert "traceEvents" in json.load(f)
    for bad in ("3", "a:b", "-1:2", "2:0"):
        with pytest.raises(TrainError, match=r"--profile-steps: expected"):
            train(micro_args(small_corpus, str(tmp_path / "bad"), "--max-steps", "1", f"--profile-steps={bad}"))


def test_profile_summary_splits_gpu_time_into_compute_and_collectives():
    """The summary's GPU lines: busy is the union of kernel intervals, NCCL and compute each their own union, and
    their overlap what both cover at once."""
    from hybridlm.train.profile import _busy_us

    assert _busy_us([]) == 0.0
    assert _busy_us([(0, 10), (5, 15), (20, 30)]) == 25.0
    assert _busy_us([(0, 10), (2, 3), (10, 12)]) == 12.0
