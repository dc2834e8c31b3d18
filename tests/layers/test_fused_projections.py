"""Sibling projections through `fused_linear` against the separate nn.Linear modules they replace.

float64: outputs, d(input) and the gradient of every parameter within 1e-12 (relative, per tensor): only the
order of the sums differs. float32 within 1e-5. The layer references are the layers' forwards written with the
separate Linears (no cache, no padding); their wiring against independent oracles is in test_layers_vs_transformers,
test_layers_by_hand and test_comba_layer (Comba, MesaNet, PaTH, DeltaFormer, written out token by token).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hybridlm.layers import MLA, GatedAttention, GatedDeltaNet, KimiDeltaAttention, SwiGLU
from hybridlm.layers.attention import apply_rotary, normed_heads, sdpa
from hybridlm.layers.projection import fused_linear
from hybridlm.ops import glue, kda

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def _randomise(m: nn.Module) -> None:
    """1-D parameters (biases, norm weights, gates) away from their init: zeros or ones would hide a wrong term."""
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(0.5 * torch.randn_like(p))


def _check(seed: int, run, reference, x: torch.Tensor, params: list[tuple[str, torch.Tensor]]) -> None:
    """run(x) and reference(x): a tensor or a tuple of them; outputs, dx and every parameter's gradient."""
    tol = TOL[x.dtype]
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    got, want = run(x1), reference(x2)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype, f"output {i}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
        assert _rel(a, b) <= tol, f"output {i}: relative error {_rel(a, b):.3e} (seed {seed})"
    cots = [torch.randn_like(b) for b in want]
    names, tensors = zip(*params)
    g_got = torch.autograd.grad(sum((a * c).sum() for a, c in zip(got, cots)), [x1, *tensors])
    g_want = torch.autograd.grad(sum((b * c).sum() for b, c in zip(want, cots)), [x2, *tensors])
    for name, a, b in zip(("x", *names), g_got, g_want):
        assert _rel(a, b) <= tol, f"d{name}: relative error {_rel(a, b):.3e} (seed {seed})"


# ------------------------------------------------------------------------------------------------- the helper

# (out_features, bias) of each Linear; a list is one tuple member. D = 64: widths <= 8 are skinny (one GEMM).
MEMBERS = {
    "wide": [(48, False), (40, False)],
    "mixed_bias_and_tuple": [[(24, False), (24, True), (16, False)], (40, True), (4, False), (2, True), (8, False)],
    "skinny_only": [(3, True), (5, True)],
    "one": [(40, True)],
}


def _build(spec, dtype) -> tuple[list, list[nn.Linear]]:
    members, flat = [], []
    for item in spec:
        group = [nn.Linear(64, n, bias=b, dtype=dtype) for n, b in (item if isinstance(item, list) else [item])]
        flat += group
        members.append(tuple(group) if isinstance(item, list) else group[0])
    return members, flat


def _separate(x: torch.Tensor, members) -> tuple[torch.Tensor, ...]:
    return tuple(torch.cat([lin(x) for lin in m], dim=-1) if isinstance(m, tuple) else m(x) for m in members)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", sorted(MEMBERS))
def test_fused_linear_equals_separate_linears(seed, case, dtype):
    members, flat = _build(MEMBERS[case], dtype)
    for lin in flat:
        _randomise(lin)
    params = [(f"{i}.{n}", p) for i, lin in enumerate(flat) for n, p in lin.named_parameters()]
    x = torch.randn(3, 7, 64, dtype=dtype)
    _check(seed, lambda t: fused_linear(t, *members), lambda t: _separate(t, members), x, params)
    with torch.no_grad():  # inference: 21 tokens (fewer than the rows: each Linear alone) and 200 (merged GEMMs)
        for T in (7, 200):
            xt = torch.randn(3, T, 64, dtype=dtype)
            for a, b in zip(fused_linear(xt, *members), _separate(xt, members)):
                assert _rel(a, b) <= TOL[dtype], f"no grad, T {T}: {_rel(a, b):.3e} (seed {seed})"


def test_unused_outputs_give_no_gradients(seed):
    members, flat = _build(MEMBERS["mixed_bias_and_tuple"], torch.float64)
    x = torch.randn(2, 5, 64, dtype=torch.float64, requires_grad=True)
    outs = fused_linear(x, *members)
    used = (outs[1] ** 2).sum() + outs[3].sum()  # one wide member, one of the skinny ones
    grads = torch.autograd.grad(used, [x] + [lin.weight for lin in flat], allow_unused=True)
    want = torch.autograd.grad((members[1](x) ** 2).sum() + members[3](x).sum(), [x, members[1].weight,
                                                                                   members[3].weight])
    assert [g is None for g in grads] == [False, True, True, True, False, True, False, True]
    for a, b in zip([grads[0], grads[4], grads[6]], want):
        assert _rel(a, b) <= 1e-12, f"relative error {_rel(a, b):.3e} (seed {seed})"


def test_other_modules_run_as_themselves(seed):
    """A projection replaced by another module (Linear + conv, as the MQAR bench does) or a Linear with a hook is
    called as a module, between the fused ones."""
    members, flat = _build(MEMBERS["mixed_bias_and_tuple"], torch.float64)
    conv = nn.Sequential(nn.Linear(64, 16, dtype=torch.float64), nn.Conv1d(5, 5, 1, dtype=torch.float64))
    hooked = nn.Linear(64, 8, dtype=torch.float64)
    calls = []
    hooked.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    members = [members[0], conv, members[1], hooked, *members[2:]]
    params = [(f"{i}.{n}", p) for i, lin in enumerate(flat + [conv, hooked]) for n, p in lin.named_parameters()]
    _check(seed, lambda t: fused_linear(t, *members), lambda t: _separate(t, members),
           torch.randn(2, 5, 64, dtype=torch.float64), params)
    assert calls == [(2, 5, 8)] * 2  # ours, then the reference


class _Ops(TorchDispatchMode):
    """Records (op name, output shape) of every aten call."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func.overloadpacket.__name__, tuple(out.shape) if isinstance(out, torch.Tensor) else None))
        return out


def test_backward_accumulates_dx_in_the_gemms(seed):
    """GDN's split layout (qkv, z, b, a): separate Linears add three [N, D] gradients; fused_linear writes dX with one
    mm and accumulates the rest with addmm_, and concatenates only the skinny outputs' gradients (b, a: [N, 8])."""
    D, N = 64, 2 * 5
    members = [nn.Linear(D, n, bias=False) for n in (96, 32, 4, 4)]
    recorded = {}
    runs = {"separate": lambda t: tuple(m(t) for m in members), "fused": lambda t: fused_linear(t, *members)}
    for name, fn in runs.items():
        x = torch.randn(2, 5, D, requires_grad=True)
        loss = sum((o * torch.randn_like(o)).sum() for o in fn(x))
        with _Ops() as rec:
            loss.backward()
        recorded[name] = rec.ops
    assert ("add", (2, 5, D)) in recorded["separate"]  # the recorder sees autograd's accumulation
    fused = recorded["fused"]
    assert not [op for op in fused if op[0] in ("add", "add_") and op[1] in ((2, 5, D), (N, D))], fused
    dx = [op for op in fused if op[1] == (N, D) and op[0] not in ("view", "detach")]
    assert dx == [("mm", (N, D)), ("addmm_", (N, D)), ("addmm_", (N, D))], fused
    assert [op for op in fused if op[0] == "cat"] == [("cat", (N, 8))], fused


def test_autocast_casts_like_linear(seed):
    """Under CPU autocast (bfloat16): outputs in bfloat16, gradients of the float32 parameters in float32, values
    as F.linear gives them (bfloat16 rounding of the sums: 1e-2)."""
    members, flat = _build(MEMBERS["mixed_bias_and_tuple"], torch.float32)
    x = torch.randn(2, 9, 64)
    runs = []
    for fn in (fused_linear, _separate):
        xr = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = fn(xr, *members) if fn is fused_linear else fn(xr, members)
        assert all(o.dtype == torch.bfloat16 for o in outs)
        loss = sum(o.float().sin().sum() for o in outs)
        grads = torch.autograd.grad(loss, [xr] + [p for lin in flat for p in lin.parameters()])
        assert all(g.dtype == torch.float32 for g in grads)
        runs.append((outs, grads))
    for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]):
        assert _rel(a.float(), b.float()) <= 1e-2, f"relative error {_rel(a.float(), b.float()):.3e} (seed {seed})"


def test_dtypes_must_match_outside_autocast():
    lin = nn.Linear(8, 4)
    with pytest.raises(RuntimeError):
        lin(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError):
        fused_linear(torch.randn(2, 8, dtype=torch.float64), lin, nn.Linear(8, 4))


def test_compiles_without_graph_breaks(seed):
    members, flat = _build(MEMBERS["mixed_bias_and_tuple"], torch.float64)
    params = [(f"{i}.{n}", p) for i, lin in enumerate(flat) for n, p in lin.named_parameters()]
    comp = torch.compile(lambda t: fused_linear(t, *members), backend="aot_eager", fullgraph=True)
    _check(seed, comp, lambda t: _separate(t, members), torch.randn(2, 5, 64, dtype=torch.float64), params)


# ------------------------------------------------------------------------------------------------- the layers


def _gdn_project_ref(m: GatedDeltaNet, x: torch.Tensor):
    """GatedDeltaNet._project with one call per Linear."""
    B, T, _ = x.shape
    if m.layout == "fused":
        r = m.HV // m.H
        grouped = m.in_proj_qkvz(x).view(B, T, m.H, 2 * m.dk + 2 * r * m.dv)
        q, k, v, z = grouped.split([m.dk, m.dk, r * m.dv, r * m.dv], dim=-1)
        b, a = m.in_proj_ba(x).view(B, T, m.H, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        return qkv, z.reshape(B, T, m.HV, m.dv), b.reshape(B, T, m.HV), a.reshape(B, T, m.HV)
    if m.layout == "split":
        return m.in_proj_qkv(x), m.in_proj_z(x).view(B, T, m.HV, m.dv), m.in_proj_b(x), m.in_proj_a(x)
    qkv = torch.cat([m.q_proj(x), m.k_proj(x), m.v_proj(x)], dim=-1)
    return qkv, m.g_proj(x).view(B, T, m.HV, m.dv), m.b_proj(x), m.a_proj(x)


def _gdn_ref(m: GatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
    """The layer's forward with the reference _project (the rest of the forward did not change)."""
    m._project = types.MethodType(_gdn_project_ref, m)
    try:
        return m(x)
    finally:
        del m._project


def _kda_ref(m: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    B, T, _ = x.shape
    qkv = torch.cat([m.q_proj(x), m.k_proj(x), m.v_proj(x)], dim=-1)
    q, k, v = (t.view(B, T, m.H, m.dk) for t in m.conv1d(qkv, None, None, impl=m.impl, split=(m.dim,) * 3))
    raw = m.f_b_proj(m.f_a_proj(x)).view(B, T, m.H, m.dk)
    o, _ = kda(q, k, v, g=raw, beta=torch.sigmoid(m.b_proj(x)), A_log=m.A_log.view(m.H), dt_bias=m.dt_bias,
               use_qk_l2norm=True, impl=glue.step_impl(m.impl, False, T))
    gate = m.g_b_proj(m.g_a_proj(x)).view(B, T, m.H, m.dk)
    return m.o_proj(m.o_norm(o, gate, impl=m.impl).reshape(B, T, m.dim))


def _attention_ref(m: GatedAttention, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    B, T, _ = x.shape
    q, gate = m.q_proj(x), None
    if m.gate_width:
        q, gate = q.view(B, T, m.nH, m.hd + m.gate_width).split([m.hd, m.gate_width], dim=-1)
    q, k = normed_heads(q, m.k_proj(x), m)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), m.v_proj(x).view(B, T, m.nKV, m.hd).transpose(1, 2)
    if m.rotary is not None:
        cos, sin = m.rotary(position_ids)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    o = sdpa(q, k, v, None, m.hd**-0.5).transpose(1, 2)
    if gate is not None:
        o = o * torch.sigmoid(gate)
    return m.o_proj(o.reshape(B, T, m.nH * m.hd))


def _mla_ref(m: MLA, x: torch.Tensor) -> torch.Tensor:
    B, T, _ = x.shape
    q = m.q_proj(x).view(B, T, m.nH, m.nope + m.rope).transpose(1, 2)
    latent, k_rot = m.kv_a_proj_with_mqa(x).split([m.r, m.rope], dim=-1)
    kv = m.kv_b_proj(m.kv_a_layernorm(latent)).view(B, T, m.nH, m.nope + m.vd).transpose(1, 2)
    k_nope, v = kv.split([m.nope, m.vd], dim=-1)
    k = torch.cat([k_nope, k_rot[:, None].expand(B, m.nH, T, m.rope)], dim=-1)
    o = sdpa(q, k, v, None, (m.nope + m.rope) ** -0.5)
    return m.o_proj(o.transpose(1, 2).reshape(B, T, m.nH * m.vd))


def _layer_cases():
    """name -> (layer factory, reference(layer, x)); D = 64, so widths <= 8 ride along in the skinny GEMM."""
    pos = torch.arange(11)[None]

    def gdn(layout):
        return (lambda: GatedDeltaNet(64, 2, 4, 8, 8, layout=layout, beta_scale=2.0)), _gdn_ref

    return {
        **{f"gdn_{layout}": gdn(layout) for layout in ("split", "fused", "olmo")},
        "kda": (lambda: KimiDeltaAttention(64, 2, 8), _kda_ref),
        "attention_elementwise_bias_rope": (
            lambda: GatedAttention(64, 4, 1, 8, gate="elementwise", bias=True, rotary_dim=4),
            lambda m, x: _attention_ref(m, x, pos)),
        "attention_headwise_wide_kv": (lambda: GatedAttention(64, 4, 2, 16, gate="headwise", qk_norm="full"),
                                       lambda m, x: _attention_ref(m, x, pos)),
        "mla_bias": (lambda: MLA(64, 2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                 bias=True), _mla_ref),
        "swiglu": (lambda: SwiGLU(64, 96), lambda m, x: m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))),
    }


LAYERS = _layer_cases()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", sorted(LAYERS))
def test_layer_equals_its_separate_linears(seed, case, dtype):
    make, reference = LAYERS[case]
    m = make().to(dtype)
    _randomise(m)
    x = torch.randn(2, 11, 64, dtype=dtype)
    run = (lambda t: m(t, None, torch.arange(11)[None])) if case.startswith(("attention", "mla")) else m
    _check(seed, run, lambda t: reference(m, t), x, list(m.named_parameters()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", sorted(MEMBERS))
def test_fused_linear_on_cuda_under_autocast(seed, case):
    """cuBLAS with the epilogue accumulation (addmm_ into dX) in bfloat16, against the separate Linears under the
    same autocast: outputs and gradients within bfloat16 rounding of sums taken in another order (1e-2)."""
    members, flat = _build(MEMBERS[case], torch.float32)
    for lin in flat:
        lin.cuda()
        _randomise(lin)
    x = torch.randn(4, 300, 64, device="cuda")
    runs = []
    for fn in (lambda t: fused_linear(t, *members), lambda t: _separate(t, members)):
        xr = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs = fn(xr)
        cot = [torch.randn(o.shape, generator=torch.Generator("cuda").manual_seed(seed + i), device="cuda")
               for i, o in enumerate(outs)]
        grads = torch.autograd.grad(sum((o.float() * c).sum() for o, c in zip(outs, cot)),
                                    [xr] + [p for lin in flat for p in lin.parameters()])
        runs.append(outs + grads)
    for i, (a, b) in enumerate(zip(*runs)):
        assert a.dtype == b.dtype and _rel(a.float(), b.float()) <= 1e-2, \
            f"tensor {i}: {a.dtype} {b.dtype} relative error {_rel(a.float(), b.float()):.3e} (seed {seed})"
