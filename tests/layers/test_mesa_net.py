"""The MesaNet layer: its cache (the (H, G) pair, constant size, counted by the memory formula), the
conjugate-gradient option against the exact solve, and the op's float32 solve under autocast.

The model-level contracts (packed documents, left padding, prefill + decode steps == one forward, gradients to
every parameter, linear_recompute) run for MesaNet through the "mesa" entry of tests/model/test_model.py."""

from __future__ import annotations

import torch

from hybridlm import HybridConfig, HybridLM
from hybridlm.layers import MesaNet
from hybridlm.model.info import cache_bytes
from hybridlm.ops import mesa_net


def tiny_config() -> HybridConfig:
    return HybridConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, linear_kind="mesa",
                        layer_types=["linear_attention", "full_attention", "linear_attention"],
                        mlp_types=["dense"] * 3, linear_num_key_heads=2, linear_num_value_heads=2,
                        linear_key_head_dim=8, linear_value_head_dim=12, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, intermediate_size=48)


def test_cache_is_the_pair_of_covariances_and_matches_the_formula():
    cfg = tiny_config()
    model = HybridLM(cfg).eval().to(torch.bfloat16)
    cb = cache_bytes(cfg, dtype_bytes=2)
    for T in (16, 48):
        cache = model.new_cache()
        with torch.no_grad():
            model(torch.randint(0, 64, (3, T)), cache=cache)
        assert cache.nbytes() == cb.total(T, batch=3)
        for st, lt in zip(cache.layers, cfg.layer_types):
            if lt == "linear_attention":
                h, s = st.recurrent
                assert h.shape == (3, 2, 8, 8) and s.shape == (3, 2, 8, 12)
                assert h.dtype == s.dtype == torch.float32


def test_layer_cg_approaches_the_exact_solve():
    layer = MesaNet(32, 2, 8, 12).double()
    x = torch.randn(2, 50, 32, dtype=torch.float64)
    with torch.no_grad():
        exact = layer(x)
        layer.cg_iters = 24
        cg = layer(x)
    assert ((cg - exact).norm() / exact.norm()).item() <= 1e-9


def test_output_gate_layer_runs_and_backpropagates():
    layer = MesaNet(32, 2, 8, 8, output_gate=True, cg_iters=5)
    x = torch.randn(1, 20, 32, requires_grad=True)
    layer(x).square().sum().backward()
    assert all(p.grad is not None for p in layer.parameters())
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_op_solves_in_float32_under_autocast():
    B, T, H, K, V = 1, 30, 2, 8, 8
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    kw = dict(g=-torch.rand(B, T, H), beta=torch.rand(B, T, H), lamb=0.25 + torch.rand(H, K), use_qk_l2norm=True)
    plain, _ = mesa_net(q, k, v, **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto, _ = mesa_net(q, k, v, **kw)
    assert auto.dtype == torch.float32 and torch.equal(auto, plain)
