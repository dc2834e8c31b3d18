"""`hybridlm train --config` with a hybrid of Comba and gated-attention blocks: two steps on the CPU, checkpoint
written and loadable, finite losses."""

from __future__ import annotations

import json
import math

from hybridlm import HybridLM
from hybridlm.cli import main as cli_main
from hybridlm.model.presets import get_preset
from hybridlm.train import checkpoint as ckpt


def test_two_training_steps_of_a_comba_hybrid(tmp_path, small_corpus):
    cfg = get_preset("test-micro")
    cfg.linear_kind = "comba"
    cfg.layer_types = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
    cfg.hf_model_type = None  # Comba has no transformers model type: checkpoints in our own format
    cfg.to_json(str(tmp_path / "comba.json"))
    out = tmp_path / "run"
    argv = ["train", "--config", str(tmp_path / "comba.json"), "--data", small_corpus, "--out", str(out),
            "--max-steps", "2", "--no-progress", "--threads", "1", "--eval-tokens", "512", "--sample-tokens", "0",
            "--val-fraction", "0.05", "--seq-len", "64", "--batch-size", "2"]
    assert cli_main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_step"] == 2 and math.isfinite(summary["final_train_loss"])
    assert math.isfinite(summary["final_val_nats_per_byte"])
    model = HybridLM.from_pretrained(ckpt.resolve_resume(str(out)))
    assert model.config.linear_kind == "comba"
    assert [type(b.mixer).__name__ for b in model.layers] == ["Comba", "GatedAttention", "Comba", "Comba"]
