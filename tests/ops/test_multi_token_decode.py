"""Multi-token decode (GDN and KDA, T 1..8 tokens a sequence on a state pool): the Triton kernel (under the CPU
interpreter in a child process, and on a GPU) and the PyTorch path, each against T one-token steps of the float64
reference, for the outputs of every token, every intermediate state, the pool rows written back at the accepted
counts and the rows that must keep their bits (tests/ops/decode_cases.py); bad inputs; the impl choice.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from decode_cases import case_names, run_case

pytest.importorskip("triton")
from hybridlm.ops import dispatch  # noqa: E402
from hybridlm.ops.triton import fused_recurrent_gated_delta_rule_update, fused_recurrent_kda_update  # noqa: E402
from hybridlm.ops.triton import gdn as tgdn  # noqa: E402

SCRIPT = Path(__file__).parent / "triton" / "interp_decode.py"
TOL = 2e-6  # fp32 kernel and PyTorch path against float64: measured up to 2.4e-7 (o), 1.2e-7 (states) at T 8
FNS = {"gdn": fused_recurrent_gated_delta_rule_update, "kda": fused_recurrent_kda_update}


def _call(impl: str):
    return lambda op, *args, **kw: FNS[op](*args, **kw, impl=impl)


def _check(name: str, res: dict, seed: int, tol: float = TOL, tol_o: float = TOL) -> None:
    assert res["o_shape_ok"] == 1.0, f"{name}: o has the wrong shape (seed {seed})"
    assert res["others_unchanged"] == 1.0, f"{name}: a row that must keep its bits changed (seed {seed})"
    assert res["o"] <= tol_o, f"{name}: o off by rel {res['o']:.3g} (seed {seed})"
    for key in ("states", "pool"):
        assert res.get(key, 0.0) <= tol, f"{name}: {key} off by rel {res[key]:.3g} (seed {seed})"


@pytest.fixture(scope="module")
def kernel_results(interp_job) -> dict:
    """Every case through the kernel under TRITON_INTERPRET=1, in one child process importing this hybridlm
    (started at collection in the suite's second lane: tests/conftest.py)."""
    return interp_job("decode")


@pytest.mark.parametrize("name", case_names())
def test_kernel_matches_one_token_steps(kernel_results, name):
    _check(name, kernel_results[name], kernel_results["seed"])


@pytest.mark.parametrize("name", case_names())
def test_torch_path_matches_one_token_steps(name, seed):
    _check(name, run_case(name, _call("torch"), seed), seed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["gdn_T4_final", "gdn_T4_both", "kda_T4_intermediate", "kda_T4_accepted",
                                  "gdn_T8_both", "kda_one"])
def test_kernel_on_the_gpu_matches_one_token_steps(name, seed, monkeypatch):
    """The bench's shape (N 64, H 16, HV 32, K = V = 128), bf16 inputs: o is rounded to bf16 (5e-3), the fp32
    states are not."""
    monkeypatch.setattr(tgdn, "POISON", True)
    res = run_case(name, _call("triton"), seed, N=64, H=16, HV=32, dims=(128, 128), P=80, dtype=torch.bfloat16,
                   device="cuda")
    _check(name, res, seed, tol=2e-5, tol_o=5e-3)


def test_auto_takes_the_torch_path_on_the_cpu_and_says_so(monkeypatch, caplog):
    """The decode's impl is the dispatch table's decode backends: "auto" takes the kernel on CUDA, or on the CPU
    under TRITON_INTERPRET=1, else the PyTorch path; each choice logged once; its own impl names."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    q, v = torch.zeros(2, 3, 1, 16), torch.zeros(2, 3, 2, 16)  # the device decides, not these CPU tensors
    with caplog.at_level(logging.INFO, logger="hybridlm.ops"):
        assert dispatch.resolve_impl("gdn_decode", "auto", cpu, q, v, needs_grad=False) == "torch"
        assert dispatch.resolve_impl("gdn_decode", "auto", cpu, q, v, needs_grad=False) == "torch"
        assert dispatch.resolve_impl("kda_decode", "auto", cuda, q, v, needs_grad=False) == "triton"
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["hybridlm.ops.gdn_decode: impl='auto' picked 'torch' on cpu",
                    "hybridlm.ops.kda_decode: impl='auto' picked 'triton' on cuda"], msgs
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.resolve_impl("gdn_decode", "auto", cpu, q, v, needs_grad=False) == "triton"
    assert dispatch.resolve_impl("gated_delta_rule", "auto", cpu, q, v) == "chunk"  # the recurrences: CUDA only
    for impl in ("triton", "torch"):
        assert dispatch.resolve_impl("gdn_decode", impl, cpu, q, v, needs_grad=False) == impl
    for op, impl in (("gdn_decode", "chunk"), ("gated_delta_rule", "torch")):
        with pytest.raises(ValueError, match=r"impl: expected one of \('auto', "):
            dispatch.resolve_impl(op, impl, cpu, q, v, needs_grad=False)


@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_bad_input_is_one_line_naming_the_argument(op, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    N, T, H, HV, K, V, P = 2, 3, 1, 2, 16, 16, 4
    g = -torch.rand(N, T, HV, K) if op == "kda" else -torch.rand(N, T, HV)
    good = dict(q=torch.randn(N, T, H, K), k=torch.randn(N, T, H, K), v=torch.randn(N, T, HV, V), g=g,
                beta=torch.rand(N, T, HV), state_pool=torch.zeros(P, HV, K, V),
                state_indices=torch.tensor([0, 2]), impl="torch")
    qT = lambda t: torch.randn(N, t, H, K)  # noqa: E731
    cases = [
        (dict(q=qT(9), k=qT(9)), ValueError, r"q: expected 1\.\.8 tokens per sequence .*got T=9"),
        (dict(q=torch.randn(1, N, T, H, K), k=torch.randn(1, N, T, H, K)), ValueError,
         r"q, k: expected \[N, T, H, K\] \(or \[N, H, K\], one token each\), got \(1, 2, 3, 1, 16\)"),
        (dict(v=torch.randn(N, T + 1, HV, V)), ValueError, r"v: expected \[N, T, HV, V\] with HV a multiple of H"),
        (dict(g=torch.zeros(N, T, HV, 3)), ValueError, r"g: expected .*\[N, T, HV.*, got torch.float32 \(2, 3, 2, 3\)"),
        (dict(beta=torch.rand(N, HV)), ValueError, r"beta: expected shape \(2, 3, 2\) \(\[N, T, HV\]\), got \(2, 2\)"),
        (dict(intermediate_states=torch.zeros(N, T - 1, HV, K, V)), ValueError,
         r"intermediate_states: expected shape \(2, 3, 2, 16, 16\) \(\[N, T, HV, K, V\]\), got \(2, 2, 2, 16, 16\)"),
        (dict(intermediate_states=torch.zeros(N, T, HV, K, V, dtype=torch.float64)), TypeError,
         r"intermediate_states: expected dtype torch.float32 \(the state's\), got torch.float64"),
        (dict(intermediate_states=torch.zeros(N, T, HV, V, K).transpose(3, 4)), ValueError,
         r"intermediate_states: expected a contiguous tensor"),
        (dict(num_accepted=torch.tensor([1.0, 2.0])), TypeError,
         r"num_accepted: expected an int32/int64 tensor, got torch.float32"),
        (dict(num_accepted=torch.tensor([1, 2, 3])), ValueError, r"num_accepted: expected shape \(2,\) .*got \(3,\)"),
        (dict(num_accepted=torch.tensor([0, 4])), ValueError, r"num_accepted: expected counts in 0\.\.3 .*got 0\.\.4"),
        (dict(num_accepted=torch.tensor([-1, 2], dtype=torch.int32)), ValueError, r"got -1\.\.2"),
        (dict(impl="cuda"), ValueError, r"impl: expected one of \('auto', 'triton', 'torch'\), got 'cuda'"),
        (dict(impl="triton"), RuntimeError, r"impl='triton' needs CUDA tensors .*got q on cpu"),
    ]
    if op == "kda":
        cases.append((dict(g=g.half()), ValueError, r"g: expected float32 \[N, T, HV, K\] = \(2, 3, 2, 16\)"))
    for change, kind, msg in cases:
        kw = dict(good, **change)
        with pytest.raises(kind, match=msg) as err:
            FNS[op](kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)
        assert "\n" not in str(err.value), str(err.value)
