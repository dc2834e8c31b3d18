"""The five recurrences take what fla's callers pass them: inference tensors (cu_seqlens included), q and k in
another floating dtype than v, a 16-bit initial_state, and int32 or int64 cu_seqlens.

Each case runs impl="naive" and impl="chunk" on fresh random inputs against the float64 token loop, run per
sequence outside inference_mode on the same (rounded) values. Bars (relative, ||a - b|| / ||b||, per tensor):
1e-10 where everything is float64; 1e-5 for float32 compute (the float32 bar of test_recurrence); for 16-bit
results the rounding of the result itself: 1e-3 for float16 and 5e-3 for bfloat16 outputs (2^-11 and 2^-8 relative
a value), 2e-3 and 1e-2 for their gradients.
The Triton kernels take the same cases under TRITON_INTERPRET=1 in a child process (tests/ops/triton/
interp_callers.py, ~30 s); tests/ops/test_caller_inputs_gpu.py runs them, and the Gluon forward, on a GPU.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from float64_check import F64, draw_seed, rel

from hybridlm.ops import delta_rule, gated_delta_rule, gated_linear_attention, kda, linear_attention

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
OUT_TOL = {F64: 1e-10, FP32: 1e-5, FP16: 1e-3, BF16: 5e-3}
GRAD_TOL = {F64: 1e-10, FP32: 1e-5, FP16: 2e-3, BF16: 1e-2}
# op -> (function, gate g: None | "scalar" | "channel", takes beta)
OPS = {
    "gated_delta_rule": (gated_delta_rule, "scalar", True),
    "kda": (kda, "channel", True),
    "delta_rule": (delta_rule, None, True),
    "gated_linear_attention": (gated_linear_attention, "channel", True),
    "linear_attention": (linear_attention, None, False),
}
IMPLS = ["naive", "chunk"]


def draw(op: str, T: int, N: int, gen: torch.Generator, B: int = 1, H: int = 2, HV: int = 4, K: int = 16,
         V: int = 24) -> dict[str, torch.Tensor]:
    """Float64 inputs of `op`: q, k, v, its gates and h0 [N, HV, K, V]; beta in (0, 1) and l2-normed keys (the
    ops are called with use_qk_l2norm) keep the ops without decay bounded."""
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    _, gate, has_beta = OPS[op]
    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), h0=r(N, HV, K, V))
    if gate is not None:
        x["g"] = -1.5 * torch.rand(B, T, HV, *((K,) if gate == "channel" else ()), generator=gen, dtype=F64)
    if has_beta:
        x["beta"] = torch.rand(B, T, HV, generator=gen, dtype=F64)
    return x


def call(op: str, x: dict[str, torch.Tensor], **kw):
    gates = {n: x[n] for n in ("g", "beta") if n in x}
    return OPS[op][0](x["q"], x["k"], x["v"], use_qk_l2norm=True, output_final_state=True, **gates, **kw)


def reference(op: str, x: dict[str, torch.Tensor], lens: list[int] | None = None):
    """The float64 token loop on x's values (o, final state), one call per sequence of `lens` (packed along T)."""
    x = {n: t.double() for n, t in x.items()}
    if lens is None:
        return call(op, x, initial_state=x["h0"], impl="naive")
    outs, states = [], []
    for n, (s, e) in enumerate(itertools.pairwise([0, *itertools.accumulate(lens)])):
        part = {name: (t[n : n + 1] if name == "h0" else t[:, s:e]) for name, t in x.items()}
        o, h = call(op, part, initial_state=part["h0"], impl="naive")
        outs.append(o)
        states.append(h)
    return torch.cat(outs, dim=1), torch.cat(states, dim=0)


@pytest.mark.parametrize("inference", [False, True], ids=["normal", "inference_mode"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", list(OPS))
def test_varlen_offsets_int32_or_int64_in_or_out_of_inference_mode(op, impl, idx_dtype, inference):
    """Every tensor, cu_seqlens included, made under torch.inference_mode and the op run there (serving), or not."""
    seed = draw_seed()
    lens = [5, 0, 17, 9]
    x = draw(op, sum(lens), len(lens), torch.Generator().manual_seed(seed))
    with torch.inference_mode(inference):
        xi = {n: t.clone() for n, t in x.items()}
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=idx_dtype)
        o, h = call(op, xi, initial_state=xi["h0"], cu_seqlens=cu, impl=impl, chunk_size=16)
    assert o.is_inference() == inference and o.dtype == F64 and h.dtype == F64, seed
    o_ref, h_ref = reference(op, x, lens)
    assert rel(o, o_ref) <= OUT_TOL[F64] and rel(h, h_ref) <= OUT_TOL[F64], (seed, rel(o, o_ref), rel(h, h_ref))


def test_the_pool_under_inference_mode():
    """A chunked prefill through a state pool, all under inference_mode (the pool a normal tensor or an inference
    one, updated in place there), equals one whole call per sequence."""
    seed = draw_seed()
    lens = [9, 20]
    x = draw("gated_delta_rule", sum(lens), 2, torch.Generator().manual_seed(seed))
    o_ref, h_ref = reference("gated_delta_rule", x, lens)
    for pool_in_inference in (False, True):
        with torch.inference_mode(pool_in_inference):
            pool = torch.zeros(3, *x["h0"].shape[1:], dtype=F64)
            pool[[2, 0]] = x["h0"]
        rows = torch.tensor([2, 0])
        got = torch.empty_like(o_ref)
        with torch.inference_mode():
            for a, b in ((0, 6), (6, 20)):  # each sequence's tokens [a, b), packed
                idx = [t for s, n in zip((0, 9), lens) for t in range(s + min(a, n), s + min(b, n))]
                cu = torch.tensor([0, min(b, 9) - min(a, 9), len(idx)], dtype=torch.int64)
                part = {n: t[:, idx] for n, t in x.items() if n != "h0"}
                o, _ = call("gated_delta_rule", part, cu_seqlens=cu, state_pool=pool, state_indices=rows,
                            impl="chunk", chunk_size=16)
                got[:, idx] = o
        assert rel(got, o_ref) <= 1e-10 and rel(pool[[2, 0]], h_ref) <= 1e-10, (seed, pool_in_inference)


QK_V = [(FP32, BF16), (FP32, FP16), (F64, FP32), (BF16, FP32)]


@pytest.mark.parametrize("qk,vd", QK_V, ids=[f"qk_{str(a)[6:]}_v_{str(b)[6:]}" for a, b in QK_V])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", list(OPS))
def test_q_k_in_another_dtype_than_v_compute_in_v_dtype(op, impl, qk, vd):
    """o in v's dtype, the state float32, gradients in each input's dtype; values as the float64 loop on q and k
    rounded to v's dtype (the documented rule: q and k are cast to v's dtype). Gates stay float32."""
    seed = draw_seed()
    x = draw(op, 40, 1, torch.Generator().manual_seed(seed))
    dtypes = dict(q=qk, k=qk, v=vd, h0=FP32, g=FP32, beta=FP32)
    leaves = {n: t.to(dtypes[n]).requires_grad_() for n, t in x.items()}
    o, h = call(op, leaves, initial_state=leaves["h0"], impl=impl, chunk_size=16)
    assert o.dtype == vd and h.dtype == FP32, (o.dtype, h.dtype)
    cot_o, cot_h = torch.randn(o.shape, dtype=F64), torch.randn(h.shape, dtype=F64)
    grads = torch.autograd.grad((o.double() * cot_o).sum() + (h.double() * cot_h).sum(), list(leaves.values()))

    rounded = {n: (t.to(vd) if n in ("q", "k") else t).detach().double().requires_grad_() for n, t in leaves.items()}
    o_ref, h_ref = reference(op, rounded)
    refs = torch.autograd.grad((o_ref * cot_o).sum() + (h_ref * cot_h).sum(), list(rounded.values()))
    assert rel(o.double(), o_ref) <= OUT_TOL[vd], (seed, rel(o.double(), o_ref))
    assert rel(h.double(), h_ref) <= OUT_TOL[FP32], (seed, rel(h.double(), h_ref))
    for n, a, b in zip(leaves, grads, refs):
        # every gradient carries o's cotangent rounded to v's dtype, and its own rounding to its leaf's dtype
        bar = max(GRAD_TOL[vd], GRAD_TOL[leaves[n].dtype])
        assert a.dtype == leaves[n].dtype and rel(a.double(), b) <= bar, (seed, n, a.dtype, rel(a.double(), b))


STATES = [(FP32, BF16), (FP32, FP16), (F64, FP32), (F64, BF16)]


@pytest.mark.parametrize("inputs,sd", STATES, ids=[f"inputs_{str(a)[6:]}_state_{str(b)[6:]}" for a, b in STATES])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", list(OPS))
def test_narrower_initial_state_is_upcast_and_the_final_state_is_in_the_state_dtype(op, impl, inputs, sd):
    seed = draw_seed()
    x = draw(op, 40, 1, torch.Generator().manual_seed(seed))
    leaves = {n: t.to(sd if n == "h0" else inputs).requires_grad_() for n, t in x.items()}
    o, h = call(op, leaves, initial_state=leaves["h0"], impl=impl, chunk_size=16)
    assert o.dtype == inputs and h.dtype == inputs, (o.dtype, h.dtype)  # the state dtype of these inputs
    cot_o, cot_h = torch.randn(o.shape, dtype=F64), torch.randn(h.shape, dtype=F64)
    dh0 = torch.autograd.grad((o.double() * cot_o).sum() + (h.double() * cot_h).sum(), leaves["h0"])[0]
    rounded = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    o_ref, h_ref = reference(op, rounded)
    dh0_ref = torch.autograd.grad((o_ref * cot_o).sum() + (h_ref * cot_h).sum(), rounded["h0"])[0]
    assert rel(o.double(), o_ref) <= OUT_TOL[inputs] and rel(h.double(), h_ref) <= OUT_TOL[inputs], seed
    bar = max(GRAD_TOL[sd], GRAD_TOL[inputs])  # dh0 is rounded to the caller's state dtype
    assert dh0.dtype == sd and rel(dh0.double(), dh0_ref) <= bar, (seed, rel(dh0.double(), dh0_ref))


def test_a_wider_initial_state_or_a_16_bit_pool_is_refused_in_one_line():
    x = draw("gated_delta_rule", 8, 1, torch.Generator().manual_seed(draw_seed()))
    f32 = {n: t.float() for n, t in x.items()}
    with pytest.raises(TypeError) as e:
        call("gated_delta_rule", f32, initial_state=x["h0"])
    assert "\n" not in str(e.value) and "initial_state" in str(e.value) and "torch.float64" in str(e.value)
    pool = torch.zeros(2, *x["h0"].shape[1:], dtype=BF16)
    with pytest.raises(TypeError, match=r"state_pool: expected dtype torch.float32 .*got torch.bfloat16") as e:
        call("gated_delta_rule", f32, state_pool=pool, state_indices=torch.tensor([1]))
    assert "\n" not in str(e.value)


INTERP = Path(__file__).parent / "triton" / "interp_callers.py"
# the Triton kernels' own bars (tests/ops/test_triton_gdn.py): fp32 o / state 2e-6, gradients 1e-5; fp16 1e-3 / 2e-3
TRITON_TOL = {"fp32": (2e-6, 1e-5), "fp16": (1e-3, 2e-3)}


@pytest.fixture(scope="module")
def interp_callers(interp_job):
    """tests/ops/triton/interp_callers.py's results: {case: {"tol": "fp32" | "fp16", tensor: rel error}} (started
    at collection in the suite's second lane: tests/conftest.py)."""
    pytest.importorskip("triton")
    return interp_job("callers")


TRITON_CASES = ["gdn_inference_int64", "kda_inference_int32", "gdn_int64_grads", "gdn_qk_fp32_v_fp16",
                "kda_qk_fp32_v_fp16_int64", "gdn_h0_bf16", "kda_h0_fp16"]


@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_kernels_take_the_same_inputs(interp_callers, case):
    res, seed = dict(interp_callers[case]), interp_callers["seed"]
    tol_out, tol_grad = TRITON_TOL[res.pop("tol")]
    assert res.pop("dtypes_ok") == 1.0, (case, seed)
    assert {"o", "final_state"} <= set(res), res
    for name, err in res.items():
        bar = tol_out if name in ("o", "final_state") else tol_grad
        if "@" in name:  # a gradient returned in a 16-bit dtype: that dtype's rounding
            bar = max(bar, GRAD_TOL[getattr(torch, name.split("@")[1])])
        assert err <= bar, f"{case} {name}: rel {err:.3g} > {bar} (seed {seed})"
