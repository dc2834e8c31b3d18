"""Host copies of cu_seqlens (hybridlm.ops.offsets): read back once per tensor, or never when registered."""

from __future__ import annotations

import pytest
import torch

from hybridlm import HybridConfig, HybridLM
from hybridlm.ops.offsets import host_offsets, remember_offsets


def test_recorded_values_are_returned_without_reading_the_tensor():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert host_offsets(cu) == [0, 3, 7]
    # a record that disagrees with the tensor is what comes back: proof that the tensor was not read again
    remember_offsets(cu, [0, 1, 7])
    assert host_offsets(cu) == [0, 1, 7]


def test_an_in_place_change_is_seen():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert host_offsets(cu) == [0, 3, 7]
    cu[1] = 5
    assert host_offsets(cu) == [0, 5, 7]


def test_remember_checks_its_input():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"host: expected 3 offsets .* got 2"):
        remember_offsets(cu, [0, 7])
    assert remember_offsets(cu, torch.tensor([0, 3, 7])) is cu


@pytest.mark.parametrize("register", [False, True])
def test_packed_forward_backward_reads_the_offsets_at_most_once(monkeypatch, register):
    """A 4-layer hybrid on packed documents: every varlen op of every layer (validation, short conv, the linear
    recurrence), forward and backward, shares one host copy: one read of the tensor, none when registered."""
    cfg = HybridConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48)
    model = HybridLM(cfg)
    x = torch.randint(0, 64, (1, 20))
    cu = torch.tensor([0, 6, 13, 20], dtype=torch.int32)
    if register:
        remember_offsets(cu, [0, 6, 13, 20])
    reads = []
    tolist = torch.Tensor.tolist

    def counting_tolist(self):
        if self is cu:
            reads.append(1)
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    model(x, cu_seqlens=cu).logits.square().mean().backward()
    assert len(reads) == (0 if register else 1)


def test_inference_tensors_are_read_on_every_use_and_never_recorded():
    """No version counter to tell a record from a stale one: an in-place change under inference_mode is seen, and
    a record asked for is not kept."""
    with torch.inference_mode():
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        assert host_offsets(cu) == [0, 3, 7]
        cu[1] = 5
        assert host_offsets(cu) == [0, 5, 7]
        assert remember_offsets(cu, [0, 1, 7]) is cu
        assert host_offsets(cu) == [0, 5, 7]


def test_packed_model_forward_under_inference_mode_equals_normal_mode():
    """A 2-layer hybrid on packed documents under torch.inference_mode (cu_seqlens an inference tensor, int64, as a
    server builds it) gives the logits of the same call outside it."""
    cfg = HybridConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48)
    model = HybridLM(cfg).eval()
    x = torch.randint(0, 64, (1, 20))
    with torch.no_grad():
        want = model(x, cu_seqlens=torch.tensor([0, 6, 13, 20])).logits
    with torch.inference_mode():
        got = model(x, cu_seqlens=torch.tensor([0, 6, 13, 20])).logits
    assert got.is_inference() and torch.equal(got, want)
