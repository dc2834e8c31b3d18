"""HybridLM against transformers (the independent oracle) on tiny random models of the five families."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hf_models import FAMILIES, VOCAB, transformers

from hybridlm import HybridLM
from hybridlm.interop.compare import compare_layers

_OURS: dict[str, HybridLM] = {}


def ours_from(folder) -> HybridLM:
    """Our float32 model loaded from the folder transformers wrote (cached: loading is what the first test checks)."""
    key = str(folder)
    if key not in _OURS:
        with torch.random.fork_rng(devices=[]):
            _OURS[key] = HybridLM.from_pretrained(key, dtype=torch.float32)
    return _OURS[key]


def inputs(B: int = 2, T: int = 32) -> torch.Tensor:
    return torch.randint(3, VOCAB, (B, T))


def ragged_mask(B: int, T: int, pads=(0, 7)) -> torch.Tensor:
    mask = torch.ones(B, T, dtype=torch.long)
    for b, p in enumerate(pads[:B]):
        mask[b, :p] = 0
    return mask


def report(ours, hf, x, mask=None) -> str:
    cmp = compare_layers(ours.layers, hf.model.layers, lambda: ours(x, attention_mask=mask),
                         lambda: hf(input_ids=x, attention_mask=mask), positions=None if mask is None else mask.bool())
    return cmp.report()


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_logits_match(family, hf_and_folder):
    hf, folder = hf_and_folder(family)
    ours = ours_from(folder)
    x = inputs()
    with torch.no_grad():
        a, b = ours(x).logits, hf(input_ids=x).logits
    err = (a - b).abs().max().item()
    assert err <= 1e-4, f"{family}: max |diff| {err:.3e}\n{report(ours, hf, x)}"


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_ragged_batch(family, hf_and_folder):
    hf, folder = hf_and_folder(family)
    ours = ours_from(folder)
    x = inputs()
    mask = ragged_mask(*x.shape)
    x = x.masked_fill(mask == 0, 0)
    with torch.no_grad():
        a, b = ours(x, attention_mask=mask).logits, hf(input_ids=x, attention_mask=mask).logits
    keep = mask.bool()
    err = (a - b)[keep].abs().max().item()
    assert err <= 1e-4, f"{family}: max |diff| on real tokens {err:.3e}\n{report(ours, hf, x, mask)}"
    assert torch.isfinite(a).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_agrees(family, hf_and_folder):
    hf, folder = hf_and_folder(family)
    ours = HybridLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    x = inputs(T=16)  # bf16 matmuls are slow on CPU
    with torch.no_grad():
        a, b = ours(x).logits.float(), hf16(input_ids=x).logits.float()
    scale = b.abs().max().item()
    err = (a - b).abs().max().item()
    # bf16 has 8 bits of mantissa; four blocks of independent roundings stay within a few percent of the range
    assert err <= 0.05 * scale, f"{family}: bf16 max |diff| {err:.3e} vs logit range {scale:.3e}"
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_through_transformers(family, hf_and_folder, tmp_path):
    hf, folder = hf_and_folder(family)
    ours = ours_from(folder)
    ours.save_pretrained(str(tmp_path))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    back.set_attn_implementation("eager")
    if family in ("qwen3_next", "qwen3_5_moe", "kimi_linear"):
        back.set_experts_implementation("eager")
    x = inputs()
    with torch.no_grad():
        a, b = ours(x).logits, back.eval()(input_ids=x).logits
    err = (a - b).abs().max().item()
    assert err <= 1e-4, f"{family}: round trip max |diff| {err:.3e}\n{report(ours, back, x)}"
    # The same tensors as transformers writes, under the same names.
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f1, safe_open(str(tmp_path / "model.safetensors"),
                                                                             "pt") as f2:
        assert sorted(f1.keys()) == sorted(f2.keys())
        for k in f1.keys():
            if k.endswith("_conv1d.weight"):
                continue  # compared concatenated below
            assert torch.equal(f1.get_tensor(k), f2.get_tensor(k)), k
        # transformers 5.23 splits the concatenated conv back into three EQUAL parts when it saves (its
        # Concatenate reverse), which is wrong when the value part is wider (OLMo-Hybrid: dv = 2 dk); we split
        # at the real q / k / v widths. Both reload to the same concatenated weight.
        for k in f1.keys():
            if k.endswith("q_conv1d.weight"):
                cat = lambda f: torch.cat([f.get_tensor(k.replace("q_conv1d", c + "_conv1d")) for c in "qkv"])  # noqa
                assert torch.equal(cat(f1), cat(f2)), k


def test_sharded_save_loads(hf_and_folder, tmp_path):
    hf, folder = hf_and_folder("kimi_linear")
    ours = ours_from(folder)
    ours.save_pretrained(str(tmp_path), max_shard_size=250_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "model.safetensors").exists()
    again = HybridLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    back.set_attn_implementation("eager")
    back.set_experts_implementation("eager")
    x = inputs()
    with torch.no_grad():
        assert torch.equal(again(x).logits, ours(x).logits)
        assert (back.eval()(input_ids=x).logits - ours(x).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear", "olmo_hybrid"])
def test_in_memory_fused_layout_loads(family, hf_and_folder, tmp_path):
    """transformers' in-memory names (fused experts, one conv, Kimi's forget_gate.*) written by hand."""
    from safetensors.torch import save_file

    hf, folder = hf_and_folder(family)
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if "inv_freq" not in k}
    assert any(k.endswith("conv1d.weight") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    ours = HybridLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    x = inputs()
    with torch.no_grad():
        err = (ours(x).logits - hf(input_ids=x).logits).abs().max().item()
    assert err <= 1e-4


def test_qwen3_5_multimodal_prefix_mtp_and_vision_ignored(hf_and_folder, tmp_path, caplog):
    from safetensors import safe_open
    from safetensors.torch import save_file

    hf, folder = hf_and_folder("qwen3_5")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        state = {k.replace("model.", "model.language_model.", 1): f.get_tensor(k) for k in f.keys()}
    state["mtp.fc.weight"] = torch.randn(4, 4)
    state["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(4, 4)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text}))
    with caplog.at_level("INFO", logger="hybridlm.model.hf"):
        ours = HybridLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert "ignored 2 checkpoint tensors" in caplog.text
    x = inputs()
    with torch.no_grad():
        assert (ours(x).logits - hf(input_ids=x).logits).abs().max() <= 1e-4


def test_hand_written_per_expert_layout_loads(hf_and_folder, tmp_path):
    """Experts one by one (as released checkpoints store them), split by hand from transformers' fused tensors."""
    from safetensors.torch import save_file

    hf, folder = hf_and_folder("qwen3_5_moe")
    state = {}
    for k, v in hf.state_dict().items():
        if k.endswith("experts.gate_up_proj"):
            for e, w in enumerate(v):
                gate, up = w.chunk(2, dim=0)
                state[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate.contiguous()
                state[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = up.contiguous()
        elif k.endswith("experts.down_proj"):
            for e, w in enumerate(v):
                state[k.replace("down_proj", f"{e}.down_proj.weight")] = w.contiguous()
        else:
            state[k] = v.contiguous()
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in state
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    ours = HybridLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    x = inputs()
    with torch.no_grad():
        assert (ours(x).logits - hf(input_ids=x).logits).abs().max() <= 1e-4
