"""The Gluon forward with long sequences cut into segments (hybridlm.ops.split, taken by the Gluon backend where few
sequences and heads leave the GPU idle) against the float64 chunked reference, on an H100.

GPU only (`@pytest.mark.gpu`; skipped without CUDA, without compute capability 9.0, or without Gluon). Fresh random
inputs each run, the seed in every failure message; the Gluon outputs are NaN-poisoned (gdn_fwd.POISON,
kda_fwd.POISON), the pre-pass's and the main pass's alike. Cases, for gated_delta_rule and kda through the public
op (impl="gluon", no gradients), with mild gates and with long memory (the segments' maps O(0.1), so the chain
through them counts): B1 T8192 H4 with an initial state; packed documents of 8192, 300, 5000 and 1000
tokens (two cut, two whole) with GVA; GDN's documents from a state pool; and GDN's cut forward captured in a CUDA
graph, replayed on fresh inputs. Each case asserts that the cut was taken. Bar (relative RMS vs float64 on the same
rounded inputs) as the uncut Gluon forward's: 5e-3 for o and the final state.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hybridlm.ops import gated_delta_rule, kda, split

pytest.importorskip("triton")
from float64_check import gluon_gpu_marks, rel_f64  # noqa: E402

from hybridlm.bench.kernels import kda_bench_gates  # noqa: E402
from hybridlm.ops.gluon import gdn_fwd, kda_fwd  # noqa: E402

BAR = 5e-3
K = V = 128
OPS = {"gated_delta_rule": gated_delta_rule, "kda": kda}

pytestmark = gluon_gpu_marks()


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Outputs start as NaN in every call of both kernels."""
    monkeypatch.setattr(gdn_fwd, "POISON", True)
    monkeypatch.setattr(kda_fwd, "POISON", True)


def _cut(lens, HV) -> tuple[int, ...]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    counts = split.segment_counts(lens, HV=HV, K=K, V=V, sms=sms)
    assert counts is not None and max(counts) >= split.MIN_SEGMENTS, (lens, HV, sms, counts)
    return counts


def _inputs(op, gen, T, H, HV, N, memory="mild"):
    """bf16 q, k, v, beta, fp32 g, an initial state. memory "mild": g = logsigmoid(N(3, 1)), beta = sigmoid(N(0, 1))
    (a segment's map M ~ e^-60: the chain carries C alone); "long": g ~ -0.001 a step and beta ~0.05, so that M
    stays O(0.1) over a segment and the chain through it counts."""
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = (x.to(torch.bfloat16) for x in (r(1, T, H, K), r(1, T, H, K), r(1, T, HV, V)))
    if op == "kda":
        g = kda_bench_gates("bench", 1, T, HV, K, "cuda", gen)
    else:
        g = torch.nn.functional.logsigmoid(r(1, T, HV) + 3.0)
    beta = torch.sigmoid(r(1, T, HV))
    if memory == "long":
        g, beta = g / 60.0, beta / 10.0
    return q, k, v, g, beta.to(torch.bfloat16), r(N, HV, K, V)


def _reference(op, q, k, v, g, beta, h0, cu):
    d = lambda x: x.double()  # noqa: E731
    return OPS[op](d(q), d(k), d(v), g=d(g), beta=d(beta), initial_state=d(h0), output_final_state=True,
                   cu_seqlens=cu, use_qk_l2norm=True, impl="chunk")


@pytest.mark.parametrize("memory", ["mild", "long"])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("lens,H,HV", [([8192], 4, 4), ([8192, 300, 5000, 1000], 2, 4)], ids=["B1_T8192", "varlen"])
def test_cut_forward_against_float64(op, lens, H, HV, memory):
    seed = torch.seed() % 2**31
    gen = torch.Generator(device="cuda").manual_seed(seed)
    counts = _cut(lens, HV)
    T, N = sum(lens), len(lens)
    cu = None if N == 1 else torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    q, k, v, g, beta, h0 = _inputs(op, gen, T, H, HV, N, memory)
    with torch.no_grad():
        o, ht = OPS[op](q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                        use_qk_l2norm=True, impl="gluon")
    o2, ht2 = _reference(op, q, k, v, g, beta, h0, cu)
    errs = {"o": rel_f64(o, o2), "final_state": rel_f64(ht, ht2)}
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    msg = f"seed {seed}: {op} lens={lens} H={H} HV={HV} {memory} memory, cut {counts}: {errs}"
    assert all(e <= BAR for e in errs.values()), msg


def test_cut_forward_from_a_state_pool():
    """Documents start from pool rows 2, 0, 3 and their final states go back there; row 1 stays."""
    seed = torch.seed() % 2**31
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lens, H, HV = [6000, 500, 4096], 2, 4
    _cut(lens, HV)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    q, k, v, g, beta, _ = _inputs("gated_delta_rule", gen, sum(lens), H, HV, 0, "long")
    pool = torch.randn(4, HV, K, V, device="cuda", generator=gen)
    rows = torch.tensor([2, 0, 3], device="cuda")
    start = pool.clone()
    with torch.no_grad():
        o, _ = gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=cu, use_qk_l2norm=True, impl="gluon",
                                state_pool=pool, state_indices=rows)
    o2, ht2 = _reference("gated_delta_rule", q, k, v, g, beta, start[rows], cu)
    errs = {"o": rel_f64(o, o2), "pool rows": rel_f64(pool[rows], ht2)}
    assert all(e <= BAR for e in errs.values()), f"seed {seed}: {errs}"
    assert torch.equal(pool[1], start[1]), f"seed {seed}: row 1 changed"


def test_cut_forward_in_a_cuda_graph():
    """The cut GDN forward (B1 T8192 H4) captured in a CUDA graph after one eager call (which makes its layout and
    compiles the kernels) and replayed on fresh inputs copied into the captured ones, against float64."""
    seed = torch.seed() % 2**31
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, H, HV = 8192, 4, 4
    _cut([T], HV)
    ins = _inputs("gated_delta_rule", gen, T, H, HV, 1, "long")

    def run():
        with torch.no_grad():
            return gated_delta_rule(*ins[:3], g=ins[3], beta=ins[4], initial_state=ins[5], output_final_state=True,
                                    use_qk_l2norm=True, impl="gluon")

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, ht = run()
    new = _inputs("gated_delta_rule", gen, T, H, HV, 1, "long")
    for x, y in zip(ins, new):
        x.copy_(y)
    graph.replay()
    o2, ht2 = _reference("gated_delta_rule", *new, None)
    errs = {"o": rel_f64(o, o2), "final_state": rel_f64(ht, ht2)}
    assert all(e <= BAR for e in errs.values()), f"seed {seed}: {errs}"
