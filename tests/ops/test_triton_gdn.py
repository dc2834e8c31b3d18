"""Triton gated-delta-rule kernels against the float64 reference.

CPU (CI): the kernels run under TRITON_INTERPRET=1 in a child process (tests/ops/triton/interp_gdn.py; the
variable must be set before triton decorates the kernels), on fresh random fp32 inputs: GVA 2 and 4, varlen
(lengths 1, 15, 64, 70), initial/final state, in-kernel l2norm, beta up to 2, T = 1, 65, 70, K=64 with V=64/128,
K=V=256,
the public `gated_delta_rule(..., impl="triton")`, a `torch.compile(fullgraph=True)` call (aot_eager backend:
the custom ops' fake kernels trace, the real kernels run), and the decode step on a state pool with indices.
Tolerance (relative RMS vs float64): 2e-6 for o and final state, 1e-5 (the GDN issue's fp32 bar) for every
gradient. Worst over 4 seeds of every case (2026-11-24): o 2.5e-7, gradients 1.4e-6 (dg at K=V=256); a case with
log-decays down to -30 a step is among them (dg 2.7e-7), and a decay cliff (in every chunk 32 steps down to -30,
then 32 mild; the kernels before had o 3-5e-5 and dg up to 7e-5 off there, now ~2e-7 / 4e-7). Before the kernels
kept their exponents and dg in their own precision (gdn_kernels `_cum_split`, `_row_minus_col`, `_dg_rows`) the
bars were 1e-5 and 3e-5, and dg reached 1.2e-5 at the usual decays and 1.5e-5 at decay 30.
Every chunk-backward launch plan (K-blocked state-first, the default; state-first with the UT dots in either
launch; the two-phase plan) runs at 4 chunks with GVA, at varlen without l2norm, and with fp16 inputs (the 16-bit
path; 1e-3 for o/state, 2e-3 for gradients), with the other plans' kernels blocked so a silent fallback fails; the
K-blocked one also at four key blocks of 16. So does each forward prep plan (K-blocked: GVA at 4 chunks,
varlen without l2norm, fp16, one launch at four key blocks; the whole-K kernel at 4 chunks).
The backward from the raw q and k (`gdn.TUNE["bwd_raw_qk"]`, the default: the forward keeps no Qg, Kd) runs in
every case above; the backward from the saved scaled tiles (bwd_raw_qk off) runs with GVA, varlen without l2norm and
fp16 inputs.
Fake kernels: the custom ops trace under FakeTensorMode without running a kernel.
GPU: `@pytest.mark.gpu` tests, skipped without CUDA; the full GPU check is scripts/gpu_check_gdn.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "triton"))
from recompute_check import check_recompute_result  # noqa: E402

TOL_OUT, TOL_GRAD = 2e-6, 1e-5


@pytest.fixture(scope="module")
def interp_results(interp_job):
    """tests/ops/triton/interp_gdn.py's results (run in the background from collection on: tests/conftest.py)."""
    return interp_job("gdn")


CASES = ["gva2_l2_h0_T70", "varlen_1_15_64_70", "gva4_K64_V128_T65_public", "T1", "K256_V256_T70", "compiled_T70",
         "inline_output_T70", "one_launch_prep_one_by_one_T130", "decay30_gva2_T130",
         "decay_cliff_gva2_T130"]


@pytest.mark.parametrize("case", CASES)
def test_chunk_kernels_match_float64(interp_results, case):
    res = interp_results[case]
    seed = interp_results["seed"]
    assert res["o_dtype_ok"] == 1.0
    for name in ("o", "final_state"):
        assert res[name] <= TOL_OUT, f"{case} {name}: rel {res[name]:.3g} (seed {seed})"
    grads = [n for n in ("dq", "dk", "dv", "dg", "dbeta", "dh0") if n in res]
    assert len(grads) >= 5
    for name in grads:
        assert res[name] <= TOL_GRAD, f"{case} {name}: rel {res[name]:.3g} (seed {seed})"


# the chunk-backward launch plans (gdn.TUNE bwd_variant / bwd_ut_dots), each with the other plans' kernels blocked:
# 4 chunks with GVA 2 and l2norm, and varlen (1, 15, 64, 70, 130 tokens: 7 chunks, partial ones, no GVA)
PLANS = ["kblock", "statefirst", "statefirst_parked", "twophase"]
PLAN_SHAPES = ["gva2_T200", "varlen_1_15_64_70_130", "fp16_varlen_gva2_T150"]
# relative RMS error vs float64 allowed per tensor. fp32: the same bars as every other case (measured 0.1e-6 to
# 5e-6). fp16 inputs (16-bit intermediates and dot operands, the GPU path; reference on the same rounded inputs):
# measured 2.6e-4 to 7.2e-4 over two seeds and all three plans
PLAN_TOL = {"o": TOL_OUT, "final_state": TOL_OUT, "dq": TOL_GRAD, "dk": TOL_GRAD, "dv": TOL_GRAD, "dg": TOL_GRAD,
            "dbeta": TOL_GRAD, "dh0": TOL_GRAD}
PLAN_TOL_FP16 = {"o": 1e-3, "final_state": 1e-3, "dq": 2e-3, "dk": 2e-3, "dv": 2e-3, "dg": 2e-3, "dbeta": 2e-3,
                 "dh0": 2e-3}


@pytest.mark.parametrize("case", ["bf16_varlen_gva2_T150", "bf16_decay30_gva2_T130"])
def test_bf16_inputs_within_the_gpu_bars(interp_results, case):
    """bf16 inputs (the GPU default: bf16 intermediates and dot operands) under the interpreter with its bf16 fixed
    (gdn_kernels._patch_interpreter_bf16), against float64 on the same rounded inputs, at the GPU check's bf16 bars:
    5e-3 for o and the final state, 1e-2 for every gradient. Measured 2.9-3.4e-3 (o) and 1.4-4.9e-3 (gradients)
    over three seeds (2026-11-25)."""
    res, seed = interp_results[case], interp_results["seed"]
    assert res["o_dtype_ok"] == 1.0
    for name in ("o", "final_state"):
        assert res[name] <= 5e-3, f"{case} {name}: rel {res[name]:.3g} (seed {seed})"
    for name in ("dq", "dk", "dv", "dg", "dbeta", "dh0"):
        assert res[name] <= 1e-2, f"{case} {name}: rel {res[name]:.3g} (seed {seed})"


@pytest.mark.parametrize("shape", PLAN_SHAPES)
@pytest.mark.parametrize("plan", PLANS)
def test_backward_launch_plans_match_float64(interp_results, plan, shape):
    res = interp_results[f"plan_{plan}_{shape}"]
    for name, tol in (PLAN_TOL_FP16 if shape.startswith("fp16") else PLAN_TOL).items():
        assert res[name] <= tol, f"{plan} {shape} {name}: rel {res[name]:.3g} > {tol} (seed {interp_results['seed']})"


# the K-blocked chunk backward (the default) at four key blocks of 16 with GVA, no initial state; other plans blocked
def test_kblock_backward_four_key_blocks_match_float64(interp_results):
    res = interp_results["plan_kblock_bk16_gva2_T130"]
    assert {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta"} == set(res) - {"o_dtype_ok"}
    for name, tol in PLAN_TOL.items():
        if name in res:
            assert res[name] <= tol, f"bk16 {name}: rel {res[name]:.3g} > {tol} (seed {interp_results['seed']})"


# the forward prep plans (gdn.TUNE prep_variant), the other plan's kernel blocked: K-blocked (default) at several
# chunks with GVA, varlen without l2norm, fp16 inputs and in one launch at four key blocks; the whole-K kernel once;
# A and T in one launch (prep_kkt, the default) against A then the solve, at four key blocks and at chunk sizes 32, 16;
# the forward without stage 1 (fwd_raw_out, the default: P from the output launch) against the one with it; the
# state pass on the Kd tile (state_raw_k off; the default reads raw k)
PREP_CASES = ["prep_kblock_bk32_gva2_T200", "prep_kblock_bk32_varlen_nol2", "prep_kblock_bk32_fp16_varlen_gva2_T150",
              "prep_kblock_one_launch_bk16_T130", "prep_whole_gva2_T200", "prep_a_then_solve_gva2_T200",
              "prep_kkt_bk16_varlen", "prep_kkt_bt32_gva2_varlen", "prep_kkt_bt16_gva2_varlen",
              "stage1_prep_gva2_T200", "raw_out_bv32_varlen_gva2", "kd_tile_state_varlen_gva2",
              "kd_tile_state_fp16_nol2_gva2_T150"]


@pytest.mark.parametrize("case", PREP_CASES)
def test_prep_plans_match_float64(interp_results, case):
    res = interp_results[case]
    for name, tol in (PLAN_TOL_FP16 if "fp16" in case else PLAN_TOL).items():
        assert res[name] <= tol, f"{case} {name}: rel {res[name]:.3g} > {tol} (seed {interp_results['seed']})"


@pytest.mark.parametrize("case", ["no_grad_prefill", "inline_output_no_grad"])
def test_inference_without_autograd_matches_float64(interp_results, case):
    res = interp_results[case]
    assert res["o"] <= TOL_OUT and res["final_state"] <= TOL_OUT, res


LEAN_CASES = [f"lean_{plan}_{shape}" for plan in ("split", "inline")
              for shape in ("gva2_T150", "varlen_nol2", "fp16_varlen_gva2", "T1")] + ["lean_split_gva4_K64_V128_bk32",
                                                                     "lean_twolaunch_prep_varlen",
                                                                     "lean_solve_doubling_varlen"]


@pytest.mark.parametrize("case", ["solve_doubling_gva2_T200", "solve_doubling16_varlen"])
def test_doubling_solves_match_float64(interp_results, case):
    """The UT solve by doubling (gdn.TUNE solve), forward and every gradient, the other prep kernel blocked."""
    res = interp_results[case]
    for name, tol in PLAN_TOL.items():
        assert res[name] <= tol, f"{case} {name}: rel {res[name]:.3g} > {tol} (seed {interp_results['seed']})"


@pytest.mark.parametrize("case", ["saved_qk_gva2_T200", "saved_qk_varlen_nol2", "saved_qk_fp16_varlen_gva2"])
def test_backward_from_saved_scaled_q_and_k_matches_float64(interp_results, case):
    """gdn.TUNE bwd_raw_qk off: the forward keeps Qg and Kd and the state backward reads them (the default reads the
    raw q and k; fp32 cases at the fp32 bars, fp16 inputs at the 16-bit path's bars)."""
    res = interp_results[case]
    for name, tol in (PLAN_TOL_FP16 if "fp16" in case else PLAN_TOL).items():
        if name in res:
            assert res[name] <= tol, f"{case} {name}: rel {res[name]:.3g} > {tol} (seed {interp_results['seed']})"


def _fake_gdn_inputs():
    """(B, T, H, HV, K, V) and bf16 q, k, v with fp32 g, beta of those shapes (GVA 2), made in the caller's mode
    (FakeTensorMode: shapes only)."""
    B, T, H, HV, K, V = 2, 100, 2, 4, 64, 128
    q, k = torch.empty(B, T, H, K, dtype=torch.bfloat16), torch.empty(B, T, H, K, dtype=torch.bfloat16)
    v = torch.empty(B, T, HV, V, dtype=torch.bfloat16)
    return (B, T, H, HV, K, V), (q, k, v, torch.empty(B, T, HV), torch.empty(B, T, HV))


@pytest.mark.parametrize("raw", [True, False])
def test_forward_keeps_scaled_copies_only_without_raw_qk(monkeypatch, raw):
    """The forward's fake kernel (what torch.compile traces) saves empty Qg and Kd under gdn.TUNE bwd_raw_qk (the
    default) and [tokens, HV, K] ones without it; the backward's fake kernel returns every gradient's shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hybridlm.ops.triton import gdn

    monkeypatch.setitem(gdn.TUNE, "bwd_raw_qk", raw)
    with FakeTensorMode():
        (B, T, H, HV, K, V), (q, k, v, g, beta) = _fake_gdn_inputs()
        o, ht, *saved = torch.ops.hybridlm.gdn_chunk_fwd(q, k, v, g, beta, None, None, 0.1, True, True, True)
        want = [(0,), (0,)] if raw else [(B * T, HV, K), (B * T, HV, K)]
        assert [tuple(x.shape) for x in saved[4:6]] == want  # Qg, Kd
        assert saved[1].shape == (B * T, HV, K) and saved[6].numel() > 0  # W and P are kept either way
        grads = torch.ops.hybridlm.gdn_chunk_bwd(o, ht, q, k, v, g, beta, *saved, None, 0.1, True, False, None)
        assert [x.shape for x in grads[:5]] == [q.shape, k.shape, v.shape, g.shape, beta.shape]


def test_state_gradients_freed_before_dq_exists(interp_results):
    """The K-blocked chunk backward drops dS and dVn after its first launch, their last reader, and allocates dq
    (written by its second launch only) after that: neither is alive when `_chunk_bwd_out_blk` starts."""
    res = interp_results["state_grads_freed"]
    assert res == {"alive_at_out_launch": 0.0, "refs": 2.0, "dq_ok": 1.0}, res


def test_t_kept_in_16_bits_changes_no_bit(interp_results):
    """fp16 inputs: the forward keeps T = (I + A)^{-1} in 16 bits for the backward, and every output and gradient
    equals, bit for bit, a run that keeps it in fp32 (exact: 0.0)."""
    res = interp_results["t16_same_bits"]
    assert res == {"kept_16bit": 1.0, "kept_fp32_then": 1.0, "max_abs_diff": 0.0}, res


@pytest.mark.parametrize(("dtype", "tune", "want"), [
    (torch.bfloat16, {}, torch.bfloat16), (torch.bfloat16, {"prep_lowp": False}, torch.float32),
    (torch.float32, {}, torch.float32)])
def test_kept_t_dtype(monkeypatch, dtype, tune, want):
    """The forward's fake kernel keeps T in the 16-bit storage dtype only when W/U's dots round it to 16 bits
    (prep_lowp) and so does the backward (bwd_lowp); otherwise fp32, as the real kernels do (`gdn._t_dtype`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hybridlm.ops.triton import gdn

    for key, val in tune.items():
        monkeypatch.setitem(gdn.TUNE, key, val)
    with FakeTensorMode():
        _, (q, k, v, g, beta) = _fake_gdn_inputs()
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        o, ht, Tb, *_ = torch.ops.hybridlm.gdn_chunk_fwd(q, k, v, g, beta, None, None, 0.1, True, True, True)
        assert Tb.dtype == want


def test_unknown_tune_keys_are_a_clear_error(monkeypatch):
    """`gdn.update_tune` (the benches' --tune-json) refuses keys TUNE does not have, naming the source."""
    from hybridlm.ops.triton import gdn

    monkeypatch.setattr(gdn, "TUNE", dict(gdn.TUNE))
    with pytest.raises(ValueError, match=r"--tune-json t.json: unknown gdn.TUNE keys \['bwd_raw_qq'\]"):
        gdn.update_tune({"bwd_raw_qq": False}, "--tune-json t.json")
    gdn.update_tune({"bwd_raw_qk": False}, "--tune-json t.json")
    assert gdn.TUNE["bwd_raw_qk"] is False


def test_state_pass_v_block_by_waves(monkeypatch):
    """`_recur_bv` on a 132-SM device: V block 32, halved to 16 only while the halved grid still runs in one wave
    (two `_recur_fwd` programs an SM, one `_recur_bwd` program); 16 above K=128; TUNE overrides."""
    from types import SimpleNamespace

    from hybridlm.ops.triton import gdn

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(multi_processor_count=132))
    cuda = torch.device("cuda")
    # (sequences x value heads) -> (forward V block, backward V block) at K = V = 128
    expect = {8: (16, 16), 16: (16, 16), 32: (16, 32), 33: (16, 32), 34: (32, 32), 64: (32, 32), 256: (32, 32)}
    for programs, (fwd, bwd) in expect.items():
        assert gdn._recur_bv(128, 128, programs, cuda) == fwd, programs
        assert gdn._recur_bv(128, 128, programs, cuda, "rbwd_bv", per_sm=1) == bwd, programs
    assert gdn._recur_bv(256, 256, 8, cuda) == 16
    assert gdn._recur_bv(64, 64, 8, cuda) == 16
    monkeypatch.setitem(gdn.TUNE, "rbwd_bv", 64)
    assert gdn._recur_bv(128, 128, 32, cuda, "rbwd_bv", per_sm=1) == 64
    assert gdn._recur_bv(128, 128, 32, cuda) == 16  # fwd_bv still follows the rule


@pytest.mark.parametrize("key", ["fwd_warps", "rbwd_warps"])
def test_four_warp_state_kernels_need_two_chunks_on_cuda(monkeypatch, key):
    """Triton 3.6 compiles the whole-K state kernels at 4 warps to out-of-bounds shared reads when the pipelined chunk
    loop runs once (H100, 2026-11-25): on CUDA, 4 warps are taken from two chunks (fwd_stages) up, 8 below; the CPU
    interpreter always gets the setting."""
    from hybridlm.ops.triton import gdn

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setitem(gdn.TUNE, key, 4)
    assert [gdn._state_warps(key, 128, cuda, nch) for nch in (0, 1, 2, 64)] == [8, 8, 4, 4]
    monkeypatch.setitem(gdn.TUNE, "fwd_stages", 3)
    assert [gdn._state_warps(key, 128, cuda, nch) for nch in (2, 3)] == [8, 4]
    assert gdn._state_warps(key, 128, cpu, 1) == 4
    monkeypatch.setitem(gdn.TUNE, key, None)
    assert gdn._state_warps(key, 128, cuda, 64) == 8


def test_kda_state_passes_follow_the_same_rule(monkeypatch):
    """KDA's state passes (kda.TUNE state_warps) take GDN's one-chunk rule, read from kda.TUNE, not gdn.TUNE."""
    from hybridlm.ops.triton import gdn, kda

    cuda = torch.device("cuda")
    monkeypatch.setitem(kda.TUNE, "state_warps", 4)
    monkeypatch.setitem(gdn.TUNE, "fwd_warps", 8)
    assert [gdn._state_warps("state_warps", 128, cuda, nch, kda.TUNE) for nch in (1, 2)] == [8, 4]


def test_kkt_settings_are_clear_errors(monkeypatch):
    """gdn.TUNE prep_kkt needs the split K-blocked prep, and kkt_prec is one of three dot precisions."""
    from hybridlm.ops.triton import gdn

    monkeypatch.setitem(gdn.TUNE, "prep_kkt", True)
    monkeypatch.setitem(gdn.TUNE, "prep_split", False)
    with pytest.raises(ValueError, match=r"TUNE\['prep_kkt'\] needs the split K-blocked prep .*prep_split=False"):
        gdn._use_kkt()
    monkeypatch.setitem(gdn.TUNE, "prep_split", True)
    assert gdn._use_kkt() is True
    monkeypatch.setitem(gdn.TUNE, "kkt_prec", "bf16")
    k = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16)
    lay = gdn.layout(None, 1, 64, 64, k.device)
    with pytest.raises(ValueError, match=r"TUNE\['kkt_prec'\]: expected 'tf32', 'tf32x3' or 'ieee', got 'bf16'"):
        gdn._kkt_launch(k, k[..., 0].float(), k[..., 0], k, lay, 1, 1, 64, 64, True, "tf32")


def test_raw_out_needs_its_plan(monkeypatch):
    """gdn.TUNE fwd_raw_out needs A from `_kkt_solve`, the output in its own launch, and (training) a backward from
    the raw q and k: any other setting is a clear error naming it."""
    from hybridlm.ops.triton import gdn

    monkeypatch.setitem(gdn.TUNE, "fwd_raw_out", True)
    assert gdn._use_raw_out(save=True) is True
    monkeypatch.setitem(gdn.TUNE, "bwd_raw_qk", False)
    with pytest.raises(ValueError, match=r"TUNE\['fwd_raw_out'\] needs .*got \{'bwd_raw_qk': False\}"):
        gdn._use_raw_out(save=True)
    assert gdn._use_raw_out(save=False) is True  # no backward: Qg is never needed
    monkeypatch.setitem(gdn.TUNE, "fwd_split_o", False)
    with pytest.raises(ValueError, match=r"got \{'fwd_split_o': False\}"):
        gdn._use_raw_out(save=False)


def test_state_raw_k_needs_raw_out(monkeypatch):
    """gdn.TUNE state_raw_k takes its key scales from the raw-output forward's W/U launch: without fwd_raw_out it is
    a clear error, not a setting that silently does nothing."""
    from hybridlm.ops.triton import gdn

    monkeypatch.setitem(gdn.TUNE, "state_raw_k", True)
    monkeypatch.setitem(gdn.TUNE, "fwd_raw_out", False)
    q = torch.zeros(1, 64, 1, 64)
    g, beta = torch.zeros(1, 64, 1), torch.ones(1, 64, 1)
    with pytest.raises(ValueError, match=r"TUNE\['state_raw_k'\] needs TUNE\['fwd_raw_out'\].*got fwd_raw_out=False"):
        gdn._fwd_impl(q, q, q, g, beta, None, None, 0.125, True, False, True, 64)


@pytest.mark.parametrize("stages", [0, 1.5, None])
def test_bwd_stages_is_checked(monkeypatch, stages):
    """gdn.TUNE bwd_stages goes to the K-blocked chunk backward's launches as num_stages: anything but an int >= 1 is
    a clear error before a launch, not a compile failure inside Triton."""
    from hybridlm.ops.triton import gdn

    monkeypatch.setitem(gdn.TUNE, "bwd_stages", stages)
    x = torch.zeros(64, 1, 64)
    lay = gdn.layout(None, 1, 64, 64, torch.device("cpu"))
    with pytest.raises(ValueError, match=rf"TUNE\['bwd_stages'\]: expected an int >= 1, got {stages!r}"):
        gdn._chunk_bwd_kblock(x, x, x, x, x, x, x, [x, x], x, x, x, x, x, x, x, lay, 0.125, 1, 1, 64, 64, 64, True,
                              "ieee", False)


def test_unknown_solve_is_a_clear_error(monkeypatch):
    from hybridlm.ops.triton import gdn, gdn_kernels

    monkeypatch.setitem(gdn.TUNE, "solve", "cholesky")
    with pytest.raises(ValueError, match=r"TUNE\['solve'\]: expected one of .*got 'cholesky'"):
        gdn._solve_args(gdn_kernels._prep_fwd_blk)


@pytest.mark.parametrize("case", LEAN_CASES)
def test_lean_inference_forward_matches_float64(interp_results, case):
    """The inference kernels (gdn.TUNE fwd_variant "lean"), with the training prep kernels blocked."""
    res = interp_results[case]
    tol = PLAN_TOL_FP16 if "fp16" in case else PLAN_TOL
    assert res["o_dtype_ok"] == 1.0
    for name in ("o", "final_state"):
        assert res[name] <= tol[name], \
            f"{case} {name}: rel {res[name]:.3g} > {tol[name]} (seed {interp_results['seed']})"


def test_decode_step_matches_float64(interp_results):
    res = interp_results["decode"]
    assert res["o"] <= TOL_OUT and res["state"] <= TOL_OUT, res
    assert res["others_unchanged"] == 1.0


def test_fake_kernels_trace():
    from torch._subclasses.fake_tensor import FakeTensorMode

    import hybridlm.ops.triton  # noqa: F401  (registers the ops)

    with FakeTensorMode():
        (B, T, H, HV, K, V), (q, k, v, g, beta) = _fake_gdn_inputs()
        o, ht, *saved = torch.ops.hybridlm.gdn_chunk_fwd(q, k, v, g, beta, None, None, 0.1, True, True, True)
        assert o.shape == (B, T, HV, V) and o.dtype == torch.bfloat16
        assert ht.shape == (B, HV, K, V) and ht.dtype == torch.float32
        grads = torch.ops.hybridlm.gdn_chunk_bwd(o, ht, q, k, v, g, beta, *saved, None, 0.1, True, False,
                                                 None)
        assert [x.shape for x in grads[:5]] == [q.shape, k.shape, v.shape, g.shape, beta.shape]
        pool = torch.empty(8, HV, K, V)
        od = torch.ops.hybridlm.gdn_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], pool,
                                           torch.empty(B, dtype=torch.int32), 0.1, True)
        assert od.shape == (B, HV, V)


def test_bad_head_dim_is_a_clear_error():
    from hybridlm.ops.triton import chunk_gated_delta_rule

    q = torch.randn(1, 4, 1, 48)
    v = torch.randn(1, 4, 1, 64)
    with pytest.raises(ValueError, match="K=48"):
        chunk_gated_delta_rule(q, q, v, g=torch.zeros(1, 4, 1), beta=torch.ones(1, 4, 1))
    with pytest.raises(ValueError, match="V=96"):
        chunk_gated_delta_rule(v, v, torch.randn(1, 4, 1, 96), g=torch.zeros(1, 4, 1), beta=torch.ones(1, 4, 1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_small_fp32():
    from hybridlm.ops import gated_delta_rule

    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    B, T, H, HV, K, V = 2, 300, 2, 4, 128, 128
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    xs = [r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V), -torch.rand(B, T, HV, device="cuda", generator=gen),
          2 * torch.rand(B, T, HV, device="cuda", generator=gen), r(B, HV, K, V)]
    kw = lambda x, impl: dict(g=x[3], beta=x[4], initial_state=x[5], output_final_state=True, use_qk_l2norm=True,
                              impl=impl)
    o, ht = gated_delta_rule(*xs[:3], **kw(xs, "triton"))
    d = [x.double() for x in xs]
    o2, ht2 = gated_delta_rule(*d[:3], **kw(d, "chunk"))
    assert ((o.double() - o2).norm() / o2.norm()).item() <= 1e-5
    assert ((ht.double() - ht2).norm() / ht2.norm()).item() <= 1e-5


def test_one_pipeline_stage_in_the_sequential_kernels_is_refused(monkeypatch):
    """num_stages=1 in `_recur_fwd` gave wrong outputs and an illegal memory access on an H100 (2026-11-23)."""
    from hybridlm.ops.triton import gdn

    monkeypatch.setitem(gdn.TUNE, "fwd_stages", 1)
    with pytest.raises(ValueError, match=r"fwd_stages.*expected >= 2.*got 1"):
        gdn.fwd_stages()


def test_kblock_backward_refuses_key_blocks_below_the_v_block(monkeypatch):
    """Key blocks 32 with V blocks 64 gave a wrong dk on an H100 (BENCHMARKS.md, 2026-11-23): refused, by name."""
    from hybridlm.ops.triton import gdn

    monkeypatch.setitem(gdn.TUNE, "bwd_bk", 32)
    monkeypatch.setitem(gdn.TUNE, "bwd_bv", None)
    with pytest.raises(ValueError, match=r"TUNE\['bwd_bk'\]=32 with V block 64"):
        gdn.kblock_bwd_blocks(128, 128)
    assert gdn.kblock_bwd_blocks(128, 64) == (32, 32)  # V 64 takes V blocks of 32
    monkeypatch.setitem(gdn.TUNE, "bwd_bv", 32)
    assert gdn.kblock_bwd_blocks(128, 128) == (32, 32)
    monkeypatch.setitem(gdn.TUNE, "bwd_bk", 64)
    monkeypatch.setitem(gdn.TUNE, "bwd_bv", None)
    assert gdn.kblock_bwd_blocks(128, 256) == (64, 64)


def test_recompute_keeps_only_the_inputs_and_changes_nothing(interp_results):
    """recompute=True: autograd keeps q, k, v, g, beta, h0 and cu_seqlens (12 bytes), nothing else; o, the final
    state and every gradient are bitwise those of recompute=False."""
    check_recompute_result(interp_results["recompute_varlen"])


def test_recompute_frees_what_the_chunk_backward_does_not_read(interp_results):
    """With recompute the backward's rerun of the forward is the only holder of W, Qg, Kd and P, and they are gone
    before the chunk backward allocates dq, dk, dv (one layer's peak memory); without it autograd holds all four."""
    res = interp_results["recompute_frees_early"]
    assert res == {"alive_without": 4.0, "alive_with": 0.0}, res
