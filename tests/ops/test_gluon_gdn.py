"""The fused Gluon GDN forward (hybridlm.ops.gluon.gdn_fwd) against the float64 chunked reference, on an H100.

GPU only (`@pytest.mark.gpu`; skipped without CUDA, without compute capability 9.0, or without Gluon). Fresh random
inputs each run, the seed in every failure message; outputs are NaN-poisoned by the wrapper (gdn_fwd.POISON), so an
element the kernel never writes fails. Cases: T = 1, 63, 65, 1000; varlen lengths 1, 15, 100, 700; GVA (HV/H = 1,
2, 4); mild log-decays (logsigmoid(N(3, 1))), strong ones (uniform down to -30 a step) and the decay cliff of
scripts/gpu_check_gdn.py; with and without initial state; l2norm in the kernel and pre-normalised inputs; bf16 and
fp16; both value blocks (32, 64); every plan ("simple", "prefetch", "split", "ws"). Bar (relative RMS vs float64 on the
same rounded inputs), as for the Triton kernels' 16-bit checks: 5e-3 for o and the final state.

Timing (not a test): `python tests/ops/test_gluon_gdn.py` prints the forward ms of our Triton kernels, each Gluon
plan and fla (when installed) at B4 T4096 H16 D128 and B1 T32768 H32 D128, bf16, inputs as `bench kernels`.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hybridlm.ops import gated_delta_rule

pytest.importorskip("triton")
from hybridlm.ops.gluon import gdn_fwd  # noqa: E402

BAR = 5e-3


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _sm90(), reason="needs a CUDA device of compute capability 9.0 (Hopper)"),
    pytest.mark.skipif(not gdn_fwd.gluon_available(), reason="needs Triton's Gluon API"),
]


@pytest.fixture(autouse=True, params=["simple", "prefetch", "split", "ws"])
def kernel(request, monkeypatch):
    """Every case runs on each plan, outputs NaN-poisoned."""
    monkeypatch.setattr(gdn_fwd, "POISON", True)
    monkeypatch.setattr(gdn_fwd, "KERNEL", request.param)
    return request.param


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _gates(gen, B, T, HV, decay):
    dev = "cuda"
    if decay == "mild":
        return torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device=dev, generator=gen) + 3.0)
    if decay == "strong":
        return -30.0 * torch.rand(B, T, HV, device=dev, generator=gen)
    bound = torch.where(torch.arange(T, device=dev) % 64 < 32, 30.0, 0.05)[:, None]  # "cliff"
    return -bound * torch.rand(B, T, HV, device=dev, generator=gen)


def _case(*, B=1, T=64, H=2, HV=2, lens=None, decay="mild", h0=True, l2=True, dtype=torch.bfloat16):
    seed = torch.seed() % 2**31
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev, K, V = "cuda", 128, 128
    if lens is not None:
        B, T = 1, sum(lens)
    cu = None if lens is None else torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)
    N = B if lens is None else len(lens)
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
    if not l2:
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    g = _gates(gen, B, T, HV, decay)
    beta = 2.0 * torch.rand(B, T, HV, device=dev, generator=gen)
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    state = r(N, HV, K, V) if h0 else None
    o, ht = gdn_fwd.fused_gated_delta_rule_fwd(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                               cu_seqlens=cu, use_qk_l2norm=l2)
    d = lambda x: None if x is None else x.double()
    o2, ht2 = gated_delta_rule(d(q), d(k), d(v), g=d(g), beta=d(beta), initial_state=d(state),
                               output_final_state=True, cu_seqlens=cu, use_qk_l2norm=l2, impl="chunk")
    errs = {"o": _rel(o, o2), "final_state": _rel(ht, ht2)}
    msg = f"seed {seed}: B={B} T={T} H={H} HV={HV} lens={lens} decay={decay} h0={h0} l2={l2} {dtype}: {errs}"
    assert o.dtype == dtype and ht.dtype == torch.float32, msg
    assert all(e <= BAR for e in errs.values()), msg


@pytest.fixture(params=gdn_fwd.BV_CHOICES, ids=lambda bv: f"BV{bv}")
def value_block(request, monkeypatch):
    """Both value blocks the host may pick (it picks by head count, so small cases would only see 32)."""
    monkeypatch.setattr(gdn_fwd, "_value_block", lambda heads, V, dev: request.param)
    return request.param


@pytest.mark.parametrize("T", [1, 63, 65, 1000])
def test_lengths(T, value_block):
    _case(B=2, T=T, H=2, HV=4)


@pytest.mark.parametrize("decay", ["mild", "strong", "cliff"])
def test_varlen(decay, value_block):
    _case(lens=[1, 15, 100, 700], H=2, HV=2, decay=decay)


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_gva(ratio):
    _case(B=2, T=300, H=2, HV=2 * ratio, decay="strong")


@pytest.mark.parametrize("decay", ["strong", "cliff"])
def test_strong_decays_long(decay):
    _case(B=1, T=1000, H=1, HV=2, decay=decay)


def test_no_initial_state_prenormalised_fp16():
    _case(B=2, T=200, H=2, HV=4, h0=False, l2=False, dtype=torch.float16)


def test_bad_input_is_one_line():
    q = torch.zeros(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.zeros(1, 8, 2, 128, device="cuda", dtype=torch.bfloat16)
    g = torch.zeros(1, 8, 2, device="cuda")
    with pytest.raises(ValueError, match="head dims"):
        gdn_fwd.fused_gated_delta_rule_fwd(q, q, v, g=g, beta=g)


def _time_shape(B, T, H, D, gen, fla_gdn):
    """Forward ms (median of triton.testing.do_bench) of our Triton forward, fla's and each Gluon plan (with its
    relative difference from ours-Triton), bf16, one shape."""
    import triton.testing
    from torch.nn.functional import logsigmoid

    from hybridlm.ops.triton import chunk_gated_delta_rule

    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q, k, v = (r(B, T, H, D).to(torch.bfloat16) for _ in range(3))
    g = logsigmoid(r(B, T, H) + 3.0)
    beta = torch.sigmoid(r(B, T, H)).to(torch.bfloat16)

    def gluon(kernel):
        gdn_fwd.KERNEL = kernel
        return gdn_fwd.fused_gated_delta_rule_fwd(q, k, v, g=g, beta=beta, use_qk_l2norm=True)[0]

    runs = {"triton": lambda: chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm=True)[0]}
    if fla_gdn is not None:
        runs["fla"] = lambda: fla_gdn(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    for plan in ("simple", "prefetch", "split", "ws"):  # ws last: the one most likely to hang if wrong
        runs[f"gluon-{plan}"] = lambda plan=plan: gluon(plan)
    shape = f"B{B} T{T} H{H} D{D} bf16 forward"
    with torch.no_grad():
        ref = runs["triton"]().float()
        for name, fn in runs.items():  # one line each, flushed: a later plan that fails leaves the earlier ones
            try:
                ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                line = f"{shape}: {name} {ms:.3f} ms"
                if name.startswith("gluon"):
                    rel = ((fn().float() - ref).norm() / ref.norm()).item()
                    line += f", rel vs triton {rel:.1e}"
            except Exception as e:  # noqa: BLE001 (reported, and the other plans still run)
                line = f"{shape}: {name} failed: {e!r}"[:300]
            print(line, flush=True)


def _time_shapes():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
    except ImportError:
        fla_gdn = None
    gen = torch.Generator(device="cuda").manual_seed(0)
    for B, T, H, D in ((4, 4096, 16, 128), (1, 32768, 32, 128)):
        _time_shape(B, T, H, D, gen, fla_gdn)


if __name__ == "__main__":
    _time_shapes()
