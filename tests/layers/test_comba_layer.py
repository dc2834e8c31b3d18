"""The Comba layer: its forward against the paper's formulas written out token by token in float64, and a hybrid
with Comba layers under the model's contracts (packed documents, left padding, cache prefill + steps +
continuation, a gradient for every parameter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridlm import HybridConfig, HybridLM
from hybridlm.layers import Comba
from hybridlm.model.info import cache_bytes

F64 = torch.float64


def _layer_by_hand(m: Comba, x: torch.Tensor) -> torch.Tensor:
    """x: [B, T, D] float64. Projections, causal depthwise conv + SiLU, l2-normalised q and k, p = sigmoid(decay) k,
    q - D p, the Comba step per token, sigmoid-gated RMSNorm, output projection."""
    B, T, _ = x.shape
    H, HV, dk, dv = m.H, m.HV, m.dk, m.dv
    qkv = torch.cat([x @ m.q_proj.weight.T, x @ m.k_proj.weight.T, x @ m.v_proj.weight.T], dim=-1)
    W = m.conv1d.weight.shape[-1]
    qkv = F.silu(F.conv1d(F.pad(qkv.transpose(1, 2), (W - 1, 0)), m.conv1d.weight, groups=qkv.shape[-1]))
    qkv = qkv.transpose(1, 2)
    q, k, v = qkv.split([H * dk, H * dk, HV * dv], dim=-1)
    q, k, v = q.reshape(B, T, H, dk), k.reshape(B, T, H, dk), v.reshape(B, T, HV, dv)
    q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    p = torch.sigmoid(m.decay)[:, None] * k
    q = q - m.D[:, None] * p
    r = HV // H
    q, k, p = (t.repeat_interleave(r, dim=2) for t in (q, k, p))
    # the log-decay as the layer's gates compute it (glue.gdn_gates: exp(A_log) and the gate input in float32,
    # whatever the model's dtype), so that the comparison below holds at float64's precision
    g = -m.A_log.float().exp() * F.softplus((x @ m.a_proj.weight.T).float() + m.dt_bias)
    beta = torch.sigmoid(x @ m.b_proj.weight.T)
    S = x.new_zeros(B, HV, dk, dv)
    o = x.new_zeros(B, T, HV, dv)
    for t in range(T):
        for b in range(B):
            for h in range(HV):
                u = beta[b, t, h] * (v[b, t, h] - S[b, h].T @ p[b, t, h])
                S[b, h] = g[b, t, h].exp() * S[b, h] + torch.outer(k[b, t, h], u)
                o[b, t, h] = S[b, h].T @ (q[b, t, h] * dk**-0.5)
    gate = (x @ m.g_proj.weight.T).reshape(B, T, HV, dv)
    o = o / (o.pow(2).mean(-1, keepdim=True) + m.o_norm.eps).sqrt() * m.o_norm.weight * torch.sigmoid(gate)
    return o.reshape(B, T, HV * dv) @ m.o_proj.weight.T


def test_layer_matches_the_formulas_fp64():
    m = Comba(24, 2, 4, 8, 6).double()
    with torch.no_grad():  # parameters away from their inits, so that each one shows
        for prm in (m.decay, m.D, m.dt_bias):
            prm.normal_()
        m.o_norm.weight.normal_()
    x = torch.randn(2, 11, 24, dtype=F64)
    got = m(x)
    ref = _layer_by_hand(m, x)
    assert ((got - ref).norm() / ref.norm()).item() <= 1e-12


def _config(**over) -> HybridConfig:
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, linear_kind="comba", linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, intermediate_size=48, rope_theta=None)
    return HybridConfig(**{**base, **over})


def test_config_builds_comba_layers_and_refuses_unknown_kinds():
    model = HybridLM(_config())
    kinds = [type(blk.mixer).__name__ for blk in model.layers]
    assert kinds == ["Comba", "Comba", "Comba", "GatedAttention"]
    with pytest.raises(ValueError, match=r"linear_kind: expected one of \(.*'comba'.*\), got 'combo'"):
        _config(linear_kind="combo")


def test_packed_documents_equal_separate_forwards():
    model = HybridLM(_config()).eval()
    x = torch.randint(0, 64, (1, 30))
    cu = torch.tensor([0, 11, 12, 30], dtype=torch.int32)
    with torch.no_grad():
        packed = model(x, cu_seqlens=cu).logits
        parts = torch.cat([model(x[:, s:e]).logits for s, e in zip(cu.tolist(), cu.tolist()[1:])], dim=1)
    assert (packed - parts).abs().max() <= 1e-5


def test_left_padding_leaves_real_tokens_unchanged():
    model = HybridLM(_config()).eval()
    x = torch.randint(1, 64, (1, 20))
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), x], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 20, dtype=torch.long)], dim=1)
    with torch.no_grad():
        a = model(x).logits
        b = model(padded, attention_mask=mask).logits[:, 5:]
    assert (a - b).abs().max() <= 1e-5


def test_prefill_steps_and_continuation_equal_one_forward():
    model = HybridLM(_config()).eval()
    x = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        full = model(x).logits
        cache = model.new_cache()
        outs = [model(x[:, :29], cache=cache).logits]
        outs += [model(x[:, i:i + 1], cache=cache).logits for i in range(29, 35)]
        outs.append(model(x[:, 35:], cache=cache).logits)
    assert (torch.cat(outs, dim=1) - full).abs().max() <= 1e-4
    linear = [t for st in cache.layers[:3] for t in (st.conv, st.recurrent)]
    assert sum(t.numel() * t.element_size() for t in linear) == 2 * cache_bytes(model.config, 4).state_per_sequence


def test_backward_reaches_every_parameter_and_recompute_changes_nothing():
    grads = {}
    x = torch.randint(0, 64, (2, 12))
    for rc in (False, True):
        torch.manual_seed(0)
        model = HybridLM(_config(linear_recompute=rc))
        loss = torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), x.flatten())
        loss.backward()
        assert [n for n, p in model.named_parameters() if p.grad is None] == []
        grads[rc] = [p.grad for p in model.parameters()]
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(grads[False], grads[True]))

