"""MesaNet: the chunked form against the token-by-token reference in float64, the reference against the closed
form of the regression it solves, conjugate gradient against the exact solve, and the bad-input errors.

Tolerance: relative error (||a - b|| / ||b||) <= 1e-10 wherever both sides are exact algebra in float64.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from float64_check import F64, draw_seed, rel

from hybridlm.ops import mesa_net

TOL = 1e-10




def make_inputs(B, T, H, HV, K, V, *, n_states=None, dtype=F64):
    """Keys of norm ~1 (as after the layer's l2 norm), log-decays in [-1, 0), beta in [0, 1), lambda in
    [0.25, 1.25) (fla's lower bound) and a symmetric positive semi-definite initial key covariance."""
    gen = torch.Generator().manual_seed(draw_seed())
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K) * K**-0.5, r(B, T, HV, V)
    g = -torch.rand(B, T, HV, generator=gen, dtype=dtype)
    beta = torch.rand(B, T, HV, generator=gen, dtype=dtype)
    lamb = 0.25 + torch.rand(HV, K, generator=gen, dtype=dtype)
    a = r(n_states or B, HV, K, K) * K**-0.5
    h0 = a @ a.transpose(-1, -2)
    s0 = r(n_states or B, HV, K, V)
    return q, k, v, g, beta, lamb, (h0, s0)


def run(impl, q, k, v, g, beta, lamb, state, **kw):
    return mesa_net(q, k, v, g=g, beta=beta, lamb=lamb, initial_state=state, output_final_state=True, impl=impl,
                    **kw)


def assert_close(got, ref, tol=TOL):
    (o, (h, s)), (o_r, (h_r, s_r)) = got, ref
    for name, a, b in (("o", o, o_r), ("H", h, h_r), ("G", s, s_r)):
        assert a.dtype == b.dtype and rel(a, b) <= tol, (name, rel(a, b))


# T against chunk size (the chunk edges), with GVA, K != V, the state and the l2 norm spread over the cases
GRID = [(T, cs, (1, 2)[(i + j) % 2], (i + j) % 2 == 0, i % 2 == 1)
        for i, T in enumerate([1, 63, 65, 100]) for j, cs in enumerate([16, 64])]


@pytest.mark.parametrize("T,chunk_size,ratio,with_state,l2", GRID)
def test_chunk_equals_naive_fp64(T, chunk_size, ratio, with_state, l2):
    q, k, v, g, beta, lamb, state = make_inputs(2, T, 2, 2 * ratio, 16, 24)
    kw = dict(use_qk_l2norm=l2)
    state = state if with_state else None
    ref = run("naive", q, k, v, g, beta, lamb, state, **kw)
    got = run("chunk", q, k, v, g, beta, lamb, state, chunk_size=chunk_size, **kw)
    assert got[0].dtype == F64 and got[1][0].dtype == F64
    assert_close(got, ref)


def test_naive_is_the_regularised_regression():
    """o_t = (sum_j w_tj v_j k_j^T) (sum_j w_tj k_j k_j^T + diag(lambda))^{-1} q_t with w_tj = beta_j prod_{j<s<=t}
    e^{g_s}: the fit of every key seen so far to its value, built here from its definition, not by recurrence."""
    q, k, v, g, beta, lamb, _ = make_inputs(1, 12, 2, 2, 6, 5)
    o, _ = mesa_net(q, k, v, g=g, beta=beta, lamb=lamb, scale=1.0, impl="naive")
    cum = g.cumsum(1)  # [1, T, H]
    for t in range(q.shape[1]):
        w = (cum[:, t : t + 1] - cum[:, : t + 1]).exp() * beta[:, : t + 1]  # [1, t+1, H]
        Hm = torch.einsum("bjh,bjhk,bjhl->bhkl", w, k[:, : t + 1], k[:, : t + 1]) + torch.diag_embed(lamb)
        Gm = torch.einsum("bjh,bjhk,bjhv->bhkv", w, k[:, : t + 1], v[:, : t + 1])
        x = torch.linalg.solve(Hm, q[:, t].unsqueeze(-1)).squeeze(-1)
        assert rel(o[:, t], torch.einsum("bhk,bhkv->bhv", x, Gm)) <= TOL, t


def _grads(impl, cot_seed, q, k, v, g, beta, lamb, state, **kw):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta, lamb, *state)]
    q, k, v, g, beta, lamb, h0, s0 = leaves
    o, (h, s) = run(impl, q, k, v, g, beta, lamb, (h0, s0), **kw)
    # random cotangents on the output and both final states: every path through the states is exercised
    gen = torch.Generator().manual_seed(cot_seed)
    loss = sum((x * torch.randn(x.shape, generator=gen, dtype=x.dtype)).sum() for x in (o, h, s))
    return torch.autograd.grad(loss, leaves)


NAMES = ["dq", "dk", "dv", "dg", "dbeta", "dlamb", "dH0", "dG0"]


@pytest.mark.parametrize("T,chunk_size,ratio,l2", [(1, 16, 1, False), (63, 16, 2, True), (65, 64, 1, True),
                                                    (100, 64, 2, False)])
def test_gradients_chunk_equal_naive_fp64(T, chunk_size, ratio, l2):
    inputs = make_inputs(1, T, 2, 2 * ratio, 8, 12)
    cot = draw_seed()
    ref = _grads("naive", cot, *inputs, use_qk_l2norm=l2)
    got = _grads("chunk", cot, *inputs, use_qk_l2norm=l2, chunk_size=chunk_size)
    for name, a, b in zip(NAMES, got, ref):
        assert rel(a, b) <= TOL, (name, rel(a, b))


def test_gradcheck_naive():
    q, k, v, g, beta, lamb, (h0, s0) = make_inputs(1, 4, 1, 1, 3, 2)
    inputs = [x.requires_grad_(True) for x in (q, k, v, g, beta, lamb, h0, s0)]

    def f(q, k, v, g, beta, lamb, h0, s0):
        o, (h, s) = run("naive", q, k, v, g, beta, lamb, (h0, s0), use_qk_l2norm=True)
        return o, h, s

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("impl", ["naive", "chunk"])
def test_varlen_equals_one_by_one(impl):
    lens = [1, 15, 40, 0, 33]
    T = sum(lens)
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    q, k, v, g, beta, lamb, (h0, s0) = make_inputs(1, T, 2, 2, 8, 12, n_states=len(lens))
    o, (h, s) = run(impl, q, k, v, g, beta, lamb, (h0, s0), cu_seqlens=cu, chunk_size=16, use_qk_l2norm=True)
    for n in range(len(lens)):
        a, b = cu[n].item(), cu[n + 1].item()
        o_n, (h_n, s_n) = run("naive", q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], lamb,
                              (h0[n : n + 1], s0[n : n + 1]), use_qk_l2norm=True)
        if b > a:
            assert rel(o[:, a:b], o_n) <= TOL, n
        assert rel(h[n : n + 1], h_n) <= TOL and rel(s[n : n + 1], s_n) <= TOL, n


def test_varlen_gradients_chunk_equal_naive_fp64():
    lens = [1, 15, 40]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)))
    inputs = make_inputs(1, sum(lens), 2, 2, 8, 12, n_states=len(lens))
    cot = draw_seed()
    ref = _grads("naive", cot, *inputs, cu_seqlens=cu)
    got = _grads("chunk", cot, *inputs, cu_seqlens=cu, chunk_size=16)
    for name, a, b in zip(NAMES, got, ref):
        assert rel(a, b) <= TOL, (name, rel(a, b))


@pytest.mark.parametrize("split", [1, 37, 64])
def test_split_with_state_carried_equals_one_call(split):
    q, k, v, g, beta, lamb, state = make_inputs(2, 100, 2, 2, 8, 12)
    kw = dict(use_qk_l2norm=True, chunk_size=32)
    o, st = run("chunk", q, k, v, g, beta, lamb, state, **kw)
    a, b = slice(None, split), slice(split, None)
    o1, st1 = run("chunk", q[:, a], k[:, a], v[:, a], g[:, a], beta[:, a], lamb, state, **kw)
    o2, st2 = run("chunk", q[:, b], k[:, b], v[:, b], g[:, b], beta[:, b], lamb, st1, **kw)
    assert_close((torch.cat([o1, o2], 1), st2), (o, st))


@pytest.mark.parametrize("T,chunk_size,iters", [(1, 16, 3), (65, 16, 5), (100, 64, 12)])
def test_cg_chunk_equals_cg_naive_fp64(T, chunk_size, iters):
    """The same iteration on two matrix-vector products: the explicit H_t + diag(lambda) token by token, and the
    chunk-start state plus intra-chunk terms."""
    inputs = make_inputs(2, T, 2, 2, 16, 24)
    ref = run("naive", *inputs, cg_iters=iters, use_qk_l2norm=True)
    got = run("chunk", *inputs, cg_iters=iters, use_qk_l2norm=True, chunk_size=chunk_size)
    assert_close(got, ref)


def test_cg_gradients_chunk_equal_naive_fp64():
    inputs = make_inputs(1, 40, 2, 2, 8, 12)
    cot = draw_seed()
    ref = _grads("naive", cot, *inputs, cg_iters=4)
    got = _grads("chunk", cot, *inputs, cg_iters=4, chunk_size=16)
    for name, a, b in zip(NAMES, got, ref):
        assert rel(a, b) <= TOL, (name, rel(a, b))


def test_cg_converges_to_the_exact_solve():
    """lambda >= 0.25 and unit keys keep H_t + diag(lambda) well conditioned: 3K steps reach float64 rounding,
    and a few steps are already a rough answer (what fla trains with at 30 steps and K = 128)."""
    inputs = make_inputs(2, 70, 2, 2, 16, 24)
    exact = run("chunk", *inputs, use_qk_l2norm=True)
    assert_close(run("chunk", *inputs, use_qk_l2norm=True, cg_iters=48), exact, tol=1e-9)
    rough = rel(run("chunk", *inputs, use_qk_l2norm=True, cg_iters=4)[0], exact[0])
    assert 1e-9 < rough < 0.3, rough


def test_scale_only_rescales_the_output():
    q, k, v, g, beta, lamb, state = make_inputs(1, 20, 2, 2, 8, 12)
    o1, _ = run("chunk", q, k, v, g, beta, lamb, state, scale=1.0)
    o2, _ = run("chunk", q, k, v, g, beta, lamb, state)
    assert rel(o2, o1 * 8**-0.5) <= TOL


def test_empty_sequence_returns_empty_outputs():
    q, k, v, g, beta, lamb, state = make_inputs(2, 0, 2, 2, 8, 12)
    o, st = run("chunk", q, k, v, g, beta, lamb, state)
    assert o.shape == (2, 0, 2, 12) and st[0] is state[0] and st[1] is state[1]
    o, (h, s) = run("chunk", q, k, v, g, beta, lamb, None)
    assert h.shape == (2, 2, 8, 8) and s.shape == (2, 2, 8, 12) and not h.any() and not s.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_fp32_state_and_dtype(dtype):
    q, k, v, g, beta, lamb, state = make_inputs(1, 70, 2, 2, 16, 16)
    o_ref, (h_ref, s_ref) = run("naive", q, k, v, g, beta, lamb, state, use_qk_l2norm=True)
    cast = lambda x: x.to(dtype)  # noqa: E731
    o, (h, s) = run("chunk", cast(q), cast(k), cast(v), g.float(), beta.float(), lamb.float(),
                    tuple(x.float() for x in state), use_qk_l2norm=True)
    assert o.dtype == dtype and h.dtype == s.dtype == torch.float32
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert rel(o.double(), o_ref) <= tol and rel(h.double(), h_ref) <= tol and rel(s.double(), s_ref) <= tol


def _call(**over):
    B, T, H, K, V = 1, 8, 2, 8, 6
    kw = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, H, V),
              g=-torch.rand(B, T, H), beta=torch.rand(B, T, H), lamb=torch.ones(H, K))
    kw.update(over)
    return mesa_net(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)


BAD = [
    # (what is wrong, overrides, exception, words the message must contain)
    ("q rank", dict(q=torch.randn(1, 8, 16)), ValueError, ["q", "rank 4", "(1, 8, 16)"]),
    ("k shape", dict(k=torch.randn(1, 8, 2, 7)), ValueError, ["k", "(1, 8, 2, 8)", "(1, 8, 2, 7)"]),
    ("g channel", dict(g=-torch.rand(1, 8, 2, 8)), ValueError, ["g", "(1, 8, 2)", "(1, 8, 2, 8)"]),
    ("g missing", dict(g=None), ValueError, ["g", "None"]),
    ("beta missing", dict(beta=None), ValueError, ["beta", "None"]),
    ("beta shape", dict(beta=torch.rand(1, 8, 3)), ValueError, ["beta", "(1, 8, 2)", "(1, 8, 3)"]),
    ("lamb shape", dict(lamb=torch.ones(2, 6)), ValueError, ["lamb", "(2, 8)", "[HV, K]", "(2, 6)"]),
    ("lamb dtype", dict(lamb=torch.ones(2, 8, dtype=torch.int64)), TypeError, ["lamb", "floating", "int64"]),
    ("state not a pair", dict(initial_state=torch.zeros(1, 2, 8, 6)), TypeError,
     ["initial_state", "pair", "Tensor"]),
    ("state H shape", dict(initial_state=(torch.zeros(1, 2, 8, 6), torch.zeros(1, 2, 8, 6))), ValueError,
     ["initial_state[0]", "(1, 2, 8, 8)", "(1, 2, 8, 6)"]),
    ("state G shape", dict(initial_state=(torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 8))), ValueError,
     ["initial_state[1]", "(1, 2, 8, 6)", "(1, 2, 8, 8)"]),
    ("state dtype", dict(initial_state=(torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 6, dtype=F64))), TypeError,
     ["initial_state[1]", "float32", "float64"]),
    ("cg_iters zero", dict(cg_iters=0), ValueError, ["cg_iters", "int >= 1", "0"]),
    ("cg_iters float", dict(cg_iters=2.5), ValueError, ["cg_iters", "2.5"]),
    ("chunk size", dict(chunk_size=48, impl="chunk"), ValueError, ["chunk_size", "48"]),
    ("impl", dict(impl="cuda"), ValueError, ["impl", "'cuda'"]),
    ("impl triton", dict(impl="triton"), RuntimeError, ["impl", "'triton'", "mesa_net"]),
    ("cu_seqlens wrong end", dict(cu_seqlens=torch.tensor([0, 5, 7])), ValueError, ["cu_seqlens", "T=8", "7"]),
]


@pytest.mark.parametrize("what,over,exc,words", BAD, ids=[c[0] for c in BAD])
def test_bad_input(what, over, exc, words):
    with pytest.raises(exc) as info:
        _call(**over)
    msg = str(info.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)
