"""Tiny random transformers models of the five families (the independent oracle for the interop tests)."""

from __future__ import annotations

import torch

transformers = __import__("pytest").importorskip("transformers")

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear", "olmo_hybrid")
VOCAB = 97


def hf_config(family: str):
    lin = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
               linear_conv_kernel_dim=4)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, rms_norm_eps=1e-6)
    if family == "qwen3_next":
        return transformers.Qwen3NextConfig(**common, **lin, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                            shared_expert_intermediate_size=48, mlp_only_layers=[1])
    if family == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**common, **lin, num_key_value_heads=2, head_dim=16,
                                              intermediate_size=96)
    if family == "qwen3_5_moe":
        return transformers.Qwen3_5MoeTextConfig(**common, **lin, num_key_value_heads=2, head_dim=16, num_experts=4,
                                                 num_experts_per_tok=2, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=48)
    if family == "kimi_linear":
        return transformers.KimiLinearConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=96, moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, n_group=2,
            topk_group=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            linear_head_dim=16, linear_num_heads=4, n_shared_experts=1, routed_scaling_factor=2.5,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "olmo_hybrid":
        return transformers.OlmoHybridConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
                                             num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                                             pad_token_id=0, eos_token_id=2)
    raise ValueError(family)


@torch.no_grad()
def randomize(model, seed: int) -> None:
    """Every parameter and persistent buffer non-trivial (norms not at 0 / 1, A_log, dt_bias, router bias)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if not p.is_floating_point() or "inv_freq" in name:
            continue
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(0.0, 2.0, generator=g))
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, generator=g))
        elif "norm" in name:
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
        elif name.endswith("e_score_correction_bias"):
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        else:
            # 0.3 / sqrt(fan_in) keeps activations O(1) through 4 blocks, so float32 agreement is meaningful.
            scale = 1.0 if "embed" in name else 0.3 / p.shape[-1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=g) * (scale if p.dim() > 1 else 0.3))


def make_hf(family: str, seed: int):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family))
    randomize(model, seed)
    model.set_attn_implementation("eager")
    if hasattr(model, "set_experts_implementation") and family in ("qwen3_next", "qwen3_5_moe", "kimi_linear"):
        model.set_experts_implementation("eager")
    return model.eval()
