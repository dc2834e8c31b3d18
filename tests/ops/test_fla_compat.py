"""hybridlm.ops.fla (fla-core 0.6.0's call signatures over our ops) against a token-by-token float64 recurrence
written out here, with fla's input transforms spelled out from their definitions: beta = sigmoid(beta) (x2 with
allow_neg_eigval), the gates -exp(A_log) * softplus(g + dt_bias) and lower_bound * sigmoid(exp(A_log) * (g +
dt_bias)), the V-first state [N, HV, V, K], a decay or beta per value channel, and chunk_kda's states at chunk
starts. Outputs, final states and every gradient (A_log, dt_bias and the raw g included) within 1e-10 (relative,
per tensor); then fla's signatures (a table taken from fla 0.6.0), its output dtypes and its errors.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from float64_check import F64, draw_seed, rel

from hybridlm.ops.fla import chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule, fused_recurrent_kda

TOL = 1e-10
B, T, H, HV, K, V = 2, 37, 2, 4, 8, 6
CU = [0, 5, 5, 40, 74]  # varlen: a zero-length sequence, and sequences across the chunk edges of 16 and 32


# ------------------------------------------------------------------------------------------------ reference

def reference(q, k, v, *, decay, beta, scale=None, h0=None, l2=False, cu=None):
    """o_t = S_t^T (scale q_t), S_t = D_t * S_{t-1} + k_t (beta_t * (v_t - (D_t * S_{t-1})^T k_t))^T, one step at
    a time; D_t = exp(decay_t) elementwise on S [K, V]. decay: broadcastable to [B, T, HV, K, V]; beta: to
    [B, T, HV, V]; h0: [N, HV, K, V]. Returns (o, final states [N, HV, K, V], state after every token
    [B, T, HV, K, V])."""
    Bq, Tq, Hq, Kq = q.shape
    HVq, Vq = v.shape[2], v.shape[3]
    if l2:
        q, k = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6), k * torch.rsqrt((k * k).sum(-1, keepdim=True)
                                                                                      + 1e-6)
    q = q * (Kq**-0.5 if scale is None else scale)
    q, k = q.repeat_interleave(HVq // Hq, 2), k.repeat_interleave(HVq // Hq, 2)
    decay = decay.expand(Bq, Tq, HVq, Kq, Vq)
    beta = beta.expand(Bq, Tq, HVq, Vq)
    segs = [(b, 0, Tq) for b in range(Bq)] if cu is None else [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    outs, afters, finals = [[None] * Tq for _ in range(Bq)], [[None] * Tq for _ in range(Bq)], []
    for n, (b, s, e) in enumerate(segs):
        S = h0[n] if h0 is not None else q.new_zeros(HVq, Kq, Vq)
        for t in range(s, e):
            S = S * decay[b, t].exp()
            err = v[b, t] - torch.einsum("hkv,hk->hv", S, k[b, t])
            S = S + torch.einsum("hk,hv->hkv", k[b, t], beta[b, t] * err)
            outs[b][t] = torch.einsum("hkv,hk->hv", S, q[b, t])
            afters[b][t] = S
        finals.append(S)
    o = torch.stack([torch.stack(row) for row in outs])
    return o, torch.stack(finals), torch.stack([torch.stack(row) for row in afters])


def gdn_gate(g, A_log, dt_bias):
    return -A_log.exp() * F.softplus(g + (0 if dt_bias is None else dt_bias))


def kda_gate(g, A_log, dt_bias, lower_bound):
    x = g + (0 if dt_bias is None else dt_bias.view(g.shape[-2], g.shape[-1]))
    if lower_bound is None:
        return -A_log.exp().view(-1, 1) * F.softplus(x)
    return lower_bound * torch.sigmoid(x if A_log is None else A_log.exp().view(-1, 1) * x)


# ------------------------------------------------------------------------------------------------ helpers

def draw(seed, *, varlen=False, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    Bx, Tx = (1, CU[-1]) if varlen else (B, T)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=dtype)  # noqa: E731
    return dict(
        q=r(Bx, Tx, H, K) * K**-0.5, k=r(Bx, Tx, H, K) * K**-0.5, v=r(Bx, Tx, HV, V),
        g_head=-u(Bx, Tx, HV), g_key=-u(Bx, Tx, HV, K), g_value=-u(Bx, Tx, HV, V),
        raw_head=r(Bx, Tx, HV), raw_key=r(Bx, Tx, HV, K), beta=u(Bx, Tx, HV), beta_v=u(Bx, Tx, HV, V),
        logit=r(Bx, Tx, HV), A_log=r(HV) * 0.5, dt_bias_head=r(HV), dt_bias_key=r(HV * K),
        h0=r(len(CU) - 1 if varlen else Bx, HV, K, V),
    )


def compare(seed, ours_fn, ref_fn, leaves: dict, extra=""):
    """ours_fn(leaves) and ref_fn(leaves) -> (o, final state): equal within TOL, and so are the gradients of one
    random functional of both with respect to every leaf."""
    results = []
    for fn in (ours_fn, ref_fn):
        xs = {n: x.detach().clone().requires_grad_(True) for n, x in leaves.items()}
        o, ht = fn(xs)
        results.append((o, ht, xs))
    (o, ht, xs), (o_ref, ht_ref, xs_ref) = results
    gen = torch.Generator().manual_seed(seed + 1)
    do, dht = torch.randn(o.shape, generator=gen, dtype=F64), torch.randn(ht.shape, generator=gen, dtype=F64)
    names = list(leaves)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), [xs[n] for n in names], allow_unused=True)
    grads_ref = torch.autograd.grad((o_ref * do).sum() + (ht_ref * dht).sum(), [xs_ref[n] for n in names],
                                    allow_unused=True)
    where = f"(seed {seed}{extra})"
    assert o.shape == o_ref.shape and rel(o, o_ref) <= TOL, f"o: rel {rel(o, o_ref):.2e} {where}"
    assert ht.shape == ht_ref.shape and rel(ht, ht_ref) <= TOL, f"final state: rel {rel(ht, ht_ref):.2e} {where}"
    for n, a, b in zip(names, grads, grads_ref):
        assert a is not None and b is not None, f"d{n}: no gradient {where}"
        assert rel(a, b) <= TOL, f"d{n}: rel {rel(a, b):.2e} {where}"


def vk(h):  # [.., K, V] <-> [.., V, K]
    return h.transpose(-1, -2)


def beta_in(x, logits, neg):
    return torch.sigmoid(x["logit"]) * (2 if neg else 1) if logits else x["beta"]


# ------------------------------------------------------------------------------------------------ values

# (gate in the op, beta logits, allow_neg_eigval, state_v_first, varlen, l2 norm in the op, chunk_size)
GDN_CASES = [
    (False, False, False, False, False, False, 16),
    (True, False, False, False, False, True, 32),
    (True, True, True, True, False, False, 64),
    (False, True, False, True, True, True, 16),
    (True, False, False, False, True, False, 64),
]


@pytest.mark.parametrize("gate,logits,neg,v_first,varlen,l2,chunk_size", GDN_CASES)
def test_chunk_gated_delta_rule_matches_reference(gate, logits, neg, v_first, varlen, l2, chunk_size):
    seed = draw_seed()
    x = draw(seed, varlen=varlen)
    cu = torch.tensor(CU) if varlen else None
    leaves = {n: x[n] for n in ("q", "k", "v", "h0")}
    leaves.update({"g": x["raw_head"], "A_log": x["A_log"], "dt_bias": x["dt_bias_head"]} if gate
                  else {"g": x["g_head"]})
    leaves["logit" if logits else "beta"] = x["logit" if logits else "beta"]

    def ours(y):
        kw = dict(use_gate_in_kernel=True, A_log=y["A_log"], dt_bias=y["dt_bias"]) if gate else {}
        return chunk_gated_delta_rule(
            y["q"], y["k"], y["v"], y["g"], y["logit"] if logits else y["beta"],
            initial_state=vk(y["h0"]) if v_first else y["h0"], output_final_state=True,
            use_qk_l2norm_in_kernel=l2, use_beta_sigmoid_in_kernel=logits, allow_neg_eigval=neg,
            state_v_first=v_first, cu_seqlens=cu, chunk_size=chunk_size, **kw)

    def ref(y):
        g = gdn_gate(y["g"], y["A_log"], y["dt_bias"]) if gate else y["g"]
        o, ht, _ = reference(y["q"], y["k"], y["v"], decay=g[..., None, None], beta=beta_in(y, logits, neg)[..., None],
                             h0=y["h0"], l2=l2, cu=CU if varlen else None)
        return o, vk(ht) if v_first else ht

    compare(seed, ours, ref, leaves)


# (decays given: head g, key gk, value gv; beta per value channel; beta None; gate in the op; v_first; varlen)
FUSED_GDN_CASES = [
    ("g", False, False, False, False, False),
    ("", False, False, False, False, False),  # no decay: the delta rule
    ("g", False, True, False, False, False),  # beta None: ones
    ("g,gk", False, False, True, True, False),
    ("gk,gv", True, False, False, False, True),
    ("g,gk,gv", False, False, True, False, False),
    ("gv", True, False, False, True, True),
]


@pytest.mark.parametrize("decays,beta_v,no_beta,gate,v_first,varlen", FUSED_GDN_CASES)
def test_fused_recurrent_gated_delta_rule_matches_reference(decays, beta_v, no_beta, gate, v_first, varlen):
    seed = draw_seed()
    x = draw(seed, varlen=varlen)
    cu = torch.tensor(CU) if varlen else None
    names = set(filter(None, decays.split(",")))
    leaves = {n: x[n] for n in ("q", "k", "v", "h0")}
    if "g" in names:
        leaves.update({"g": x["raw_head"], "A_log": x["A_log"], "dt_bias": x["dt_bias_head"]} if gate
                      else {"g": x["g_head"]})
    if "gk" in names:
        leaves["gk"] = x["g_key"]
    if "gv" in names:
        leaves["gv"] = x["g_value"]
    if not no_beta:
        leaves["beta"] = x["beta_v"] if beta_v else x["beta"]

    def ours(y):
        kw = dict(use_gate_in_kernel=True, A_log=y["A_log"], dt_bias=y["dt_bias"]) if gate and "g" in y else {}
        return fused_recurrent_gated_delta_rule(
            y["q"], y["k"], y["v"], y.get("g"), y.get("gk"), y.get("gv"), y.get("beta"),
            initial_state=vk(y["h0"]) if v_first else y["h0"], output_final_state=True, state_v_first=v_first,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu, **kw)

    def ref(y):
        decay = torch.zeros((), dtype=F64)
        if "g" in y:
            decay = decay + (gdn_gate(y["g"], y["A_log"], y["dt_bias"]) if gate else y["g"])[..., None, None]
        if "gk" in y:
            decay = decay + y["gk"][..., None]
        if "gv" in y:
            decay = decay + y["gv"][..., None, :]
        beta = torch.ones((), dtype=F64) if no_beta else (y["beta"] if beta_v else y["beta"][..., None])
        o, ht, _ = reference(y["q"], y["k"], y["v"], decay=decay, beta=beta, h0=y["h0"], l2=True,
                             cu=CU if varlen else None)
        return o, vk(ht) if v_first else ht

    compare(seed, ours, ref, leaves, f", decays {decays or 'none'}")


# (gate in the op: "", "softplus", "bound", "bound-noA"; dt_bias; beta logits; allow_neg; v_first; varlen; chunk)
KDA_CASES = [
    ("", False, False, False, False, False, 64),
    ("softplus", True, False, False, False, False, 32),
    ("softplus", False, True, True, True, False, 64),
    ("bound", True, False, False, False, True, 32),
    ("bound-noA", True, True, False, True, True, 64),
    ("", False, True, False, False, True, 32),
]


def kda_leaves(x, gate, bias, logits):
    leaves = {n: x[n] for n in ("q", "k", "v", "h0")}
    leaves["g"] = x["raw_key"] if gate else x["g_key"]
    if gate in ("softplus", "bound"):
        leaves["A_log"] = x["A_log"]
    if gate and bias:
        leaves["dt_bias"] = x["dt_bias_key"]
    leaves["logit" if logits else "beta"] = x["logit" if logits else "beta"]
    return leaves


def kda_ref(y, gate, logits, neg, v_first, varlen, beta=None):
    lower = -5.0 if gate.startswith("bound") else None
    g = kda_gate(y["g"], y.get("A_log"), y.get("dt_bias"), lower) if gate else y["g"]
    b = beta if beta is not None else beta_in(y, logits, neg)[..., None]
    o, ht, after = reference(y["q"], y["k"], y["v"], decay=g[..., None], beta=b, h0=y["h0"],
                             cu=CU if varlen else None)
    return o, vk(ht) if v_first else ht


@pytest.mark.parametrize("gate,bias,logits,neg,v_first,varlen,chunk_size", KDA_CASES)
def test_chunk_kda_matches_reference(gate, bias, logits, neg, v_first, varlen, chunk_size):
    seed = draw_seed()
    x = draw(seed, varlen=varlen)
    cu = torch.tensor(CU) if varlen else None
    leaves = kda_leaves(x, gate, bias, logits)

    def ours(y):
        kw = {}
        if gate:
            A, dt = y.get("A_log"), y.get("dt_bias")
            if chunk_size == 64:  # fla reads them by view: its own tests pass A_log [1, 1, HV, 1], dt_bias [HV, K]
                A = None if A is None else A.view(1, 1, -1, 1)
                dt = None if dt is None else dt.view(-1, y["q"].shape[-1])
            kw = dict(A_log=A, dt_bias=dt)
        return chunk_kda(
            y["q"], y["k"], y["v"], y["g"], y["logit"] if logits else y["beta"],
            initial_state=vk(y["h0"]) if v_first else y["h0"], output_final_state=True,
            use_gate_in_kernel=bool(gate), use_beta_sigmoid_in_kernel=logits, allow_neg_eigval=neg,
            safe_gate=gate.startswith("bound"), lower_bound=-5.0 if gate.startswith("bound") else None,
            state_v_first=v_first, cu_seqlens=cu, chunk_size=chunk_size, **kw)

    compare(seed, ours, lambda y: kda_ref(y, gate, logits, neg, v_first, varlen), leaves, f", gate {gate!r}")


@pytest.mark.parametrize("gate,bias,logits,neg,v_first,varlen,beta_v", [
    ("", False, False, False, False, False, False),
    ("softplus", True, True, True, True, False, False),
    ("bound", False, False, False, False, True, False),
    ("bound-noA", True, False, False, True, False, True),
])
def test_fused_recurrent_kda_matches_reference(gate, bias, logits, neg, v_first, varlen, beta_v):
    seed = draw_seed()
    x = draw(seed, varlen=varlen)
    cu = torch.tensor(CU) if varlen else None
    leaves = kda_leaves(x, gate, bias, logits)
    if beta_v:
        leaves["beta"] = x["beta_v"]

    def ours(y):
        return fused_recurrent_kda(
            y["q"], y["k"], y["v"], y["g"], y["logit"] if logits else y["beta"], y.get("A_log"), y.get("dt_bias"),
            initial_state=vk(y["h0"]) if v_first else y["h0"], output_final_state=True,
            use_gate_in_kernel=bool(gate), use_beta_sigmoid_in_kernel=logits, allow_neg_eigval=neg,
            lower_bound=-5.0 if gate.startswith("bound") else None, state_v_first=v_first, cu_seqlens=cu)

    compare(seed, ours, lambda y: kda_ref(y, gate, logits, neg, v_first, varlen, y["beta"] if beta_v else None),
            leaves, f", gate {gate!r}")


@pytest.mark.parametrize("varlen,v_first,chunk_size", [(False, False, 32), (True, True, 64), (True, False, 32)])
def test_chunk_kda_intermediate_states(varlen, v_first, chunk_size):
    """return_intermediate_states: h holds the state at the start of every chunk, sequence by sequence for varlen
    (a zero-length sequence has no chunk), in k's dtype, beside the same outputs and final state."""
    seed = draw_seed()
    x = draw(seed, varlen=varlen)
    cu = torch.tensor(CU) if varlen else None
    k32 = x["k"].float()  # k's dtype is h's dtype: float32 here, while the rest stays float64
    with torch.inference_mode():
        o, ht, h = chunk_kda(x["q"], k32, x["v"], x["g_key"], x["beta"],
                             initial_state=vk(x["h0"]) if v_first else x["h0"], output_final_state=True,
                             return_intermediate_states=True, state_v_first=v_first, cu_seqlens=cu,
                             chunk_size=chunk_size)
    o_ref, ht_ref, after = reference(x["q"], k32.double(), x["v"], decay=x["g_key"][..., None],
                                     beta=x["beta"][..., None], h0=x["h0"], cu=CU if varlen else None)
    starts = []
    segs = [(b, 0, T, b) for b in range(B)] if not varlen else [(0, CU[n], CU[n + 1], n) for n in range(len(CU) - 1)]
    rows = [[] for _ in range(1 if varlen else B)]
    for b, s, e, n in segs:
        for c in range(s, e, chunk_size):
            rows[b].append(x["h0"][n] if c == s else after[b, c - 1])
    starts = torch.stack([torch.stack(r) for r in rows])
    assert h.dtype == torch.float32 and o.dtype == F64, (h.dtype, o.dtype)
    assert h.shape == (starts.shape[:2] + ((HV, V, K) if v_first else (HV, K, V))), h.shape
    where = f"(seed {seed})"
    assert rel(o, o_ref) <= 1e-6, f"o: rel {rel(o, o_ref):.2e} {where}"  # k went through float32
    assert rel(vk(ht) if v_first else ht, ht_ref) <= 1e-6, f"final state {where}"
    assert rel((vk(h) if v_first else h).double(), starts) <= 1e-6, f"h: rel {rel(h.double(), starts):.2e} {where}"


# ------------------------------------------------------------------------------------------------ dtypes

@pytest.mark.parametrize("fn", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda",
                                "fused_recurrent_kda"])
def test_mixed_dtypes_and_16_bit_state(fn):
    """q, k in float32 with v in bfloat16 (and a bfloat16 initial state where fla takes one): fla's output dtype
    (q's for chunk_*, v's for fused_recurrent_*), a float32 final state, and gradients in each input's dtype."""
    seed = draw_seed()
    x = draw(seed)
    kda_op = "kda" in fn
    q, k = x["q"].float().requires_grad_(), x["k"].float().requires_grad_()
    v = x["v"].bfloat16().requires_grad_()
    g = (x["g_key"] if kda_op else x["g_head"]).float()
    # chunk_kda asserts a float32 initial state; the others take any float dtype
    h0 = (x["h0"].float() if fn == "chunk_kda" else x["h0"].bfloat16()).requires_grad_()
    o, ht = globals()[fn](q, k, v, g, beta=x["beta"].float(), initial_state=h0, output_final_state=True)
    want = torch.bfloat16 if fn.startswith("fused") else torch.float32
    assert o.dtype == want and ht.dtype == torch.float32, (o.dtype, ht.dtype)
    o_ref, ht_ref, _ = reference(q.double(), k.double(), v.double(), decay=(g[..., None] if kda_op else
                                 g[..., None, None]).double(), beta=x["beta"][..., None], h0=h0.double())
    assert rel(o.double(), o_ref) <= 1e-2 and rel(ht.double(), ht_ref) <= 1e-4, f"seed {seed}"
    (o.float().sum() + ht.sum()).backward()
    assert (q.grad.dtype, v.grad.dtype, h0.grad.dtype) == (q.dtype, v.dtype, h0.dtype)


def test_varlen_under_inference_mode():
    """cu_seqlens made under torch.inference_mode (as serving code does) is taken."""
    seed = draw_seed()
    x = draw(seed, varlen=True)
    with torch.inference_mode():
        cu = torch.tensor(CU)
        o, ht = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g_head"], x["beta"], initial_state=x["h0"],
                                       output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu)
    o_ref, ht_ref, _ = reference(x["q"], x["k"], x["v"], decay=x["g_head"][..., None, None],
                                 beta=x["beta"][..., None], h0=x["h0"], cu=CU)
    assert rel(o, o_ref) <= TOL and rel(ht, ht_ref) <= TOL, f"seed {seed}"


# ------------------------------------------------------------------------------------------------ signatures

P, KW = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.VAR_KEYWORD
REQ = inspect.Parameter.empty
# fla-core 0.6.0: (name, default) in order; every function ends in **kwargs
FLA_SIGNATURES = {
    chunk_gated_delta_rule: [
        ("q", REQ), ("k", REQ), ("v", REQ), ("g", REQ), ("beta", REQ), ("scale", None), ("initial_state", None),
        ("output_final_state", False), ("use_qk_l2norm_in_kernel", False), ("use_beta_sigmoid_in_kernel", False),
        ("allow_neg_eigval", False), ("state_v_first", False), ("cu_seqlens", None), ("cu_seqlens_cpu", None),
        ("chunk_indices", None), ("cp_context", None)],
    fused_recurrent_gated_delta_rule: [
        ("q", REQ), ("k", REQ), ("v", REQ), ("g", None), ("gk", None), ("gv", None), ("beta", None), ("scale", None),
        ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
        ("use_gate_in_kernel", False), ("A_log", None), ("dt_bias", None), ("use_beta_sigmoid_in_kernel", False),
        ("allow_neg_eigval", False), ("state_v_first", False), ("cu_seqlens", None)],
    chunk_kda: [
        ("q", REQ), ("k", REQ), ("v", REQ), ("g", REQ), ("beta", REQ), ("scale", None), ("initial_state", None),
        ("output_final_state", False), ("use_qk_l2norm_in_kernel", False), ("use_gate_in_kernel", False),
        ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False), ("safe_gate", False),
        ("lower_bound", None), ("disable_recompute", False), ("return_intermediate_states", False),
        ("state_v_first", False), ("cu_seqlens", None), ("cu_seqlens_cpu", None), ("cp_context", None),
        ("use_graph", False), ("max_num_seqs", None)],
    fused_recurrent_kda: [
        ("q", REQ), ("k", REQ), ("v", REQ), ("g", REQ), ("beta", REQ), ("A_log", None), ("dt_bias", None),
        ("scale", None), ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
        ("use_gate_in_kernel", False), ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False),
        ("lower_bound", None), ("state_v_first", False), ("cu_seqlens", None)],
}


@pytest.mark.parametrize("fn", list(FLA_SIGNATURES), ids=lambda f: f.__name__)
def test_signature_is_fla_060(fn):
    params = list(inspect.signature(fn).parameters.values())
    got = [(p.name, p.default) for p in params[:-1]]
    assert got == FLA_SIGNATURES[fn], got
    assert all(p.kind == P for p in params[:-1]) and params[-1].kind == KW, [p.kind for p in params]


# ------------------------------------------------------------------------------------------------ errors

def small(kda_op=False, Bx=1, Tx=8):
    q = torch.randn(Bx, Tx, 1, 8)
    v = torch.randn(Bx, Tx, 1, 8)
    g = -torch.rand(Bx, Tx, 1, 8) if kda_op else -torch.rand(Bx, Tx, 1)
    return q, q.clone(), v, g, torch.rand(Bx, Tx, 1)


ERRORS = [
    ("gdn chunk_size 128", lambda: chunk_gated_delta_rule(*small(), chunk_size=128), ValueError,
     "`chunk_size` must be 16, 32, or 64"),
    ("kda chunk_size 16", lambda: chunk_kda(*small(True), chunk_size=16), ValueError,
     "`chunk_size` must be either 32 or 64"),
    ("gdn head_first", lambda: chunk_gated_delta_rule(*small(), head_first=False), DeprecationWarning,
     "head_first has been removed"),
    ("gdn cu_seqlens with B 2", lambda: chunk_gated_delta_rule(*small(Bx=2), cu_seqlens=torch.tensor([0, 8])),
     ValueError, "batch size is expected to be 1 rather than 2"),
    ("kda initial states vs sequences", lambda: fused_recurrent_kda(
        *small(True), initial_state=torch.zeros(1, 1, 8, 8), cu_seqlens=torch.tensor([0, 3, 8])), ValueError,
     "i.e., 2 rather than 1"),
    ("gdn q/k heads", lambda: chunk_gated_delta_rule(
        torch.randn(1, 8, 2, 8), torch.randn(1, 8, 1, 8), *small()[2:]), ValueError, "same number of heads"),
    ("gdn GVA", lambda: chunk_gated_delta_rule(
        torch.randn(1, 8, 2, 8), torch.randn(1, 8, 2, 8), torch.randn(1, 8, 3, 8), -torch.rand(1, 8, 3),
        torch.rand(1, 8, 3)), ValueError, "must be evenly divisible"),
    ("neg eigval without sigmoid", lambda: fused_recurrent_gated_delta_rule(
        *small()[:3], g=small()[3], beta=small()[4], allow_neg_eigval=True), ValueError,
     "requires `use_beta_sigmoid_in_kernel=True`"),
    ("gdn chunk A_log", lambda: chunk_gated_delta_rule(*small(), use_gate_in_kernel=True), AssertionError,
     "A_log must be provided"),
    ("gdn fused A_log", lambda: fused_recurrent_gated_delta_rule(*small()[:3], g=small()[3], use_gate_in_kernel=True),
     ValueError, "`A_log` must be provided"),
    ("gdn fused raw g", lambda: fused_recurrent_gated_delta_rule(
        *small()[:3], A_log=torch.zeros(1), use_gate_in_kernel=True), ValueError, "`g` \\(raw pre-activation\\)"),
    ("kda A_log", lambda: chunk_kda(*small(True), use_gate_in_kernel=True), ValueError,
     "`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set"),
    ("kda fused A_log", lambda: fused_recurrent_kda(*small(True), use_gate_in_kernel=True), ValueError,
     "`A_log` must be provided"),
    ("kda safe_gate bound", lambda: chunk_kda(*small(True), use_gate_in_kernel=True, safe_gate=True,
                                              A_log=torch.zeros(1)), ValueError, "`lower_bound` must be specified"),
    ("kda safe_gate range", lambda: chunk_kda(*small(True), use_gate_in_kernel=True, safe_gate=True,
                                              lower_bound=-6.0), ValueError, "safe range \\[-5, 0\\), got -6.0"),
    ("kda bf16 state", lambda: chunk_kda(*small(True), initial_state=torch.zeros(1, 1, 8, 8, dtype=torch.bfloat16)),
     AssertionError, "initial_state must be in float32"),
    ("kda g shape", lambda: chunk_kda(*small(), ), AssertionError, "g must have shape"),
    ("kda intermediate states outside inference", lambda: chunk_kda(*small(True), return_intermediate_states=True),
     AssertionError, "only allowed in inference mode"),
    ("both layout names", lambda: chunk_kda(*small(True), state_v_first=True, transpose_state_layout=True),
     ValueError, "Cannot pass both"),
    ("context parallel", lambda: chunk_gated_delta_rule(*small(), cp_context=object()), NotImplementedError,
     "cp_context"),
]


@pytest.mark.parametrize("call,err,match", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_errors_are_fla_060(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_renamed_layout_flag_still_taken():
    """transpose_state_layout=True is state_v_first=True, with fla's DeprecationWarning."""
    q, k, v, g, beta = small(True)
    h0 = torch.randn(1, 1, 8, 8)
    with pytest.warns(DeprecationWarning, match="renamed to `state_v_first`"):
        o, ht = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                    transpose_state_layout=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o2, ht2 = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      state_v_first=True)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
