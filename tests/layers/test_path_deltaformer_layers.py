"""PaTH / DeltaFormer layers inside a hybrid: a cache (prefill + steps + continuation) equals one forward, packed
documents equal separate forwards, left padding equals the unpadded row, all in float64 (the ops are exact there),
and generate runs."""

from __future__ import annotations

import pytest
import torch

from hybridlm import HybridConfig, HybridLM
from hybridlm.layers.history import key_padding

F64 = torch.float64
TOL = 1e-10


def config(kind: str) -> HybridConfig:
    return HybridConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3,
                        layer_types=["full_attention", "linear_attention", "full_attention"],
                        attention_kind=kind, path_forget_gate=kind == "path", num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, intermediate_size=48, linear_num_key_heads=2,
                        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)


def model(kind: str) -> HybridLM:
    m = HybridLM(config(kind)).to(F64).eval()
    with torch.no_grad():  # non-zero gate biases, so that a wrong gate shows
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return m


KINDS = ["path", "deltaformer"]


@pytest.mark.parametrize("kind", KINDS)
def test_cache_equals_one_forward(kind):
    m = model(kind)
    x = torch.randint(0, 64, (2, 30))
    with torch.no_grad():
        full = m(x).logits
        cache = m.new_cache()
        outs = [m(x[:, :17], cache=cache).logits]
        outs += [m(x[:, i:i + 1], cache=cache).logits for i in range(17, 21)]
        outs.append(m(x[:, 21:], cache=cache).logits)
    assert (torch.cat(outs, dim=1) - full).abs().max() <= TOL
    assert cache.seen_tokens == 30 and cache[0].k.shape[1] == 30


@pytest.mark.parametrize("kind", KINDS)
def test_packed_documents_equal_separate_forwards(kind):
    m = model(kind)
    lens = [5, 1, 20]
    x = torch.randint(0, 64, (1, sum(lens)))
    cu = torch.tensor([0, 5, 6, 26], dtype=torch.int32)
    with torch.no_grad():
        packed = m(x, cu_seqlens=cu).logits
        alone = torch.cat([m(x[:, s:e]).logits for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
    assert (packed - alone).abs().max() <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_left_padding_equals_unpadded_row_and_generate(kind):
    m = model(kind)
    x = torch.randint(1, 64, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batched = m(x, attention_mask=mask, position_ids=pos).logits
        row = m(x[1:, 4:]).logits
        assert (batched[1, 4:] - row[0]).abs().max() <= TOL
        assert (batched[0] - m(x[:1]).logits[0]).abs().max() <= TOL
        out = m.generate(x, attention_mask=mask, max_new_tokens=3)
        alone = m.generate(x[1:, 4:], max_new_tokens=3)
    assert out.shape == (2, 15) and torch.equal(out[1, 12:], alone[0, 8:])


@pytest.mark.parametrize("kind", KINDS)
def test_trains_in_float32(kind):
    m = HybridLM(config(kind)).train()
    x = torch.randint(0, 64, (2, 20))
    out = m(x, targets=x)
    out.loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_masks_other_than_key_padding_are_refused():
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    docs = causal.clone()
    docs[2:, :2] = False  # two packed documents
    assert key_padding(causal[None, None], 1, 4, 4).all()
    with pytest.raises(ValueError, match="mask: .*key padding only"):
        key_padding(docs[None, None], 1, 4, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_cache_bytes_match_the_formula(kind):
    from hybridlm.model.info import cache_bytes

    cfg = config(kind)
    m = HybridLM(cfg).eval().to(torch.bfloat16)
    cache = m.new_cache()
    with torch.no_grad():
        m(torch.randint(0, 64, (3, 16)), cache=cache)
    assert cache.nbytes() == cache_bytes(cfg, dtype_bytes=2).total(16, batch=3)
