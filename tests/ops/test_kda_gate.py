"""Kimi's gate inside `kda` (A_log, dt_bias, lower_bound) against a float64 token loop that applies the gate
outside, written here from its definition: outputs, final state and the gradients of raw, A_log, dt_bias, q, k, v,
beta and the initial state, for both gate forms, on the token loop and the chunkwise impls, with GVA and varlen.
Plus the one-line errors of bad gate arguments.

Tolerance: relative error <= 1e-10 per tensor (exact algebra in float64 on both sides)."""

from __future__ import annotations

import pytest
import torch
from float64_check import F64, draw_seed, rel

from hybridlm.ops import kda

TOL = 1e-10


def gate_by_definition(raw, A_log, dt_bias, lower_bound):
    """raw [B, T, HV, K] -> log-decay, elementwise as Kimi's gate is defined (softplus(x) = x above 20)."""
    HV, K = raw.shape[-2:]
    x = raw + (0 if dt_bias is None else dt_bias.reshape(HV, K))
    a = torch.ones(HV, 1, dtype=raw.dtype) if A_log is None else torch.exp(A_log).reshape(HV, 1)
    if lower_bound is None:
        return -a * torch.where(x > 20, x, torch.log(1 + torch.exp(torch.clamp(x, max=20))))
    return lower_bound / (1 + torch.exp(-a * x))


def token_loop(q, k, v, g, beta, h0, offsets):
    """o_t = S_t^T (q_t / sqrt(K)), S_t = diag(e^{g_t}) S_{t-1} + beta_t k_t (v_t - (diag(e^{g_t}) S_{t-1})^T k_t)^T;
    value head h reads key head h // (HV / H); each packed sequence starts from its own state."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    r = HV // H
    q, k = q.repeat_interleave(r, dim=2) * K**-0.5, k.repeat_interleave(r, dim=2)
    outs, finals = [], []
    spans = [(b, 0, T, b) for b in range(B)] if offsets is None else [
        (0, s, e, n) for n, (s, e) in enumerate(zip(offsets, offsets[1:]))]
    o = [[None] * T for _ in range(B)]
    for b, s, e, n in spans:
        S = h0[n]
        for t in range(s, e):
            S = torch.exp(g[b, t])[..., None] * S
            u = v[b, t] - torch.einsum("hkv,hk->hv", S, k[b, t])
            S = S + beta[b, t][:, None, None] * torch.einsum("hk,hv->hkv", k[b, t], u)
            o[b][t] = torch.einsum("hkv,hk->hv", S, q[b, t])
        finals.append(S)
    outs = torch.stack([torch.stack(row) for row in o])
    return outs, torch.stack(finals)


def make(B, T, H, HV, K, V, gen, N=None):
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    q, k = r(B, T, H, K) * K**-0.5, r(B, T, H, K) * K**-0.5  # keys of norm ~1: a bounded state
    return dict(q=q, k=k, v=r(B, T, HV, V), raw=r(B, T, HV, K), beta=2 * torch.rand(B, T, HV, generator=gen,
                dtype=F64), A_log=torch.rand(HV, generator=gen, dtype=F64) * 2 - 1, dt_bias=r(HV * K) * 0.5,
                h0=r(N or B, HV, K, V))


CASES = [  # (name, B, T, H, HV, lower_bound, impl, offsets)
    ("softplus_chunk", 2, 37, 2, 2, None, "chunk", None),
    ("softplus_naive_gva2", 2, 9, 1, 2, None, "naive", None),
    ("lower_bound_chunk_gva2", 1, 70, 1, 2, -5.0, "chunk", None),
    ("lower_bound_naive", 2, 9, 2, 2, -2.5, "naive", None),
    ("softplus_chunk_varlen", 1, 40, 2, 4, None, "chunk", [0, 1, 16, 40]),
]


@pytest.mark.parametrize("name,B,T,H,HV,lower_bound,impl,offsets", CASES, ids=[c[0] for c in CASES])
def test_gate_in_op_equals_gate_outside_fp64(name, B, T, H, HV, lower_bound, impl, offsets):
    seed = draw_seed()
    gen = torch.Generator().manual_seed(seed)
    K, V = 8, 6
    x = make(B, T, H, HV, K, V, gen, None if offsets is None else len(offsets) - 1)
    names = list(x)
    cot_o = torch.randn(B, T, HV, V, generator=gen, dtype=F64)
    cot_s = torch.randn(x["h0"].shape, generator=gen, dtype=F64)
    cu = None if offsets is None else torch.tensor(offsets, dtype=torch.int32)

    def grads(run):
        leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
        o, s = run(**leaves)
        gs = torch.autograd.grad((o * cot_o).sum() + (s * cot_s).sum(), [leaves[n] for n in names])
        return {"o": o, "final_state": s, **{f"d{n}": g for n, g in zip(names, gs)}}

    def in_op(q, k, v, raw, beta, A_log, dt_bias, h0):
        return kda(q, k, v, g=raw, beta=beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                   initial_state=h0, output_final_state=True, cu_seqlens=cu, impl=impl, chunk_size=16)

    def outside(q, k, v, raw, beta, A_log, dt_bias, h0):
        return token_loop(q, k, v, gate_by_definition(raw, A_log, dt_bias, lower_bound), beta, h0, offsets)

    got, ref = grads(in_op), grads(outside)
    for n in ref:
        err = rel(got[n], ref[n])
        assert err <= TOL, f"{name} {n}: rel err {err:.3g} > {TOL} (seed {seed})"
    assert got["dA_log"].abs().max() > 0 and got["ddt_bias"].abs().max() > 0, f"{name}: no gate gradient (seed {seed})"


def test_lower_bound_without_A_log_fp64():
    """lower_bound alone (A_log None, no dt_bias): g = lower_bound * sigmoid(raw), as fla's chunk_kda takes it."""
    seed = draw_seed()
    gen = torch.Generator().manual_seed(seed)
    x = make(1, 11, 1, 2, 8, 4, gen)
    o, s = kda(x["q"], x["k"], x["v"], g=x["raw"], beta=x["beta"], lower_bound=-1.0, initial_state=x["h0"],
               output_final_state=True, impl="naive")
    o_ref, s_ref = token_loop(x["q"], x["k"], x["v"], gate_by_definition(x["raw"], None, None, -1.0), x["beta"],
                              x["h0"], None)
    assert rel(o, o_ref) <= TOL and rel(s, s_ref) <= TOL, f"seed {seed}"


def _call(**over):
    B, T, H, HV, K = 1, 4, 2, 4, 8
    kw = dict(g=torch.randn(B, T, HV, K), beta=torch.rand(B, T, HV), A_log=torch.zeros(HV),
              dt_bias=torch.zeros(HV * K))
    kw.update(over)
    return kda(torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, HV, 6), **kw)


BAD = [
    ("A_log shape", dict(A_log=torch.zeros(1, 1, 4, 1)), ValueError, ["A_log", "(4,)", "[HV]", "(1, 1, 4, 1)"]),
    ("A_log per channel", dict(A_log=torch.zeros(32)), ValueError, ["A_log", "(4,)", "(32,)"]),
    ("dt_bias shape", dict(dt_bias=torch.zeros(4, 8)), ValueError, ["dt_bias", "(32,)", "[HV * K]", "(4, 8)"]),
    ("dt_bias per head", dict(dt_bias=torch.zeros(4)), ValueError, ["dt_bias", "(32,)", "(4,)"]),
    ("A_log int", dict(A_log=torch.zeros(4, dtype=torch.int64)), TypeError, ["A_log", "floating", "int64"]),
    ("dt_bias without A_log", dict(A_log=None), ValueError, ["A_log", "dt_bias", "None"]),
    ("lower_bound str", dict(lower_bound="-5"), TypeError, ["lower_bound", "float", "str"]),
]


@pytest.mark.parametrize("what,over,exc,words", BAD, ids=[c[0] for c in BAD])
def test_bad_gate_arguments_one_line(what, over, exc, words):
    with pytest.raises(exc) as e:
        _call(**over)
    msg = str(e.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, f"{what}: {w!r} not in {msg!r}"
