"""Comba: the chunk form against the token loop in float64 (outputs, final states, gradients of every input),
varlen, GVA (both forms against a per-value-head loop written here), the link to Gated DeltaNet, low-precision
dtypes, float32 at log-decays down to -30 against float64, and bad input.

Tolerance: relative error (||a - b|| / ||b||) <= 1e-10, as for the other ops (exact algebra in float64).
"""

from __future__ import annotations

import pytest
import torch
from float64_check import F64, draw_seed, rel

from hybridlm.ops import comba, gated_delta_rule

TOL = 1e-10




def make_inputs(B, T, H, HV, K, V, *, dtype=F64, n_states=None):
    """q, k, p, v, g, beta, h0. k and p of norm ~1 (raw N(0, 1) keys of norm sqrt(K) make the transition expand
    without bound, which tests the inputs, not the algorithm); p = d k + noise, as the layer's p = d k."""
    gen = torch.Generator().manual_seed(draw_seed())
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    q, k = r(B, T, H, K), r(B, T, H, K) * K**-0.5
    p = 0.7 * k + 0.3 * r(B, T, H, K) * K**-0.5
    v = r(B, T, HV, V)
    g = -1.5 * torch.rand(B, T, HV, generator=gen, dtype=dtype)  # strong enough that a wrong decay shows
    beta = 1.5 * torch.rand(B, T, HV, generator=gen, dtype=dtype)
    h0 = r(n_states or B, HV, K, V)
    return q, k, p, v, g, beta, h0


GRID = [(1, 16, 1, True), (63, 16, 2, False), (65, 64, 1, True), (100, 16, 4, True), (100, 64, 2, False),
        (64, 64, 1, False)]


@pytest.mark.parametrize("T,chunk_size,ratio,with_state", GRID)
def test_chunk_equals_naive_fp64(T, chunk_size, ratio, with_state):
    H, K, V = 2, 16, 24
    q, k, p, v, g, beta, h0 = make_inputs(2, T, H, H * ratio, K, V)
    for l2 in (False, True):
        kw = dict(g=g, beta=beta, initial_state=h0 if with_state else None, output_final_state=True,
                  use_qk_l2norm=l2)
        o_ref, s_ref = comba(q, k, v, p, impl="naive", **kw)
        o, s = comba(q, k, v, p, impl="chunk", chunk_size=chunk_size, **kw)
        assert o.dtype == F64 and s.dtype == F64 and o.shape == (2, T, H * ratio, V)
        assert rel(o, o_ref) <= TOL, (l2, rel(o, o_ref))
        assert rel(s, s_ref) <= TOL, (l2, rel(s, s_ref))


def _grads(impl, cot_seed, inputs, **kw):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    q, k, p, v, g, beta, h0 = leaves
    o, s = comba(q, k, v, p, g=g, beta=beta, initial_state=h0, output_final_state=True, impl=impl, **kw)
    gen = torch.Generator().manual_seed(cot_seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=F64)).sum() + (s * torch.randn(s.shape, generator=gen,
                                                                                          dtype=F64)).sum()
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("T,chunk_size,ratio,l2", [(1, 16, 1, False), (65, 16, 2, True), (100, 64, 1, False)])
def test_gradients_chunk_equal_naive_fp64(T, chunk_size, ratio, l2):
    inputs = make_inputs(1, T, 2, 2 * ratio, 8, 12)
    cot = draw_seed()
    ref = _grads("naive", cot, inputs, use_qk_l2norm=l2)
    got = _grads("chunk", cot, inputs, use_qk_l2norm=l2, chunk_size=chunk_size)
    for name, a, b in zip(("q", "k", "p", "v", "g", "beta", "h0"), got, ref):
        assert rel(a, b) <= TOL, (name, rel(a, b))


def test_gradcheck_naive():
    """The reference's own gradients against finite differences (so the chunk form is not checked against an
    autograd graph that is wrong the same way)."""
    inputs = [x.requires_grad_(True) for x in make_inputs(1, 5, 1, 2, 3, 4)]

    def f(q, k, p, v, g, beta, h0):
        return comba(q, k, v, p, g=g, beta=beta, initial_state=h0, output_final_state=True, impl="naive")

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("impl", ["naive", "chunk"])
def test_varlen_equals_one_by_one(impl):
    """Packed sequences of lengths 1, 15 and 40, each from its own initial state, against separate calls (and the
    chunk form's packed call against the reference's)."""
    lens = [1, 15, 40]
    q, k, p, v, g, beta, h0 = make_inputs(1, sum(lens), 2, 4, 8, 12, n_states=len(lens))
    cu = torch.tensor([0, 1, 16, 56], dtype=torch.int32)
    kw = dict(use_qk_l2norm=True, output_final_state=True)
    o, s = comba(q, k, v, p, g=g, beta=beta, initial_state=h0, cu_seqlens=cu, impl=impl, chunk_size=16, **kw)
    o_ref, s_ref = comba(q, k, v, p, g=g, beta=beta, initial_state=h0, cu_seqlens=cu, impl="naive", **kw)
    assert rel(o, o_ref) <= TOL and rel(s, s_ref) <= TOL
    for n in range(len(lens)):
        a, b = int(cu[n]), int(cu[n + 1])
        sl = slice(a, b)
        o_n, s_n = comba(q[:, sl], k[:, sl], v[:, sl], p[:, sl], g=g[:, sl], beta=beta[:, sl],
                         initial_state=h0[n : n + 1], impl="naive", **kw)
        assert rel(o[:, sl], o_n) <= TOL, n
        assert rel(s[n : n + 1], s_n) <= TOL, n


@pytest.mark.parametrize("impl", ["naive", "chunk"])
def test_read_key_decayed_by_g_is_gated_delta_rule(impl):
    """Gated DeltaNet reads the decayed state with k (r = (e^g S)^T k = S^T (e^g k)), so Comba with p = e^g k is
    Gated DeltaNet: checked against the library's GDN op (its own token loop)."""
    q, k, _, v, g, beta, h0 = make_inputs(2, 70, 2, 2, 8, 12)  # H == HV: one g per key head
    p = k * g[..., None].exp()
    kw = dict(g=g, beta=beta, initial_state=h0, output_final_state=True)
    o, s = comba(q, k, v, p, impl=impl, chunk_size=32, **kw)
    o_ref, s_ref = gated_delta_rule(q, k, v, impl="naive", **kw)
    assert rel(o, o_ref) <= TOL and rel(s, s_ref) <= TOL


def test_state_carried_across_a_split_equals_one_call():
    q, k, p, v, g, beta, h0 = make_inputs(1, 50, 2, 2, 8, 8)
    kw = dict(output_final_state=True, impl="chunk", chunk_size=16)
    o, s = comba(q, k, v, p, g=g, beta=beta, initial_state=h0, **kw)
    o1, s1 = comba(q[:, :21], k[:, :21], v[:, :21], p[:, :21], g=g[:, :21], beta=beta[:, :21], initial_state=h0,
                   **kw)
    o2, s2 = comba(q[:, 21:], k[:, 21:], v[:, 21:], p[:, 21:], g=g[:, 21:], beta=beta[:, 21:], initial_state=s1,
                   **kw)
    assert rel(torch.cat([o1, o2], dim=1), o) <= TOL and rel(s2, s) <= TOL


def test_empty_sequence_passes_the_state_through():
    q, k, p, v, g, beta, h0 = make_inputs(1, 0, 2, 2, 8, 8)
    o, s = comba(q, k, v, p, g=g, beta=beta, initial_state=h0, output_final_state=True)
    assert o.shape == (1, 0, 2, 8) and torch.equal(s, h0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_inputs_float32_state_and_close_to_float64(dtype):
    inputs = make_inputs(1, 40, 2, 2, 16, 16)
    q, k, p, v, g, beta, h0 = inputs
    o_ref, s_ref = comba(q, k, v, p, g=g, beta=beta, initial_state=h0, output_final_state=True, impl="naive")
    q, k, p, v, g, beta = (x.to(dtype) for x in (q, k, p, v, g, beta))
    o, s = comba(q, k, v, p, g=g, beta=beta, initial_state=h0.float(), output_final_state=True, chunk_size=16)
    assert o.dtype == dtype and s.dtype == torch.float32
    # float32: rounding only; bfloat16: the inputs' own rounding (3 significant digits) through 40 steps
    bar = 1e-5 if dtype == torch.float32 else 5e-2
    assert rel(o.double(), o_ref) <= bar and rel(s.double(), s_ref) <= bar


# Bars ~5x above the worst of 40 seeds (o, state, dq/dk/dp/dv/dbeta <= 2e-7, dg 4.4e-7, dh0 1.1e-6: the initial
# state's gradient passes through the strongest decays): float32's own level. A misplaced decay is off by O(1).
STRONG_DECAY_TOL = {"o": 1e-6, "state": 1e-6, "dq": 1e-6, "dk": 1e-6, "dp": 1e-6, "dv": 1e-6, "dbeta": 1e-6,
                    "dg": 3e-6, "dh0": 1e-5}


def test_strong_decay_float32_matches_float64():
    """log-decays of -30 per step (every decay factor exp of a non-positive number, so nothing overflows): the
    float32 chunk form's output, final state and every gradient against the float64 token loop on the same inputs.
    The read sees the undecayed state, so the previous step still matters: a dropped or misplaced decay shows."""
    inputs = [x.float() for x in make_inputs(1, 64, 1, 1, 8, 8)]
    inputs[4] = 20 * inputs[4]  # log-decays in (-30, 0]
    inputs[4][:, 10:20] = -30.0  # and a run of the strongest
    gen = torch.Generator().manual_seed(draw_seed())
    cot = (torch.randn(1, 64, 1, 8, generator=gen, dtype=F64), torch.randn(1, 1, 8, 8, generator=gen, dtype=F64))

    def run(impl, dtype, **kw):
        leaves = [x.to(dtype).requires_grad_(True) for x in inputs]
        q, k, p, v, g, beta, h0 = leaves
        o, s = comba(q, k, v, p, g=g, beta=beta, initial_state=h0, output_final_state=True, impl=impl, **kw)
        grads = torch.autograd.grad((o.double() * cot[0]).sum() + (s.double() * cot[1]).sum(), leaves)
        return [o, s, *grads]

    ref = run("naive", F64)
    got = run("chunk", torch.float32, chunk_size=64)
    for name, a, b in zip(("o", "state", "dq", "dk", "dp", "dv", "dg", "dbeta", "dh0"), got, ref):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        assert rel(a.double(), b) <= STRONG_DECAY_TOL[name], (name, rel(a.double(), b))


def _gva_by_hand(q, k, p, v, g, beta, h0):
    """Comba with grouped values, one value head at a time: value head j reads key head j // (HV / H); q, k, p
    l2-normalised (x / sqrt(|x|^2 + 1e-6)), q scaled by K^-1/2; u = beta (v - S^T p), S = e^g S + k u^T,
    o = S^T q. Returns o [B, T, HV, V] and the final states [B, HV, K, V]."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    unit = lambda x: x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()  # noqa: E731
    q, k, p = unit(q) * K**-0.5, unit(k), unit(p)
    outs, finals = [], []
    for b in range(B):
        o_b, s_b = [], []
        for j in range(HV):
            h = j // (HV // H)
            S, o_j = h0[b, j], []
            for t in range(T):
                u = beta[b, t, j] * (v[b, t, j] - S.T @ p[b, t, h])
                S = g[b, t, j].exp() * S + torch.outer(k[b, t, h], u)
                o_j.append(S.T @ q[b, t, h])
            o_b.append(torch.stack(o_j))
            s_b.append(S)
        outs.append(torch.stack(o_b, dim=1))
        finals.append(torch.stack(s_b))
    return torch.stack(outs), torch.stack(finals)


@pytest.mark.parametrize("ratio", [2, 4])
@pytest.mark.parametrize("impl", ["naive", "chunk"])
def test_grouped_values_match_a_per_head_loop(ratio, impl):
    """HV = 2H and 4H, l2-normalised q, k, p: output, final state and every gradient against `_gva_by_hand`."""
    inputs = make_inputs(2, 21, 2, 2 * ratio, 8, 6)
    gen = torch.Generator().manual_seed(draw_seed())
    cot = (torch.randn(2, 21, 2 * ratio, 6, generator=gen, dtype=F64),
           torch.randn(2, 2 * ratio, 8, 6, generator=gen, dtype=F64))

    def run(fn):
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        o, s = fn(*leaves)
        return [o, s, *torch.autograd.grad((o * cot[0]).sum() + (s * cot[1]).sum(), leaves)]

    def op(q, k, p, v, g, beta, h0):
        return comba(q, k, v, p, g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True,
                     impl=impl, chunk_size=16)

    for name, a, b in zip(("o", "state", "dq", "dk", "dp", "dv", "dg", "dbeta", "dh0"), run(op), run(_gva_by_hand)):
        assert rel(a, b) <= TOL, (name, rel(a, b))


def test_recompute_changes_nothing():
    inputs = make_inputs(1, 33, 2, 2, 8, 8)
    cot = draw_seed()
    ref = _grads("chunk", cot, inputs, chunk_size=16)
    got = _grads("chunk", cot, inputs, chunk_size=16, recompute=True)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_auto_is_chunk_and_triton_is_a_clear_error():
    q, k, p, v, g, beta, h0 = make_inputs(1, 20, 1, 1, 8, 8)
    o_auto, _ = comba(q, k, v, p, g=g, beta=beta)
    o_chunk, _ = comba(q, k, v, p, g=g, beta=beta, impl="chunk")
    assert torch.equal(o_auto, o_chunk)
    with pytest.raises(RuntimeError, match=r"impl: 'triton' was asked for comba, but no Triton kernel"):
        comba(q, k, v, p, g=g, beta=beta, impl="triton")


def _bad(**over):
    q, k, p, v, g, beta, h0 = make_inputs(1, 8, 2, 4, 8, 6, dtype=torch.float32)
    args = dict(q=q, k=k, v=v, p=p)
    kw = dict(g=g, beta=beta, initial_state=h0.float())
    for name, val in over.items():
        (args if name in args else kw)[name] = val
    return comba(args["q"], args["k"], args["v"], args["p"], **kw)


@pytest.mark.parametrize("over,exc,match", [
    (dict(p=None), ValueError, r"p: expected the read keys.*\(1, 8, 2, 8\).*got None"),
    (dict(p=torch.zeros(1, 8, 2, 4)), ValueError, r"p: expected the shape of k \(1, 8, 2, 8\).*got \(1, 8, 2, 4\)"),
    (dict(p=torch.zeros(1, 8, 2, 8, dtype=torch.float64)), TypeError, r"p: expected the dtype of k torch.float32"),
    (dict(p=torch.zeros(1, 8, 2, 8, dtype=torch.int64)), TypeError, r"p: expected a floating dtype"),
    (dict(beta=None), ValueError, r"beta: expected a write-strength tensor.*got None"),
    (dict(g=torch.zeros(1, 8, 4, 8)), ValueError, r"g: expected shape \(1, 8, 4\) .*got \(1, 8, 4, 8\)"),
    (dict(g=None), ValueError, r"g: expected a log-decay tensor, got None"),
    (dict(beta=torch.zeros(1, 8, 2)), ValueError, r"beta: expected shape \(1, 8, 4\).*got \(1, 8, 2\)"),
    (dict(v=torch.zeros(1, 8, 3, 6)), ValueError, r"v: expected value heads HV to be a multiple of the key heads H=2"),
    (dict(initial_state=torch.zeros(1, 4, 8, 6, dtype=torch.float64)), TypeError,
     r"initial_state: expected dtype torch.float32 for torch.float32 inputs, got torch.float64"),
    (dict(initial_state=torch.zeros(2, 4, 8, 6)), ValueError, r"initial_state: expected shape \(1, 4, 8, 6\)"),
    (dict(chunk_size=48), ValueError, r"chunk_size: expected one of \(16, 32, 64, 128\), got 48"),
    (dict(impl="fast"), ValueError, r"impl: expected one of .*got 'fast'"),
])
def test_bad_input(over, exc, match):
    with pytest.raises(exc, match=match):
        _bad(**over)


def test_varlen_bad_input_and_keyword_only_gates():
    q, k, p, v, g, beta, _ = make_inputs(2, 8, 1, 1, 4, 4)
    with pytest.raises(ValueError, match=r"cu_seqlens.*B=1.*B=2"):
        comba(q, k, v, p, g=g, beta=beta, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(TypeError):
        comba(q, k, v, p, g, beta)  # gates are keyword-only
