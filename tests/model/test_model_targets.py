"""HybridLM with targets: the fused head + loss equals cross-entropy on the model's own logits, packed or not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridlm import HybridConfig, HybridLM


def _config(tied: bool) -> HybridConfig:
    return HybridConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                        tie_word_embeddings=tied)


@pytest.mark.parametrize("tied", [False, True])
def test_targets_loss_and_grads_equal_logits_cross_entropy(tied):
    seed = 7 + tied
    torch.manual_seed(seed)
    model = HybridLM(_config(tied)).double()
    x = torch.randint(0, 64, (1, 30))
    tg = torch.randint(0, 64, (1, 30))
    tg[0, [4, 10, 29]] = -100
    cu = torch.tensor([0, 5, 11, 30], dtype=torch.int32)
    out = model(x, cu_seqlens=cu, targets=tg)
    assert out.logits is None and out.loss.dtype == torch.float64
    out.loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = F.cross_entropy(model(x, cu_seqlens=cu).logits.flatten(0, 1), tg.flatten(), ignore_index=-100,
                          reduction="sum")
    ref.backward()
    assert abs(out.loss.item() - ref.item()) <= 1e-10, f"seed {seed}"
    for n, p in model.named_parameters():
        err = (fused[n] - p.grad).abs().max().item()
        assert err <= 1e-10, f"seed {seed}: {n} gradient error {err}"


def test_targets_shape_is_checked():
    model = HybridLM(_config(False))
    with pytest.raises(ValueError, match=r"targets: expected shape \(1, 6\)"):
        model(torch.zeros(1, 6, dtype=torch.long), targets=torch.zeros(1, 5, dtype=torch.long))
