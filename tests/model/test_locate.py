"""What a model argument resolves to: run folders, checkpoints folders, model folders, presets and Hub ids (from a
cache laid out as huggingface_hub lays it out, offline), and from_pretrained on each."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from hybridlm import HybridLM
from hybridlm.model.locate import UsageError, locate, resolve_folder
from hybridlm.model.presets import PRESETS, get_preset


def _tiny(seed: int) -> HybridLM:
    torch.manual_seed(seed)
    return HybridLM(get_preset("tiny")).eval()


def _checkpoint(root, step: int, model: HybridLM | None, complete: bool = True) -> str:
    """A training checkpoint folder as the trainer leaves it: from_pretrained files, then train_state.json last."""
    folder = os.path.join(root, f"step_{step:06d}")
    os.makedirs(folder)
    if model is not None:
        model.save_pretrained(folder)
    if complete:
        with open(os.path.join(folder, "train_state.json"), "w") as f:
            json.dump({"step": step}, f)
    return folder


def _logits(model: HybridLM) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(1, 9)[None]).logits


def test_run_folder_and_checkpoints_folder_give_the_latest_complete(tmp_path, caplog):
    """`latest` names step 3, which is incomplete (no train_state.json): both the run folder and its checkpoints
    folder resolve to step 2, the newest complete one, and from_pretrained loads its weights and says so."""
    run = tmp_path / "run"
    root = run / "checkpoints"
    root.mkdir(parents=True)
    _checkpoint(root, 1, _tiny(1))
    two = _checkpoint(root, 2, _tiny(2))
    _checkpoint(root, 3, _tiny(3), complete=False)
    (root / "latest").write_text("step_000003\n")
    for target in (run, root):
        found = locate(str(target))
        assert found.folder == two and two in found.note
    assert locate(two).folder == two and locate(two).note is None
    with caplog.at_level("INFO", logger="hybridlm.model"):
        loaded = HybridLM.from_pretrained(str(run))
    assert two in caplog.text
    assert torch.equal(_logits(loaded), _logits(_tiny(2)))


def test_a_step_moved_aside_by_an_interrupted_resave_still_counts(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    _checkpoint(root, 1, _tiny(1))
    aside = _checkpoint(root, 2, _tiny(2))
    os.rename(aside, root / ".old-step_000002-0badc0de")
    assert resolve_folder(str(tmp_path)) == str(root / ".old-step_000002-0badc0de")


def test_presets_files_and_what_is_not_a_model(tmp_path):
    assert locate("tiny", PRESETS).preset == "tiny"
    (tmp_path / "c.json").write_text("{}")
    assert locate(str(tmp_path / "c.json")).file == str(tmp_path / "c.json")
    with pytest.raises(UsageError, match="no such file or folder, and not a preset"):
        locate(str(tmp_path / "nothing"), PRESETS)
    with pytest.raises(UsageError, match="presets: .*tiny"):
        locate("no-such-preset", PRESETS)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no config.json, no hybridlm_config.json and no checkpoints/"):
        locate(str(tmp_path / "empty"))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(UsageError, match="no complete checkpoint"):
        locate(str(tmp_path / "run"))
    with pytest.raises(UsageError, match="a file, not a folder"):
        resolve_folder(str(tmp_path / "c.json"))


def _hub_cache(cache, repo_id: str, model: HybridLM, tmp_path) -> str:
    """`repo_id` in a Hub cache as huggingface_hub writes one: blobs named by content hash, a snapshot folder per
    revision of links to them, refs/main naming the revision."""
    src = tmp_path / "src"
    model.save_pretrained(str(src))
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    rev = hashlib.sha1(repo_id.encode()).hexdigest()
    snap = repo / "snapshots" / rev
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for name in os.listdir(src):
        data = (src / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return str(snap)


_HUB_CHILD = """
import sys, torch
from hybridlm import HybridLM
m = HybridLM.from_pretrained(sys.argv[1])
with torch.no_grad():
    torch.save(m(torch.arange(1, 9)[None]).logits, sys.argv[2])
"""


def test_hub_id_from_the_cache_offline(tmp_path):
    """With HF_HUB_OFFLINE=1 and HF_HUB_CACHE pointing at a cache holding `someorg/tiny-hybrid`: from_pretrained,
    `info` and `generate` read it from there; an id the cache lacks is a one-line error naming it."""
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    model = _tiny(4)
    _hub_cache(cache, "someorg/tiny-hybrid", model, tmp_path)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path / "hf_home"),
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    run = lambda *argv: subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env,  # noqa
                                       timeout=300)
    r = run("-c", _HUB_CHILD, "someorg/tiny-hybrid", str(tmp_path / "logits.pt"))
    assert r.returncode == 0, r.stderr
    assert torch.equal(torch.load(tmp_path / "logits.pt"), _logits(model))
    r = run("-m", "hybridlm.cli", "info", "someorg/tiny-hybrid")
    assert r.returncode == 0 and "qwen3_5_text" in r.stdout, r.stderr
    r = run("-m", "hybridlm.cli", "generate", "--model", "someorg/tiny-hybrid", "--prompt", "ab",
            "--max-new-tokens", "3", "--greedy")
    assert r.returncode == 0 and r.stdout.startswith("ab"), r.stderr
    assert "someorg/tiny-hybrid from the Hugging Face cache" in r.stderr
    r = run("-m", "hybridlm.cli", "generate", "--model", "someorg/not-cached", "--prompt", "ab")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "--model someorg/not-cached" in r.stderr, r.stderr
    assert "HF_HUB_OFFLINE" in r.stderr
