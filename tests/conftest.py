"""Suite-wide: the CPU interpreter's two long child processes (the GDN and the KDA kernel cases, several minutes
each under TRITON_INTERPRET=1) start in the background as soon as pytest has collected a test that needs them, one
after the other, so that on CI's two cores they run beside the rest of the suite instead of after it. A test
module's `interp_results` fixture waits for its job (`interp_job("gdn")`), or runs it itself when nothing started
it. Each job draws its own fresh seed and prints it, as when the fixture ran it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
# job: (its script, the test file whose tests read it, timeout in seconds), in the order the suite reads them
JOBS = {"gdn": (HERE / "ops" / "triton" / "interp_gdn.py", "tests/ops/test_triton_gdn.py", 1200),
        "kda": (HERE / "ops" / "triton" / "interp_kda.py", "tests/ops/test_triton_kda.py", 1200)}
_lock = threading.Lock()
_finished: dict[str, threading.Event] = {}  # a job is claimed once its event exists
_results: dict[str, object] = {}  # CompletedProcess, or the exception that stopped the run


def _run(name: str) -> None:
    script, _, timeout = JOBS[name]
    env = dict(os.environ, TRITON_INTERPRET="1")
    try:
        _results[name] = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                                        timeout=timeout)
    except Exception as e:  # noqa: BLE001 (reported by the fixture that reads the job)
        _results[name] = e
    _finished[name].set()


def _claim(names: list[str]) -> list[str]:
    with _lock:
        new = [n for n in names if n not in _finished]
        for n in new:
            _finished[n] = threading.Event()
        return new


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only jobs that a selected test reads
def pytest_collection_modifyitems(session, config, items):
    files = {item.nodeid.split("::")[0] for item in items}
    names = _claim([n for n, (_, test_file, _) in JOBS.items() if test_file in files])
    if names:
        threading.Thread(target=lambda: [_run(n) for n in names], daemon=True, name="interp-jobs").start()


def interp_result(name: str) -> dict:
    """The job's RESULT line as a dict (waiting for it, or running it here when nothing has)."""
    if _claim([name]):
        _run(name)
    _finished[name].wait()
    r = _results[name]
    if isinstance(r, Exception):
        raise AssertionError(f"{JOBS[name][0].name}: {type(r).__name__}: {r}")
    assert r.returncode == 0, f"{JOBS[name][0].name}: exit {r.returncode}\n{r.stderr[-4000:]}"
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="session")
def interp_job():
    return interp_result


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true",
                     help="also run the tests marked slow (long CPU runs guarding no default path; skipped otherwise)")


def pytest_runtest_setup(item):
    if item.get_closest_marker("slow") and not item.config.getoption("--runslow"):
        pytest.skip("slow: run with --runslow")


# Every test runs on a fresh seed of torch's global RNG (HYBRIDLM_TEST_SEED=N replays one), printed with any failure;
# the RNG and the process-wide flags a test may set are put back afterwards, so no test depends on another's leftovers.
SEED_ENV = "HYBRIDLM_TEST_SEED"


def _flag(obj, name):
    return (lambda: getattr(obj, name)), (lambda v: setattr(obj, name, v))


_GLOBAL_STATE = {
    "default dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "cuda.matmul.allow_tf32": _flag(torch.backends.cuda.matmul, "allow_tf32"),
    "cudnn.allow_tf32": _flag(torch.backends.cudnn, "allow_tf32"),
    "float32 matmul precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "deterministic algorithms": (torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms),
    "grad mode": (torch.is_grad_enabled, torch.set_grad_enabled),
    "CPU threads": (torch.get_num_threads, torch.set_num_threads),
}


@pytest.fixture(autouse=True)
def seed(request) -> int:
    """This test's seed: torch's global RNG starts from it (draw explicit generators from it too)."""
    value = int(os.environ.get(SEED_ENV) or int.from_bytes(os.urandom(4), "little") % 2**31)
    request.node.stash[_SEED_KEY] = value
    saved = {name: get() for name, (get, _) in _GLOBAL_STATE.items()}
    env = dict(os.environ)
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else []):
        torch.manual_seed(value)
        yield value
    for name, (get, put) in _GLOBAL_STATE.items():
        if get() != saved[name]:
            put(saved[name])
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)


_SEED_KEY = pytest.StashKey[int]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and _SEED_KEY in item.stash:
        value = item.stash[_SEED_KEY]
        note = f"seed {value} (replay: {SEED_ENV}={value} python -m pytest '{item.nodeid}')"
        if hasattr(report.longrepr, "addsection"):
            report.longrepr.addsection("seed", note)
        else:
            report.sections.append(("seed", note))
    return report
