"""torchrun + FSDP2 on CPU (gloo, 2 ranks): same loss as one process at the same global batch, DCP resume exact,
a SIGINT saves on every rank and the rerun finishes exactly, the exported weights load with from_pretrained."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from hybridlm.model.hybrid import HybridLM
from hybridlm.train import checkpoint as ckpt
from hybridlm.train.main import add_arguments, train

ARGS = ["--preset", "test-micro", "--device", "cpu", "--max-steps", "6", "--save-every", "3", "--eval-every", "0",
        "--no-progress", "--threads", "1", "--eval-tokens", "512", "--val-fraction", "0.05", "--sample-tokens", "0",
        "--keep", "0"]


def _run(cmd, timeout=900):
    """timeout: a ceiling, not an expected time (~10 s each on an idle CPU; a loaded one slows the two ranks and
    three Python start-ups several fold, and the 180 s before was the suspect of a failure under load). Ports are
    not fixed: --standalone's rendezvous store binds port 0 and the ranks reuse it. On a timeout torchrun gets
    SIGTERM, which it passes on to its ranks (each in a session of its own: killing torchrun alone would orphan
    them), and the test fails with the output so far."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = "", "(no output: it did not stop on SIGTERM)"
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{out[-2000:]}{err[-4000:]}")
    assert p.returncode == 0, f"exit {p.returncode}: {' '.join(cmd)}\n{out[-2000:]}{err[-4000:]}"


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def _summary(out):
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")
def test_fsdp2_two_ranks_cpu(tmp_path, small_corpus, seed):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "-m", "hybridlm.train"]
    fsdp = str(tmp_path / "fsdp")
    _run([*torchrun, *ARGS, "--data", small_corpus, "--batch-size", "4", "--out", fsdp])
    a, b = _summary(fsdp), train(_parse([*ARGS, "--data", small_corpus, "--batch-size", "8",
                                         "--out", str(tmp_path / "single")]))  # one process: in this one
    # fp32 on the CPU: the same gradients up to summation order (FSDP averages over ranks; the job scales the
    # loss by the world size so that they are the global token mean). Without that scale: 1.1e-3 after 12 steps.
    assert abs(a["final_train_loss"] - b["final_train_loss"]) <= 1e-5, (a["final_train_loss"], b["final_train_loss"])
    # tokens/s: the median over the last 3 of 6 steps (at most half are dropped as warm-up), all ranks' tokens
    assert a["tokens_per_s_steps"] == b["tokens_per_s_steps"] == 3 and a["tokens_per_s"] > 0 and b["tokens_per_s"] > 0
    # the sharded checkpoint's export is a from_pretrained folder
    last = ckpt.resolve_resume(fsdp)
    assert os.path.isdir(os.path.join(last, "dcp"))
    HybridLM.from_pretrained(last)
    # resume from the step-3 DCP checkpoint: the same final loss
    shutil.rmtree(os.path.join(fsdp, "checkpoints", "step_000006"))
    _run([*torchrun, *ARGS, "--data", small_corpus, "--batch-size", "4", "--out", fsdp, "--resume"])
    assert abs(_summary(fsdp)["final_train_loss"] - a["final_train_loss"]) <= 1e-6
    # SIGINT to torchrun (which passes it on to both ranks) at a random early step: the ranks agree on the step at
    # the next flush, both save it (DCP shards, each rank's RNG) and exit; the same command again finishes the run
    # with the uninterrupted run's loss
    cmd = [*torchrun, *ARGS, "--data", small_corpus, "--batch-size", "4", "--out", str(tmp_path / "int")]
    target = random.Random(seed).randint(1, 2)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    metrics = tmp_path / "int" / "metrics.jsonl"
    t0 = time.time()
    while p.poll() is None and time.time() - t0 < 600:
        lines = metrics.read_text().split("\n")[:-1] if metrics.exists() else []
        if any("loss" in r and r["step"] >= target for r in map(json.loads, lines)):
            break
        time.sleep(0.005)
    p.send_signal(signal.SIGINT)
    said = p.communicate(timeout=600)[0]
    stops = [ln for ln in said.splitlines() if "interrupted at step" in ln]
    assert len(stops) == 1, f"target step {target} (seed {seed}):\n{said[-3000:]}"
    step = int(stops[0].split("interrupted at step ")[1].split(";")[0])
    assert target <= step < 6
    saved = ckpt.resolve_resume(str(tmp_path / "int"))
    assert os.path.basename(saved) == ckpt.step_name(step)
    assert {"rng_rank0.pt", "rng_rank1.pt", "dcp"} <= set(os.listdir(saved)), os.listdir(saved)
    _run(cmd)
    assert abs(_summary(str(tmp_path / "int"))["final_train_loss"] - a["final_train_loss"]) <= 1e-6
    steps = [json.loads(line)["step"] for line in open(metrics) if "loss" in json.loads(line)]
    assert steps == list(range(1, 7)), steps


def test_median_tokens_per_s_drops_the_warm_up_steps():
    from hybridlm.train.main import median_tokens_per_s

    assert median_tokens_per_s([1.0] * 10 + [5.0, 7.0, 6.0] * 4, warmup=10) == (6.0, 12)
    assert median_tokens_per_s([1.0, 9.0, 3.0, 4.0], warmup=10) == (3.5, 2)  # at most half dropped
    assert median_tokens_per_s([2.0], warmup=10) == (2.0, 1)
    assert median_tokens_per_s([]) == (None, 0)


def test_reshard_after_forward_reaches_every_block(small_corpus):
    """--no-reshard-after-forward: apply_fsdp passes reshard_after_forward=False to each block's fully_shard (the
    root keeps FSDP's default); a one-process run with the flag is a clear error, not a silently ignored flag."""
    from hybridlm.train.errors import TrainError
    from hybridlm.train.parallel import apply_fsdp, find_blocks
    from hybridlm.train.presets import build_config

    model = HybridLM(build_config("test-micro", None, "cpu")[0])
    calls = []
    apply_fsdp(model, True, reshard_after_forward=False, fully_shard=lambda m, **kw: calls.append((m, kw)))
    assert [m for m, _ in calls] == list(find_blocks(model)) + [model]
    assert all(kw["reshard_after_forward"] is False for _, kw in calls[:-1])
    assert "reshard_after_forward" not in calls[-1][1] and "mp_policy" in calls[-1][1]
    with pytest.raises(TrainError, match="--no-reshard-after-forward: applies to FSDP2 runs under torchrun"):
        train(_parse([*ARGS, "--data", small_corpus, "--no-reshard-after-forward"]))


def test_fsdp_units_group_blocks_up_to_the_parameter_bar():
    """Consecutive blocks share a unit until it holds min_unit_params; 0 keeps one unit per block; a bar above the
    whole model gives one unit; apply_fsdp shards each unit (a list when it holds several blocks), then the root."""
    from torch import nn

    from hybridlm.train.parallel import apply_fsdp, find_blocks, fsdp_units

    blocks = nn.ModuleList(nn.Linear(10, 10) for _ in range(5))  # 110 parameters each
    assert [len(u) for u in fsdp_units(blocks, 0)] == [1] * 5
    assert [len(u) for u in fsdp_units(blocks, 200)] == [2, 2, 1]
    assert [len(u) for u in fsdp_units(blocks, 220)] == [2, 2, 1]
    assert [len(u) for u in fsdp_units(blocks, 221)] == [3, 2]
    assert [len(u) for u in fsdp_units(blocks, 10**9)] == [5]
    assert [b for u in fsdp_units(blocks, 300) for b in u] == list(blocks)

    from hybridlm.train.presets import build_config

    model = HybridLM(build_config("test-micro", None, "cpu")[0])
    per_block = sum(p.numel() for p in find_blocks(model)[0].parameters())
    calls = []
    apply_fsdp(model, True, min_unit_params=2 * per_block, fully_shard=lambda m, **kw: calls.append(m))
    blocks = list(find_blocks(model))
    assert calls[-1] is model and all(isinstance(c, list) and len(c) == 2 for c in calls[:-1]), calls
    assert [b for c in calls[:-1] for b in c] == blocks
