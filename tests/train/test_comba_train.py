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


def test_a_config_its_transformers_type_cannot_hold_is_refused_before_training(tmp_path, small_corpus, capsys):
    """A preset's config with hf_model_type kept and a mixer transformers has no class for fails at once, in one
    line that says what to change, not at the first checkpoint after training."""
    cfg = get_preset("test-micro")
    cfg.linear_kind = "comba"
    assert cfg.hf_model_type  # the preset's
    cfg.to_json(str(tmp_path / "comba.json"))
    argv = ["train", "--config", str(tmp_path / "comba.json"), "--data", small_corpus, "--out",
            str(tmp_path / "run"), "--max-steps", "2", "--no-progress", "--threads", "1"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--config: cannot save as" in err[0] and "linear_kind" in err[0], err
    assert '"hf_model_type": null' in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()
