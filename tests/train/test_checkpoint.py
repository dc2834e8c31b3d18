"""Atomic checkpoints (a crash mid-save leaves the previous one loadable) and exact resume, in-process."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hybridlm.train import checkpoint as ckpt
from hybridlm.train.errors import TrainError
from hybridlm.train.main import train
from hybridlm.train.optim import lr_at, no_decay_names, param_groups


def _save(out, step, value):
    model_state = {"w": torch.full((3, 2), float(value))}
    return ckpt.save_checkpoint(out, step, model_state=model_state, config_json="{}",
                                optimizer_state={"state": {}, "param_groups": []},
                                train_state={"step": step, "micro": step, "tokens_seen": 0}, keep=0)


def test_checkpoint_roundtrip_and_latest(tmp_path):
    out = str(tmp_path)
    _save(out, 1, 1.0)
    p2 = _save(out, 2, 2.0)
    assert ckpt.resolve_resume(out) == p2
    st = ckpt.load_checkpoint(p2)
    assert st["train_state"]["step"] == 2 and float(st["model"]["w"][0, 0]) == 2.0
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(out)] == ["step_000001", "step_000002"]
    _save(out, 2, 3.0)  # the same step again replaces it whole
    assert float(ckpt.load_checkpoint(p2)["model"]["w"][0, 0]) == 3.0


def test_crash_mid_save_keeps_previous(tmp_path, monkeypatch):
    out = str(tmp_path)
    p1 = _save(out, 1, 1.0)

    def boom(*a, **k):
        raise KeyboardInterrupt("simulated crash while writing the optimizer state")

    monkeypatch.setattr(ckpt.torch, "save", boom)
    with pytest.raises(KeyboardInterrupt):
        _save(out, 2, 2.0)
    monkeypatch.undo()
    # the half-written folder is a .tmp-*: no loader picks it; latest still names step 1
    root = os.path.join(out, ckpt.CKPT_DIR)
    assert any(n.startswith(".tmp-") for n in os.listdir(root))
    assert ckpt.list_checkpoints(out) == [p1]
    assert ckpt.resolve_resume(out) == p1
    assert ckpt.load_checkpoint(p1)["train_state"]["step"] == 1
    # the next save cleans up the leftover
    _save(out, 2, 2.0)
    assert not any(n.startswith(".tmp-") for n in os.listdir(root))


def test_crash_between_rename_and_latest(tmp_path, monkeypatch):
    out = str(tmp_path)
    _save(out, 1, 1.0)
    real_replace = os.replace

    def fail_latest(src, dst):
        if os.path.basename(dst) == ckpt.LATEST:
            raise KeyboardInterrupt("simulated crash before latest moved")
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", fail_latest)
    with pytest.raises(KeyboardInterrupt):
        _save(out, 2, 2.0)
    monkeypatch.undo()
    for p in ckpt.list_checkpoints(out):  # both complete, both load
        ckpt.load_checkpoint(p)
    assert os.path.basename(ckpt.resolve_resume(out)) == "step_000001"


def test_resume_errors(tmp_path):
    with pytest.raises(TrainError, match="no checkpoint"):
        ckpt.resolve_resume(str(tmp_path))
    bad = tmp_path / "checkpoints" / "step_000003"
    bad.mkdir(parents=True)
    (bad / "train_state.json").write_text("{}")
    with pytest.raises(TrainError, match="cannot be read"):
        ckpt.load_checkpoint(str(bad))


def test_schedule_and_decay_groups():
    assert lr_at(0, lr=1.0, warmup=10, total=100) == pytest.approx(0.1)
    assert lr_at(9, lr=1.0, warmup=10, total=100) == pytest.approx(1.0)
    assert lr_at(100, lr=1.0, warmup=10, total=100, min_ratio=0.1) == pytest.approx(0.1)
    assert 0.1 < lr_at(55, lr=1.0, warmup=10, total=100) < 1.0
    from hybridlm.model.hybrid import HybridLM
    from hybridlm.train.presets import build_config

    m = HybridLM(build_config("test-micro", None, "cpu")[0])
    names = no_decay_names(m)
    assert "embed_tokens.weight" in names
    assert any("A_log" in n for n in names) and any("dt_bias" in n for n in names)
    assert any("norm" in n for n in names)
    decay, nodecay = param_groups(m, 0.1)
    assert decay["weight_decay"] == 0.1 and nodecay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"])


def test_resume_is_exact(tmp_path, small_corpus, micro_args):
    """8 steps straight == resume from the step-4 checkpoint and run 4 more: same final train and val loss."""
    a = train(micro_args(small_corpus, str(tmp_path / "a"), "--max-steps", "8", "--save-every", "4",
                         "--eval-every", "4", "--keep", "0"))
    step4 = os.path.join(str(tmp_path / "a"), "checkpoints", "step_000004")
    assert os.path.isdir(step4)
    b = train(micro_args(small_corpus, str(tmp_path / "b"), "--max-steps", "8", "--save-every", "4",
                         "--eval-every", "4", "--resume", step4))
    assert abs(a["final_train_loss"] - b["final_train_loss"]) <= 1e-6
    assert abs(a["final_val_nats_per_byte"] - b["final_val_nats_per_byte"]) <= 1e-6
    assert a["final_train_loss"] == b["final_train_loss"]  # bitwise, in fact
    sa = ckpt.load_checkpoint(os.path.join(str(tmp_path / "a"), "checkpoints", "step_000008"))
    sb = ckpt.load_checkpoint(os.path.join(str(tmp_path / "b"), "checkpoints", "step_000008"))
    for k, v in sa["model"].items():
        assert torch.equal(v, sb["model"][k]), k
    # outputs of a run
    for name in ("metrics.jsonl", "loss_curve.png", "summary.json"):
        assert os.path.exists(tmp_path / "a" / name)
    recs = [json.loads(line) for line in open(tmp_path / "a" / "metrics.jsonl")]
    assert any("val_nats_per_byte" in r for r in recs) and any("loss" in r for r in recs)


def test_grad_accum_and_options_match(tmp_path, small_corpus, micro_args):
    """batch 8 == batch 4 x grad-accum 2; flat packing, activation checkpointing and --recompute-linear change no
    loss."""
    common = ("--max-steps", "4", "--eval-every", "0", "--save-every", "0")
    base = train(micro_args(small_corpus, str(tmp_path / "a"), *common, "--batch-size", "8"))
    acc = train(micro_args(small_corpus, str(tmp_path / "b"), *common, "--batch-size", "4", "--grad-accum", "2"))
    assert abs(base["final_train_loss"] - acc["final_train_loss"]) <= 1e-5
    flat = train(micro_args(small_corpus, str(tmp_path / "c"), *common, "--batch-size", "8", "--packing", "flat"))
    assert abs(base["final_train_loss"] - flat["final_train_loss"]) <= 1e-4
    ac = train(micro_args(small_corpus, str(tmp_path / "d"), *common, "--batch-size", "8",
                          "--activation-checkpointing"))
    assert abs(base["final_train_loss"] - ac["final_train_loss"]) <= 1e-6
    rl = train(micro_args(small_corpus, str(tmp_path / "r"), *common, "--batch-size", "8", "--recompute-linear"))
    assert rl["final_train_loss"] == base["final_train_loss"]  # the same kernels rerun: bitwise
    tok = train(micro_args(small_corpus, str(tmp_path / "e"), "--max-tokens", "1000", "--eval-every", "0"))
    assert tok["final_step"] == 4  # ceil(1000 / (4 rows x 64 tokens))


def _value(path) -> float:
    return float(ckpt.load_checkpoint(path)["model"]["w"][0, 0])


@pytest.mark.parametrize("crash_at", ["aside", "swap", "drop"])
def test_crash_inside_a_resave_keeps_a_complete_copy(tmp_path, monkeypatch, crash_at):
    """A re-save of step 2 interrupted after moving the old copy aside, after the swap, or while dropping the old
    copy: step 2 still resolves to a complete checkpoint holding the old or the new values, and the next save
    tidies up."""
    out = str(tmp_path)
    _save(out, 1, 1.0)
    _save(out, 2, 2.0)
    real_rename, real_rmtree = os.rename, ckpt.shutil.rmtree

    def rename(src, dst):
        if crash_at == "swap" and os.path.basename(src).startswith(".tmp-"):
            raise KeyboardInterrupt("simulated crash between moving the old copy aside and renaming the new one")
        real_rename(src, dst)
        if crash_at == "aside" and os.path.basename(dst).startswith(".old-"):
            raise KeyboardInterrupt("simulated crash right after moving the old copy aside")

    def rmtree(path, **kw):
        if os.path.basename(path).startswith(".old-"):
            os.remove(os.path.join(path, "model.safetensors"))  # half deleted
            raise KeyboardInterrupt("simulated crash while dropping the old copy")
        return real_rmtree(path, **kw)

    monkeypatch.setattr(ckpt.os, "rename", rename)
    monkeypatch.setattr(ckpt.shutil, "rmtree", rmtree)
    with pytest.raises(KeyboardInterrupt):
        _save(out, 2, 3.0)
    monkeypatch.undo()
    paths = ckpt.list_checkpoints(out)
    assert len(paths) == 2, paths
    assert _value(paths[1]) in (2.0, 3.0) and _value(ckpt.resolve_resume(out)) in (2.0, 3.0)
    _save(out, 3, 4.0)  # the next save moves the aside copy back or drops it
    names = sorted(os.listdir(os.path.join(out, ckpt.CKPT_DIR)))
    assert names == ["latest", "step_000001", "step_000002", "step_000003"], names
    assert _value(os.path.join(out, ckpt.CKPT_DIR, "step_000002")) in (2.0, 3.0)


_RESAVER = """
import sys, torch
from hybridlm.train import checkpoint as ckpt
out = sys.argv[1]
for i in range(100000):
    step = 1 + i % 2
    ckpt.save_checkpoint(out, step, model_state={"w": torch.full((256, 1024), float(i))}, config_json="{}",
                         optimizer_state={"state": {}, "param_groups": []},
                         train_state={"step": step, "micro": i, "tokens_seen": 0}, keep=0)
    print(step, i, flush=True)
"""


def test_kill9_during_resaves_keeps_every_step(tmp_path, seed):
    """A process re-saves steps 1 and 2 over and over (1 MiB of weights each) and is killed with SIGKILL at
    random moments: after every kill both steps resolve to a complete checkpoint that loads, holding a value that
    was being saved to that step, and the next process carries on from there."""
    import random
    import signal
    import subprocess
    import sys
    import time

    out = str(tmp_path / "run")
    rng = random.Random(seed)  # the suite's seed for this test: HYBRIDLM_TEST_SEED replays the kill times
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    for kill in range(6):
        p = subprocess.Popen([sys.executable, "-c", _RESAVER, out], stdout=subprocess.PIPE, text=True, env=env)
        saved = [p.stdout.readline() for _ in range(2 if kill == 0 else 1)]  # each step complete once, then re-saves
        assert all(saved), f"the saving process ended early (kill seed {seed})"
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        p.stdout.close()
        steps = {ckpt.load_checkpoint(path)["train_state"]["step"]: path for path in ckpt.list_checkpoints(out)}
        assert sorted(steps) == [1, 2], f"kill {kill}: {os.listdir(os.path.join(out, 'checkpoints'))} (seed {seed})"
        for step, path in steps.items():
            v = _value(path)
            assert v == int(v) and 1 + int(v) % 2 == step, f"kill {kill}: step {step} holds {v} (seed {seed})"
