"""The command line: a few-step smoke run, bad input, and kill -9 at random moments with exact resume."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from hybridlm.cli import main as cli_main
from hybridlm.train import checkpoint as ckpt
from hybridlm.train.main import train

MICRO = ["--preset", "test-micro", "--no-progress", "--threads", "1", "--eval-tokens", "512", "--val-fraction", "0.05"]


def _cli(*argv, module="hybridlm", timeout=240):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", module, *(["train"] if module == "hybridlm" else []), *argv],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_cli_smoke(tmp_path, small_corpus):
    out = tmp_path / "run"
    r = _cli(*MICRO, "--data", small_corpus, "--out", str(out), "--max-steps", "3", "--sample-tokens", "40",
             "--prompt", "KING.\n")
    assert r.returncode == 0, r.stderr
    assert "val" in r.stdout and "unigram" in r.stdout and "sample" in r.stdout
    for name in ("metrics.jsonl", "loss_curve.png", "sample.txt", "summary.json", "run.json"):
        assert (out / name).exists(), name
    assert (out / "sample.txt").read_text().startswith("KING.\n")
    assert os.path.basename(ckpt.resolve_resume(str(out))) == "step_000003"


def test_module_entry_point_help():
    r = _cli("--help", module="hybridlm.train", timeout=60)
    assert r.returncode == 0
    for flag in ("--preset", "--config", "--data", "--tokenizer", "--seq-len", "--batch-size", "--grad-accum", "--lr",
                 "--warmup", "--max-steps", "--max-tokens", "--eval-every", "--save-every", "--out", "--resume",
                 "--seed", "--precision", "--compile", "--activation-checkpointing", "--recompute-linear",
                 "--device"):
        assert flag in r.stdout, flag


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--data", "/nonexistent/corpus.txt"], "no such file or folder"),
        (["--seq-len", "100000"], "longer than this model supports"),
        (["--batch-size", "100000"], "lower --batch-size"),
    ],
)
def test_bad_input_messages(tmp_path, small_corpus, argv, match, capsys):
    """In-process through the CLI's main (the same code the command runs; test_cli_smoke covers the process)."""
    args = [*MICRO, "--out", str(tmp_path / "o"), "--max-steps", "1"]
    if "--data" not in argv:
        args += ["--data", small_corpus]
    assert cli_main(["train", *args, *argv]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err, err


def test_empty_corpus_message(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("\n\n")
    assert cli_main(["train", *MICRO, "--data", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "empty" in capsys.readouterr().err


def _kill_run(argv, seed):
    """Start the run, wait for its first checkpoint, SIGKILL it at a random moment afterwards."""
    rng = random.Random(seed)
    out = argv[argv.index("--out") + 1]
    p = subprocess.Popen([sys.executable, "-m", "hybridlm.train", *argv], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    latest = os.path.join(out, "checkpoints", "latest")
    t0 = time.time()
    before = open(latest).read() if os.path.exists(latest) else None
    while time.time() - t0 < 120:
        if os.path.exists(latest) and open(latest).read() != before:
            break
        if p.poll() is not None:
            break
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 0.6))
    finished = p.poll() is not None
    if not finished:
        os.kill(p.pid, signal.SIGKILL)
    p.wait()
    return finished


@pytest.mark.slow
def test_kill9_resume_exact(tmp_path, small_corpus, micro_args, seed):
    """kill -9 twice at random moments (saves happen every step, so some kills land inside a save): every
    checkpoint on disk loads, and resuming ends with the same final loss as an uninterrupted run."""
    common = ["--data", small_corpus, "--sample-tokens", "0", "--max-steps", "40", "--save-every", "1",
              "--eval-every", "0", "--keep", "0"]
    ref = train(micro_args(small_corpus, str(tmp_path / "ref"), *common[2:]))
    out = str(tmp_path / "killed")
    argv = [*MICRO, *common, "--out", out]
    kills = 0
    for i in range(2):
        finished = _kill_run(argv + (["--resume"] if i else []), seed + i)
        kills += not finished
        print(f"kill {i}: {'finished before the kill' if finished else 'killed'} at "
              f"{os.path.basename(ckpt.resolve_resume(out))}")
        paths = ckpt.list_checkpoints(out)
        assert paths, "no checkpoint survived"
        for path in paths:  # every checkpoint on disk loads
            ckpt.load_checkpoint(path)
        ckpt.load_checkpoint(ckpt.resolve_resume(out))
        if finished:
            break
    assert kills >= 1, "the run finished before it could be killed: make it longer"
    r = _cli(*argv, "--resume", module="hybridlm.train")
    assert r.returncode == 0, r.stderr
    with open(os.path.join(out, "summary.json")) as f:
        got = json.load(f)
    assert got["final_step"] == 40
    assert abs(got["final_train_loss"] - ref["final_train_loss"]) <= 1e-6, f"kill seed {seed}"
    assert abs(got["final_val_nats_per_byte"] - ref["final_val_nats_per_byte"]) <= 1e-6, f"kill seed {seed}"


def test_threads_flag_applies_on_every_device():
    """--threads sets PyTorch's CPU threads on GPU runs too (it was read on CPU only, so torchrun's ranks kept the 1
    thread torchrun gives them whatever the flag said); without it a GPU run leaves PyTorch's setting alone."""
    import torch

    from hybridlm.train.errors import TrainError
    from hybridlm.train.main import set_threads

    before = torch.get_num_threads()
    try:
        set_threads(3, torch.device("cuda"))
        assert torch.get_num_threads() == 3
        set_threads(None, torch.device("cuda"))
        assert torch.get_num_threads() == 3
        set_threads(2, torch.device("cpu"))
        assert torch.get_num_threads() == 2
        with pytest.raises(TrainError, match="--threads: expected >= 1, got 0"):
            set_threads(0, torch.device("cpu"))
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_default_threads_are_the_allowed_cores_not_the_load(monkeypatch):
    """Without --threads a CPU run uses every core its affinity mask allows, however busy the load average says
    the machine is, and a process pinned to one core uses one."""
    import torch

    from hybridlm.train import main as train_main

    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 64.0, 64.0), raising=False)
    cores = len(os.sched_getaffinity(0))
    assert train_main.cpu_threads() == cores
    before = torch.get_num_threads()
    try:
        train_main.set_threads(None, torch.device("cpu"))
        assert torch.get_num_threads() == cores
    finally:
        torch.set_num_threads(before)
    one = min(os.sched_getaffinity(0))
    code = (f"import os; os.sched_setaffinity(0, {{{one}}}); from hybridlm.train.main import cpu_threads; "
            "print(cpu_threads())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1"


def test_resuming_a_finished_run_says_so_and_changes_nothing(tmp_path, small_corpus, micro_args, capsys):
    """--resume on a run that reached its last step: exit 0, says it is finished, no step trained, metrics.jsonl
    and summary.json as they were (no duplicate row, no nan)."""
    from hybridlm.train.main import run

    out = str(tmp_path / "run")
    assert run(micro_args(small_corpus, out, "--max-steps", "2")) == 0
    files = {name: (tmp_path / "run" / name).read_text() for name in ("metrics.jsonl", "summary.json")}
    capsys.readouterr()
    assert run(micro_args(small_corpus, out, "--max-steps", "2", "--resume")) == 0
    said = capsys.readouterr().out
    assert "is finished" in said and "step 2 of 2" in said and "nan" not in said, said
    for name, text in files.items():
        assert (tmp_path / "run" / name).read_text() == text, name
    steps = [json.loads(line)["step"] for line in files["metrics.jsonl"].splitlines()
             if "loss" in json.loads(line)]
    assert steps == sorted(set(steps)), steps
    assert "NaN" not in files["summary.json"] and "nan" not in files["summary.json"]
