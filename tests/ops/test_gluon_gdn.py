"""The Gluon GDN forward (hybridlm.ops.gluon.gdn_fwd) against the float64 chunked reference, on an H100.

GPU only (`@pytest.mark.gpu`; skipped without CUDA, without compute capability 9.0, or without Gluon). Fresh random
inputs each run, the seed in every failure message; outputs are NaN-poisoned by the wrapper (gdn_fwd.POISON), so an
element the kernel never writes fails. Cases (the lengths, varlen lengths, GVA ratios and head dims are the KDA
forward's too: gluon_fwd_cases.py): T = 1, 63, 65, 128, 1000; varlen lengths 1, 15, 100, 700; GVA (HV/H = 1, 2, 4);
mild log-decays (logsigmoid(N(3, 1))), strong ones (uniform down to -30 a step) and the decay cliff of
scripts/gpu_check_gdn.py; with and without initial state; l2norm in the kernel and pre-normalised inputs; bf16 and
fp16; head dims K 64 and 128 with V 64 to 256; chunked prefill through a state pool (up to 16 sequences of 4096
tokens in 2048-token chunks) against whole sequences; the solve beside the chain (the overlapped form), also
captured in a CUDA graph. Bar (relative RMS vs float64 on the same rounded inputs), as for the Triton kernels'
16-bit checks: 5e-3 for o and the final state.

Timing (not a test): `python tests/ops/test_gluon_gdn.py` prints, at B4 T4096 H16, B8 T2048 H32 and B1 T32768 H32
D128 bf16 (inputs as `bench kernels`), the forward ms of our Triton kernels, fla (when installed) and the Gluon
forward, then each Gluon launch alone against its floors (see `_stage_rows`).
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridlm.ops import gated_delta_rule

pytest.importorskip("triton")
from float64_check import check_cache_reuse, gluon_gpu_marks, rel_f64  # noqa: E402
from gluon_fwd_cases import (  # noqa: E402
    BAR,
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

from hybridlm.ops.gluon import gdn_fwd  # noqa: E402

pytestmark = gluon_gpu_marks()


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Outputs start as NaN in every case."""
    monkeypatch.setattr(gdn_fwd, "POISON", True)


def _gates(gen, B, T, HV, decay):
    dev = "cuda"
    if decay == "mild":
        return torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device=dev, generator=gen) + 3.0)
    if decay == "strong":
        return -30.0 * torch.rand(B, T, HV, device=dev, generator=gen)
    bound = torch.where(torch.arange(T, device=dev) % 64 < 32, 30.0, 0.05)[:, None]  # "cliff"
    return -bound * torch.rand(B, T, HV, device=dev, generator=gen)


def _case(*, B=1, T=64, H=2, HV=2, lens=None, decay="mild", h0=True, l2=True, dtype=torch.bfloat16, K=128, V=128):
    seed, gen = seeded()
    dev = "cuda"
    if lens is not None:
        B, T = 1, sum(lens)
    cu = None if lens is None else offsets(lens)
    N = B if lens is None else len(lens)
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
    if not l2:
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    g = _gates(gen, B, T, HV, decay)
    beta = 2.0 * torch.rand(B, T, HV, device=dev, generator=gen)
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    state = r(N, HV, K, V) if h0 else None
    kw = dict(initial_state=state, cu_seqlens=cu, use_qk_l2norm=l2)
    got = gdn_fwd.gated_delta_rule_fwd(q, k, v, g=g, beta=beta, output_final_state=True, **kw)
    check_call(got, gated_delta_rule, q, k, v, g=g, beta=beta, **kw,
               msg=f"seed {seed}: B={B} T={T} H={H} HV={HV} K={K} V={V} lens={lens} decay={decay} h0={h0} l2={l2} "
                   f"{dtype}")


@pytest.mark.parametrize("T", LENGTHS)
def test_lengths(T):
    _case(B=2, T=T, H=2, HV=4)


@pytest.mark.parametrize("decay", ["mild", "strong", "cliff"])
def test_varlen(decay):
    _case(lens=VARLEN, H=2, HV=2, decay=decay)


@pytest.mark.parametrize("K,V", HEAD_DIMS)
def test_head_dims(K, V):
    _case(B=2, T=200, H=2, HV=4, K=K, V=V, decay="cliff")


@pytest.mark.parametrize("ratio", GVA)
def test_gva(ratio):
    _case(B=2, T=300, H=2, HV=2 * ratio, decay="strong")


@pytest.mark.parametrize("decay", ["strong", "cliff"])
def test_strong_decays_long(decay):
    _case(B=1, T=1000, H=1, HV=2, decay=decay)


def test_no_initial_state_prenormalised_fp16():
    _case(B=2, T=200, H=2, HV=4, h0=False, l2=False, dtype=torch.float16)


@pytest.mark.parametrize("n_seq,length,chunk", [(4, 300, 128), (16, 4096, 2048)], ids=["small", "server"])
def test_chunked_prefill_through_the_state_pool(n_seq, length, chunk):
    """Sequences prefilled chunk by chunk through a state pool (each call reads every sequence's pool row and the
    kernel writes the final state back there) against one float64 call per whole sequence; rows no sequence owns
    stay as they were. "server": 16 sequences of 4096 tokens in 2048-token chunks."""
    seed, gen = seeded()
    dev, H, HV, K, V = "cuda", 2, 4, 128, 128
    lens = prefill_lens(n_seq, length)
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    q, k, v = r(1, sum(lens), H, K), r(1, sum(lens), H, K), r(1, sum(lens), HV, V)
    g = _gates(gen, 1, sum(lens), HV, "mild")
    beta = torch.rand(1, sum(lens), HV, device=dev, generator=gen)
    q, k, v, beta = (x.to(torch.bfloat16) for x in (q, k, v, beta))
    check_prefill(gdn_fwd.gated_delta_rule_fwd, gated_delta_rule, q, k, v, g=g, beta=beta, lens=lens, chunk=chunk,
                  gen=gen, seed=seed)


@pytest.mark.parametrize("start", ["state", "zeros", "pool", "cu_seqlens"])
def test_solve_beside_the_chain(monkeypatch, start):
    """The overlapped form (OVERLAP_TOKENS lowered to 256: the solve launched beside a chain that waits on its
    chunk flags) against float64: from an initial state, from zeros, from a pool row (the final state written back
    to that row only), or as two sequences of cu_seqlens."""
    monkeypatch.setattr(gdn_fwd, "OVERLAP_TOKENS", 256)
    T, HV, K, V = 900, 4, 128, 128
    q = torch.zeros(1, T, 2, K, device="cuda", dtype=torch.bfloat16)
    assert gdn_fwd.forward_launches(q, q, torch.zeros(1, T, HV, V, device="cuda", dtype=torch.bfloat16),
                                    g=torch.zeros(1, T, HV, device="cuda"),
                                    beta=torch.zeros(1, T, HV, device="cuda", dtype=torch.bfloat16)).overlapped
    if start != "pool":
        _case(B=1, T=T, H=2, HV=HV, h0=start == "state", lens=[T - 333, 333] if start == "cu_seqlens" else None,
              decay="cliff")
        return
    seed, gen = seeded()
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = (x.to(torch.bfloat16) for x in (r(1, T, 2, K), r(1, T, 2, K), r(1, T, HV, V)))
    g = _gates(gen, 1, T, HV, "mild")
    beta = torch.rand(1, T, HV, device="cuda", generator=gen).to(torch.bfloat16)
    pool0 = r(3, HV, K, V)
    pool = pool0.clone()
    o, ht = gdn_fwd.gated_delta_rule_fwd(q, k, v, g=g, beta=beta, use_qk_l2norm=True, output_final_state=True,
                                         state_pool=pool, state_indices=torch.tensor([1], device="cuda"))
    d = lambda x: x.double()  # noqa: E731
    o2, ht2 = gated_delta_rule(d(q), d(k), d(v), g=d(g), beta=d(beta), initial_state=d(pool0[1:2]),
                               output_final_state=True, use_qk_l2norm=True, impl="chunk")
    errs = {"o": rel_f64(o, o2), "pool row": rel_f64(pool[1:2], ht2), "final_state": rel_f64(ht, ht2)}
    msg = f"seed {seed}: one sequence of {T} tokens from pool row 1: {errs}"
    assert all(e <= BAR for e in errs.values()), msg
    assert torch.equal(pool[0::2], pool0[0::2]), f"{msg}: rows 0 and 2 changed"


def test_overlapped_forward_in_a_cuda_graph(monkeypatch):
    """The overlapped form captured in a CUDA graph (its second stream forks from and joins the capturing one, the
    flags are zeroed inside the graph) and replayed twice on fresh inputs copied into the captured ones, against
    float64 each time."""
    monkeypatch.setattr(gdn_fwd, "OVERLAP_TOKENS", 256)
    seed, gen = seeded()
    T, H, HV, K, V = 700, 2, 4, 128, 128
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731

    def fresh():
        q, k, v = (x.to(torch.bfloat16) for x in (r(1, T, H, K), r(1, T, H, K), r(1, T, HV, V)))
        beta = (2.0 * torch.rand(1, T, HV, device="cuda", generator=gen)).to(torch.bfloat16)
        return q, k, v, _gates(gen, 1, T, HV, "cliff"), beta, r(1, HV, K, V)

    ins = fresh()
    run = lambda: gdn_fwd.gated_delta_rule_fwd(*ins[:3], g=ins[3], beta=ins[4], initial_state=ins[5],  # noqa: E731
                                               output_final_state=True, use_qk_l2norm=True)
    run()  # compiles and loads both kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, ht = run()
    for replay in range(2):
        new = fresh()
        for x, y in zip(ins, new):
            x.copy_(y)
        graph.replay()
        d = lambda x: x.double()  # noqa: E731
        o2, ht2 = gated_delta_rule(*(d(x) for x in new[:3]), g=d(new[3]), beta=d(new[4]), initial_state=new[5].double(),
                                   output_final_state=True, use_qk_l2norm=True, impl="chunk")
        errs = {"o": rel_f64(o, o2), "final_state": rel_f64(ht, ht2)}
        assert all(e <= BAR for e in errs.values()), f"seed {seed}: replay {replay}: {errs}"


@pytest.mark.parametrize("overlap", [False, True], ids=["after", "beside"])
def test_direct_launches_see_new_tensors(monkeypatch, overlap):
    """The cached launches and tensor maps (gdn_fwd's plans, hybridlm.ops.launch) never serve a stale call:
    the public op (impl="auto", inference mode) at one shape on inputs A, then on other tensors B (another scale),
    then on A's buffers refilled in place (same addresses, new values), then on inputs allocated after A's were
    freed (the caching allocator hands their addresses out again), each against float64; and the later calls went
    through the direct launches."""
    from hybridlm.ops import launch

    if overlap:
        monkeypatch.setattr(gdn_fwd, "OVERLAP_TOKENS", 256)
    monkeypatch.setattr(gdn_fwd, "_PLANS", type(gdn_fwd._PLANS)())
    seed, gen = seeded()
    B, T, H, HV, K, V = (1, 900, 2, 4, 128, 128) if overlap else (2, 700, 2, 4, 128, 128)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731

    def fresh():
        q, k, v = (x.to(torch.bfloat16) for x in (r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)))
        beta = (2.0 * torch.rand(B, T, HV, device="cuda", generator=gen)).to(torch.bfloat16)
        return [q, k, v, _gates(gen, B, T, HV, "cliff"), beta, r(B, HV, K, V)]

    def check(ins, scale, what):
        with torch.inference_mode():
            o, ht = gated_delta_rule(*ins[:3], g=ins[3], beta=ins[4], initial_state=ins[5], scale=scale,
                                     output_final_state=True, use_qk_l2norm=True)
        d = lambda x: x.double()  # noqa: E731
        o2, ht2 = gated_delta_rule(*(d(x) for x in ins[:3]), g=d(ins[3]), beta=d(ins[4]), initial_state=d(ins[5]),
                                   scale=scale, output_final_state=True, use_qk_l2norm=True, impl="chunk")
        errs = {"o": rel_f64(o, o2), "final_state": rel_f64(ht, ht2)}
        assert all(e <= BAR for e in errs.values()), f"seed {seed}: {what}: {errs}"

    a = check_cache_reuse(fresh, check)
    (plan,) = gdn_fwd._PLANS.values()
    assert isinstance(plan.solve, launch.DirectLaunch) and isinstance(plan.chain, launch.DirectLaunch), seed
    assert plan.overlap == overlap
    before = [x.data_ptr() for x in a]
    del a
    c = fresh()
    reused = sum(x.data_ptr() in before for x in c)
    check(c, None, f"after A was freed ({reused} of 6 addresses reused)")


def test_bad_input_is_one_line():
    q = torch.zeros(1, 8, 2, 96, device="cuda", dtype=torch.bfloat16)
    v = torch.zeros(1, 8, 2, 192, device="cuda", dtype=torch.bfloat16)
    g = torch.zeros(1, 8, 2, device="cuda")
    with pytest.raises(ValueError, match="head dims"):
        gdn_fwd.gated_delta_rule_fwd(q, q, v, g=g, beta=g)


# --- timing (python tests/ops/test_gluon_gdn.py): not collected by pytest --------------------------------------

COPY_BW = 3.0e12  # bytes/s: an H100's measured device-to-device copy bandwidth, the byte floors' rate
CLOCK = 1.83e9  # Hz: the clock at which an H100 SXM's 989 dense 16-bit TFLOPS are 4096 flops a clock per SM
FLOPS_16 = 4096  # dense 16-bit flops a clock per multiprocessor
MMA_LATENCY = 128  # clocks from issuing one warpgroup MMA to its result (an estimate), paid by each synchronous one


def _mma_clocks(m, n, k, count=1):
    """Clocks of `count` synchronous 16-bit warpgroup MMAs [m, k] @ [k, n], one after another on one SM."""
    return count * (MMA_LATENCY + 2 * m * n * k / FLOPS_16)


def _state_path_clocks():
    """The chain's serial path a chunk, its products back to back: S^T K^T, R^T T^T, U^T K. The output products
    run in the other warpgroup, beside it."""
    return _mma_clocks(64, 64, 128) + _mma_clocks(64, 64, 64) + _mma_clocks(64, 128, 64)


def _stage_rows(B, T, H, D, gen, fla_gdn):
    """Print the forward ms of ours (Triton), fla (also its kernels' GPU time, which leaves out its host time) and
    the Gluon forward at one shape (bf16, l2norm in the kernel), then each Gluon launch alone (median of
    triton.testing.do_bench) with its floors: bytes / COPY_BW (each tensor counted once), and for the chain a serial
    floor = chunks x the state path's MMA clocks / CLOCK (one wave)."""
    import triton.testing
    from torch.nn.functional import logsigmoid

    from hybridlm.bench.kernels import _gpu_ms
    from hybridlm.ops.triton import chunk_gated_delta_rule

    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")  # noqa: E731
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = (r(B, T, H, D).to(torch.bfloat16) for _ in range(3))
    g = logsigmoid(r(B, T, H) + 3.0)
    beta = torch.sigmoid(r(B, T, H)).to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    chunks = math.ceil(T / gdn_fwd.CHUNK)
    nb = lambda x: x.numel() * x.element_size()  # noqa: E731
    print(f"\nB{B} T{T} H{H} D{D} bf16 forward, {torch.cuda.get_device_name()}, {sms} SMs", flush=True)
    with torch.no_grad():
        ref = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm=True)[0].float()
        launch = gdn_fwd.forward_launches(q, k, v, g=g, beta=beta, use_qk_l2norm=True)

        launch.run()
        rel = ((launch.o.float() - ref).norm() / ref.norm()).item()
        times = {"ours (Triton)": bench(lambda: chunk_gated_delta_rule(q, k, v, g=g, beta=beta,
                                                                       use_qk_l2norm=True)[0])}
        if fla_gdn is not None:
            fla_fwd = lambda: fla_gdn(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]  # noqa: E731
            times["fla"] = bench(fla_fwd)
            times["fla GPU (kernel time)"] = _gpu_ms(fla_fwd, steps=20)
        times["gluon forward"] = bench(lambda: gdn_fwd.gated_delta_rule_fwd(
            q, k, v, g=g, beta=beta, use_qk_l2norm=True)[0])
        for name, ms in times.items():
            print(f"  {name}: {ms:.3f} ms", flush=True)
        if "fla" in times:
            print(f"  fla GPU / gluon forward: {times['fla GPU (kernel time)'] / times['gluon forward']:.2f}")
        print(f"  gluon rel vs ours: {rel:.1e}")
        Tbuf, Gbuf = launch.buffers
        solve_mb = nb(q) + nb(k) + nb(g) + nb(beta) + nb(Tbuf) + nb(Gbuf)
        chain_mb = nb(q) + nb(k) + 2 * nb(v) + nb(Tbuf) + nb(Gbuf)
        solve_ms, chain_ms = bench(launch.solve), bench(launch.chain)
        waves = math.ceil(launch.programs[1] / sms)
        serial = 1e3 * waves * chunks * _state_path_clocks() / CLOCK
        print("| stage | programs | ms | MB | byte floor ms | serial floor ms | us/chunk |")
        print("|---|---|---|---|---|---|---|")
        print(f"| T solve | {launch.programs[0]} | {solve_ms:.3f} | {solve_mb / 1e6:.0f} "
              f"| {1e3 * solve_mb / COPY_BW:.3f} | - | - |")
        print(f"| chain | {launch.programs[1]} ({waves} wave{'s' * (waves > 1)}) | {chain_ms:.3f} "
              f"| {chain_mb / 1e6:.0f} | {1e3 * chain_mb / COPY_BW:.3f} | {serial:.3f} "
              f"| {1e3 * chain_ms / (waves * chunks):.2f} |")
        gap = times["gluon forward"] - solve_ms - chain_ms
        print(f"| forward - solve - chain ({'solve beside the chain' if launch.overlapped else 'one after the other'})"
              f" | - | {gap:.3f} | - | - | - | - |", flush=True)


def _stage_table():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
    except ImportError:
        fla_gdn = None
    print(f"byte floor: bytes / {COPY_BW / 1e12:.1f} TB/s; serial floor: {MMA_LATENCY} clocks a synchronous MMA + its "
          f"flops at {FLOPS_16} a clock per SM, {CLOCK / 1e9:.2f} GHz, {_state_path_clocks():.0f} clocks a chunk")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for B, T, H, D in ((4, 4096, 16, 128), (8, 2048, 32, 128), (1, 32768, 32, 128)):
        _stage_rows(B, T, H, D, gen, fla_gdn)


if __name__ == "__main__":
    _stage_table()
