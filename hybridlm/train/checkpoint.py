"""Atomic training checkpoints: weights (safetensors) + config + optimizer + data position + RNG.

Layout under `OUT/checkpoints/`:
    step_000200/             a complete checkpoint (a loader only ever sees complete ones)
        config.json +        when the config has an hf_model_type: a `HybridLM.from_pretrained` folder
        model.safetensors    (transformers' layout, float32 as trained); otherwise model.safetensors is the
                             plain state dict and there is no config.json
        hybrid_config.json   HybridConfig.to_json (what resume rebuilds the model from)
        optimizer.pt         optimizer.state_dict() (torch.save; loads with weights_only=True)
        rng.pt               torch / cuda / python RNG states
        train_state.json     step, micro-batch index (the data position), tokens seen, best val, run settings
    latest                   text file naming the newest complete checkpoint (replaced atomically)

The layout's names and what counts as complete are defined in `hybridlm.model.locate` (generation reads runs too).

Atomicity: everything is written into `.tmp-step_000200-<pid>/`, each file fsync'd, then the folder is renamed to
its final name (one rename) and `latest` is replaced (hybridlm.files.atomic_write_text: a temp file, fsync,
os.replace). A crash at any point leaves either the previous checkpoints untouched or the new one complete; stray
`.tmp-*` folders are ignored by loaders and removed by the next save. Saving a step that exists already (after a
resume) moves the old folder aside to `.old-step_000200-<id>` before the new one takes the name: loaders count the
aside copy as the step while the name is empty, and the next save moves it back (`recover`), so a crash at any
point of a re-save leaves a complete copy of the step.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from collections.abc import Callable

import torch
from safetensors.torch import load_file, save_file

from hybridlm.files import atomic_write_text, fsync_dir, fsync_file
from hybridlm.model.locate import (
    ASIDE_RE,
    CKPT_DIR,
    COMPLETE,
    HYBRID_CONFIG,
    LATEST,
    complete_checkpoints,
    is_complete,
    latest_checkpoint,
    step_name,
)

from .errors import TrainError


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(_py_state_to_list(random.getstate()))}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _py_state_to_list(s):
    version, internal, gauss = s
    return [version, list(internal), gauss]


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def plain_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as contiguous CPU tensors, shared (tied) tensors stored once under their first name."""
    out, seen = {}, {}
    for k, v in model.state_dict().items():
        key = (v.data_ptr(), v.shape, v.stride()) if v.numel() else None
        if key is not None and key in seen:
            continue  # tied weight: load_state_dict(strict=False) restores it through the first name
        if key is not None:
            seen[key] = k
        out[k] = v.detach().to("cpu").contiguous().clone()
    return out


def recover(root: str) -> None:
    """Tidy a checkpoints folder after a crash: remove `.tmp-*` folders (unfinished saves); move a complete copy
    set aside by an interrupted re-save back to its name when the name is empty, else remove it."""
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        m = ASIDE_RE.match(name)
        if m:
            final = os.path.join(root, step_name(int(m.group(1))))
            if not os.path.exists(final) and is_complete(path):
                os.rename(path, final)
                fsync_dir(root)
            else:
                shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(".tmp-") or name.startswith(".old-"):
            shutil.rmtree(path, ignore_errors=True)


def begin_checkpoint(out_dir: str, step: int, tag: str | None = None) -> str:
    """Create the temp folder of checkpoint `step` (tidying up after crashed saves first); returns its path."""
    root = os.path.join(out_dir, CKPT_DIR)
    os.makedirs(root, exist_ok=True)
    recover(root)
    tmp = os.path.join(root, f".tmp-{step_name(step)}-{tag or (str(os.getpid()) + '-' + uuid.uuid4().hex[:8])}")
    os.makedirs(tmp, exist_ok=True)
    return tmp


def write_checkpoint_files(tmp: str, step: int, *, model_state: dict[str, torch.Tensor] | None, config_json: str,
                           optimizer_state: dict | None, train_state: dict, rng: dict | None = None,
                           export: Callable[[str], None] | None = None, tokenizer=None) -> None:
    """Write the parts into the temp folder, each fsync'd (model/optimizer may be None when DCP holds them).

    `export(folder)`, when given, writes the weights as a `HybridLM.from_pretrained` folder (config.json +
    safetensors in transformers' layout) instead of the plain state dict. `tokenizer` (the run's) is saved beside
    the weights as files `transformers.AutoTokenizer` loads (`model.tokenizer.save_tokenizer_files`)."""
    files = {HYBRID_CONFIG: lambda p: _write_text(p, config_json)}
    if export is not None:
        export(tmp)
    elif model_state is not None:
        files["model.safetensors"] = lambda p: save_file(model_state, p, metadata={"format": "pt", "step": str(step)})
    if optimizer_state is not None:
        files["optimizer.pt"] = lambda p: torch.save(optimizer_state, p)
    files["rng.pt"] = lambda p: torch.save(rng if rng is not None else rng_state(), p)
    for name, write in files.items():
        write(os.path.join(tmp, name))
    if tokenizer is not None:
        from hybridlm.model.tokenizer import save_tokenizer_files

        save_tokenizer_files(tokenizer, tmp)
    for root, _, names in os.walk(tmp):
        for name in names:
            fsync_file(os.path.join(root, name))
    # train_state.json last: a folder holding it is complete
    with open(os.path.join(tmp, COMPLETE), "w", encoding="utf-8") as f:
        json.dump(train_state, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def commit_checkpoint(out_dir: str, step: int, tmp: str, keep: int = 3) -> str:
    """Rename the complete temp folder into place, point `latest` at it, prune old ones. Returns its path."""
    root = os.path.join(out_dir, CKPT_DIR)
    final = os.path.join(root, step_name(step))
    if os.path.exists(final):  # the same step saved again (e.g. after a resume): swap, then drop the old one
        old = os.path.join(root, f".old-{step_name(step)}-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)  # from here until the next rename, loaders take `old` as this step
        fsync_dir(root)
        os.rename(tmp, final)
        fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(root)
    atomic_write_text(os.path.join(root, LATEST), step_name(step) + "\n")
    if keep > 0:
        for s in list_checkpoints(out_dir)[:-keep]:
            shutil.rmtree(s, ignore_errors=True)
    return final


def save_checkpoint(out_dir: str, step: int, *, model_state: dict[str, torch.Tensor], config_json: str,
                    optimizer_state: dict, train_state: dict, rng: dict | None = None, keep: int = 3) -> str:
    """Single-process save of checkpoint `step`, atomically; keeps the newest `keep` (0: all). Returns its path."""
    tmp = begin_checkpoint(out_dir, step)
    write_checkpoint_files(tmp, step, model_state=model_state, config_json=config_json,
                           optimizer_state=optimizer_state, train_state=train_state, rng=rng)
    return commit_checkpoint(out_dir, step, tmp, keep)


def list_checkpoints(out_dir: str) -> list[str]:
    """Complete checkpoints under OUT/checkpoints, oldest first (hybridlm.model.locate.complete_checkpoints)."""
    return [p for _, p in complete_checkpoints(os.path.join(out_dir, CKPT_DIR))]


def resolve_resume(path: str) -> str:
    """A checkpoint folder from `--resume PATH`: a checkpoint itself, or a run folder (its `latest`)."""
    if is_complete(path):
        return path
    found = latest_checkpoint(os.path.join(path, CKPT_DIR))
    if found is not None:
        return found
    raise TrainError(f"--resume: no checkpoint in {path} (expected {path}/{CKPT_DIR}/step_NNNNNN or a checkpoint "
                     "folder with train_state.json); start without --resume")


def load_checkpoint(path: str, map_location="cpu") -> dict:
    """Read every part of a checkpoint (raises if any is missing or corrupt)."""
    try:
        with open(os.path.join(path, COMPLETE), encoding="utf-8") as f:
            state = json.load(f)
        with open(os.path.join(path, HYBRID_CONFIG), encoding="utf-8") as f:
            config_json = f.read()
        if os.path.exists(os.path.join(path, "config.json")):  # a from_pretrained folder (transformers layout)
            from hybridlm.model.hybrid import HybridLM

            model_state = {k: v.to(map_location) for k, v in HybridLM.from_pretrained(path).state_dict().items()}
        else:
            model_state = load_file(os.path.join(path, "model.safetensors"), device=str(map_location))
        opt_path = os.path.join(path, "optimizer.pt")
        optimizer_state = (torch.load(opt_path, map_location=map_location, weights_only=True)
                           if os.path.exists(opt_path) else None)  # None: sharded, in dcp/
        rng = torch.load(os.path.join(path, "rng.pt"), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read means this checkpoint is unusable
        raise TrainError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); resume from an earlier one "
                         f"(ls {os.path.dirname(path)})") from e
    return {"train_state": state, "config_json": config_json, "model": model_state,
            "optimizer": optimizer_state, "rng": rng, "path": path}
