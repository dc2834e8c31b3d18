"""The Gluon state-gradient chain of the GDN backward (hybridlm.ops.gluon.gdn_bwd), which the Triton backward runs
instead of `state_pass._recur_bwd` on sm_90 with 16-bit inputs.

CPU: the switch (`gdn._gluon_chain`, `gdn_bwd.unsupported_reason`) on a mocked Hopper: taken for 16-bit inputs at
K 64/128, V 64-256, chunks of 64, aligned tensors; refused with a reason naming the argument otherwise; and
`_state_grad_pass` calls the chain or the Triton launch accordingly.
GPU (`gpu`, sm_90 with Gluon): the whole op's output, final state and every gradient against float64 at the Triton
path's bars (scripts/gpu_check_gdn.py: bf16 and fp16, T 1/63/65/1000, varlen 1/15/100/700, GVA 1/2/4, with and
without an initial state and l2norm, always a final-state cotangent; the chain asserted to have run); the chain's
dS', dVn and dh0 against `_recur_bwd`'s on the same saved tensors (outputs NaN-poisoned, with and without a
final-state cotangent); `dh0_without_dht` likewise; 100 repeated chain calls bitwise equal. The host path's direct
launches (`gdn_bwd._PLANS`; CPU: tests/ops/test_gluon_launch.py): the op's gradients against float64 on new tensors,
refilled inputs and reused addresses with only the first call through the JIT; the direct launches bitwise equal to
the JIT's (forced by a Triton launch hook); the chain captured in a CUDA graph and replayed on refilled inputs,
bitwise equal to the eager call.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")
from float64_check import check_cache_reuse, count_calls, draw_seed, gluon_gpu, gpu_check_row, rel_f64  # noqa: E402
from gluon_switch import Recorder  # noqa: E402

from hybridlm.ops import gated_delta_rule, launch  # noqa: E402
from hybridlm.ops.gluon import gdn_bwd, gdn_fwd  # noqa: E402
from hybridlm.ops.triton import gdn, state_pass  # noqa: E402
from hybridlm.ops.triton.chunk_layout import layout  # noqa: E402
from hybridlm.ops.triton.tune import tuned  # noqa: E402

BAR = 5e-3  # the chain against `_recur_bwd`: both round the same fp32 values to 16 bits; only summation order differs


# ------------------------------------------------------------------------------------------------ the switch (CPU)
def _args(dtype=torch.bfloat16, K=128, V=128, BT=64, H=2, HV=4, T=70, **override):
    """(q, k, do, Wb, Pb) as `_state_grad_pass` gets them; override replaces one by name."""
    x = dict(q=torch.zeros(1, T, H, K, dtype=dtype), k=torch.zeros(1, T, H, K, dtype=dtype),
             do=torch.zeros(1, T, HV, V, dtype=dtype), Wb=torch.zeros(T, HV, K, dtype=dtype),
             Pb=torch.zeros(-(-T // BT) + 1, HV, BT, BT, dtype=dtype))
    x.update(override)
    return x["q"], x["k"], x["do"], x["Wb"], x["Pb"]


def _misaligned(shape, dtype=torch.bfloat16):
    return torch.zeros(torch.Size(shape).numel() + 8, dtype=dtype)[1:1 + torch.Size(shape).numel()].view(shape)


@pytest.mark.parametrize("dtype,K,V", [(torch.bfloat16, 128, 128), (torch.float16, 64, 64), (torch.bfloat16, 64, 256)])
def test_switch_takes_supported_inputs(hopper, dtype, K, V):
    args = _args(dtype, K, V)
    assert gdn_bwd.unsupported_reason(*args) is None
    assert gdn._gluon_chain(*args)


@pytest.mark.parametrize("case,args,words", [
    ("fp32", dict(dtype=torch.float32), "q: expected dtype"),
    ("K256", dict(K=256), "head dims"),
    ("V32", dict(V=32), "head dims"),
    ("chunk32", dict(BT=32), "Pb: expected the forward's chunk of 64"),
    ("Wb fp16", dict(Wb=torch.zeros(70, 4, 128, dtype=torch.float16)), "Wb: expected q's dtype"),
    ("q misaligned", dict(q=_misaligned((1, 70, 2, 128))), "q: expected a 16-byte aligned"),
    ("do misaligned", dict(do=_misaligned((1, 70, 4, 128))), "do: expected a 16-byte aligned"),
])
def test_switch_refuses_with_a_reason(hopper, case, args, words):
    x = _args(**args)
    why = gdn_bwd.unsupported_reason(*x)
    assert why is not None and words in why, (case, why)
    assert not gdn._gluon_chain(*x)


def test_switch_refuses_other_devices(hopper, monkeypatch):
    monkeypatch.setattr(gdn_fwd, "_capability", lambda index: (8, 0))
    why = gdn_bwd.unsupported_reason(*_args())
    assert why is not None and "compute capability (9, 0)" in why and "(8, 0)" in why
    assert not gdn._gluon_chain(*_args())
    monkeypatch.undo()  # CPU tensors as they are
    assert not gdn._gluon_chain(*_args())


def test_switch_off_by_the_launch_table(hopper):
    with tuned(gdn.TUNE, gluon_chain=False):
        assert not gdn._gluon_chain(*_args())
    assert gdn._gluon_chain(*_args())


@pytest.mark.parametrize("dtype,taken", [(torch.bfloat16, True), (torch.float32, False)])
def test_state_grad_pass_calls_the_chosen_chain(hopper, monkeypatch, dtype, taken):
    calls = []
    monkeypatch.setattr(gdn_bwd, "state_grad_chain", Recorder("gluon", calls))
    monkeypatch.setattr(state_pass, "_recur_bwd", Recorder("triton", calls))
    q, k, do, Wb, Pb = _args(dtype)
    lay = layout(None, 1, 70, 64, "cpu")
    g = torch.zeros(1, 70, 4)
    dhb, dvn, dh0 = torch.empty(2, 4, 128, 128, dtype=dtype), torch.empty(70, 4, 128, dtype=dtype), torch.empty(0)
    Gb = torch.empty(3, 4, 4, 64)
    gdn._state_grad_pass(do, None, q, k, g, Wb, Pb, Gb, dh0, dhb, dvn, lay, 4, 128, 0.1, True, False)
    assert [c[0] for c in calls] == ["gluon" if taken else "triton"]
    if taken:  # the chain reads the forward's gate rows and writes the very buffers the chunk backward reads
        a = calls[0][1]
        assert a[4] is Gb and a[8] is dhb and a[9] is dvn and a[7] is dh0


# ----------------------------------------------------------------------------------------------------------- GPU
CASES = []
for _dt in (torch.bfloat16, torch.float16):
    _n = str(_dt)[6:]
    for _T, (_H, _HV) in zip((1, 63, 65, 1000), ((2, 2), (2, 4), (1, 4), (2, 2))):
        CASES.append((f"T{_T} B2 H{_H} HV{_HV} {_n}", dict(B=2, T=_T, H=_H, HV=_HV, K=128, V=128, dtype=_dt)))
    CASES.append((f"varlen 1,15,100,700 H2 HV4 {_n}", dict(B=1, T=816, H=2, HV=4, K=128, V=128, dtype=_dt,
                                                          cu=[0, 1, 16, 116, 816])))
    CASES.append((f"T300 H1 HV2 K64 V128 no-h0 {_n}", dict(B=2, T=300, H=1, HV=2, K=64, V=128, dtype=_dt,
                                                           h0=False)))
    CASES.append((f"T130 H2 HV4 K128 V64 no-l2 {_n}", dict(B=1, T=130, H=2, HV=4, K=128, V=64, dtype=_dt,
                                                           l2=False)))
    CASES.append((f"T200 H2 HV2 K64 V256 {_n}", dict(B=1, T=200, H=2, HV=2, K=64, V=256, dtype=_dt)))
CASES.append(("T300 HV2 decay cliff bf16", dict(B=1, T=300, H=1, HV=2, K=128, V=128, dtype=torch.bfloat16,
                                                decay="cliff")))
CASES.append(("recompute varlen bf16", dict(B=1, T=816, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                                            cu=[0, 1, 16, 116, 816], recompute=True)))


@gluon_gpu
@pytest.mark.parametrize(("name", "kw"), CASES, ids=[c[0] for c in CASES])
def test_op_gradients_match_float64(monkeypatch, name, kw):
    row, calls, seed = gpu_check_row(monkeypatch, gdn_bwd, "state_grad_chain", name, kw)
    assert calls, f"{name}: the Gluon chain did not run"
    assert row["pass"], f"{name}: worst {row['worst']} {row['worst_rel']:.3g}, errors {row['errors']} (seed {seed})"


def _saved(seed, *, B=2, T=300, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, lens=None, l2=True):
    """Inputs, the forward's saved tensors (chunks of 64) and cotangents of one random case."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    if lens is not None:
        B, T = 1, sum(lens)
    N = B if lens is None else len(lens)
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    q, k, v = (r(B, T, h, d).to(dtype) for h, d in ((H, K), (H, K), (HV, V)))
    if not l2:  # the caller normalizes: raw N(0, 1) keys (|k|^2 ~ K) would make the recurrence diverge to inf
        q, k = (torch.nn.functional.normalize(x.float(), dim=-1).to(dtype) for x in (q, k))
    g = torch.nn.functional.logsigmoid(r(B, T, HV) + 3.0)
    beta = (2.0 * torch.rand(B, T, HV, device=dev, generator=gen)).to(dtype)
    h0 = r(N, HV, K, V)
    cu = None if lens is None else torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)
    scale = K**-0.5
    _, _, _Tb, Wb, hb, _vn, Pb, Gb = gdn._fwd_impl(q, k, v, g, beta, h0, cu, scale, l2, False, True, 64)
    return dict(q=q, k=k, g=g, Wb=Wb, hb=hb, Pb=Pb, Gb=Gb, cu=cu, scale=scale, l2=l2, lay=layout(cu, B, T, 64, dev),
                do=r(B, T, HV, V).to(dtype), dht=r(N, HV, K, V), N=N, HV=HV, V=V, K=K)


def _state_grads(x, *, gluon: bool, dht: bool, has_h0: bool = True):
    """(dS' of every chunk, dVn, dh0) of `_state_grad_pass`, into NaN-filled buffers."""
    lay = x["lay"]
    dhb = torch.full_like(x["hb"], float("nan"))
    dvn = torch.full((lay.Ttot, x["HV"], x["V"]), float("nan"), device="cuda", dtype=x["hb"].dtype)
    dh0 = torch.full((x["N"], x["HV"], x["K"], x["V"]), float("nan"), device="cuda")
    with tuned(gdn.TUNE, gluon_chain=gluon):
        assert gdn._gluon_chain(x["q"], x["k"], x["do"], x["Wb"], x["Pb"]) == gluon
        gdn._state_grad_pass(x["do"], x["dht"] if dht else None, x["q"], x["k"], x["g"], x["Wb"], x["Pb"], x["Gb"],
                             dh0, dhb, dvn, lay, x["HV"], x["V"], x["scale"], x["l2"], has_h0)
    return dhb[:lay.nc], dvn, dh0


DIRECT = [
    dict(B=2, T=300, H=2, HV=4),
    dict(B=2, T=1, H=2, HV=2, dtype=torch.float16, K=64, V=64),
    dict(lens=[1, 15, 100, 700, 64], H=1, HV=4, V=256),
    dict(B=1, T=130, H=2, HV=2, l2=False),
]


@gluon_gpu
@pytest.mark.parametrize("kw", DIRECT, ids=["T300 GVA2", "T1 fp16 K64 V64", "varlen GVA4 V256", "no-l2"])
@pytest.mark.parametrize("dht", [True, False], ids=["dht", "no-dht"])
def test_chain_matches_recur_bwd(kw, dht):
    seed = draw_seed()
    x = _saved(seed, **kw)
    ours = _state_grads(x, gluon=True, dht=dht)
    ref = _state_grads(x, gluon=False, dht=dht)
    for name, a, b in zip(("dS'", "dVn", "dh0"), ours, ref):
        e = rel_f64(a, b)
        assert e <= BAR, f"{name}: rel {e:.3g} > {BAR} against _recur_bwd ({kw}, dht={dht}, seed {seed})"


@gluon_gpu
def test_dh0_without_dht_matches_triton():
    seed = draw_seed()
    x = _saved(seed, lens=[1, 15, 100, 700], H=2, HV=4)
    out = {}
    for gluon in (True, False):
        with tuned(gdn.TUNE, gluon_chain=gluon):
            out[gluon] = gdn.dh0_without_dht(x["do"], x["q"], x["k"], x["g"], x["Wb"], x["hb"], x["Pb"], x["Gb"],
                                             x["cu"], x["scale"], x["l2"])
    e = rel_f64(out[True], out[False])
    assert e <= BAR, f"dh0: rel {e:.3g} > {BAR} (seed {seed})"


@gluon_gpu
def test_chain_is_deterministic():
    seed = draw_seed()
    x = _saved(seed, lens=[15, 700, 1000], H=2, HV=4)
    first = _state_grads(x, gluon=True, dht=True)
    for i in range(100):
        again = _state_grads(x, gluon=True, dht=True)
        for name, a, b in zip(("dS'", "dVn", "dh0"), again, first):
            assert torch.equal(a, b), f"{name} differs at call {i + 1} (seed {seed})"


# ---------------------------------------------------------------------------------------- the host path (GPU)
GRAD_BAR = 1e-2  # every gradient against float64, 16-bit inputs (scripts/gpu_check_gdn.py's bar)
STATE_GRADS = ("dS'", "dVn", "dh0")


class _Counted:
    """A kernel whose JIT launches (`kernel[grid](...)`) are counted; a direct launch does not go through it."""

    def __init__(self, kernel):
        self.kernel, self.n = kernel, 0

    def __getitem__(self, grid):
        self.n += 1
        return self.kernel[grid]


@pytest.fixture
def jit_counts(monkeypatch):
    """The chain's JIT-launch counter, and no plan from another test."""
    chain = _Counted(gdn_bwd._gdn_chain_bwd_kernel)
    monkeypatch.setattr(gdn_bwd, "_gdn_chain_bwd_kernel", chain)
    monkeypatch.setattr(gdn_bwd, "_PLANS", type(gdn_bwd._PLANS)())
    return chain


@pytest.fixture
def counted(monkeypatch):
    """The Gluon chain's host calls (`count_calls`: outputs NaN-poisoned, TF32 off for the float64 comparison)."""
    return count_calls(monkeypatch, gdn_bwd, "state_grad_chain")


def _direct_plan():
    (plan,) = gdn_bwd._PLANS.values()
    return isinstance(plan.chain, launch.DirectLaunch)


@gluon_gpu
def test_direct_launches_see_new_tensors(counted, jit_counts):
    """The cached launches and tensor maps never serve a stale call: the op's gradients (impl="triton", the chain in
    Gluon) at one shape on inputs A, then on other tensors B (another scale), then on A refilled in place, then on
    inputs allocated after A's were freed (the caching allocator hands their addresses out again; the saved W and
    P and the cotangents reuse addresses call after call anyway), each against float64; only the first call went
    through the JIT."""
    seed = draw_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, T, H, HV, K, V = 2, 700, 2, 4, 128, 128
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731

    def fresh():
        q, k, v = (x.to(torch.bfloat16) for x in (r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)))
        g = torch.nn.functional.logsigmoid(r(B, T, HV) + 3.0)
        beta = (2.0 * torch.rand(B, T, HV, device="cuda", generator=gen)).to(torch.bfloat16)
        return [q, k, v, g, beta, r(B, HV, K, V), r(B, T, HV, V), r(B, HV, K, V)]  # ..., h0, do, dht

    def check(x, scale, what):
        grads = {}
        for impl, cast in (("triton", lambda t: t), ("chunk", lambda t: t.double())):
            leaf = [cast(t).detach().requires_grad_(True) for t in x[:6]]
            do, dht = (cast(t) for t in x[6:])
            o, ht = gated_delta_rule(*leaf[:3], g=leaf[3], beta=leaf[4], initial_state=leaf[5], scale=scale,
                                     output_final_state=True, use_qk_l2norm=True, impl=impl)
            grads[impl] = torch.autograd.grad((o.to(do.dtype) * do).sum() + (ht * dht).sum(), leaf)
        errs = {n: rel_f64(a, b) for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), *grads.values())}
        assert all(e <= GRAD_BAR for e in errs.values()), f"seed {seed}: {what}: {errs}"

    check_cache_reuse(fresh, check)  # A, returned, is freed here
    check(fresh(), None, "after A was freed")
    assert len(counted) == 4, f"seed {seed}: the Gluon chain ran {len(counted)} of 4 times"
    assert jit_counts.n == 1 and _direct_plan(), f"seed {seed}: not launched directly"


@gluon_gpu
@pytest.mark.parametrize("kw", DIRECT, ids=["T300 GVA2", "T1 fp16 K64 V64", "varlen GVA4 V256", "no-l2"])
@pytest.mark.parametrize("dht", [True, False], ids=["dht", "no-dht"])
def test_direct_equals_jit_bitwise(jit_counts, kw, dht):
    """dS', dVn and dh0 of the direct launches equal the JIT's bit for bit: the first call (JIT), a second (direct),
    a third with a Triton launch hook registered (which sends it through the JIT)."""
    seed = draw_seed()
    x = _saved(seed, **kw)
    first = _state_grads(x, gluon=True, dht=dht)
    direct = _state_grads(x, gluon=True, dht=dht)
    assert jit_counts.n == 1 and _direct_plan(), f"not launched directly (seed {seed})"
    hook = lambda *a: None  # noqa: E731
    launch.knobs.runtime.launch_enter_hook.add(hook)
    try:
        jit = _state_grads(x, gluon=True, dht=dht)
    finally:
        launch.knobs.runtime.launch_enter_hook.remove(hook)
    assert jit_counts.n == 2, f"the hooked call launched directly (seed {seed})"
    for name, d, j, f in zip(STATE_GRADS, direct, jit, first):
        assert torch.equal(d, j) and torch.equal(d, f), f"{name}: direct != JIT ({kw}, dht={dht}, seed {seed})"


@gluon_gpu
def test_chain_in_a_cuda_graph(jit_counts):
    """The state-gradient pass captured in a CUDA graph (through the direct launches: the plan was made by a call
    before) and replayed twice on new saved tensors and cotangents copied into the captured ones: bitwise equal to
    the eager call on the same inputs, and within BAR of `_recur_bwd`."""
    seed = draw_seed()
    kw = dict(lens=[15, 700, 100], H=2, HV=4)
    x = _saved(seed, **kw)
    _state_grads(x, gluon=True, dht=True)  # compiles and loads the chain outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _state_grads(x, gluon=True, dht=True)
    assert jit_counts.n == 1, f"the capture launched through the JIT (seed {seed})"
    for replay in range(2):
        new = _saved(seed + 1 + replay, **kw)
        for n in ("q", "k", "g", "Wb", "Pb", "Gb", "do", "dht"):
            x[n].copy_(new[n])
        graph.replay()
        eager = _state_grads(x, gluon=True, dht=True)
        ref = _state_grads(x, gluon=False, dht=True)
        for name, a, b, c in zip(STATE_GRADS, got, eager, ref):
            assert torch.equal(a, b), f"{name}: replay {replay} != eager (seed {seed})"
            e = rel_f64(a, c)
            assert e <= BAR, f"{name}: replay {replay}: rel {e:.3g} > {BAR} against _recur_bwd (seed {seed})"
