"""Configs the family tests do not cover, each both ways against transformers: OLMo-Hybrid without rotary
embeddings (NoPE), Gated DeltaNet with 4 value heads per key head in Qwen3-Next's fused layout, odd head dims, and
a layer pattern that starts with attention and puts two attention layers together.

transformers -> ours: transformers builds and saves a random model, we load it. ours -> transformers: we build a
model from the same config with our own random weights, save it, and transformers loads it. Logits agree to 1e-4
in float32 both ways."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import VOCAB, randomize, transformers

from hybridlm import HybridLM
from hybridlm.model.hf import config_from_hf

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, rms_norm_eps=1e-6)


def unseen_config(name: str):
    if name == "olmo_hybrid_nope":
        return transformers.OlmoHybridConfig(**_COMMON, num_hidden_layers=4, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=96, pad_token_id=0,
                                             eos_token_id=2, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": None})
    if name == "qwen3_next_gva4":
        return transformers.Qwen3NextConfig(**_COMMON, num_hidden_layers=4, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                            linear_num_key_heads=1, linear_num_value_heads=4, linear_key_head_dim=16,
                                            linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=32, shared_expert_intermediate_size=48)
    if name == "qwen3_5_odd_dims":
        return transformers.Qwen3_5TextConfig(**_COMMON, num_hidden_layers=4, num_attention_heads=3,
                                              num_key_value_heads=1, head_dim=20, intermediate_size=80,
                                              linear_num_key_heads=3, linear_num_value_heads=3,
                                              linear_key_head_dim=9, linear_value_head_dim=7)
    if name == "olmo_hybrid_pattern":
        return transformers.OlmoHybridConfig(
            **_COMMON, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
            pad_token_id=0, eos_token_id=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12,
            linear_value_head_dim=10,
            layer_types=["full_attention", "linear_attention", "full_attention", "full_attention", "linear_attention"])
    if name == "kimi_linear_pattern":
        return transformers.KimiLinearConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=96, moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, n_group=2,
            topk_group=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
            linear_head_dim=12, linear_num_heads=2, n_shared_experts=1, routed_scaling_factor=2.5,
            layer_types=["full_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
    raise ValueError(name)


NAMES = ("olmo_hybrid_nope", "qwen3_next_gva4", "qwen3_5_odd_dims", "olmo_hybrid_pattern", "kimi_linear_pattern")
_MOE = ("qwen3_next_gva4", "kimi_linear_pattern")


def _eager(model, name: str):
    model.set_attn_implementation("eager")
    if name in _MOE:
        model.set_experts_implementation("eager")
    return model.eval()


def _x(seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", NAMES)
def test_transformers_to_ours(name, tmp_path):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(unseen_config(name))
    randomize(hf, seed=1)
    hf = _eager(hf, name)
    hf.save_pretrained(str(tmp_path))
    ours = HybridLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    x = _x(2)
    with torch.no_grad():
        err = (ours(x).logits - hf(input_ids=x).logits).abs().max().item()
    assert err <= 1e-4, f"{name}: max |diff| {err:.3e}"


@pytest.mark.parametrize("name", NAMES)
def test_ours_to_transformers(name, tmp_path):
    cfg = config_from_hf(unseen_config(name).to_dict())
    cfg.extra.pop("hf_config")  # save from our own config, not from the dict it was read from
    torch.manual_seed(0)
    ours = HybridLM(cfg).eval()
    randomize(ours, seed=3)
    ours.save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    back = _eager(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32), name)
    if name == "olmo_hybrid_nope":
        assert saved["rope_parameters"]["rope_theta"] is None and back.model.rotary_emb is None, saved
    x = _x(4)
    with torch.no_grad():
        err = (ours(x).logits - back(input_ids=x).logits).abs().max().item()
    assert err <= 1e-4, f"{name}: max |diff| {err:.3e}"


def test_olmo_config_naming_no_rope_reads_as_transformers_default():
    """A config.json with neither rope_parameters nor rope_theta gets transformers' theta 10000, as transformers
    reads it; rope_theta null is NoPE."""
    d = unseen_config("olmo_hybrid_nope").to_dict()
    d.pop("rope_parameters")
    d.pop("rope_theta", None)
    assert config_from_hf(d).rope_theta == 10000.0
    d["rope_theta"] = None
    assert config_from_hf(d).rope_theta is None
