"""One preset table for every command: the training shapes resolve for info / memory / generate too."""

from __future__ import annotations

import json

import pytest

from hybridlm.cli import main as cli_main
from hybridlm.model.presets import PRESETS, get_preset
from hybridlm.train.errors import TrainError
from hybridlm.train.presets import TRAIN_DEFAULTS, build_config

# name -> (layers, parameter range the name promises)
TRAIN_SHAPES = {"cpu-tiny": (4, 0.5e6, 2e6), "gpu-30m": (8, 20e6, 40e6), "gpu-325m": (24, 250e6, 400e6),
                "test-micro": (4, 1e3, 1e5)}


def test_every_training_preset_is_a_model_preset():
    assert set(TRAIN_DEFAULTS) == set(TRAIN_SHAPES)
    assert set(TRAIN_DEFAULTS) <= set(PRESETS)


@pytest.mark.parametrize("name", sorted(TRAIN_SHAPES))
def test_info_knows_the_training_presets(name, capsys):
    layers, lo, hi = TRAIN_SHAPES[name]
    assert cli_main(["info", name, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["layers"] == layers and d["pattern"] == "LLLA" * (layers // 4)
    assert lo < d["parameters"] < hi


def test_memory_and_generate_know_a_training_preset(capsys):
    assert cli_main(["memory", "--preset", "cpu-tiny", "--max-context", "2048"]) == 0
    assert "cache bytes for cpu-tiny" in capsys.readouterr().out
    assert cli_main(["generate", "--model", "test-micro", "--prompt", "ab", "--max-new-tokens", "2",
                     "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("ab")


def test_train_reads_the_same_table():
    for name in TRAIN_SHAPES:
        cfg, got_name, defaults = build_config(name, None, "cpu")
        assert cfg == get_preset(name) and got_name == name and defaults == TRAIN_DEFAULTS[name]
    cfg, _, defaults = build_config("tiny", None, "cpu")  # a model preset without run settings
    assert cfg == get_preset("tiny") and defaults not in TRAIN_DEFAULTS.values()
    assert build_config(None, None, "cpu")[1] == "cpu-tiny" and build_config(None, None, "cuda")[1] == "gpu-30m"
    with pytest.raises(TrainError, match="--preset: unknown 'nope'; training presets: cpu-tiny"):
        build_config("nope", None, "cpu")
