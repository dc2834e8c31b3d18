"""The newcomer's path through the command line: the README's main job, then `generate`, `info` and `memory` on
its run folder; every bad model input is one line on stderr with exit status 2; `generate --help` shows every
default."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from hybridlm import HybridLM, cli
from hybridlm.model import generate_cli
from hybridlm.model.presets import get_preset


def _cli(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "hybridlm.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_main_job_then_generate_and_info_on_its_run_folder(tmp_path):
    """`hybridlm train` as the README runs it (its defaults, two steps and a short evaluation here), then the
    commands the README names after it, on the folder the run printed."""
    out = str(tmp_path / "runs" / "train")
    r = _cli("train", "--out", out, "--max-steps", "2", "--eval-tokens", "1024", "--sample-tokens", "8",
             "--no-progress")
    assert r.returncode == 0, r.stderr
    if hasattr(os, "sched_getaffinity"):
        assert f"threads {len(os.sched_getaffinity(0))}," in r.stdout, r.stdout
    assert f"outputs in {out}/" in r.stdout
    g = _cli("generate", "--model", out, "--prompt", "ROMEO.\n", "--max-new-tokens", "16")
    assert g.returncode == 0, g.stderr
    assert g.stdout.startswith("ROMEO.\n") and len(g.stdout) > len("ROMEO.\n")
    assert os.path.join(out, "checkpoints", "step_000002") in g.stderr  # which checkpoint it loaded
    assert "seed" in g.stderr and "temperature 0.8" in g.stderr
    i = _cli("info", out)
    assert i.returncode == 0, i.stderr
    assert "parameters" in i.stdout and "pattern           LLLA" in i.stdout
    m = _cli("memory", "--config", out, "--max-context", "4096")
    assert m.returncode == 0 and "hybrid (this config)" in m.stdout, m.stderr


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny")
    HybridLM(get_preset("tiny")).save_pretrained(str(folder))
    return str(folder)


def _damaged(model_folder: str, tmp_path, how: str) -> str:
    folder = tmp_path / how
    shutil.copytree(model_folder, folder)
    weights = folder / "model.safetensors"
    if how == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        weights.write_bytes(os.urandom(4096))
    elif how == "no_config":
        (folder / "config.json").unlink()
    elif how == "bad_config":
        (folder / "config.json").write_text('{"model_type": "qwen3_5_text", ')
    return str(folder)


CASES = {
    "truncated weights": (["generate", "--model", "{truncated}", "--prompt", "a"], "--model", "truncated"),
    "corrupt weights": (["generate", "--model", "{garbage}", "--prompt", "a"], "--model", "safetensors"),
    "missing config": (["generate", "--model", "{no_config}", "--prompt", "a"], "--model", "no config.json"),
    "config not JSON": (["info", "{bad_config}"], "target", "not a transformers or HybridConfig"),
    "unknown preset (info)": (["info", "no-such-preset"], "target no-such-preset", "presets:"),
    "unknown preset (generate)": (["generate", "--model", "no-such-preset", "--prompt", "a"], "--model", "presets:"),
    "unknown preset (memory)": (["memory", "--preset", "no-such-preset"], "--preset", "presets:"),
    "wrong path": (["generate", "--model", "/nonexistent/model", "--prompt", "a"], "--model /nonexistent/model",
                   "no such file or folder"),
    "empty prompt": (["generate", "--model", "tiny", "--prompt", ""], "--prompt", "empty"),
    "no new tokens": (["generate", "--model", "tiny", "--prompt", "a", "--max-new-tokens", "0"],
                      "--max-new-tokens", "expected >= 1, got 0"),
    "truncated weights (info)": (["info", "{truncated}"], "target", "truncated"),
    "no context (memory)": (["memory", "--preset", "tiny", "--max-context", "0"], "--max-context",
                            "expected >= 1, got 0"),
    "no context (info)": (["info", "tiny", "--context", "0"], "--context", "expected >= 1, got 0"),
    "plot into a missing folder": (["memory", "--preset", "tiny", "--plot", "/nonexistent/m.png"],
                                   "--plot /nonexistent/m.png", "no such folder /nonexistent"),
    "plot format unknown": (["memory", "--preset", "tiny", "--plot", "{garbage}/m.xyz"], "m.xyz", "not supported"),
    "bad flag value": (["generate", "--model", "tiny", "--prompt", "a", "--max-new-tokens", "many"],
                       "--max-new-tokens", "invalid int value"),
}


def _cli_in_process(argv: list[str], capsys, caplog) -> tuple[int, str, list[logging.LogRecord]]:
    """`hybridlm.cli.main(argv)` in this process (a child process a case costs seconds of interpreter start):
    (exit status, what it wrote to stderr, the log records at WARNING and above, which a process would have
    written to stderr too). An exception main lets through fails the test, as a traceback would."""
    capsys.readouterr()
    with caplog.at_level(logging.WARNING):
        try:
            rc = cli.main(argv)
        except SystemExit as e:  # argparse's usage errors
            rc = e.code
    return rc, capsys.readouterr().err, [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_and_exit_2(case, model_folder, tmp_path, capsys, caplog):
    argv, names, says = CASES[case]
    folders = {how: _damaged(model_folder, tmp_path, how) for how in ("truncated", "garbage", "no_config",
                                                                      "bad_config")}
    argv = [a.format(**folders) for a in argv]
    rc, err, logged = _cli_in_process(argv, capsys, caplog)
    assert rc == 2, (case, rc, err)
    assert not logged, [r.getMessage() for r in logged]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and names in lines[0] and says in lines[0], (case, err)


def test_verbose_shows_the_traceback():
    r = _cli("-v", "generate", "--model", "/nonexistent/model", "--prompt", "a")
    assert r.returncode != 0 and "Traceback" in r.stderr and "UsageError" in r.stderr
    r = _cli("generate", "--model", "/nonexistent/model", "--prompt", "a", "-v")
    assert "Traceback" in r.stderr


def test_generate_help_shows_every_default():
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction) and not action.required:
            assert "default" in (action.help or ""), f"{action.option_strings}: no default in its help"
    defaults = parser.parse_args(["--model", "m", "--prompt", "p"])
    assert not defaults.greedy and defaults.temperature == 0.8 and defaults.top_p == 0.95
