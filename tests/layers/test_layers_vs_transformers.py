"""Single layers against the transformers modules they reproduce (the oracle), weights copied by name."""

from __future__ import annotations

import pytest
import torch

from hybridlm.layers import GatedDeltaNet, GatedRMSNorm, KimiDeltaAttention, MoE, RMSNorm, ShortConv

transformers = pytest.importorskip("transformers")
from transformers.models.kimi_linear import modeling_kimi_linear as kimi  # noqa: E402
from transformers.models.olmo_hybrid import modeling_olmo_hybrid as olmo  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5 as q35  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as qn  # noqa: E402


def randomize(*modules):
    with torch.no_grad():
        for m in modules:
            for name, p in list(m.named_parameters()) + list(m.named_buffers()):
                if p.is_floating_point() and "inv_freq" not in name:
                    scale = 0.3 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.5
                    p.copy_(torch.randn(p.shape) * scale + (1.0 if "norm" in name else 0.0))


def copy_by_name(ours, theirs, rename=lambda k: k):
    sd = {rename(k): v for k, v in theirs.state_dict().items()}
    missing, unexpected = ours.load_state_dict(sd, strict=False)
    assert not missing, missing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_flavours_bit_exact(dtype):
    x = torch.randn(3, 7, 16).to(dtype)
    gate = torch.randn(3, 7, 16).to(dtype)
    pairs = [(RMSNorm(16, 1e-6, "zero_centered"), qn.Qwen3NextRMSNorm(16, 1e-6)),
             (RMSNorm(16, 1e-5, "llama"), kimi.KimiLinearRMSNorm(16, 1e-5)),
             (RMSNorm(16, 1e-6, "fp32_weight"), olmo.OlmoHybridRMSNorm(16, 1e-6))]
    for ours, ref in pairs:
        randomize(ref)
        copy_by_name(ours, ref)
        ours, ref = ours.to(dtype), ref.to(dtype)
        assert torch.equal(ours(x), ref(x)), type(ref).__name__
    gated = [(GatedRMSNorm(16, 1e-6, "silu"), qn.Qwen3NextRMSNormGated(16, 1e-6)),
             (GatedRMSNorm(16, 1e-5, "sigmoid", fp32_output=True), kimi.KimiLinearRMSNormGated(16, 1e-5))]
    for ours, ref in gated:
        randomize(ref)
        copy_by_name(ours, ref)
        ours, ref = ours.to(dtype), ref.to(dtype)
        assert torch.equal(ours(x, gate), ref(x, gate)), type(ref).__name__


def lin_config(cls, **kw):
    return cls(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
               linear_value_head_dim=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, **kw)


@pytest.mark.parametrize("layout", ["fused", "split"])
def test_gated_deltanet_matches(layout):
    if layout == "fused":
        ref = qn.Qwen3NextGatedDeltaNet(lin_config(transformers.Qwen3NextConfig), 0)
    else:
        ref = q35.Qwen3_5GatedDeltaNet(lin_config(transformers.Qwen3_5TextConfig), 0)
    ours = GatedDeltaNet(32, 2, 4, 8, 8, layout=layout)
    randomize(ref)
    copy_by_name(ours, ref)
    x = torch.randn(2, 40, 32)
    mask = torch.ones(2, 40)
    mask[1, :6] = 0
    with torch.no_grad():
        a, b = ours(x, attention_mask=mask), ref(x, attention_mask=mask)
    assert (a - b)[mask.bool()].abs().max() <= 1e-5


def test_olmo_deltanet_matches_with_negative_eigenvalues():
    cfg = transformers.OlmoHybridConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=4)
    ref = olmo.OlmoHybridGatedDeltaNet(cfg, 0)
    ours = GatedDeltaNet(32, 4, 4, cfg.linear_key_head_dim, cfg.linear_value_head_dim, layout="olmo", beta_scale=2.0,
                         norm_eps=1e-5)
    randomize(ref)
    copy_by_name(ours, ref)
    x = torch.randn(2, 24, 32)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max() <= 1e-5


def test_kimi_delta_attention_matches():
    cfg = transformers.KimiLinearConfig(hidden_size=32, linear_num_heads=4, linear_head_dim=8, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5)
    ref = kimi.KimiLinearDeltaAttention(cfg, 0)
    ours = KimiDeltaAttention(32, 4, 8, norm_eps=1e-5)
    randomize(ref)
    copy_by_name(ours, ref, rename=lambda k: k.replace("forget_gate.", ""))
    x = torch.randn(2, 24, 32)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max() <= 1e-5


def test_kimi_moe_router_matches():
    cfg = transformers.KimiLinearConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2, n_group=4,
                                        topk_group=2, moe_intermediate_size=16, n_shared_experts=2,
                                        routed_scaling_factor=2.5, num_hidden_layers=2)
    ref = kimi.KimiLinearMoE(cfg)
    ours = MoE("kimi", 32, 8, 2, 16, 32, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    randomize(ref)
    copy_by_name(ours, ref)
    x = torch.randn(2, 10, 32)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max() <= 1e-5


def test_short_conv_restarts_at_document_boundaries():
    conv = ShortConv(6, 4)
    x = torch.randn(1, 10, 6)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    assert torch.allclose(conv(x, cu), torch.cat([conv(x[:, :3]), conv(x[:, 3:])], dim=1))
