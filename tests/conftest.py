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

HERE = Path(__file__).parent
if os.environ.get("TRITON_INTERPRET") == "1":  # kernels run in this process too: the interpreter's fixes first
    sys.path.insert(0, str(HERE / "ops" / "triton"))
    from interp_patches import patch_interpreter

    patch_interpreter()
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
