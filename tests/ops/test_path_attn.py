"""PaTH attention: the blockwise UT form against the token-by-token reference in float64 (outputs and the
gradients of every input), the reference against explicit Householder products, varlen, and bad input.

Tolerance: relative error <= 1e-10; both paths are exact algebra in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from float64_check import F64, check_chunk_equals_naive, rel

from hybridlm.ops import path_attention

TOL = 1e-10



def make(B, T, HQ, H, K, V, *, dtype=F64):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    w = F.normalize(r(B, T, H, K), dim=-1)
    beta = 2 * torch.rand(B, T, H, generator=gen, dtype=dtype)
    g = -1.5 * torch.rand(B, T, HQ, generator=gen, dtype=dtype)
    return dict(q=r(B, T, HQ, K), k=r(B, T, H, K), v=r(B, T, H, V), w=w, g=g, beta=beta)


def run(x, **kw):
    return path_attention(x["q"], x["k"], x["v"], x["w"], g=x["g"], beta=x["beta"], **kw)


def explicit(x, b: int, hq: int, scale: float) -> torch.Tensor:
    """One (batch, query head) by the definition: the Householder product written out as matrices."""
    q, g = x["q"][b, :, hq], x["g"][b, :, hq]
    hk = hq // (x["q"].shape[2] // x["k"].shape[2])
    k, v, w, beta = (x[n][b, :, hk] for n in ("k", "v", "w", "beta"))
    T, K = k.shape
    G = g.cumsum(0)
    logit = torch.full((T, T), float("-inf"), dtype=F64)
    for i in range(T):
        P = torch.eye(K, dtype=F64)  # H_i ... H_{j+1}, built from j = i downwards
        for j in range(i, -1, -1):
            logit[i, j] = scale * q[i] @ P @ k[j] + G[i] - G[j]
            P = P @ (torch.eye(K, dtype=F64) - beta[j] * torch.outer(w[j], w[j]))
    return logit.softmax(-1) @ v


def test_reference_is_the_definition():
    x = make(2, 19, 4, 2, 6, 5)
    o = run(x, impl="naive", scale=0.3)
    for b, hq in ((0, 0), (1, 3), (0, 2)):
        assert rel(o[b, :, hq], explicit(x, b, hq, 0.3)) <= TOL


@pytest.mark.parametrize("T,chunk_size,ratio,gate", [(1, 16, 1, True), (63, 16, 2, False), (65, 64, 1, True),
                                                     (100, 16, 2, True), (64, 32, 1, False)])
def test_chunk_equals_naive_fp64_with_gradients(T, chunk_size, ratio, gate):
    x = make(2, T, 2 * ratio, 2, 16, 12)
    if not gate:
        x["g"] = None
    names = [n for n in ("q", "k", "v", "w", "g", "beta") if x[n] is not None]
    cot = torch.randn(2, T, 2 * ratio, 12, dtype=F64)
    o = check_chunk_equals_naive(run, x, names, cot, TOL, chunk_size=chunk_size)
    assert o.dtype == F64 and o.shape == (2, T, 2 * ratio, 12)


def test_varlen_equals_separate_sequences():
    lens = [1, 15, 40]
    x = make(1, sum(lens), 4, 2, 8, 8)
    cu = torch.tensor([0, 1, 16, 56], dtype=torch.int32)
    o_ref = run(x, impl="naive", cu_seqlens=cu)
    o = run(x, impl="chunk", cu_seqlens=cu, chunk_size=16)
    assert rel(o, o_ref) <= TOL
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):  # each sequence alone: nothing crosses a boundary
        alone = run({n: t[:, s:e] for n, t in x.items()}, impl="naive")
        assert rel(o[:, s:e], alone) <= TOL


def test_dtypes_and_empty():
    x = make(1, 9, 2, 2, 8, 4, dtype=torch.float32)
    assert run(x).dtype == torch.float32
    xb = {n: t.bfloat16() for n, t in x.items()}
    o = run(xb)
    assert o.dtype == torch.bfloat16 and torch.isfinite(o).all()
    e = make(1, 0, 2, 2, 8, 4)
    assert run(e).shape == (1, 0, 2, 4)


def good(**over):
    x = make(1, 8, 4, 2, 8, 6, dtype=torch.float32)
    x.update(over)
    return x


CASES = [
    ("q rank", dict(q=torch.randn(1, 8, 32)), ValueError, ["q", "rank 4", "(1, 8, 32)"]),
    ("k dims", dict(k=torch.randn(1, 8, 2, 7)), ValueError, ["k", "[B, T, H, K]", "(1, 8, 2, 7)"]),
    ("HQ not multiple", dict(k=torch.randn(1, 8, 3, 8)), ValueError, ["q", "multiple", "H=3", "HQ=4"]),
    ("v heads", dict(v=torch.randn(1, 8, 4, 6)), ValueError, ["v", "(1, 8, 2)", "(1, 8, 4, 6)"]),
    ("w shape", dict(w=torch.randn(1, 8, 4, 8)), ValueError, ["w", "(1, 8, 2, 8)", "(1, 8, 4, 8)"]),
    ("beta shape", dict(beta=torch.rand(1, 8, 4)), ValueError, ["beta", "(1, 8, 2)", "(1, 8, 4)"]),
    ("beta missing", dict(beta=None), ValueError, ["beta", "None"]),
    ("g per kv head", dict(g=-torch.rand(1, 8, 2)), ValueError, ["g", "(1, 8, 4)", "(1, 8, 2)"]),
    ("int w", dict(w=torch.ones(1, 8, 2, 8, dtype=torch.int64)), TypeError, ["w", "floating", "int64"]),
    ("mixed dtypes", dict(k=torch.randn(1, 8, 2, 8, dtype=F64)), TypeError, ["q", "k", "float64"]),
    ("impl", dict(impl="cuda"), ValueError, ["impl", "'cuda'"]),
    ("triton", dict(impl="triton"), RuntimeError, ["impl", "triton", "path_attention"]),
    ("chunk size", dict(chunk_size=48), ValueError, ["chunk_size", "48"]),
    ("cu_seqlens end", dict(cu_seqlens=torch.tensor([0, 5, 7])), ValueError, ["cu_seqlens", "T=8", "7"]),
    ("cu_seqlens dtype", dict(cu_seqlens=torch.tensor([0.0, 8.0])), TypeError, ["cu_seqlens", "float32"]),
]


@pytest.mark.parametrize("what,over,exc,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input(what, over, exc, words):
    kw = {n: over.pop(n) for n in ("impl", "chunk_size", "cu_seqlens") if n in over}
    with pytest.raises(exc) as info:
        run(good(**over), **kw)
    assert "\n" not in str(info.value)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
