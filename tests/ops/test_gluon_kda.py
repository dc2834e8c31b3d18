"""The Gluon KDA forward (hybridlm.ops.gluon.kda_fwd: the Triton prep, then the Gluon state chain) against the
float64 chunked reference, on an H100.

GPU only (`@pytest.mark.gpu`; skipped without CUDA, without compute capability 9.0, or without Gluon). Fresh random
inputs each run, the seed in every failure message; outputs are NaN-poisoned by the wrapper (kda_fwd.POISON), so an
element the kernel never writes fails. Cases (the lengths, varlen lengths, GVA ratios and head dims are the GDN
forward's too: gluon_fwd_cases.py): T = 1, 63, 65, 128, 1000; varlen lengths 1, 15, 100, 700; GVA (HV/H = 1, 2, 4);
per-channel log-decays mild (`kda_bench_gates` "bench": every chunk through the prep's whole-chunk dot), a fresh
layer's ("init": mostly the 16-row blocks) and strong (uniform down to -30 a step: the 8-row halves and the exact
form); with and without initial state; l2norm in the kernel and pre-normalised inputs; bf16 and fp16; K 64 and 128
with V 64 to 256; chunked prefill through a state pool against whole sequences; the public op's impl="auto" without
gradients. Bar (relative RMS vs float64 on the same rounded inputs), the Triton KDA path's 16-bit bar
(scripts/gpu_check_gdn.py): 5e-3 for o and the final state.
"""

from __future__ import annotations

import pytest
import torch

from hybridlm.ops import kda

pytest.importorskip("triton")
from float64_check import gluon_gpu_marks  # noqa: E402
from gluon_fwd_cases import (  # noqa: E402
    GVA,
    HEAD_DIMS,
    LENGTHS,
    VARLEN,
    check_call,
    check_prefill,
    offsets,
    prefill_lens,
    seeded,
)

from hybridlm.bench.kernels import kda_bench_gates  # noqa: E402
from hybridlm.ops.gluon import kda_fwd  # noqa: E402

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
    seed, gen = seeded()
    if lens is not None:
        B, T = 1, sum(lens)
    cu = None if lens is None else offsets(lens)
    N = B if lens is None else len(lens)
    q, k, v, g, beta, state = _inputs(gen, B, T, H, HV, K, V, N, decay, h0, l2, dtype)
    kw = dict(initial_state=state, cu_seqlens=cu, use_qk_l2norm=l2)
    if public:
        with torch.no_grad():
            got = kda(q, k, v, g=g, beta=beta, impl="auto", output_final_state=True, **kw)
    else:
        got = kda_fwd.kda_fwd(q, k, v, g=g, beta=beta, output_final_state=True, **kw)
    check_call(got, kda, q, k, v, g=g, beta=beta, **kw,
               msg=f"seed {seed}: B={B} T={T} H={H} HV={HV} K={K} V={V} lens={lens} decay={decay} h0={h0} l2={l2} "
                   f"{dtype}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", LENGTHS)
def test_lengths(T, dtype):
    _case(B=2, T=T, H=2, HV=4, dtype=dtype)


@pytest.mark.parametrize("decay", ["mild", "fresh", "strong"])
def test_varlen(decay):
    _case(lens=VARLEN, H=2, HV=2, decay=decay)


@pytest.mark.parametrize("K,V", HEAD_DIMS)
def test_head_dims(K, V):
    _case(B=2, T=200, H=2, HV=4, K=K, V=V, decay="fresh")


@pytest.mark.parametrize("ratio", GVA)
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
    _case(lens=VARLEN, H=2, HV=4, decay="fresh", public=True)


@pytest.mark.parametrize("n_seq,length,chunk", [(4, 300, 128), (8, 2048, 1024)], ids=["small", "server"])
def test_chunked_prefill_through_the_state_pool(n_seq, length, chunk):
    """Sequences prefilled chunk by chunk through a state pool (each call reads every sequence's pool row and the
    kernel writes the final state back there) against one float64 call per whole sequence; rows no sequence owns
    stay as they were."""
    seed, gen = seeded()
    lens = prefill_lens(n_seq, length)
    H, HV, K, V = 2, 4, 128, 128
    q, k, v, g, beta, _ = _inputs(gen, 1, sum(lens), H, HV, K, V, 1, "fresh", False, True, torch.bfloat16)
    check_prefill(kda_fwd.kda_fwd, kda, q, k, v, g=g, beta=beta, lens=lens, chunk=chunk, gen=gen, seed=seed)
