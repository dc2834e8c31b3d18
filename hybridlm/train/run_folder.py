"""The run folder (--out): one run at a time in it, a rerun of the same command continues it, and --fresh keeps the
earlier run aside instead of overwriting it.

Non-standard here:
- The lock is an advisory `fcntl.flock` on OUT/.lock, which holds the holder's pid for the message a second run
  prints. The kernel drops the lock with the process, so a run that was killed leaves nothing that blocks the next.
  Under torchrun rank 0 holds it for the whole job.
- A rerun continues only the run it would have been: the settings that fix the model, the data and its order (the
  checkpoint's hybrid_config.json and train_state.json, or run.json for what an older checkpoint lacks) must be
  the ones of this command. Schedule settings (--max-steps, --lr, ...) may change, as with --resume.
- "The earlier run" is the files a run writes (`RUN_FILES`), not whatever else the folder holds, so that
  `--out .` never moves unrelated files.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from ..files import atomic_write_text, fsync_dir
from ..model.locate import CKPT_DIR, COMPLETE, HYBRID_CONFIG, latest_checkpoint
from .errors import TrainError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; one run per folder is then the user's to keep
    fcntl = None

LOCK = ".lock"
RUN_FILES = (CKPT_DIR, "metrics.jsonl", "run.json", "summary.json", "loss_curve.png", "sample.txt", "profile")
# model settings that change no number a run computes (the recurrences' backward memory): free to differ
FREE_MODEL_FIELDS = ("linear_recompute",)
# settings a continued run must share with the run it continues: key -> how a message names it
SAME_RUN = {
    "seq_len": "--seq-len", "batch_size": "--batch-size", "grad_accum": "--grad-accum", "world": "ranks",
    "seed": "--seed", "tokenizer": "--tokenizer", "data": "--data", "val_fraction": "--val-fraction",
    "train_tokens": "training tokens (the --data files changed)", "val_tokens": "val tokens (the --data files changed)",
}


class RunLock:
    """The advisory lock of a run folder; a no-op when `enabled` is False (ranks other than 0)."""

    def __init__(self, out: str, enabled: bool = True):
        self.path, self.enabled, self.fd = os.path.join(out, LOCK), enabled and fcntl is not None, None

    def __enter__(self) -> RunLock:
        if not self.enabled:
            return self
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise TrainError(f"--out {os.path.dirname(self.path)}: another run is using this folder (pid {holder}, "
                             f"holding {self.path}); wait for it to end, or pass another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def earlier_run_files(out: str) -> list[str]:
    """The names of `RUN_FILES` present in `out`."""
    return [n for n in RUN_FILES if os.path.lexists(os.path.join(out, n))]


def keep_aside(out: str) -> str | None:
    """Move the earlier run's files (`RUN_FILES`) out of `out` into a new sibling folder `OUT.prev-DATE`; returns
    that folder (None when there was nothing to move)."""
    names = earlier_run_files(out)
    if not names:
        return None
    base = f"{os.path.normpath(out)}.prev-{time.strftime('%Y%m%d-%H%M%S')}"
    dest, n = base, 1
    while os.path.lexists(dest):
        n += 1
        dest = f"{base}-{n}"
    os.makedirs(dest)
    for name in names:
        os.rename(os.path.join(out, name), os.path.join(dest, name))
    fsync_dir(out)
    fsync_dir(dest)
    return dest


def _read_json(path: str) -> dict:
    with contextlib.suppress(OSError, ValueError):
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
        return value if isinstance(value, dict) else {}
    return {}


def saved_settings(checkpoint: str, out: str) -> tuple[dict, dict]:
    """(the `SAME_RUN` settings, the model config dict) a checkpoint was trained with. A checkpoint written before
    train_state.json held the data settings gets them from the run's run.json."""
    run_args = _read_json(os.path.join(out, "run.json")).get("args", {})
    settings = {}
    if run_args.get("val_fraction") is not None:
        settings["val_fraction"] = run_args["val_fraction"]
    if "data" in run_args:
        settings["data"] = absolute_data(run_args["data"])
    ts = _read_json(os.path.join(checkpoint, COMPLETE))
    settings.update({k: ts[k] for k in SAME_RUN if k in ts})
    return settings, _read_json(os.path.join(checkpoint, HYBRID_CONFIG))


def absolute_data(paths: list[str] | None) -> list[str] | None:
    """--data as absolute paths (None: the bundled corpus), so that the same files compare equal from any folder."""
    return None if paths is None else [os.path.abspath(p) for p in paths]


def _show(value) -> str:
    text = " ".join(map(str, value)) if isinstance(value, list) else str(value)
    return text if len(text) <= 60 else "..." + text[-57:]  # a path's end names the file


def differences(saved: dict, saved_model: dict, current: dict, current_model: dict) -> list[str]:
    """What differs between a saved run and this one, as 'name saved -> now' (only what the saved run recorded)."""
    out = [f"{SAME_RUN[k]} {_show(saved[k])} -> {_show(current[k])}"
           for k in SAME_RUN if k in saved and k in current and saved[k] != current[k]]
    for k in sorted(set(saved_model) | set(current_model)):
        if k not in FREE_MODEL_FIELDS and saved_model.get(k) != current_model.get(k):
            out.append(f"model {k} {_show(saved_model.get(k))} -> {_show(current_model.get(k))}")
    return out


def find_continuation(out: str, current: dict, current_model: dict) -> str | None:
    """The checkpoint a rerun into `out` continues from (None: `out` holds none); refuses, naming what differs, a
    run whose model or data settings are not this command's."""
    latest = latest_checkpoint(os.path.join(out, CKPT_DIR))
    if latest is None:
        return None
    saved, saved_model = saved_settings(latest, out)
    diff = differences(saved, saved_model, current, current_model)
    if diff:
        raise TrainError(f"--out {out} holds a run with other settings ({'; '.join(diff)}); rerun with that run's "
                         "settings to continue it, or pass --fresh to start over (the earlier run is kept aside)")
    return latest


class MetricsLog:
    """metrics.jsonl: one JSON object per line; on resume, records past the resumed step are dropped, so that a
    continued run records each step once."""

    def __init__(self, path: str, enabled: bool, resume_step: int | None):
        self.path, self.enabled = path, enabled
        self.records: list[dict] = []
        if enabled and resume_step is not None and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    with contextlib.suppress(json.JSONDecodeError):
                        r = json.loads(line)
                        if r.get("step", 0) <= resume_step:
                            self.records.append(r)
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in self.records))
        elif enabled:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            open(path, "w").close()

    def add(self, **rec) -> None:
        if not self.enabled:
            return
        self.records.append(rec)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
