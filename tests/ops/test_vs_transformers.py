"""Our ops against transformers' own PyTorch fallbacks (an independent implementation), in float32.

Tolerance: relative error <= 2e-5 (float32 rounding of two different orders of summation over ~100 steps).
"""

from __future__ import annotations

import pytest
import torch

from hybridlm.ops import causal_conv1d, causal_conv1d_update, gated_delta_rule, gated_rms_norm, kda, rms_norm

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

TOL = 2e-5


def raw(fn):
    """transformers wraps these for hub kernels; the plain torch function is underneath."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("T,ratio,l2,state", [(1, 1, True, False), (64, 2, True, True), (131, 4, False, True),
                                              (77, 1, True, True)])
def test_gated_delta_rule_matches_transformers(T, ratio, l2, state):
    B, H, K, V = 2, 2, 32, 48
    HV = H * ratio
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, HV, V)
    g = -2 * torch.rand(B, T, HV)
    beta = torch.rand(B, T, HV) * (2 if not l2 else 1)
    h0 = torch.randn(B, HV, K, V) if state else None
    if not l2:  # without normalisation keep the keys short so the state stays bounded
        k = k / K
    o_hf, s_hf = raw(qwen3_next.torch_chunk_gated_delta_rule)(
        q, k, v, g, beta, chunk_size=64, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2
    )
    o_hf2, _ = raw(qwen3_next.torch_recurrent_gated_delta_rule)(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2
    )
    for impl in ("naive", "chunk"):
        o, s = gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                use_qk_l2norm=l2, impl=impl)
        assert rel(o, o_hf) <= TOL, (impl, rel(o, o_hf))
        assert rel(o, o_hf2) <= TOL
        assert rel(s, s_hf) <= TOL, (impl, rel(s, s_hf))


@pytest.mark.parametrize("T,state", [(1, False), (64, True), (100, True)])
def test_kda_matches_transformers(T, state):
    B, H, K, V = 2, 3, 32, 32  # Kimi Linear has no GVA and K == V
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    g = -torch.rand(B, T, H, K)
    beta = torch.rand(B, T, H)
    h0 = torch.randn(B, H, K, V) if state else None
    o_hf, s_hf = raw(kimi.chunk_kimi_delta_attention)(
        q, k, v, g, beta, chunk_size=64, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    for impl in ("naive", "chunk"):
        o, s = kda(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True, impl=impl)
        assert rel(o, o_hf) <= TOL, (impl, rel(o, o_hf))
        assert rel(s, s_hf) <= TOL


def test_causal_conv1d_matches_transformers_and_its_update():
    B, T, C, W = 2, 11, 12, 4
    x, w = torch.randn(B, T, C), torch.randn(C, W)
    # transformers' reference path: a Conv1d with left padding W-1, then SiLU
    conv = torch.nn.Conv1d(C, C, W, groups=C, bias=False, padding=W - 1)
    conv.weight.data = w.unsqueeze(1)
    y_hf = torch.nn.functional.silu(conv(x.transpose(1, 2))[..., :T]).transpose(1, 2)
    y, state = causal_conv1d(x, w, activation="silu", output_final_state=True)
    assert rel(y, y_hf) <= 1e-6
    # transformers' decode step agrees with ours, and with the full pass on the same new token
    x_new = torch.randn(B, C)
    y_full, _ = causal_conv1d(torch.cat([x, x_new[:, None]], 1), w, activation="silu")
    st_hf = state.clone()
    y_hf_step = raw(qwen3_next.causal_conv1d_update)(x_new[:, :, None], st_hf, w, None, "silu")[:, :, 0]
    y_step = causal_conv1d_update(x_new, state, w, activation="silu")
    assert rel(y_step, y_full[:, -1]) <= 1e-6 and rel(y_step, y_hf_step) <= 1e-6
    assert torch.equal(state, st_hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_transformers_bitwise(dtype):
    D = 64
    x = torch.randn(3, 5, D).to(dtype)
    z = torch.randn(3, 5, D).to(dtype)
    w = torch.randn(D).to(dtype)
    zc = qwen3_next.Qwen3NextRMSNorm(D, eps=1e-6).to(dtype)
    zc.weight.data = w.clone()
    assert torch.equal(rms_norm(x, w, 1e-6, zero_centered=True), zc(x))
    gated = qwen3_next.Qwen3NextRMSNormGated(D, eps=1e-6).to(dtype)
    gated.weight.data = w.clone()
    assert torch.equal(gated_rms_norm(x, z, w, 1e-6, activation="silu"), gated(x, z))
    kimi_norm = kimi.KimiLinearRMSNorm(D, eps=1e-5).to(dtype)
    kimi_norm.weight.data = w.clone()
    assert torch.equal(rms_norm(x, w, 1e-5), kimi_norm(x))
    kimi_gated = kimi.KimiLinearRMSNormGated(D, eps=1e-5).to(dtype)
    kimi_gated.weight.data = w.clone()
    assert torch.equal(gated_rms_norm(x, z, w, 1e-5, activation="sigmoid", fp32_output=True), kimi_gated(x, z))
