"""`hybridlm train --config` for two steps on a tiny hybrid whose linear layers are MesaNet (between attention
layers), in-process through the CLI's main: the run finishes, logs finite losses and writes its checkpoint."""

from __future__ import annotations

import dataclasses
import json
import math

from hybridlm.cli import main as cli_main
from hybridlm.model.presets import get_preset


def test_two_training_steps_of_a_mesa_hybrid(tmp_path, small_corpus):
    base = get_preset("test-micro")
    # no transformers architecture has MesaNet: checkpoints are written in the native format (hf_model_type None)
    cfg = dataclasses.replace(base, linear_kind="mesa", linear_num_key_heads=base.linear_num_value_heads,
                              hf_model_type=None)
    assert set(cfg.layer_types) == {"linear_attention", "full_attention"}
    path = tmp_path / "mesa.json"
    cfg.to_json(str(path))
    out = tmp_path / "run"
    rc = cli_main(["train", "--preset", "test-micro", "--config", str(path), "--data", small_corpus, "--out", str(out),
                   "--max-steps", "2", "--seq-len", "64", "--batch-size", "2", "--no-progress", "--threads", "1",
                   "--eval-tokens", "256", "--sample-tokens", "0", "--val-fraction", "0.05"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) >= 2 and all(math.isfinite(x) for x in losses), rows
    assert json.loads((out / "run.json").read_text())["config"]["linear_kind"] == "mesa"
