"""Suite-wide: the CPU interpreter's two long child processes (the GDN and the KDA kernel cases, several minutes
each under TRITON_INTERPRET=1) start in the background as soon as pytest has collected a test that needs them, one
after the other, so that on CI's two cores they run beside the rest of the suite instead of after it. A test
module's `interp_results` fixture waits for its job (`interp_job("gdn")`), or runs it itself when nothing started
it. Each job draws its own fresh seed or takes one derived from the run's, and reports it. A second lane does the
same, beside the first, for the shorter interpreter children of other modules (glue, callers' inputs,
cross-entropy, add-norm, decode), whose fixtures read them through `interp_job` too."""

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
_OPS = HERE / "ops" / "triton"
# job: (its lane, the test file whose fixture reads it, the script and its arguments, the derive_seed name of a seed
# passed as its last argument or None: the script then draws its own), each lane in the order the suite reads them.
# Lane 0 holds the two long jobs; lane 1 the shorter children (tens of seconds each) that the fixtures would
# otherwise run in line.
JOBS = {"gdn": (0, "tests/ops/test_triton_gdn.py", ["interp_gdn.py"], None),
        "kda": (0, "tests/ops/test_triton_kda.py", ["interp_kda.py"], None),
        "glue_layers": (1, "tests/layers/test_fused_glue.py", ["interp_glue.py", "layers"], "glue_layers"),
        "glue_full": (1, "tests/layers/test_fused_glue.py", ["interp_glue.py", "full"], "glue_full"),
        "add_norm": (1, "tests/ops/test_add_rms_norm.py", ["interp_add_norm.py"],
                     "tests/ops/test_add_rms_norm.py::interp"),
        "callers": (1, "tests/ops/test_caller_inputs.py", ["interp_callers.py"], None),
        "ce": (1, "tests/ops/test_linear_ce.py", ["interp_ce.py"], "tests/ops/test_linear_ce.py::interp"),
        "decode": (1, "tests/ops/test_multi_token_decode.py", ["interp_decode.py"],
                   "tests/ops/test_multi_token_decode.py::interp"),
        "glue_ops": (1, "tests/ops/test_triton_glue.py", ["interp_glue.py", "ops"], None)}
TIMEOUT = 1200  # seconds a job may run
_lock = threading.Lock()
_finished: dict[str, threading.Event] = {}  # a job is claimed once its event exists
_results: dict[str, object] = {}  # CompletedProcess, or the exception that stopped the run


def _argv(name: str) -> list[str]:
    _, _, (script, *args), seed_name = JOBS[name]
    return [str(_OPS / script), *args, *([str(derive_seed(seed_name))] if seed_name else [])]


def _run(name: str) -> None:
    """Job `name` under the interpreter with this checkout's hybridlm first on the path (the child's own path starts
    at its script's folder) and HYBRIDLM_INTERP_SEED from the run's seed (for the scripts that read it)."""
    path = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path, HYBRIDLM_INTERP_SEED=str(derive_seed(name)))
    try:
        _results[name] = subprocess.run([sys.executable, *_argv(name)], capture_output=True, text=True, env=env,
                                        timeout=TIMEOUT)
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
    names = _claim([n for n, (_, test_file, _, _) in JOBS.items() if test_file in files])
    for lane in sorted({JOBS[n][0] for n in names}):
        mine = [n for n in names if JOBS[n][0] == lane]
        threading.Thread(target=lambda m=mine: [_run(n) for n in m], daemon=True, name=f"interp-lane{lane}").start()


def interp_result(name: str) -> dict:
    """The job's RESULT line as a dict (waiting for it, or running it here when nothing has)."""
    if _claim([name]):
        _run(name)
    _finished[name].wait()
    r, what = _results[name], " ".join(Path(a).name for a in _argv(name))
    if isinstance(r, Exception):
        raise AssertionError(f"{what}: {type(r).__name__}: {r}")
    assert r.returncode == 0, f"{what}: exit {r.returncode}\n{r.stderr[-4000:]}"
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
