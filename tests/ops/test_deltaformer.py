"""DeltaFormer attention: the triangular-solve form against the token-by-token recursion in float64 (outputs and
the gradients of every input), the recursion against a definition written with explicit sums, varlen, bad input.

Tolerance: relative error <= 1e-10; both paths are exact algebra in float64.
"""

from __future__ import annotations

import pytest
import torch
from float64_check import F64, check_chunk_equals_naive, rel

from hybridlm.ops import deltaformer_attention

TOL = 1e-10



def make(B, T, HQ, H, K, V, *, dtype=F64):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    return dict(q=r(B, T, HQ, K), k=r(B, T, H, K), v=r(B, T, H, V),
                beta=torch.rand(B, T, HQ, generator=gen, dtype=dtype))


def run(x, **kw):
    return deltaformer_attention(x["q"], x["k"], x["v"], beta=x["beta"], **kw)


def explicit(x, b: int, hq: int, scale: float) -> torch.Tensor:
    """One (batch, query head) by the definition, scalar sums over j with explicit exp-normalisation."""
    hk = hq // (x["q"].shape[2] // x["k"].shape[2])
    q, beta = x["q"][b, :, hq], x["beta"][b, :, hq]
    k, v = x["k"][b, :, hk], x["v"][b, :, hk]
    T = q.shape[0]
    u, o = [], []
    for i in range(T):
        e = [torch.exp(scale * q[i] @ k[j]) for j in range(i + 1)]
        write = sum((e[j] * u[j] for j in range(i)), torch.zeros_like(v[i])) / sum(e[:i]) if i else 0
        u.append(v[i] - beta[i] * write)
        o.append(sum(e[j] * u[j] for j in range(i + 1)) / sum(e))
    return torch.stack(o)


def test_reference_is_the_definition():
    x = make(2, 13, 4, 2, 6, 5)
    o = run(x, impl="naive", scale=0.4)
    for b, hq in ((0, 0), (1, 3), (1, 1)):
        assert rel(o[b, :, hq], explicit(x, b, hq, 0.4)) <= TOL


@pytest.mark.parametrize("T,ratio", [(1, 1), (63, 2), (65, 1), (100, 2)])
def test_chunk_equals_naive_fp64_with_gradients(T, ratio):
    x = make(2, T, 2 * ratio, 2, 16, 12)
    names = ("q", "k", "v", "beta")
    cot = torch.randn(2, T, 2 * ratio, 12, dtype=F64)
    o = check_chunk_equals_naive(run, x, names, cot, TOL)
    assert o.dtype == F64 and o.shape == (2, T, 2 * ratio, 12)


def test_varlen_equals_separate_sequences():
    x = make(1, 56, 2, 2, 8, 8)
    cu = torch.tensor([0, 1, 16, 56], dtype=torch.int64)
    o_ref = run(x, impl="naive", cu_seqlens=cu)
    o = run(x, impl="chunk", cu_seqlens=cu)
    assert rel(o, o_ref) <= TOL
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        assert rel(o[:, s:e], run({n: t[:, s:e] for n, t in x.items()}, impl="naive")) <= TOL


def test_dtypes_and_empty():
    x = make(1, 9, 2, 2, 8, 4, dtype=torch.float32)
    assert run(x).dtype == torch.float32
    o = run({n: t.bfloat16() for n, t in x.items()})
    assert o.dtype == torch.bfloat16 and torch.isfinite(o).all()
    assert run(make(1, 0, 2, 2, 8, 4)).shape == (1, 0, 2, 4)


CASES = [
    ("q rank", dict(q=torch.randn(1, 8, 32)), ValueError, ["q", "rank 4", "(1, 8, 32)"]),
    ("HQ not multiple", dict(k=torch.randn(1, 8, 3, 8), v=torch.randn(1, 8, 3, 6)), ValueError,
     ["q", "multiple", "H=3", "HQ=4"]),
    ("v time", dict(v=torch.randn(1, 9, 2, 6)), ValueError, ["v", "(1, 8, 2)", "(1, 9, 2, 6)"]),
    ("beta per kv head", dict(beta=torch.rand(1, 8, 2)), ValueError, ["beta", "(1, 8, 4)", "(1, 8, 2)"]),
    ("beta missing", dict(beta=None), ValueError, ["beta", "None"]),
    ("complex v", dict(v=torch.randn(1, 8, 2, 6, dtype=torch.complex64)), TypeError, ["v", "complex64"]),
    ("impl", dict(impl="cuda"), ValueError, ["impl", "'cuda'"]),
    ("triton", dict(impl="triton"), RuntimeError, ["impl", "triton", "deltaformer_attention"]),
    ("cu_seqlens batch", dict(q=torch.randn(2, 8, 4, 8), k=torch.randn(2, 8, 2, 8), v=torch.randn(2, 8, 2, 6),
                              beta=torch.rand(2, 8, 4), cu_seqlens=torch.tensor([0, 8])), ValueError,
     ["cu_seqlens", "B=1", "B=2"]),
]


@pytest.mark.parametrize("what,over,exc,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input(what, over, exc, words):
    x = make(1, 8, 4, 2, 8, 6, dtype=torch.float32)
    x.update(over)
    kw = {n: x.pop(n) for n in ("impl", "cu_seqlens") if n in x}
    with pytest.raises(exc) as info:
        run(x, **kw)
    assert "\n" not in str(info.value)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
