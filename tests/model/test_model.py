"""HybridConfig, presets, HybridLM forward contracts (padding, packed documents), and `hybridlm info`."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hybridlm import HybridConfig, HybridLM
from hybridlm.cli import main as cli_main
from hybridlm.model.info import cache_bytes, count_parameters, layer_pattern
from hybridlm.model.presets import PRESETS, get_preset


def small_variants():
    """One tiny config per mixer / MLP kind, NoPE so left padding must not change real tokens' logits."""
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=8, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, intermediate_size=48, rope_theta=None)
    moe = dict(mlp_types=["dense", "moe", "moe", "moe"], num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=16, shared_expert_intermediate_size=16)
    return {
        "gdn_fused_qwen_moe": HybridConfig(**base, gdn_layout="fused", **moe),
        "gdn_split_headwise": HybridConfig(**base, gdn_layout="split", attn_gate="headwise"),
        "gdn_olmo": HybridConfig(**base, gdn_layout="olmo", linear_beta_scale=2.0, attention_kind="plain",
                                 qk_norm="full", norm_kind="fp32_weight", block_style="olmo"),
        "kda_mla_kimi_moe": HybridConfig(**{**base, "linear_num_key_heads": 4}, linear_kind="kda", attention_kind="mla",
                                         kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                         norm_kind="llama", moe_kind="kimi", n_group=2, topk_group=1,
                                         routed_scaling_factor=2.0, **moe),
        "mesa": HybridConfig(**{**base, "linear_num_key_heads": 4}, linear_kind="mesa"),
    }


@pytest.mark.parametrize("name", list(small_variants()))
def test_packed_documents_equal_separate_forwards(name):
    model = HybridLM(small_variants()[name]).eval()
    x = torch.randint(0, 64, (1, 30))
    cu = torch.tensor([0, 11, 12, 30], dtype=torch.int32)
    with torch.no_grad():
        packed = model(x, cu_seqlens=cu).logits
        parts = torch.cat([model(x[:, s:e]).logits for s, e in zip(cu.tolist(), cu.tolist()[1:])], dim=1)
    assert (packed - parts).abs().max() <= 1e-5


@pytest.mark.parametrize("name", list(small_variants()))
def test_left_padding_leaves_real_tokens_unchanged(name):
    model = HybridLM(small_variants()[name]).eval()
    x = torch.randint(1, 64, (1, 20))
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), x], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 20, dtype=torch.long)], dim=1)
    with torch.no_grad():
        a = model(x).logits
        b = model(padded, attention_mask=mask).logits[:, 5:]
    assert (a - b).abs().max() <= 1e-5


@pytest.mark.parametrize("name", list(small_variants()))
def test_backward_reaches_every_parameter(name):
    model = HybridLM(small_variants()[name])
    x = torch.randint(0, 64, (2, 12))
    loss = torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), x.flatten())
    loss.backward()
    # Each expert need not be routed to in a 24-token batch; everything else must get a gradient.
    missing = [n for n, p in model.named_parameters() if p.grad is None and ".experts." not in n]
    assert not missing


@pytest.mark.parametrize("name", ["gdn_split_headwise", "kda_mla_kimi_moe", "mesa"])
def test_linear_recompute_changes_no_gradient(name):
    """linear_recompute=True: the same loss and parameter gradients bit for bit, packed documents included, with
    fewer tensors kept for the backward (the recurrences keep only their inputs)."""
    x = torch.randint(0, 64, (1, 40))
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    runs, init = {}, torch.random.get_rng_state()
    for rc in (False, True):
        torch.random.set_rng_state(init)  # the same weights for both
        model = HybridLM(dataclasses.replace(small_variants()[name], linear_recompute=rc))
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, kept=kept: kept.append(t.numel()) or t, lambda t: t):
            loss = torch.nn.functional.cross_entropy(model(x, cu_seqlens=cu).logits.flatten(0, 1), x.flatten())
        loss.backward()
        runs[rc] = (loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                    sum(kept))
    assert torch.equal(runs[False][0], runs[True][0])
    assert runs[False][1].keys() == runs[True][1].keys()
    assert all(torch.equal(runs[False][1][n], runs[True][1][n]) for n in runs[False][1])
    assert runs[True][2] < runs[False][2]


def test_config_json_round_trip(tmp_path):
    for name in PRESETS:
        cfg = get_preset(name)
        assert HybridConfig.from_json(cfg.to_json()) == cfg
    path = tmp_path / "c.json"
    get_preset("small").to_json(str(path))
    assert HybridConfig.from_json(str(path)) == get_preset("small")
    assert HybridConfig.from_dict(get_preset("tiny").to_dict()) == get_preset("tiny")


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="layer_types: expected 4 entries"):
        HybridConfig(num_hidden_layers=4, layer_types=["linear_attention"])
    with pytest.raises(ValueError, match="gdn_layout"):
        HybridConfig(gdn_layout="weird")
    with pytest.raises(ValueError, match="unknown field"):
        HybridConfig.from_dict({"hiden_size": 3})
    with pytest.raises(KeyError, match="unknown preset"):
        get_preset("nope")


@pytest.mark.parametrize("name", list(small_variants()))
def test_impl_reaches_every_norm(name):
    """No hidden switch: every RMSNorm (block, final, attention q/k, MLA latent) and gated norm's owner runs the
    model's impl, so a model built with impl="naive" never takes the fused Triton norm on CUDA."""
    from hybridlm.layers.norm import RMSNorm

    model = HybridLM(small_variants()[name], impl="naive")
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) >= 2 * model.config.num_hidden_layers + 1
    assert {m.impl for m in norms} == {"naive"}, [(n, m.impl) for n, m in model.named_modules() if m in norms]


def test_small_presets_run():
    for name in ("tiny", "small"):
        cfg = get_preset(name)
        assert cfg.vocab_size == 256 and layer_pattern(cfg).count("A") * 3 == layer_pattern(cfg).count("L")
        out = HybridLM(cfg)(torch.randint(0, 256, (2, 9)))
        assert out.logits.shape == (2, 9, 256)


def test_released_shapes_parameter_counts():
    # Published totals: Qwen3-Next 80B (A3B), Kimi Linear 48B (A3B); counted on the meta device.
    total, active = count_parameters(get_preset("qwen3-next-80b-a3b"))
    assert 78e9 < total < 82e9 and 3e9 < active < 4.2e9
    total, active = count_parameters(get_preset("kimi-linear-48b-a3b"))
    assert 47e9 < total < 50e9 and 2.8e9 < active < 3.8e9


def test_cache_bytes_formula():
    cfg = get_preset("tiny")
    cb = cache_bytes(cfg, dtype_bytes=2)
    assert cb.kv_per_token == 1 * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    conv = (2 * cfg.linear_key_dim + cfg.linear_value_dim) * cfg.linear_conv_kernel_dim * 2
    rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    assert cb.state_per_sequence == 3 * (conv + rec)


def test_info_subcommand(capsys):
    assert cli_main(["info", "kimi-linear-48b-a3b"]) == 0
    out = capsys.readouterr().out
    assert "active per token" in out and "KV cache" in out and "Kkkm" in out
    assert cli_main(["info", "tiny", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["pattern"] == "LLLA" and d["parameters"] == HybridLM(get_preset("tiny")).num_parameters()


def test_layer_pattern_names_every_mixer_kind():
    """`hybridlm info`'s pattern: one letter per layer and kind (no new kind printed as another's letter)."""
    cfg = get_preset("test-micro")
    letters = set()
    for field, kinds in (("linear_kind", ("gdn", "kda", "comba", "mesa")),
                         ("attention_kind", ("gated", "mla", "path", "deltaformer"))):
        for kind in kinds:
            c = HybridConfig.from_dict({**cfg.to_dict(), field: kind})
            letters.add(layer_pattern(c)[cfg.layer_types.index(
                "linear_attention" if field == "linear_kind" else "full_attention")])
    assert len(letters) == 8, letters
