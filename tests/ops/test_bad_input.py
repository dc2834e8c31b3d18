"""Every malformed call fails with an error that names the argument, the expected and the actual value."""

from __future__ import annotations

import pytest
import torch

from hybridlm.ops import causal_conv1d, delta_rule, gated_delta_rule, gated_linear_attention, kda, linear_attention


def good(B=1, T=8, H=2, HV=4, K=8, V=6, channel=False):
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, HV, V)
    g = -torch.rand(B, T, HV, K) if channel else -torch.rand(B, T, HV)
    return dict(q=q, k=k, v=v, g=g, beta=torch.rand(B, T, HV))


def call(fn=gated_delta_rule, **over):
    kw = good(channel=fn is kda)
    kw.update(over)
    q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
    return fn(q, k, v, **kw)


CASES = [
    # (what is wrong, overrides, exception, words the message must contain)
    ("q rank", dict(q=torch.randn(1, 8, 16)), ValueError, ["q", "rank 4", "(1, 8, 16)"]),
    ("v rank", dict(v=torch.randn(8, 4, 6)), ValueError, ["v", "rank 4", "(8, 4, 6)"]),
    ("k shape", dict(k=torch.randn(1, 8, 2, 7)), ValueError, ["k", "(1, 8, 2, 8)", "(1, 8, 2, 7)"]),
    ("v time", dict(v=torch.randn(1, 9, 4, 6)), ValueError, ["v", "(1, 8)", "(1, 9, 4, 6)"]),
    ("HV not multiple", dict(v=torch.randn(1, 8, 3, 6)), ValueError, ["v", "multiple", "H=2", "HV=3"]),
    ("g channel for GDN", dict(g=-torch.rand(1, 8, 4, 8)), ValueError, ["g", "(1, 8, 4)", "(1, 8, 4, 8)"]),
    ("beta shape", dict(beta=torch.rand(1, 8, 2)), ValueError, ["beta", "(1, 8, 4)", "(1, 8, 2)"]),
    ("g missing", dict(g=None), ValueError, ["g", "None"]),
    ("int q", dict(q=torch.ones(1, 8, 2, 8, dtype=torch.int64)), TypeError, ["q", "floating", "int64"]),
    ("complex v", dict(v=torch.randn(1, 8, 4, 6, dtype=torch.complex64)), TypeError, ["v", "complex64"]),
    ("state shape", dict(initial_state=torch.zeros(1, 4, 8, 5)), ValueError, ["initial_state", "(1, 4, 8, 6)"]),
    ("state dtype", dict(initial_state=torch.zeros(1, 4, 8, 6, dtype=torch.float64), impl="chunk"), TypeError,
     ["initial_state", "float32", "float64"]),
    ("chunk size", dict(chunk_size=48, impl="chunk"), ValueError, ["chunk_size", "48"]),
    ("impl", dict(impl="cuda"), ValueError, ["impl", "'cuda'"]),
    ("cu_seqlens dtype", dict(cu_seqlens=torch.tensor([0.0, 8.0])), TypeError, ["cu_seqlens", "int32", "float32"]),
    ("cu_seqlens not increasing", dict(cu_seqlens=torch.tensor([0, 5, 3, 8])), ValueError,
     ["cu_seqlens", "non-decreasing", "[0, 5, 3, 8]"]),
    ("cu_seqlens wrong end", dict(cu_seqlens=torch.tensor([0, 5, 7])), ValueError, ["cu_seqlens", "T=8", "7"]),
    ("cu_seqlens wrong start", dict(cu_seqlens=torch.tensor([1, 8])), ValueError, ["cu_seqlens", "start at 0"]),
]


@pytest.mark.parametrize("what,over,exc,words", CASES, ids=[c[0] for c in CASES])
def test_gdn_bad_input(what, over, exc, words):
    with pytest.raises(exc) as info:
        call(**over)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_cu_seqlens_needs_batch_one():
    kw = good(B=2)
    with pytest.raises(ValueError, match=r"cu_seqlens.*B=1.*B=2"):
        gated_delta_rule(kw["q"], kw["k"], kw["v"], g=kw["g"], beta=kw["beta"], cu_seqlens=torch.tensor([0, 8]))


def test_cu_seqlens_state_count():
    with pytest.raises(ValueError, match=r"initial_state.*\(2, 4, 8, 6\).*\(1, 4, 8, 6\)"):
        call(cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32), initial_state=torch.zeros(1, 4, 8, 6))


def test_kda_needs_channel_gate():
    with pytest.raises(ValueError, match=r"g: expected shape \(1, 8, 4, 8\).*got \(1, 8, 4\)"):
        call(kda, g=-torch.rand(1, 8, 4))


def test_ops_without_decay_refuse_g():
    kw = good()
    with pytest.raises(TypeError):  # g is not even a parameter of these ops
        delta_rule(kw["q"], kw["k"], kw["v"], g=kw["g"], beta=kw["beta"])
    with pytest.raises(TypeError):
        linear_attention(kw["q"], kw["k"], kw["v"], g=kw["g"])


def test_gates_are_keyword_only():
    kw = good()
    with pytest.raises(TypeError):
        gated_delta_rule(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"])
    with pytest.raises(TypeError):
        gated_linear_attention(kw["q"], kw["k"], kw["v"], kw["g"])


def test_triton_impl_without_kernel_is_a_clear_error():
    from hybridlm.ops import TRITON_KERNELS

    if "delta_rule" in TRITON_KERNELS:
        pytest.skip("a Triton delta_rule kernel is registered")
    kw = good()
    with pytest.raises(RuntimeError, match="triton.*delta_rule"):
        delta_rule(kw["q"], kw["k"], kw["v"], beta=kw["beta"], impl="triton")


def test_conv_bad_input():
    with pytest.raises(ValueError, match=r"weight: expected shape \[C=4, W\], got \(5, 3\)"):
        causal_conv1d(torch.randn(1, 3, 4), torch.randn(5, 3))
    with pytest.raises(ValueError, match=r"initial_state.*\(1, 4, 3\).*\(1, 4, 2\)"):
        causal_conv1d(torch.randn(1, 3, 4), torch.randn(4, 3), initial_state=torch.zeros(1, 4, 2))
    with pytest.raises(TypeError, match="x.*int64"):
        causal_conv1d(torch.ones(1, 3, 4, dtype=torch.int64), torch.randn(4, 3))
