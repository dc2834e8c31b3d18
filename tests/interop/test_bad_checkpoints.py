"""Loader errors: each names the file / key / expected and actual shape, and nothing is returned half-loaded."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridlm import HybridLM
from hybridlm.model import CheckpointError
from hybridlm.model.hf import key_map
from hybridlm.model.presets import get_preset


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good")
    HybridLM(get_preset("tiny")).save_pretrained(str(folder))
    return folder


def copy_to(good, tmp_path, tensors=None, config=None):
    state = load_file(str(good / "model.safetensors")) if tensors is None else tensors
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((good / "config.json").read_text()) if config is None else config
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_good_folder_loads(good):
    model = HybridLM.from_pretrained(str(good))
    assert model(torch.zeros(1, 4, dtype=torch.long)).logits.shape == (1, 4, 256)


def test_missing_safetensors(good, tmp_path):
    (tmp_path / "config.json").write_text((good / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        HybridLM.from_pretrained(str(tmp_path))


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="a folder with no config.json"):
        HybridLM.from_pretrained(str(tmp_path))


def test_truncated_safetensors(good, tmp_path):
    copy_to(good, tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        HybridLM.from_pretrained(str(tmp_path))


def test_garbage_safetensors(good, tmp_path):
    copy_to(good, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        HybridLM.from_pretrained(str(tmp_path))


def test_index_names_a_missing_shard(good, tmp_path):
    copy_to(good, tmp_path)
    keys = list(load_file(str(tmp_path / "model.safetensors")))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors: listed in .* but missing"):
        HybridLM.from_pretrained(str(tmp_path))


def test_unknown_model_type(good, tmp_path):
    cfg = json.loads((good / "config.json").read_text())
    cfg["model_type"] = "llama"
    copy_to(good, tmp_path, config=cfg)
    with pytest.raises(CheckpointError, match="unknown model_type 'llama'"):
        HybridLM.from_pretrained(str(tmp_path))


def test_missing_key(good, tmp_path):
    state = load_file(str(good / "model.safetensors"))
    del state["model.layers.1.linear_attn.in_proj_z.weight"]
    copy_to(good, tmp_path, tensors=state)
    with pytest.raises(CheckpointError, match=r"missing key\(s\) \['model\.layers\.1\.linear_attn\.in_proj_z\."):
        HybridLM.from_pretrained(str(tmp_path))


def test_wrong_shape(good, tmp_path):
    state = load_file(str(good / "model.safetensors"))
    state["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(7, 64)
    copy_to(good, tmp_path, tensors=state)
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.self_attn\.k_proj\.weight: expected shape "
                                              r"\[32, 64\], got \[7, 64\]"):
        HybridLM.from_pretrained(str(tmp_path))


def test_missing_expert_in_per_expert_layout(tmp_path):
    cfg = get_preset("tiny")
    cfg.mlp_types = ["moe"] * 4
    cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size = 4, 2, 16
    cfg.shared_expert_intermediate_size = 16
    cfg.hf_model_type = "qwen3_5_moe_text"
    HybridLM(cfg).save_pretrained(str(tmp_path))
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.2.mlp.experts.3.up_proj.weight"]
    os.remove(tmp_path / "model.safetensors")
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight"):
        HybridLM.from_pretrained(str(tmp_path))


def test_unexpected_key_is_refused_when_strict(good, tmp_path):
    state = load_file(str(good / "model.safetensors"))
    state["model.layers.0.linear_attn.surprise.weight"] = torch.zeros(2)
    copy_to(good, tmp_path, tensors=state)
    with pytest.raises(CheckpointError, match="unexpected key"):
        HybridLM.from_pretrained(str(tmp_path))
    # strict=False skips the surprise and fills every parameter with its tensor of the file, bit for bit
    model = HybridLM.from_pretrained(str(tmp_path), strict=False)
    ours = model.state_dict()
    kmap = key_map(model)
    assert len(kmap) == len(state) - 1
    assert [k for k, n in kmap.items() if not torch.equal(ours[n], state[k])] == []


def test_save_refuses_a_config_the_model_type_cannot_express(tmp_path):
    cfg = get_preset("tiny")
    cfg.block_style = "olmo"
    with pytest.raises(ValueError, match="block_style"):
        HybridLM(cfg).save_pretrained(str(tmp_path), model_type="qwen3_5_text")
