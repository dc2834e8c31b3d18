"""The Gluon chunk backward of GDN (hybridlm.ops.gluon.chunk_bwd, host `gdn_bwd.chunk_grads`), which the Triton
backward runs instead of `chunk_bwd._chunk_bwd_state_blk` and `_chunk_bwd_out_blk` on sm_90 with 16-bit inputs.

CPU: the switch (`gdn._gluon_chunk`, `gdn_bwd.chunk_unsupported_reason`) on a mocked Hopper: taken for 16-bit inputs
at K 64/128, V 64/128 and chunks of 64, refused with a reason naming the argument otherwise; `gdn._chunk_bwd` calls
the Gluon host or the two Triton launches accordingly, on the same buffers.
GPU (`gpu`, sm_90 with Gluon): dq, dk, dv, dg and dbeta of both paths on the same saved tensors and state gradients
(NaN-poisoned outputs; GVA, varlen, K 64, no l2norm, strong decays, bf16 and fp16); the whole op against float64 at
the Triton path's bars (scripts/gpu_check_gdn.py's cases that reach the kernels, the Gluon path asserted to have
run); 100 repeated backward calls bitwise equal.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
from float64_check import draw_seed, gluon_gpu, gpu_check_row, rel_f64  # noqa: E402
from gluon_switch import Recorder  # noqa: E402

from hybridlm.ops.gluon import gdn_bwd  # noqa: E402
from hybridlm.ops.triton import chunk_bwd, gdn  # noqa: E402
from hybridlm.ops.triton.chunk_layout import layout  # noqa: E402
from hybridlm.ops.triton.tune import tuned  # noqa: E402


# ------------------------------------------------------------------------------------------------ the switch (CPU)
def _qv(dtype=torch.bfloat16, K=128, V=128):
    return torch.zeros(1, 70, 2, K, dtype=dtype), torch.zeros(1, 70, 4, V, dtype=dtype)


@pytest.mark.parametrize("dtype,K,V", [(torch.bfloat16, 128, 128), (torch.float16, 64, 64), (torch.bfloat16, 64, 128),
                                       (torch.float16, 128, 64)])
def test_switch_takes_supported_inputs(hopper, dtype, K, V):
    q, v = _qv(dtype, K, V)
    assert gdn_bwd.chunk_unsupported_reason(q, v, 64) is None
    assert gdn._gluon_chunk(q, v, 64)


@pytest.mark.parametrize("case,kw,BT,words", [
    ("fp32", dict(dtype=torch.float32), 64, "q: expected dtype"),
    ("K256", dict(K=256), 64, "head dims"),
    ("V256", dict(V=256), 64, "v: expected a head dim of at most 128, got 256"),
    ("chunk32", dict(), 32, "BT: expected the forward's chunk of 64 tokens, got 32"),
])
def test_switch_refuses_with_a_reason(hopper, case, kw, BT, words):
    q, v = _qv(**kw)
    why = gdn_bwd.chunk_unsupported_reason(q, v, BT)
    assert why is not None and words in why, (case, why)
    assert not gdn._gluon_chunk(q, v, BT)


def test_switch_off_by_the_launch_table(hopper):
    q, v = _qv()
    with tuned(gdn.TUNE, gluon_chunk_bwd=False):
        assert not gdn._gluon_chunk(q, v, 64)
    assert gdn._gluon_chunk(q, v, 64)


@pytest.mark.parametrize("dtype,taken", [(torch.bfloat16, True), (torch.float32, False)])
def test_chunk_bwd_calls_the_chosen_path(hopper, monkeypatch, dtype, taken):
    calls = []
    monkeypatch.setattr(gdn_bwd, "chunk_grads", Recorder("gluon", calls))
    monkeypatch.setattr(chunk_bwd, "_chunk_bwd_state_blk", Recorder("state", calls))
    monkeypatch.setattr(chunk_bwd, "_chunk_bwd_out_blk", Recorder("out", calls))
    T, H, HV, K, V = 70, 2, 4, 128, 128
    q, k = torch.zeros(1, T, H, K, dtype=dtype), torch.zeros(1, T, H, K, dtype=dtype)
    v, do = torch.zeros(1, T, HV, V, dtype=dtype), torch.zeros(1, T, HV, V, dtype=dtype)
    g, beta = torch.zeros(1, T, HV), torch.zeros(1, T, HV, dtype=dtype)
    lay = layout(None, 1, T, 64, "cpu")
    Tb, hb = torch.zeros(lay.nc, HV, 64, 64, dtype=dtype), torch.zeros(lay.nc, HV, K, V, dtype=dtype)
    vn, dvn = torch.zeros(T, HV, V, dtype=dtype), torch.zeros(T, HV, V, dtype=dtype)  # distinct: a swap shows
    dhb = torch.zeros_like(hb)
    dk, dkp = torch.zeros(T, HV, K), torch.zeros(T, HV, K)
    dv, dg, db = torch.zeros_like(v), torch.zeros(1, T, HV), torch.zeros(1, T, HV)
    dq = gdn._chunk_bwd(q, k, v, g, beta, Tb, hb, [dhb, dvn], vn, do, dk, dkp, dv, dg, db, lay, 0.1, H, HV, K, V, 64,
                        True, gdn._prec(dtype), dtype != torch.float32)
    assert [c[0] for c in calls] == (["gluon"] if taken else ["state", "out"])
    if taken:  # the Gluon host writes the very buffers the Triton launches would
        a = calls[0][1]
        assert a[7] is dhb and a[8] is vn and a[9] is dvn and a[11] is dq
        assert a[12] is dk and a[13] is dkp and a[14] is dv and a[15] is dg and a[16] is db


# ----------------------------------------------------------------------------------------------------------- GPU
def _saved(seed, *, B=2, T=300, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, cu=None, l2=True, decay=None):
    """What `gdn._chunk_bwd` reads for one random case: inputs, the forward's saved tensors (chunks of 64) and the
    state-gradient pass's dS', dVn."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    q, k, v = (r(B, T, h, d).to(dtype) for h, d in ((H, K), (H, K), (HV, V)))
    if not l2:  # the caller normalizes: raw N(0, 1) keys would make the recurrence diverge
        q, k = (torch.nn.functional.normalize(x.float(), dim=-1).to(dtype) for x in (q, k))
    g = torch.nn.functional.logsigmoid(r(B, T, HV) + 3.0)
    if decay is not None:
        g = -decay * torch.rand(B, T, HV, device=dev, generator=gen)
    beta = (2.0 * torch.rand(B, T, HV, device=dev, generator=gen)).to(dtype)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    scale = K**-0.5
    _, _, Tb, Wb, hb, vn, Pb, Gb = gdn._fwd_impl(q, k, v, g, beta, None, cu_t, scale, l2, False, True, 64)
    lay = layout(cu_t, B, T, 64, dev)
    do = r(B, T, HV, V).to(dtype)
    dhb = torch.empty_like(hb)
    dvn = torch.empty(lay.Ttot, HV, V, device=dev, dtype=dtype)
    gdn._state_grad_pass(do, None, q, k, g, Wb, Pb, Gb, torch.empty(0, device=dev), dhb, dvn, lay, HV, V, scale, l2,
                         False)
    return dict(q=q, k=k, v=v, g=g, beta=beta, Tb=Tb, hb=hb, vn=vn, do=do, dhb=dhb, dvn=dvn, lay=lay, scale=scale,
                l2=l2, H=H, HV=HV, K=K, V=V)


def _chunk_grads(x, *, gluon: bool) -> dict[str, torch.Tensor]:
    """dq, dk, dv, dg, dbeta of `gdn._chunk_bwd` on x, every output NaN-filled first."""
    lay, H, HV, K, V, q = x["lay"], x["H"], x["HV"], x["K"], x["V"], x["q"]
    f32 = torch.float32
    gd = f32 if HV > H else q.dtype
    nan = lambda shape, dt: torch.full(shape, float("nan"), device="cuda", dtype=dt)  # noqa: E731
    dk = nan((lay.Ttot, HV, K), gd)
    dkp = dk if gd == f32 else nan((lay.Ttot, HV, K), f32)
    dv, dg, db = nan(x["v"].shape, x["v"].dtype), nan(x["g"].shape, f32), nan(x["g"].shape, f32)
    with tuned(gdn.TUNE, gluon_chunk_bwd=gluon):
        assert gdn._gluon_chunk(q, x["v"], 64) == gluon
        dq = gdn._chunk_bwd(q, x["k"], x["v"], x["g"], x["beta"], x["Tb"], x["hb"], [x["dhb"], x["dvn"]], x["vn"],
                            x["do"], dk, dkp, dv, dg, db, lay, x["scale"], H, HV, K, V, 64, x["l2"],
                            gdn._prec(q.dtype), True)
    return dict(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=db)


BAR = 5e-3  # against the Triton launches: the same math on the same 16-bit operands, fewer of them rounded here
DECAY_BARS = dict(dg=3e-2)  # log-decays to -30 a step: dg is a difference of large sums (gpu_check_gdn's tail)
UNIT = {
    "T1000 B2 GVA2": dict(B=2, T=1000, H=2, HV=4),
    "T63": dict(B=1, T=63, H=2, HV=2),
    "varlen 1,15,100,700": dict(B=1, T=816, H=2, HV=4, cu=[0, 1, 16, 116, 816]),
    "K64 V64 no-l2": dict(B=1, T=300, H=2, HV=2, K=64, V=64, l2=False),
    "K64 V128 GVA2": dict(B=1, T=300, H=1, HV=2, K=64, V=128),
    "K128 V64 no-l2 GVA2": dict(B=1, T=130, H=2, HV=4, K=128, V=64, l2=False),
    "decay30": dict(B=1, T=300, H=1, HV=2, decay=30.0),
}


@gluon_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(UNIT))
def test_gluon_chunk_bwd_matches_triton(name, dtype):
    seed = draw_seed()
    x = _saved(seed, dtype=dtype, **UNIT[name])
    ours, ref = _chunk_grads(x, gluon=True), _chunk_grads(x, gluon=False)
    bars = {n: BAR for n in ours} | (DECAY_BARS if "decay" in name else {})
    for n in ours:
        e = rel_f64(ours[n], ref[n])
        assert e <= bars[n], f"{n}: rel {e:.3g} > {bars[n]} against the Triton launches ({name}, {dtype}, seed {seed})"


def _check_cases():
    sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
    import gpu_check_gdn as check

    out = []
    for name, kw in check.cases(quick=True):
        if name.startswith("kda:") or kw["dtype"] == torch.float32 or not kw.get("grads", True):
            continue
        if kw["K"] in (64, 128) and kw["V"] in (64, 128):  # what the Gluon kernels take (others pad to 256 or run
            out.append((f"{name} {str(kw['dtype'])[6:]}", kw))  # Triton)
    return out


CHECK = _check_cases()


@gluon_gpu
@pytest.mark.parametrize(("name", "kw"), CHECK, ids=[c[0] for c in CHECK])
def test_op_gradients_match_float64(monkeypatch, name, kw):
    row, calls, seed = gpu_check_row(monkeypatch, gdn_bwd, "chunk_grads", name, kw)
    assert calls or kw["T"] == 0, f"{name}: the Gluon chunk backward did not run"
    assert row["pass"], f"{name}: worst {row['worst']} {row['worst_rel']:.3g}, errors {row['errors']} (seed {seed})"


@gluon_gpu
def test_gluon_chunk_bwd_is_deterministic():
    seed = draw_seed()
    x = _saved(seed, B=1, T=1815, H=2, HV=4, cu=[0, 15, 715, 1815])
    first = _chunk_grads(x, gluon=True)
    for i in range(100):
        again = _chunk_grads(x, gluon=True)
        for n in first:
            assert torch.equal(again[n], first[n]), f"{n} differs at call {i + 1} (seed {seed})"
