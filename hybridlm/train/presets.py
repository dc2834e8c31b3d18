"""Run settings for training: the defaults of the no-argument run, per model preset.

Non-standard here: model shapes are not defined here. Every name is a `hybridlm.model.presets` name (so `info`,
`memory` and `generate` know it too); this table only adds the run settings `hybridlm train` uses for it. Any
other model preset trains with GENERIC_DEFAULTS.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridlm.model.config import HybridConfig
from hybridlm.model.presets import PRESETS, get_preset

from .errors import TrainError


@dataclass(frozen=True)
class TrainDefaults:
    """What the no-argument run uses for a preset unless flags say otherwise."""

    seq_len: int
    batch_size: int
    lr: float
    warmup: int
    max_steps: int
    eval_every: int
    save_every: int


TRAIN_DEFAULTS: dict[str, TrainDefaults] = {
    "cpu-tiny": TrainDefaults(seq_len=256, batch_size=16, lr=3e-3, warmup=20, max_steps=200, eval_every=50,
                              save_every=50),
    # 600 steps x 32k tokens = ~4 epochs of the corpus; one H100: ~300k tokens/s, about 2 minutes
    "gpu-30m": TrainDefaults(seq_len=1024, batch_size=32, lr=2e-3, warmup=60, max_steps=600, eval_every=100,
                             save_every=200),
    "gpu-325m": TrainDefaults(seq_len=4096, batch_size=4, lr=6e-4, warmup=100, max_steps=2000, eval_every=250,
                              save_every=500),
    "test-micro": TrainDefaults(seq_len=64, batch_size=4, lr=3e-3, warmup=2, max_steps=8, eval_every=4,
                                save_every=4),
}
GENERIC_DEFAULTS = TrainDefaults(seq_len=1024, batch_size=8, lr=1e-3, warmup=100, max_steps=1000, eval_every=200,
                                 save_every=500)


def default_preset(device_type: str) -> str:
    return "gpu-30m" if device_type == "cuda" else "cpu-tiny"


def build_config(preset: str | None, config_path: str | None, device_type: str):
    """HybridConfig from --config (a JSON file) or --preset; returns (config, name, TrainDefaults)."""
    if config_path:
        try:
            cfg = HybridConfig.from_json(config_path)
        except FileNotFoundError as e:
            raise TrainError(f"--config: no such file: {config_path}") from e
        except (ValueError, TypeError) as e:
            raise TrainError(f"--config: {config_path} is not a valid HybridConfig JSON: {e}") from e
        return cfg, config_path, GENERIC_DEFAULTS
    name = preset or default_preset(device_type)
    if name not in PRESETS:
        raise TrainError(f"--preset: unknown {name!r}; training presets: {', '.join(TRAIN_DEFAULTS)}; other model "
                         f"presets: {', '.join(sorted(set(PRESETS) - set(TRAIN_DEFAULTS)))}")
    return get_preset(name), name, TRAIN_DEFAULTS.get(name, GENERIC_DEFAULTS)
