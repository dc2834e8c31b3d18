"""`hybridlm train --config X.json` runs two steps of a tiny hybrid whose attention layers are PaTH (with the
forget gate) or DeltaFormer, between Gated DeltaNet layers, and writes its checkpoint and metrics."""

from __future__ import annotations

import json
import math

import pytest

from hybridlm.cli import main as cli_main
from hybridlm.model.presets import get_preset


@pytest.mark.parametrize("kind", ["path", "deltaformer"])
def test_two_training_steps(kind, tmp_path, small_corpus):
    cfg = get_preset("test-micro")
    d = cfg.to_dict()
    d.update(attention_kind=kind, path_forget_gate=kind == "path", hf_model_type=None,  # no HF model has these
             layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    out = tmp_path / "run"
    rc = cli_main(["train", "--config", str(path), "--data", small_corpus, "--out", str(out), "--max-steps", "2",
                   "--seq-len", "64", "--batch-size", "2", "--no-progress", "--threads", "1", "--eval-tokens", "256",
                   "--sample-tokens", "0", "--val-fraction", "0.05"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) >= 2 and all(math.isfinite(x) for x in losses), rows
    assert (out / "checkpoints").is_dir()
