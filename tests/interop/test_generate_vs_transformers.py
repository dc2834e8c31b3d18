"""Greedy generation equals transformers' generate token for token (ragged, left-padded batch). Models and prompts are
fresh random ones, so two logits can tie to float32 rounding: a first difference is accepted only at such a near tie
(our two candidates' logits within 1e-4, the bar of the float32 logit parity tests)."""

from __future__ import annotations

import pytest
import torch
from hf_models import FAMILIES, make_hf

from hybridlm import HybridLM


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(family, hf_and_folder):
    hf, folder = hf_and_folder(family)
    ours = HybridLM.from_pretrained(str(folder), dtype=torch.float32)
    x = torch.randint(3, 97, (2, 10))
    mask = torch.ones_like(x)
    mask[1, :4] = 0
    x = x.masked_fill(mask == 0, 0)
    with torch.no_grad():
        a = ours.generate(x, mask, max_new_tokens=8, pad_token_id=0)
        b = hf.generate(input_ids=x, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    msg = f"{family}:\nours {a[:, 10:].tolist()}\nhf   {b[:, 10:].tolist()}"
    assert a.shape == b.shape, msg
    if torch.equal(a, b):
        return
    j = int((a != b).any(0).nonzero()[0])  # the first step where a row differs: the prefixes before it agree
    r = int((a[:, j] != b[:, j]).nonzero()[0])
    full = torch.cat([mask, torch.ones(2, a.shape[1] - 10, dtype=mask.dtype)], 1)
    with torch.no_grad():
        logits = ours(a[r:r + 1, :j], attention_mask=full[r:r + 1, :j]).logits[0, -1]
    gap = (logits[a[r, j]] - logits[b[r, j]]).abs().item()
    assert gap <= 1e-4, f"{msg}\nrow {r} step {j - 10}: logit gap {gap:.3e}, not a near tie"


@pytest.mark.parametrize("family", ["qwen3_5", "olmo_hybrid"])
def test_repetition_penalty_matches_transformers(family, tmp_path):
    """Greedy with a repetition penalty, ragged batch: the same tokens as transformers' generate."""
    hf = make_hf(family, seed=2)
    hf.save_pretrained(str(tmp_path))
    ours = HybridLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    x = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    x = x.masked_fill(mask == 0, 0)
    with torch.no_grad():
        a = ours.generate(x, mask, max_new_tokens=12, pad_token_id=0, repetition_penalty=1.8)
        b = hf.generate(input_ids=x, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                        repetition_penalty=1.8)
        plain = ours.generate(x, mask, max_new_tokens=12, pad_token_id=0)
    assert torch.equal(a, b), f"{family}:\nours {a[:, 10:].tolist()}\nhf   {b[:, 10:].tolist()}"
    assert not torch.equal(a, plain), "the penalty changed nothing: the test cannot tell it is applied"
