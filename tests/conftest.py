"""Suite-wide: the CPU interpreter's two long child processes (the GDN and the KDA kernel cases, several minutes
each under TRITON_INTERPRET=1) start in the background as soon as pytest has collected a test that needs them, one
after the other, so that on CI's two cores they run beside the rest of the suite instead of after it. A test
module's `interp_results` fixture waits for its job (`interp_job("gdn")`), or runs it itself when nothing started
it. Each job draws its own fresh seed and prints it, as when the fixture ran it. A second lane (`LANE2`) does the
same for the shorter interpreter children of other modules (glue, callers' inputs, cross-entropy, add-norm, decode),
whose fixtures read them through `lane2`; their seeds derive from the run's."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

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


# A second lane: shorter interpreter children that module fixtures would otherwise run in line (tens of seconds
# each), started one after the other at collection beside the first lane, so that the two cores stay busy while the
# rest of the suite runs. name: (the test file whose fixture reads it, script argv after the interpreter). Each
# child draws its own fresh seed (or gets one from the run's seed) and reports it in its RESULT line.
_OPS = HERE / "ops" / "triton"
# name: (the test file whose fixture reads it, the script and its arguments, the derive_seed name of the seed
# passed as its last argument or None), in the order the suite reads them
LANE2 = {"glue_layers": ("tests/layers/test_fused_glue.py", ["interp_glue.py", "layers"], "glue_layers"),
         "glue_full": ("tests/layers/test_fused_glue.py", ["interp_glue.py", "full"], "glue_full"),
         "add_norm": ("tests/ops/test_add_rms_norm.py", ["interp_add_norm.py"],
                      "tests/ops/test_add_rms_norm.py::interp"),
         "callers": ("tests/ops/test_caller_inputs.py", ["interp_callers.py"], None),
         "ce": ("tests/ops/test_linear_ce.py", ["interp_ce.py"], "tests/ops/test_linear_ce.py::interp"),
         "decode": ("tests/ops/test_multi_token_decode.py", ["interp_decode.py"],
                    "tests/ops/test_multi_token_decode.py::interp"),
         "glue_ops": ("tests/ops/test_triton_glue.py", ["interp_glue.py", "ops"], None)}
_lane2: dict[str, threading.Event] = {}
_lane2_out: dict[str, object] = {}


def _lane2_env(name: str) -> dict:
    """The child's environment: the interpreter on, this checkout's hybridlm first, a seed from the run's."""
    path = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path, HYBRIDLM_INTERP_SEED=str(derive_seed(name)))


def _lane2_argv(name: str) -> list[str]:
    _, (script, *args), seed_name = LANE2[name]
    return [str(_OPS / script), *args, *([str(derive_seed(seed_name))] if seed_name else [])]


def _lane2_run(names: list[str]) -> None:
    for n in names:
        try:
            _lane2_out[n] = subprocess.run([sys.executable, *_lane2_argv(n)], capture_output=True, text=True,
                                           env=_lane2_env(n), timeout=900)
        except Exception as e:  # noqa: BLE001 (reported by the fixture that reads it)
            _lane2_out[n] = e
        _lane2[n].set()


def lane2_result(name: str) -> subprocess.CompletedProcess:
    """The finished child `name` of the second lane (waiting for it, or running it here when nothing started it)."""
    with _lock:
        started = name in _lane2
        if not started:
            _lane2[name] = threading.Event()
    if not started:
        _lane2_run([name])
    _lane2[name].wait()
    r = _lane2_out[name]
    if isinstance(r, Exception):
        raise AssertionError(f"{' '.join(_lane2_argv(name))}: {type(r).__name__}: {r}")
    return r


@pytest.fixture(scope="session")
def lane2():
    return lane2_result


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only jobs that a selected test reads
def pytest_collection_modifyitems(session, config, items):
    files = {item.nodeid.split("::")[0] for item in items}
    names = _claim([n for n, (_, test_file, _) in JOBS.items() if test_file in files])
    if names:
        threading.Thread(target=lambda: [_run(n) for n in names], daemon=True, name="interp-jobs").start()
    with _lock:
        lane = [n for n, (test_file, *_) in LANE2.items() if test_file in files and n not in _lane2]
        for n in lane:
            _lane2[n] = threading.Event()
    if lane:
        threading.Thread(target=_lane2_run, args=(lane,), daemon=True, name="interp-lane2").start()


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


# The run draws one fresh seed (HYBRIDLM_TEST_SEED=N replays it) and prints it in the header, at the end (which
# -q shows too) and with any failure. Each test's torch RNG starts from a seed derived from it and the test's id, as
# do models that a module builds once and shares (`derive_seed`), so that one number replays any test alone. The RNG
# and the process-wide flags a test may set are put back after it, so that no test depends on another's leftovers.
SEED_ENV = "HYBRIDLM_TEST_SEED"
RUN_SEED = int(os.environ.get(SEED_ENV) or int.from_bytes(os.urandom(4), "little") % 2**31)


def derive_seed(name: str) -> int:
    """A seed in [0, 2**31) for `name`, fixed by the run's seed."""
    return int.from_bytes(hashlib.sha256(f"{RUN_SEED}:{name}".encode()).digest()[:4], "little") % 2**31


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
    """This test's seed: torch's global RNG starts from it (seed explicit generators from it too)."""
    value = derive_seed(request.node.nodeid)
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


@pytest.fixture(scope="session", name="derive_seed")
def derive_seed_fixture():
    return derive_seed


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        note = f"run seed {RUN_SEED} (replay: {SEED_ENV}={RUN_SEED} python -m pytest '{item.nodeid}')"
        if hasattr(report.longrepr, "addsection"):
            report.longrepr.addsection("seed", note)
        else:
            report.sections.append(("seed", note))
    return report


def pytest_report_header(config):
    return f"run seed {RUN_SEED} ({SEED_ENV}={RUN_SEED} replays it)"


def pytest_terminal_summary(terminalreporter):
    """The seed again at the end, where `-q` (which hides the header) still shows it."""
    terminalreporter.write_line(f"run seed {RUN_SEED} ({SEED_ENV}={RUN_SEED} replays it)")
