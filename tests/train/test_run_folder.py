"""The run folder keeps its promises: a rerun continues (and refuses other settings), --fresh keeps the earlier run
aside, SIGINT / SIGTERM save the step and exit 130 / 143, one run at a time holds --out, flags are range-checked,
and a run whose stderr is no terminal draws no progress bar."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from hybridlm.cli import main as cli_main
from hybridlm.train import checkpoint as ckpt
from hybridlm.train import main as train_main
from hybridlm.train.errors import TrainError, TrainInterrupted
from hybridlm.train.main import run, train
from hybridlm.train.run_folder import RunLock
from hybridlm.train.trainer import Trainer

MICRO = ["--preset", "test-micro", "--threads", "1", "--eval-tokens", "512", "--val-fraction", "0.05",
         "--sample-tokens", "0"]
STEPS = 20  # interruptions fall in the first half: a child stops a step or two after the signal
SCHEDULE = ["--max-steps", str(STEPS), "--eval-every", "5", "--save-every", "6", "--keep", "0"]


def _records(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _losses(out) -> dict[int, float]:
    """step -> train loss; asserts each step is recorded once."""
    steps = [r["step"] for r in _records(out) if "loss" in r]
    assert len(steps) == len(set(steps)), f"a step recorded twice: {steps}"
    return {r["step"]: r["loss"] for r in _records(out) if "loss" in r}


def _vals(out) -> dict[int, float]:
    steps = [r["step"] for r in _records(out) if "val_loss" in r]
    assert len(steps) == len(set(steps)), f"an evaluation recorded twice: {steps}"
    return {r["step"]: r["val_loss"] for r in _records(out) if "val_loss" in r}


def _start(argv, log_path):
    """`hybridlm train ARGV` as a child process, its stdout and stderr into files (no terminal: no bar)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    out, err = open(f"{log_path}.out", "w"), open(f"{log_path}.err", "w")
    p = subprocess.Popen([sys.executable, "-m", "hybridlm", "train", *argv], stdout=out, stderr=err, env=env)
    out.close()
    err.close()
    return p


def _read(log_path) -> tuple[str, str]:
    with open(f"{log_path}.out") as f, open(f"{log_path}.err") as g:
        return f.read(), g.read()


def _wait_for_step(p, out: str, step: int, timeout: float = 300) -> None:
    """Until metrics.jsonl records the train loss of `step` (or the child ends)."""
    t0 = time.time()
    path = os.path.join(out, "metrics.jsonl")
    while time.time() - t0 < timeout and p.poll() is None:
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                lines = f.read().split("\n")[:-1]  # complete lines only
            if any("loss" in r and r["step"] >= step for r in map(json.loads, lines)):
                return
        time.sleep(0.005)


def test_sigint_three_times_then_rerun_equals_an_uninterrupted_run(tmp_path, small_corpus, micro_args, seed):
    """SIGINT at three random steps (drawn from the test's seed), each time followed by a rerun of the same command:
    every interruption exits 130 with one line naming the step it saved, each rerun says it continues, and the
    finished run equals an uninterrupted one: every step's train and val loss bitwise, each step recorded once, the
    final checkpoint's weights and optimizer state equal. No progress bar without a terminal: no carriage returns,
    plain progress lines instead."""
    rng = random.Random(seed)
    ref_out = str(tmp_path / "ref")
    ref = train(micro_args(small_corpus, ref_out, *SCHEDULE))
    out = str(tmp_path / "run")
    argv = [*MICRO, "--data", small_corpus, "--out", out, *SCHEDULE]
    targets = sorted(rng.sample(range(1, STEPS // 2 + 1), 3))
    saved = 0
    for i, target in enumerate(targets):
        target = max(target, saved + 1)
        log = str(tmp_path / f"child{i}")
        p = _start(argv, log)
        _wait_for_step(p, out, target)
        if p.poll() is None:
            assert open(os.path.join(out, ".lock")).read().strip() == str(p.pid)  # the running child holds --out
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=300)
        stdout, stderr = _read(log)
        assert rc == 130, f"child {i} (seed {seed}, step {target}): exit {rc}\n{stdout[-2000:]}\n{stderr[-3000:]}"
        said = [line for line in stdout.splitlines() if line.startswith("interrupted at step")]
        assert len(said) == 1 and said[0].endswith("; rerun the same command to continue"), stdout[-2000:]
        step = int(said[0].split()[3].rstrip(";"))
        assert step >= target, (step, target)
        assert "Traceback" not in stderr and "\r" not in stderr, stderr[-2000:]
        if i:
            assert f"continuing the run in {out} from step {saved} " in stdout, stdout[:2000]
        assert os.path.basename(ckpt.resolve_resume(out)) == ckpt.step_name(step)
        assert sorted(_losses(out)) == list(range(1, step + 1)), f"seed {seed}"
        saved = step
    log = str(tmp_path / "last")
    p = _start(argv, log)
    rc = p.wait(timeout=300)
    stdout, stderr = _read(log)
    assert rc == 0, stdout[-2000:] + stderr[-3000:]
    assert f"continuing the run in {out} from step {saved} " in stdout
    assert "\r" not in stderr and f"step {STEPS}/{STEPS} | loss" in stdout, stdout[-2000:]
    got, want = _losses(out), _losses(ref_out)
    assert list(got) == list(range(1, STEPS + 1)) and got == want, f"seed {seed}, interrupted after {targets}"
    assert _vals(out) == _vals(ref_out)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["final_train_loss"] == ref["final_train_loss"]
    assert summary["final_val_nats_per_byte"] == ref["final_val_nats_per_byte"]
    a = ckpt.load_checkpoint(os.path.join(out, "checkpoints", ckpt.step_name(STEPS)))
    b = ckpt.load_checkpoint(os.path.join(ref_out, "checkpoints", ckpt.step_name(STEPS)))
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    assert {k: v for k, v in a["train_state"].items()} == b["train_state"]


def _signal_at(monkeypatch, step: int, signum: int) -> None:
    """The process signals itself during step `step` (as a terminal or a cluster would, from outside)."""
    real = Trainer.train_step

    def train_step(self):
        if self.state.step + 1 == step:
            os.kill(os.getpid(), signum)
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", train_step)


def test_sigterm_saves_the_step_and_exits_143(tmp_path, small_corpus, micro_args, monkeypatch, capsys):
    """SIGTERM during step 3 of 8 (saves every 4): step 3 finishes, is saved and recorded, one line says so, exit
    143; the handlers are put back; a rerun continues from step 3 to the uninterrupted run's final loss."""
    out = str(tmp_path / "run")
    before = signal.getsignal(signal.SIGTERM)
    _signal_at(monkeypatch, 3, signal.SIGTERM)
    assert run(micro_args(small_corpus, out, "--max-steps", "8")) == 143
    assert signal.getsignal(signal.SIGTERM) == before
    said = capsys.readouterr().out
    assert said.splitlines()[-1] == "interrupted at step 3; rerun the same command to continue", said[-500:]
    assert os.path.basename(ckpt.resolve_resume(out)) == "step_000003"
    assert sorted(_losses(out)) == [1, 2, 3]
    monkeypatch.undo()
    s = train(micro_args(small_corpus, out, "--max-steps", "8"))
    ref = train(micro_args(small_corpus, str(tmp_path / "ref"), "--max-steps", "8"))
    assert s["final_train_loss"] == ref["final_train_loss"] and _losses(out) == _losses(str(tmp_path / "ref"))
    assert "continuing the run" in capsys.readouterr().out


def test_a_second_signal_exits_at_once():
    """The first SIGINT is only recorded, and so is a repeat within a second (torchrun passing on a signal its
    workers got too); a second one after that ends the process there and then (exit 130, one line)."""
    code = ("import os, signal, time\n"
            "from hybridlm.train.signals import REPEAT_S, StopSignals\n"
            "with StopSignals() as s:\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(0.05)\n"
            "    print('first', s.signum, flush=True)\n"
            "    time.sleep(REPEAT_S)\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(30)\n"
            "    print('not reached', flush=True)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 130 and r.stdout == "first 2\n", (r.returncode, r.stdout, r.stderr)
    assert "SIGINT again: exiting now" in r.stderr and "Traceback" not in r.stderr


def test_ctrl_c_before_the_first_step_is_one_line(tmp_path, small_corpus, micro_args, monkeypatch, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_main, "load_data", interrupted)
    assert run(micro_args(small_corpus, str(tmp_path / "run"), "--max-steps", "2")) == 130
    err = capsys.readouterr().err
    assert err == "hybridlm train: interrupted before the first step; nothing was saved\n", err


def test_rerun_continues_or_refuses_other_settings(tmp_path, small_corpus, micro_args, capsys):
    """A rerun with a larger --max-steps continues (schedule settings may change); a rerun of a finished run does
    nothing; a changed data or model setting is refused in one line that names it, and nothing is written."""
    out = str(tmp_path / "run")
    train(micro_args(small_corpus, out, "--max-steps", "2"))
    files = {n: (tmp_path / "run" / n).read_bytes() for n in ("metrics.jsonl", "summary.json", "run.json")}
    capsys.readouterr()
    assert run(micro_args(small_corpus, out, "--max-steps", "2")) == 0
    said = capsys.readouterr().out
    assert "is finished" in said and "step 2 of 2" in said and "nothing to do" in said, said
    for refused, names in ((["--seq-len", "32"], "--seq-len 64 -> 32"),
                           (["--seed", "1"], "--seed 0 -> 1"),
                           (["--val-fraction", "0.1"], "--val-fraction 0.05 -> 0.1"),
                           (["--preset", "tiny"], "model hidden_size")):
        args = micro_args(small_corpus, out, "--max-steps", "3", *refused)
        with pytest.raises(TrainError, match=f"holds a run with other settings \\(.*{names}") as e:
            train(args)
        assert "--fresh" in str(e.value) and "\n" not in str(e.value)
    for n, data in files.items():
        assert (tmp_path / "run" / n).read_bytes() == data, n
    other = tmp_path / "other.txt"
    other.write_text(open(small_corpus).read()[:30000])
    with pytest.raises(TrainError, match="--data .* -> .*other.txt"):
        train(micro_args(str(other), out, "--max-steps", "3"))
    s = train(micro_args(small_corpus, out, "--max-steps", "4", "--recompute-linear"))  # memory setting: free
    assert s["final_step"] == 4 and sorted(_losses(out)) == [1, 2, 3, 4]
    assert "continuing the run in" in capsys.readouterr().out


def test_fresh_keeps_the_whole_earlier_run_aside(tmp_path, small_corpus, micro_args, capsys):
    """--fresh starts at step 1 and moves the earlier run's files (checkpoints, metrics, run.json, summary, plot)
    into OUT.prev-DATE; a second --fresh gets a name of its own. Without a terminal, no progress bar is drawn."""
    out = tmp_path / "run"
    train(micro_args(small_corpus, str(out), "--max-steps", "2"))
    first = {n: (out / n).read_bytes() for n in ("metrics.jsonl", "run.json", "summary.json")}
    args = micro_args(small_corpus, str(out), "--max-steps", "3", "--fresh")
    args.no_progress = False  # pytest's stderr is no terminal
    capsys.readouterr()
    train(args)
    cap = capsys.readouterr()
    assert "\r" not in cap.err and "step 3/3 | loss" in cap.out, cap
    kept = sorted(p for p in tmp_path.iterdir() if p.name.startswith("run.prev-"))
    assert len(kept) == 1 and f"kept aside in {kept[0]} (--fresh)" in cap.out
    for n, data in first.items():
        assert (kept[0] / n).read_bytes() == data, n
    assert ckpt.load_checkpoint(str(kept[0] / "checkpoints" / "step_000002"))["train_state"]["step"] == 2
    assert (kept[0] / "loss_curve.png").exists() and not (kept[0] / ".lock").exists()
    assert sorted(_losses(str(out))) == [1, 2, 3]
    assert os.path.basename(ckpt.resolve_resume(str(out))) == "step_000003"
    train(micro_args(small_corpus, str(out), "--max-steps", "1", "--fresh"))
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("run.prev-")]) == 2
    with pytest.raises(TrainError, match="--fresh: starts over, --resume continues"):
        train(micro_args(small_corpus, str(out), "--fresh", "--resume"))


def test_a_folder_without_checkpoint_starts_over_and_keeps_its_files(tmp_path, small_corpus, micro_args, capsys):
    """An earlier run killed before its first save left metrics but no checkpoint: the rerun starts at step 1 and
    keeps those files aside rather than appending to them."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    (out / "notes.txt").write_text("mine")
    train(micro_args(small_corpus, str(out), "--max-steps", "2"))
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("run.prev-")]
    assert len(kept) == 1 and (kept[0] / "metrics.jsonl").read_text() == '{"step": 1, "loss": 9.0}\n'
    assert (out / "notes.txt").read_text() == "mine"  # not a run's file: stays
    assert sorted(_losses(str(out))) == [1, 2] and "no checkpoint to continue from" in capsys.readouterr().out


_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
print("locked", flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="no fcntl")
def test_one_run_per_folder(tmp_path, small_corpus, micro_args, capsys):
    """While another process holds OUT/.lock, a run into OUT exits 2 in one line naming that process's pid and
    writes nothing; once the holder is killed (SIGKILL: no clean-up), the lock it left does not block."""
    out = tmp_path / "run"
    out.mkdir()
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "locked\n"
        assert cli_main(["train", *MICRO, "--no-progress", "--data", small_corpus, "--out", str(out),
                         "--max-steps", "1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"another run is using this folder (pid {p.pid}" in err, err
        assert os.listdir(out) == [".lock"]
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
    assert run(micro_args(small_corpus, str(out), "--max-steps", "1")) == 0
    with RunLock(str(out)):  # released at the end of the run: this process takes it again
        pass


@pytest.mark.parametrize("flag, value, expected", [
    ("--val-fraction", "1.5", "--val-fraction: expected a fraction in (0, 1), got 1.5"),
    ("--val-fraction", "0", "--val-fraction: expected a fraction in (0, 1), got 0"),
    ("--max-steps", "0", "--max-steps: expected >= 1, got 0"),
    ("--lr", "-1", "--lr: expected a finite learning rate > 0, got -1"),
    ("--lr", "nan", "--lr: expected a finite learning rate > 0, got nan"),
    ("--warmup", "-2", "--warmup: expected >= 0, got -2"),
    ("--max-tokens", "0", "--max-tokens: expected a number of tokens > 0, got 0"),
    ("--min-lr-ratio", "1.5", "--min-lr-ratio: expected a fraction in [0, 1], got 1.5"),
    ("--grad-clip", "-1", "--grad-clip: expected a finite norm >= 0 (0: off), got -1"),
    ("--eval-every", "-1", "--eval-every: expected >= 0 (0: only at the end), got -1"),
    ("--save-every", "-5", "--save-every: expected >= 0 (0: only at the end), got -5"),
    ("--keep", "-1", "--keep: expected >= 0 (0: keep all), got -1"),
    ("--batch-size", "0", "--batch-size: expected >= 1, got 0"),
    ("--grad-accum", "0", "--grad-accum: expected >= 1, got 0"),
    ("--seq-len", "1", "--seq-len: expected >= 2, got 1"),
    ("--eval-tokens", "0", "--eval-tokens: expected >= 1, got 0"),
    ("--weight-decay", "-0.1", "--weight-decay: expected a finite value >= 0, got -0.1"),
    ("--temperature", "-1", "--temperature: expected a finite temperature >= 0 (0: greedy), got -1"),
])
def test_flag_ranges_are_one_line_errors(tmp_path, small_corpus, flag, value, expected, capsys):
    """Each bad value: exit 2, one line naming the flag, what it accepts and what it got; nothing written."""
    out = tmp_path / "o"
    assert cli_main(["train", *MICRO, "--no-progress", "--data", small_corpus, "--out", str(out),
                     f"{flag}={value}"]) == 2
    err = capsys.readouterr().err
    assert err == f"hybridlm train: error: {expected}\n", err
    assert not out.exists()


def test_interrupted_exception_carries_the_line():
    e = TrainInterrupted(7, signal.SIGTERM)
    assert str(e) == "interrupted at step 7; rerun the same command to continue" and e.signum == 15
