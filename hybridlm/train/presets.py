"""Model shapes for training: small 3:1 hybrids sized for the no-argument run and a single GPU.

Names here are tried first; any other name goes to `hybridlm.model.presets.get_preset`.
"""

from __future__ import annotations

from dataclasses import dataclass

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


# 3 Gated DeltaNet blocks : 1 gated-attention block, byte vocabulary; Qwen3.5 layout, so checkpoints are
# `HybridLM.from_pretrained` folders (and transformers' qwen3_5_text).
TRAIN_PRESETS: dict[str, dict] = {
    # ~1M parameters: the no-argument CPU run (a few minutes on 2 cores)
    "cpu-tiny": dict(
        vocab_size=256, hidden_size=192, num_hidden_layers=4, intermediate_size=512,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=48, linear_value_head_dim=48,
        num_attention_heads=4, num_key_value_heads=2, head_dim=48, max_position_embeddings=4096,
        hf_model_type="qwen3_5_text",
    ),
    # ~30M parameters: one GPU, the same corpus
    "gpu-30m": dict(
        vocab_size=256, hidden_size=512, num_hidden_layers=8, intermediate_size=1792,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
        hf_model_type="qwen3_5_text",
    ),
    # ~325M parameters: the shape of `hybridlm bench train`'s 357M model (hidden 1024, 24 blocks, 8 GDN heads of 128)
    # with the byte vocabulary; for multi-GPU scaling, where the 30M model is too small to keep a GPU busy
    "gpu-325m": dict(
        vocab_size=256, hidden_size=1024, num_hidden_layers=24, intermediate_size=2816,
        linear_num_key_heads=8, linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=8192,
        hf_model_type="qwen3_5_text",
    ),
    # the smallest thing that runs: tests
    "test-micro": dict(
        vocab_size=256, hidden_size=32, num_hidden_layers=4, intermediate_size=64,
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
        hf_model_type="qwen3_5_text",
    ),
}

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
    from hybridlm.model.config import HybridConfig

    if config_path:
        try:
            cfg = HybridConfig.from_json(config_path)
        except FileNotFoundError as e:
            raise TrainError(f"--config: no such file: {config_path}") from e
        except (ValueError, TypeError) as e:
            raise TrainError(f"--config: {config_path} is not a valid HybridConfig JSON: {e}") from e
        return cfg, config_path, GENERIC_DEFAULTS
    name = preset or default_preset(device_type)
    if name in TRAIN_PRESETS:
        return HybridConfig(**TRAIN_PRESETS[name]), name, TRAIN_DEFAULTS[name]
    try:
        from hybridlm.model.presets import get_preset
    except ImportError as e:
        raise TrainError(f"--preset: unknown {name!r}; known here: {sorted(TRAIN_PRESETS)}") from e
    try:
        cfg = get_preset(name)
    except (KeyError, ValueError) as e:
        raise TrainError(f"--preset: unknown {name!r} ({e}); training presets: {sorted(TRAIN_PRESETS)}") from e
    return cfg, name, GENERIC_DEFAULTS
