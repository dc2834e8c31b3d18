"""Greedy generation equals transformers' generate token for token (ragged, left-padded batch)."""

from __future__ import annotations

import pytest
import torch
from hf_models import FAMILIES, make_hf

from hybridlm import HybridLM


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(family, tmp_path):
    hf = make_hf(family, seed=1)
    hf.save_pretrained(str(tmp_path))
    ours = HybridLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    x = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(x)
    mask[1, :4] = 0
    x = x.masked_fill(mask == 0, 0)
    with torch.no_grad():
        a = ours.generate(x, mask, max_new_tokens=8, pad_token_id=0)
        b = hf.generate(input_ids=x, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b), f"{family}:\nours {a[:, 10:].tolist()}\nhf   {b[:, 10:].tolist()}"
