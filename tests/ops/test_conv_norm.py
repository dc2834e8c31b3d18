"""Short conv and norms against their definitions written out by hand, in float64."""

from __future__ import annotations

import pytest
import torch

from hybridlm.ops import causal_conv1d, causal_conv1d_update, gated_rms_norm, l2norm, rms_norm

F64 = torch.float64


def conv_by_definition(x, w, bias, past):
    """y_t = bias + sum_i w[:, i] * x_{t-(W-1)+i}, with x before 0 read from `past` ([B, C, W], last column newest)."""
    B, T, C = x.shape
    W = w.shape[1]
    hist = torch.cat([past.transpose(1, 2), x], dim=1)  # [B, W+T, C], x_t at index W + t
    y = torch.zeros(B, T, C, dtype=x.dtype)
    for t in range(T):
        for i in range(W):
            y[:, t] += w[:, i] * hist[:, W + t - (W - 1) + i]
    return y + (0 if bias is None else bias)


@pytest.mark.parametrize("T,W,with_bias,with_state", [(1, 4, False, False), (7, 4, True, True), (3, 2, True, False),
                                                      (10, 4, False, True)])
def test_conv_matches_definition_and_state_chains(T, W, with_bias, with_state):
    B, C = 2, 5
    x, w = torch.randn(B, T, C, dtype=F64), torch.randn(C, W, dtype=F64)
    bias = torch.randn(C, dtype=F64) if with_bias else None
    past = torch.randn(B, C, W, dtype=F64) if with_state else torch.zeros(B, C, W, dtype=F64)
    y, state = causal_conv1d(x, w, bias, initial_state=past if with_state else None, output_final_state=True)
    torch.testing.assert_close(y, conv_by_definition(x, w, bias, past), rtol=1e-12, atol=1e-12)
    # the state is the last W inputs, so a following call continues the sequence exactly
    x2 = torch.randn(B, 3, C, dtype=F64)
    y2, _ = causal_conv1d(x2, w, bias, initial_state=state, activation="silu")
    y_all, _ = causal_conv1d(torch.cat([x, x2], 1), w, bias, initial_state=past if with_state else None,
                             activation="silu")
    torch.testing.assert_close(y2, y_all[:, T:], rtol=1e-12, atol=1e-12)
    # and so do single decode steps
    st = state.clone()
    for t in range(3):
        y_t = causal_conv1d_update(x2[:, t], st, w, bias, activation="silu")
        torch.testing.assert_close(y_t, y_all[:, T + t], rtol=1e-12, atol=1e-12)


def test_packed_conv_with_empty_documents_matches_definition():
    """Packed documents of 3, 0, 7, 0 positions (the glue's packed path, one call per document): each document's
    output is its conv by definition from its own initial state, an empty one passes its state through unchanged,
    and gradients reach every initial state."""
    from hybridlm.ops.glue import causal_conv1d as packed_conv1d

    C, W, bounds = 5, 4, [0, 3, 3, 10, 10]
    x, w, bias = torch.randn(1, 10, C, dtype=F64), torch.randn(C, W, dtype=F64), torch.randn(C, dtype=F64)
    h0 = torch.randn(4, C, W, dtype=F64, requires_grad=True)
    cu = torch.tensor(bounds, dtype=torch.int32)
    y, ht = packed_conv1d(x, w, bias, initial_state=h0, output_final_state=True, cu_seqlens=cu, impl="torch")
    for n, (s, e) in enumerate(zip(bounds, bounds[1:])):
        torch.testing.assert_close(y[:, s:e], conv_by_definition(x[:, s:e], w, bias, h0[n : n + 1].detach()),
                                   rtol=1e-12, atol=1e-12)
    for n in (1, 3):
        assert torch.equal(ht[n], h0[n]), f"empty document {n}: its state must pass through"
    (dh0,) = torch.autograd.grad(ht.sum() + y.sum(), [h0])
    assert torch.equal(dh0[1], torch.ones_like(dh0[1])) and torch.equal(dh0[3], torch.ones_like(dh0[3]))


def test_norms_match_definitions():
    x, z, w = torch.randn(4, 16, dtype=F64), torch.randn(4, 16, dtype=F64), torch.randn(16, dtype=F64)
    rms = (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    torch.testing.assert_close(rms_norm(x, w, 1e-6), w * x / rms, rtol=1e-12, atol=0)
    torch.testing.assert_close(rms_norm(x, w, 1e-6, zero_centered=True), (1 + w) * x / rms, rtol=1e-12, atol=0)
    torch.testing.assert_close(rms_norm(x, None, 1e-6), x / rms, rtol=1e-12, atol=0)
    silu = z * torch.sigmoid(z)
    torch.testing.assert_close(gated_rms_norm(x, z, w, 1e-6), w * x / rms * silu, rtol=1e-12, atol=0)
    torch.testing.assert_close(gated_rms_norm(x, z, w, 1e-6, activation="sigmoid", fp32_output=True),
                               w * x / rms * torch.sigmoid(z), rtol=1e-12, atol=0)
    torch.testing.assert_close(l2norm(x), x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt(), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="activation.*'relu'"):
        gated_rms_norm(x, z, w, activation="relu")
    with pytest.raises(ValueError, match=r"gate.*\(4, 16\).*\(4, 8\)"):
        gated_rms_norm(x, z[:, :8], w)
