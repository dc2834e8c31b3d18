"""The Gluon training forward of GDN (`gdn_fwd.training_forward`), which `triton.gdn._fwd_impl` runs with save on
sm_90 where its chain fills the GPU, keeping what the backward reads (T, W / m, the chunk states, V', P, and the
backward chain's gate rows: against the Triton forward's, which launches `gdn_bwd.gate_rows` for them).

CPU: the switch (`gdn._gluon_train_fwd`, `gdn_fwd.train_reason`) on a mocked Hopper of 32 multiprocessors.
GPU (`gpu`, sm_90 with Gluon): every saved tensor and o, ht against the Triton forward's on the same inputs (the
program-count rule lifted so that small cases take it); the whole op (Gluon forward, Gluon backward) against
float64 on gpu_check_gdn's cases that the kernels take, the Gluon forward asserted to have run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
from float64_check import draw_seed, gluon_gpu, gpu_check_row, rel_f64  # noqa: E402

from hybridlm.ops.gluon import gdn_fwd  # noqa: E402
from hybridlm.ops.triton import gdn  # noqa: E402
from hybridlm.ops.triton.chunk_layout import layout  # noqa: E402
from hybridlm.ops.triton.tune import tuned  # noqa: E402


@pytest.fixture
def hopper_sms(hopper, monkeypatch):
    """The mocked Hopper (`hopper`, tests/ops/conftest.py) with 32 multiprocessors."""
    monkeypatch.setattr(gdn_fwd, "_multiprocessors", lambda dev: 32)


def _qv(dtype=torch.bfloat16, HV=4, K=128, V=128):
    return torch.zeros(1, 70, 2, K, dtype=dtype), torch.zeros(1, 70, HV, V, dtype=dtype)


def test_switch_takes_inputs_that_fill_the_gpu(hopper_sms):
    q, v = _qv()
    assert gdn_fwd.train_reason(q, v, 1, 64) is None  # 2 value blocks x 4 heads = 8 programs
    assert gdn._gluon_train_fwd(q, v, 1, 64)
    with tuned(gdn.TUNE, gluon_train_fwd=False):
        assert not gdn._gluon_train_fwd(q, v, 1, 64)


@pytest.mark.parametrize("case,kw,N,BT,words", [
    ("few programs", dict(HV=2), 1, 64, "expected at least 8 chain programs"),  # 2 value blocks x 2 heads
    ("chunk32", dict(), 1, 32, "BT: expected chunks of 64 tokens, got 32"),
    ("fp32", dict(dtype=torch.float32), 1, 64, "q: expected dtype"),
    ("K256", dict(K=256), 1, 64, "head dims"),
])
def test_switch_refuses_with_a_reason(hopper_sms, case, kw, N, BT, words):
    q, v = _qv(**kw)
    why = gdn_fwd.train_reason(q, v, N, BT)
    assert why is not None and words in why, (case, why)
    assert not gdn._gluon_train_fwd(q, v, N, BT)


def _inputs(seed, *, B=2, T=300, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, cu=None, l2=True, h0=True):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = (r(B, T, h, d).to(dtype) for h, d in ((H, K), (H, K), (HV, V)))
    if not l2:
        q, k = (torch.nn.functional.normalize(x.float(), dim=-1).to(dtype) for x in (q, k))
    g = torch.nn.functional.logsigmoid(r(B, T, HV) + 3.0)
    beta = (2.0 * torch.rand(B, T, HV, device="cuda", generator=gen)).to(dtype)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    N = B if cu is None else len(cu) - 1
    return q, k, v, g, beta, (r(N, HV, K, V) if h0 else None), cu_t


SAVED = ("o", "ht", "T", "W", "h", "Vn", "P", "G")
CASES = {
    "T300 B2 GVA2": dict(),
    "T63 no-h0": dict(B=2, T=63, h0=False),
    "varlen 1,15,100,700": dict(B=1, T=816, cu=[0, 1, 16, 116, 816]),
    "K64 V64 no-l2 fp16": dict(K=64, V=64, l2=False, dtype=torch.float16),
}


def _compare_saved(kw: dict, what: str) -> None:
    """Every saved tensor of the Gluon training forward against the Triton forward's on one random case."""
    seed = draw_seed()
    q, k, v, g, beta, h0, cu = _inputs(seed, **kw)
    out = {}
    for on in (True, False):
        with tuned(gdn.TUNE, gluon_train_fwd=on):
            assert gdn._gluon_train_fwd(q, v, len(cu) - 1 if cu is not None else q.shape[0], 64) == on
            out[on] = gdn._fwd_impl(q, k, v, g, beta, h0, cu, q.shape[-1] ** -0.5, kw.get("l2", True), True, True, 64)
    lay = layout(cu, q.shape[0], q.shape[1], 64, "cuda")
    for n, a, b in zip(SAVED, out[True], out[False]):
        if n in ("T", "h", "P", "G"):  # chunk slots past the layout's chunks are never written
            a, b = a[:lay.nc], b[:lay.nc]
        e = rel_f64(a, b)
        assert e <= 1e-2, f"{n}: rel {e:.3g} against the Triton forward ({what}, seed {seed})"


@gluon_gpu
@pytest.mark.parametrize("name", list(CASES))
def test_saved_tensors_match_the_triton_forward(monkeypatch, name):
    monkeypatch.setattr(gdn_fwd, "_multiprocessors", lambda dev: 1)
    _compare_saved(CASES[name], name)


BESIDE = {  # chain programs (value blocks x sequences x value heads) p, on a GPU told it has 2p multiprocessors
    "T4160 GVA2": (dict(B=1, T=4160, H=2, HV=4), 16),
    "varlen 100,4200 no-h0": (dict(B=1, T=4300, H=2, HV=4, cu=[0, 100, 4300], h0=False), 32),
}


@gluon_gpu
@pytest.mark.parametrize("name", list(BESIDE))
def test_solve_beside_the_chain_matches_the_triton_forward(monkeypatch, name):
    """The overlapped form (`gdn_fwd._overlaps`: the chain's programs leave half the multiprocessors to the solve,
    whose chunk flags the chain waits on) keeps the same saved tensors."""
    kw, sms = BESIDE[name]
    monkeypatch.setattr(gdn_fwd, "_multiprocessors", lambda dev: sms)
    forks = []
    real = gdn_fwd._beside
    monkeypatch.setattr(gdn_fwd, "_beside", lambda *a: (forks.append(1), real(*a))[1])
    _compare_saved(kw, name)
    assert forks == [1], f"{name}: the solve ran beside the chain {len(forks)} times, expected once"


def _check_cases():
    sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
    import gpu_check_gdn as check

    return [(f"{n} {str(kw['dtype'])[6:]}", kw) for n, kw in check.cases(quick=True)
            if not n.startswith("kda:") and kw["dtype"] != torch.float32 and kw.get("grads", True)
            and kw["K"] in (64, 128) and kw["V"] in (64, 128, 256) and kw["T"] > 0]


CHECK = _check_cases()


@gluon_gpu
@pytest.mark.parametrize(("name", "kw"), CHECK, ids=[c[0] for c in CHECK])
def test_op_gradients_match_float64(monkeypatch, name, kw):
    monkeypatch.setattr(gdn_fwd, "_multiprocessors", lambda dev: 1)
    row, calls, seed = gpu_check_row(monkeypatch, gdn_fwd, "training_forward", name, kw)
    assert calls, f"{name}: the Gluon training forward did not run"
    assert row["pass"], f"{name}: worst {row['worst']} {row['worst_rel']:.3g}, errors {row['errors']} (seed {seed})"
