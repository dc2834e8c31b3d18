"""`hybridlm train --context-parallel N` under torchrun on the CPU (gloo): the per-step train losses and the val
loss equal one process's on the same global batch and seed (fp32: summation order only), the DCP checkpoint of a
CP run resumes to the same loss, and a bad N or --seq-len is a one-line error.

Two processes with N = 2 is the pure context-parallel mesh (1 data x 2 context ranks, parameters replicated); the
slow test runs the 2-D mesh (2 x 2, FSDP2 over the data dimension) with four.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from hybridlm.train.errors import TrainError
from hybridlm.train.main import add_arguments, train

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")

ARGS = ["--preset", "test-micro", "--device", "cpu", "--max-steps", "4", "--save-every", "2", "--eval-every", "0",
        "--no-progress", "--threads", "1", "--eval-tokens", "512", "--val-fraction", "0.05", "--sample-tokens", "0",
        "--keep", "0"]
TOL = 1e-5  # fp32 on the CPU: the same sums in another order (seen: < 1e-6); a lost gradient share is O(1e-2)


def _torchrun(n: int, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """torchrun --standalone with n CPU ranks (a timeout is a ceiling for a loaded 2-core machine, not the
    expected ~10 s)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
           "-m", "hybridlm.train", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def _ok(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, f"exit {p.returncode}: {' '.join(p.args)}\n{p.stdout[-2000:]}{p.stderr[-4000:]}"


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def _losses(out: str) -> tuple[list[float], list[float]]:
    """(train loss of each step, val losses) from a run's metrics.jsonl."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return [r["loss"] for r in recs if "loss" in r], [r["val_loss"] for r in recs if "val_loss" in r]


def _assert_same(got: str, want: str, what: str, seed: int) -> None:
    (tr, va), (tr_ref, va_ref) = _losses(got), _losses(want)
    assert len(tr) == len(tr_ref) == 4 and len(va) == len(va_ref) == 1, (tr, tr_ref, va, va_ref)
    for step, (a, b) in enumerate(zip(tr + va, tr_ref + va_ref), 1):
        name = f"step {step} train loss" if step <= len(tr) else "val loss"
        assert abs(a - b) <= TOL, f"{what} {name}: {a!r} against one process's {b!r} (seed {seed})"


def test_context_parallel_two_ranks_matches_one_process(tmp_path, small_corpus, seed):
    data = ["--data", small_corpus, "--seed", str(seed), "--batch-size", "4"]
    single = str(tmp_path / "single")
    train(_parse([*ARGS, *data, "--out", single]))
    # flat packing: every micro-batch one [1, 4 * 64] row whose documents cross the two ranks' slices (the single
    # run's default "auto" packing computes the same math)
    cp = str(tmp_path / "cp")
    cmd = [*ARGS, *data, "--out", cp, "--context-parallel", "2", "--packing", "flat"]
    _ok(_torchrun(2, *cmd))
    _assert_same(cp, single, "--context-parallel 2", seed)
    state = json.load(open(os.path.join(cp, "checkpoints", "step_000004", "train_state.json")))
    assert state["context_parallel"] == 2 and state["world"] == 2, state
    # resume from the step-2 DCP checkpoint: the same losses
    shutil.rmtree(os.path.join(cp, "checkpoints", "step_000004"))
    before = _losses(cp)
    _ok(_torchrun(2, *cmd, "--resume"))
    assert _losses(cp)[0][-1] == pytest.approx(before[0][-1], abs=1e-6), (before, _losses(cp))


def test_context_parallel_bad_sizes_are_one_line_errors(tmp_path, small_corpus):
    from hybridlm.train.settings import check_args

    data = ["--data", small_corpus]
    # the flags' check (set_up runs it once the number of ranks is known to be a multiple of N)
    with pytest.raises(TrainError, match=r"^--seq-len: expected a multiple of --context-parallel 2 .* got 63$"):
        check_args(_parse([*ARGS, *data, "--context-parallel", "2", "--seq-len", "63"]))
    with pytest.raises(TrainError, match=r"^--context-parallel: expected a divisor of the number of ranks \(1\), "
                                         r"got 0$"):
        train(_parse([*ARGS, *data, "--out", str(tmp_path / "b"), "--context-parallel", "0"]))
    with pytest.raises(TrainError, match=r"^--context-parallel: expected a divisor of the number of ranks \(1\), "
                                         r"got 2$"):
        train(_parse([*ARGS, *data, "--out", str(tmp_path / "c"), "--context-parallel", "2"]))
    p = _torchrun(2, *ARGS, *data, "--out", str(tmp_path / "d"), "--context-parallel", "3")
    said = p.stdout + p.stderr
    line = "hybridlm train: error: --context-parallel: expected a divisor of the number of ranks (2), got 3"
    # a rank's one line (torchrun stops the other rank when the first exits, and reports the exit with a traceback
    # of its own); no frame of the job's code
    assert p.returncode != 0 and line in said and "hybridlm/train/" not in said, said[-3000:]


@pytest.mark.slow
def test_context_parallel_2d_mesh_four_ranks(tmp_path, small_corpus, seed):
    """2 data x 2 context ranks: FSDP2 over "dp", the gradients summed over "cp"; the same global batch (2 rows a
    data rank) as one process's 4."""
    data = ["--data", small_corpus, "--seed", str(seed)]
    single = str(tmp_path / "single")
    train(_parse([*ARGS, *data, "--batch-size", "4", "--out", single]))
    mesh = str(tmp_path / "mesh")
    _ok(_torchrun(4, *ARGS, *data, "--batch-size", "2", "--out", mesh, "--context-parallel", "2"))
    _assert_same(mesh, single, "2 x 2 mesh", seed)
