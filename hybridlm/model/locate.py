"""Where a model comes from: a user's model argument (a folder, a file, a preset name or a Hub id) to something
loadable, and the layout of a training run's checkpoints.

Non-standard here:
- The training run layout (`OUT/checkpoints/step_NNNNNN/`, the `latest` pointer, `train_state.json` written last
  so that a folder holding it is complete) is defined at the model level, not in `hybridlm.train`: generation and
  `from_pretrained` read training runs, and the model layer may not import the trainer. The trainer imports it.
- A re-save of a step moves the old folder aside (`.old-step_NNNNNN-<id>`) just before the new one takes its
  name; a crash between those two renames leaves only the aside copy, which counts as that step here (and the
  trainer's next save puts it back).
- A name that is no local path, no preset and looks like `org/name` is a Hugging Face Hub repository, fetched
  through the optional `huggingface_hub`, which keeps its own cache and honours `HF_HUB_OFFLINE`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger("hybridlm.model")

CKPT_DIR = "checkpoints"  # OUT/checkpoints/ of a training run
LATEST = "latest"  # OUT/checkpoints/latest: a text file naming the newest complete checkpoint
COMPLETE = "train_state.json"  # written last into a checkpoint: its presence means the folder is complete
HYBRID_CONFIG = "hybrid_config.json"  # HybridConfig of a training checkpoint
HF_CONFIG = "config.json"
NATIVE_CONFIG = "hybridlm_config.json"  # HybridLM.save_pretrained for configs transformers has no class for
STEP_RE = re.compile(r"^step_(\d+)$")
ASIDE_RE = re.compile(r"^\.old-step_(\d+)-[0-9a-f]+$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
HUB_WEIGHTS = ["*.json", "*.safetensors", "tokenizer*"]  # what loading a Hub model fetches (no .bin, no images)


class UsageError(ValueError):
    """An argument that cannot be used as given (here: a model argument that names nothing loadable); the message
    names it and says what to give instead. The `hybridlm` command line prints it as one line and exits with 2."""


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def is_complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, COMPLETE))


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, folder) of the complete checkpoints in a checkpoints folder, oldest first: `step_N` when complete,
    else a complete copy moved aside by an interrupted re-save of step N."""
    if not os.path.isdir(root):
        return []
    found: dict[int, str] = {}
    aside: dict[int, str] = {}
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        m = STEP_RE.match(name)
        if m and is_complete(path):
            found[int(m.group(1))] = path
        m = ASIDE_RE.match(name)
        if m and is_complete(path):
            aside.setdefault(int(m.group(1)), path)
    for step, path in aside.items():
        if step not in found and not os.path.exists(os.path.join(root, step_name(step))):
            found[step] = path
    return sorted(found.items())


def latest_checkpoint(root: str) -> str | None:
    """The checkpoint `root/latest` names when it is complete, else the newest complete one (None: none)."""
    latest = os.path.join(root, LATEST)
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8") as f:
            cand = os.path.join(root, f.read().strip())
        if is_complete(cand):
            return cand
    ckpts = complete_checkpoints(root)
    return ckpts[-1][1] if ckpts else None


def _is_model_folder(path: str) -> bool:
    has = lambda name: os.path.isfile(os.path.join(path, name))  # noqa: E731
    return has(HF_CONFIG) or has(NATIVE_CONFIG) or (has(HYBRID_CONFIG) and has("model.safetensors"))


def _checkpoints_root(path: str) -> str | None:
    """The checkpoints folder of a run folder, or the folder itself when it is one."""
    if os.path.isdir(os.path.join(path, CKPT_DIR)):
        return os.path.join(path, CKPT_DIR)
    names = os.listdir(path)
    if LATEST in names or any(STEP_RE.match(n) or ASIDE_RE.match(n) for n in names):
        return path
    return None


@dataclass
class Located:
    """What a model argument names: exactly one of `folder` (loadable weights + config), `file` (a config JSON)
    or `preset`; `note` says how a folder was found when it is not the argument itself."""

    folder: str | None = None
    file: str | None = None
    preset: str | None = None
    note: str | None = None


def locate(target: str, presets: Iterable[str] = (), hub_files: list[str] | None = None) -> Located:
    """A model argument -> Located. `presets`: the preset names that count; `hub_files`: the patterns to fetch for
    a Hub id (default: config, weights, tokenizer). Raises UsageError saying what to give instead."""
    target, presets = os.fspath(target), list(presets)
    if os.path.isfile(target):
        return Located(file=target)
    if os.path.isdir(target):
        return _locate_folder(target)
    if target in presets:
        return Located(preset=target)
    if _HUB_ID.match(target) and not os.path.exists(target.split("/")[0]):
        folder = hub_snapshot(target, hub_files or HUB_WEIGHTS)
        return Located(folder=folder, note=f"{target} from the Hugging Face cache: {folder}")
    known = f"a preset (presets: {', '.join(sorted(presets))}), " if presets else ""
    raise UsageError(f"{target}: no such file or folder, and not a preset or a Hub id (org/name); give a "
                     f"training run folder, a checkpoint folder, a Hugging Face folder, {known}or a Hub id such "
                     "as Qwen/Qwen3-Next-80B-A3B-Instruct")


def _locate_folder(path: str) -> Located:
    if _is_model_folder(path):
        return Located(folder=path)
    root = _checkpoints_root(path)
    if root is None:
        raise UsageError(f"{path}: a folder with no {HF_CONFIG}, no {NATIVE_CONFIG} and no {CKPT_DIR}/; "
                                 "give a training run folder (hybridlm train --out), a checkpoint folder or a Hugging "
                                 "Face folder")
    ckpt = latest_checkpoint(root)
    if ckpt is None:
        raise UsageError(f"{path}: no complete checkpoint in {root} (a run saves its first one at "
                                 "--save-every steps or at its end); wait for it, or give another folder")
    if not _is_model_folder(ckpt):
        raise UsageError(f"{ckpt}: a checkpoint without weights of its own (a sharded run's dcp/ only); "
                                 "give a checkpoint written by a single-process run or by save_pretrained")
    return Located(folder=ckpt, note=f"the latest complete checkpoint of {path}: {ckpt}")


def resolve_folder(target: str) -> str:
    """A folder to load weights from (for `from_pretrained`): a model folder as it is, the latest complete
    checkpoint of a run or checkpoints folder (logged), or a Hub snapshot."""
    found = locate(target)
    if found.folder is None:
        raise UsageError(f"{target}: a file, not a folder; give the folder that holds {HF_CONFIG} and the "
                                 "weights")
    if found.note:
        log.info("loading %s", found.note)
    return found.folder


def hub_snapshot(repo_id: str, patterns: list[str]) -> str:
    """The local folder of a Hub repository's files matching `patterns`, through huggingface_hub's cache
    (downloaded when missing, unless HF_HUB_OFFLINE is set)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError as e:
        raise UsageError(f"{repo_id}: not a local path; to load it from the Hugging Face Hub install "
                                 "huggingface_hub (pip install huggingface_hub), or give a local folder") from e
    try:
        return snapshot_download(repo_id, allow_patterns=patterns)
    except RepositoryNotFoundError as e:
        raise UsageError(f"{repo_id}: no such local folder, and no such repository on the Hugging Face Hub "
                                 "(or a private one: log in with `hf auth login`); check the name") from e
    except LocalEntryNotFoundError as e:
        raise UsageError(f"{repo_id}: no such local folder, and not in the Hugging Face cache while offline "
                                 "(HF_HUB_OFFLINE is set or the Hub is unreachable); check the path, or download "
                                 "the repository once online") from e
    except Exception as e:  # noqa: BLE001 - network and HTTP errors of huggingface_hub's own types
        raise UsageError(f"{repo_id}: download from the Hugging Face Hub failed ({e}); retry, or give a "
                                 "local folder") from e
