"""The Gluon KDA forward (hybridlm.ops.gluon.kda_fwd: the Triton prep, then the Gluon state chain) against the
float64 chunked reference, on an H100.

GPU only (`@pytest.mark.gpu`; skipped without CUDA, without compute capability 9.0, or without Gluon). Fresh random
inputs each run, the seed in every failure message; outputs are NaN-poisoned by the wrapper (kda_fwd.POISON), so an
element the kernel never writes fails. Cases: T = 1, 63, 65, 1000; varlen lengths 1, 15, 100, 700; GVA (HV/H = 1, 2,
4); per-channel log-decays mild (`kda_bench_gates` "bench": every chunk through the prep's whole-chunk dot), a fresh
layer's ("init": mostly the 16-row blocks) and strong (uniform down to -30 a step: the 8-row halves and the exact
form); with and without initial state; l2norm in the kernel and pre-normalised inputs; bf16 and fp16; K 64 and 128
with V 64 to 256; chunked prefill through a state pool against whole sequences; the public op's impl="auto" without
gradients. Bar (relative RMS vs float64 on the same rounded inputs), the Triton KDA path's 16-bit bar
(scripts/gpu_check_gdn.py): 5e-3 for o and the final state.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hybridlm.ops import kda

pytest.importorskip("triton")
from float64_check import gluon_gpu_marks, rel_f64  # noqa: E402

from hybridlm.bench.kernels import kda_bench_gates  # noqa: E402
from hybridlm.ops.gluon import kda_fwd  # noqa: E402

BAR = 5e-3

pytestmark = gluon_gpu_marks()


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Outputs start as NaN in every case."""
    monkeypatch.setattr(kda_fwd, "POISON", True)


def _gates(gen, B, T, HV, K, decay):
    if decay == "strong":
        return -30.0 * torch.rand(B, T, HV, K, device="cuda", generator=gen)
    return kda_bench_gates({"mild": "bench", "fresh": "init"}[decay], B, T, HV, K, "cuda", gen)


def _inputs(gen, B, T, H, HV, K, V, N, decay, h0, l2, dtype):
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
    if not l2:
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    g = _gates(gen, B, T, HV, K, decay)
    beta = torch.rand(B, T, HV, device="cuda", generator=gen)
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    return q, k, v, g, beta, (r(N, HV, K, V) if h0 else None)


def _case(*, B=1, T=64, H=2, HV=2, lens=None, decay="mild", h0=True, l2=True, dtype=torch.bfloat16, K=128, V=128,
          public=False):
    seed = torch.seed() % 2**31
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if lens is not None:
        B, T = 1, sum(lens)
    cu = None if lens is None else torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    N = B if lens is None else len(lens)
    q, k, v, g, beta, state = _inputs(gen, B, T, H, HV, K, V, N, decay, h0, l2, dtype)
    kw = dict(initial_state=state, output_final_state=True, cu_seqlens=cu, use_qk_l2norm=l2)
    if public:
        with torch.no_grad():
            o, ht = kda(q, k, v, g=g, beta=beta, impl="auto", **kw)
    else:
        o, ht = kda_fwd.kda_fwd(q, k, v, g=g, beta=beta, **kw)
    d = lambda x: None if x is None else x.double()  # noqa: E731
    o2, ht2 = kda(d(q), d(k), d(v), g=d(g), beta=d(beta), initial_state=d(state), output_final_state=True,
                  cu_seqlens=cu, use_qk_l2norm=l2, impl="chunk")
    errs = {"o": rel_f64(o, o2), "final_state": rel_f64(ht, ht2)}
    msg = (f"seed {seed}: B={B} T={T} H={H} HV={HV} K={K} V={V} lens={lens} decay={decay} h0={h0} l2={l2} {dtype}: "
           f"{errs}")
    assert o.dtype == dtype and ht.dtype == torch.float32, msg
    assert all(e <= BAR for e in errs.values()), msg


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 63, 65, 1000])
def test_lengths(T, dtype):
    _case(B=2, T=T, H=2, HV=4, dtype=dtype)


@pytest.mark.parametrize("decay", ["mild", "fresh", "strong"])
def test_varlen(decay):
    _case(lens=[1, 15, 100, 700], H=2, HV=2, decay=decay)


@pytest.mark.parametrize("K,V", [(64, 64), (64, 256), (128, 64), (128, 256)])
def test_head_dims(K, V):
    _case(B=2, T=200, H=2, HV=4, K=K, V=V, decay="fresh")


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_gva(ratio):
    _case(B=2, T=300, H=2, HV=2 * ratio, decay="fresh")


@pytest.mark.parametrize("decay", ["fresh", "strong"])
def test_decays_long(decay):
    _case(B=1, T=1000, H=1, HV=2, decay=decay)


def test_no_initial_state_prenormalised_fp16():
    _case(B=2, T=200, H=2, HV=4, h0=False, l2=False, dtype=torch.float16, decay="fresh")


def test_public_op_auto_takes_it_without_gradients():
    """kda(impl="auto") under no_grad on sm_90 resolves to the Gluon forward and meets the bar."""
    from hybridlm.ops.dispatch import resolve_impl

    q = torch.empty(1, 1, 2, 128, dtype=torch.bfloat16, device="cuda")
    assert resolve_impl("kda", "auto", q.device, q, q, needs_grad=False) == "gluon"
    _case(lens=[1, 15, 100, 700], H=2, HV=4, decay="fresh", public=True)


@pytest.mark.parametrize("n_seq,length,chunk", [(4, 300, 128), (8, 2048, 1024)], ids=["small", "server"])
def test_chunked_prefill_through_the_state_pool(n_seq, length, chunk):
    """Sequences prefilled chunk by chunk through a state pool (each call reads every sequence's pool row and the
    kernel writes the final state back there) against one float64 call per whole sequence; rows no sequence owns
    stay as they were."""
    seed = torch.seed() % 2**31
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev, H, HV, K, V = "cuda", 2, 4, 128, 128
    lens = [max(1, length - 37 * i) for i in range(n_seq)]
    total = sum(lens)
    q, k, v, g, beta, _ = _inputs(gen, 1, total, H, HV, K, V, 1, "fresh", False, True, torch.bfloat16)
    starts = [0, *itertools.accumulate(lens)]
    rows = torch.randperm(2 * n_seq, device=dev, generator=gen)[:n_seq]
    pool0 = torch.randn(2 * n_seq, HV, K, V, device=dev, generator=gen)
    pool = pool0.clone()
    o = torch.full_like(v, float("nan"))
    for c0 in range(0, max(lens), chunk):
        live = [i for i, n in enumerate(lens) if n > c0]
        pieces = [torch.arange(starts[i] + c0, starts[i] + min(lens[i], c0 + chunk), device=dev) for i in live]
        at = torch.cat(pieces)
        cu = torch.tensor([0, *itertools.accumulate(len(p) for p in pieces)], dtype=torch.int32, device=dev)
        o_c, _ = kda_fwd.kda_fwd(q[:, at], k[:, at], v[:, at], g=g[:, at], beta=beta[:, at], cu_seqlens=cu,
                                 use_qk_l2norm=True, state_pool=pool, state_indices=rows[live])
        o[:, at] = o_c
    cu_all = torch.tensor(starts, dtype=torch.int32, device=dev)
    d = lambda x: x.double()  # noqa: E731
    o2, ht2 = kda(d(q), d(k), d(v), g=d(g), beta=d(beta), initial_state=d(pool0[rows]), output_final_state=True,
                  cu_seqlens=cu_all, use_qk_l2norm=True, impl="chunk")
    errs = {"o": rel_f64(o, o2), "final_state": rel_f64(pool[rows], ht2)}
    others = torch.ones(2 * n_seq, dtype=torch.bool, device=dev)
    others[rows] = False
    msg = f"seed {seed}: n_seq={n_seq} length={length} chunk={chunk}: {errs}"
    assert all(e <= BAR for e in errs.values()), msg
    assert torch.equal(pool[others], pool0[others]), msg
