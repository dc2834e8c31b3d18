"""Named configs: the released hybrids' shapes and small ones for experiments.

Non-standard here: the released shapes are written from their published config.json files (as transformers
reads them); they are for `hybridlm info` and for building untrained models of the same shape, not weights.
"tiny" / "small" are byte-level (vocab 256) 3:1 GDN + gated-attention hybrids for experiments; "cpu-tiny",
"gpu-30m", "gpu-325m" and "test-micro" are the byte-level 3:1 shapes `hybridlm train` knows run settings for
(hybridlm.train.presets.TRAIN_DEFAULTS). This is the one table of names: `info`, `memory`, `generate` and
`train` all read it.
"""

from __future__ import annotations

from collections.abc import Callable

from .config import HybridConfig


def _pattern(n: int, every: int = 4) -> list[str]:
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]


def _qwen3_next_80b_a3b() -> HybridConfig:
    return HybridConfig(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=48, layer_types=_pattern(48), mlp_types=["moe"] * 48,
        norm_kind="zero_centered", gdn_layout="fused", linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, rope_theta=10_000_000.0, partial_rotary_factor=0.25, intermediate_size=5120, moe_kind="qwen",
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        max_position_embeddings=262144, hf_model_type="qwen3_next", bos_token_id=151643, eos_token_id=151645,
    )


def _qwen3_5(hidden: int, layers: int, heads: int, kv: int, inter: int, lin_v: int, tie: bool,
             lin_k: int = 16) -> Callable[[], HybridConfig]:
    def make() -> HybridConfig:
        return HybridConfig(
            vocab_size=248320, hidden_size=hidden, num_hidden_layers=layers, layer_types=_pattern(layers),
            mlp_types=["dense"] * layers, norm_kind="zero_centered", gdn_layout="split", linear_num_key_heads=lin_k,
            linear_num_value_heads=lin_v, linear_key_head_dim=128, linear_value_head_dim=128,
            num_attention_heads=heads, num_key_value_heads=kv, head_dim=256, rope_theta=10_000_000.0,
            partial_rotary_factor=0.25, intermediate_size=inter, tie_word_embeddings=tie,
            max_position_embeddings=262144, hf_model_type="qwen3_5_text",
        )
    return make


def _qwen3_5_moe_35b_a3b() -> HybridConfig:
    return HybridConfig(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, layer_types=_pattern(40), mlp_types=["moe"] * 40,
        norm_kind="zero_centered", gdn_layout="split", linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, rope_theta=10_000_000.0, partial_rotary_factor=0.25, intermediate_size=0, moe_kind="qwen",
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        max_position_embeddings=262144, hf_model_type="qwen3_5_moe_text",
    )


def _kimi_linear_48b_a3b() -> HybridConfig:
    full = {4, 8, 12, 16, 20, 24, 27}  # 1-indexed, from the released linear_attn_config
    return HybridConfig(
        vocab_size=163840, hidden_size=2304, num_hidden_layers=27,
        layer_types=["full_attention" if i + 1 in full else "linear_attention" for i in range(27)],
        mlp_types=["dense"] + ["moe"] * 26, norm_kind="llama", rms_norm_eps=1e-5, linear_kind="kda",
        linear_num_key_heads=32, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_norm_eps=1e-5, attention_kind="mla", num_attention_heads=32, num_key_value_heads=32, head_dim=192,
        rope_theta=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=9216, moe_kind="kimi", num_experts=256, num_experts_per_tok=8, moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024, n_group=1, topk_group=1, routed_scaling_factor=2.446,
        max_position_embeddings=1048576, hf_model_type="kimi_linear", bos_token_id=163584, eos_token_id=163586,
        pad_token_id=163839,
    )


def _olmo_hybrid_7b() -> HybridConfig:
    n, D, heads = 32, 3840, 30
    dk = int(0.75 * D / heads)
    return HybridConfig(
        vocab_size=100352, hidden_size=D, num_hidden_layers=n,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)],
        mlp_types=["dense"] * n, norm_kind="fp32_weight", block_style="olmo", gdn_layout="olmo",
        linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=dk, linear_value_head_dim=2 * dk,
        linear_beta_scale=2.0, linear_norm_eps=1e-5, attention_kind="plain", qk_norm="full",
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=D // heads, rope_theta=None,
        intermediate_size=11008, max_position_embeddings=65536, hf_model_type="olmo_hybrid", eos_token_id=100257,
        pad_token_id=100277,
    )


def _small(D: int, layers: int, heads: int, kv: int, lin_k: int, lin_v: int, dk: int, inter: int):
    def make() -> HybridConfig:
        return HybridConfig(
            vocab_size=256, hidden_size=D, num_hidden_layers=layers, layer_types=_pattern(layers),
            mlp_types=["dense"] * layers, norm_kind="zero_centered", gdn_layout="split", linear_num_key_heads=lin_k,
            linear_num_value_heads=lin_v, linear_key_head_dim=dk, linear_value_head_dim=dk, num_attention_heads=heads,
            num_key_value_heads=kv, head_dim=D // heads, rope_theta=10000.0, partial_rotary_factor=0.5,
            intermediate_size=inter, tie_word_embeddings=True, max_position_embeddings=4096,
            hf_model_type="qwen3_5_text",
        )
    return make


def _train_shape(**fields) -> Callable[[], HybridConfig]:
    """3 Gated DeltaNet blocks : 1 gated-attention block, byte vocabulary; Qwen3.5 layout, so training checkpoints
    are `HybridLM.from_pretrained` folders (and transformers' qwen3_5_text); other fields keep their defaults."""
    return lambda: HybridConfig(vocab_size=256, hf_model_type="qwen3_5_text", **fields)


PRESETS: dict[str, Callable[[], HybridConfig]] = {
    "tiny": _small(64, 4, 4, 2, 2, 4, 16, 192),
    "small": _small(256, 8, 4, 2, 4, 8, 32, 768),
    "qwen3-next-80b-a3b": _qwen3_next_80b_a3b,
    "qwen3.5-0.8b": _qwen3_5(1024, 24, 8, 2, 3584, 16, True),
    "qwen3.5-2b": _qwen3_5(2048, 24, 8, 2, 6144, 16, True),
    "qwen3.5-4b": _qwen3_5(2560, 32, 16, 4, 9216, 32, True),
    "qwen3.5-9b": _qwen3_5(4096, 32, 16, 4, 12288, 32, False),
    "qwen3.5-35b-a3b": _qwen3_5_moe_35b_a3b,
    "kimi-linear-48b-a3b": _kimi_linear_48b_a3b,
    "olmo-hybrid-7b": _olmo_hybrid_7b,
    # ~1.7M parameters: the no-argument CPU training run (a few minutes on 2 cores)
    "cpu-tiny": _train_shape(
        hidden_size=192, num_hidden_layers=4, intermediate_size=512, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=48, linear_value_head_dim=48, num_attention_heads=4, num_key_value_heads=2, head_dim=48,
        max_position_embeddings=4096,
    ),
    # ~30M parameters: one GPU, the same corpus
    "gpu-30m": _train_shape(
        hidden_size=512, num_hidden_layers=8, intermediate_size=1792, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=64, linear_value_head_dim=64, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=8192,
    ),
    # ~325M parameters: the shape of `hybridlm bench train`'s 357M model (hidden 1024, 24 blocks, 8 GDN heads of
    # 128) with the byte vocabulary; for multi-GPU scaling, where the 30M model is too small to keep a GPU busy, and
    # context parallelism (RoPE has no table: max_position_embeddings only bounds --seq-len)
    "gpu-325m": _train_shape(
        hidden_size=1024, num_hidden_layers=24, intermediate_size=2816, linear_num_key_heads=8,
        linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=262144,
    ),
    # the smallest thing that runs: tests
    "test-micro": _train_shape(
        hidden_size=32, num_hidden_layers=4, intermediate_size=64, linear_num_key_heads=1, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=1024,
    ),
}
PRESETS["olmo-hybrid"] = _olmo_hybrid_7b


def get_preset(name: str) -> HybridConfig:
    """A fresh HybridConfig for a preset name (see PRESETS)."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]()
