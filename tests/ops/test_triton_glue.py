"""Fused Triton layer glue (hybridlm/ops/triton/{conv,norm,gates,swiglu}.py) against the float64 PyTorch references.

CPU (CI): the kernels run under TRITON_INTERPRET=1 in a child process (tests/ops/triton/interp_glue.py ops; the
variable must be set before triton decorates the kernels) on fresh random float32 inputs with NaN-poisoned
outputs: conv widths 1, 2, 3, 4, 6, 8 with/without bias, SiLU or none, initial state, varlen documents shorter than
the kernel (lengths 1, 2), T = 1, C not a multiple of the channel block, the output split as a layer's q, k, v, the
backward's token ranges ending inside documents (both ways of shifting dpre), launch blocks other than the defaults
(conv and gated norm); the pooled decode step; gated RMSNorm (SiLU / sigmoid +
fp32 output, with and without weight) at D = 64, 100, 128, 256; RMSNorm kinds at D = 48..2560; the GDN gates
(beta_scale 1 and 2, both softplus branches) and Kimi's channel-wise gates; SwiGLU's silu(gate) * up (a partial
last block); a torch.compile(fullgraph, aot_eager) call through the custom ops. RoPE on q and k (views of a fused
projection; GQA, partial rotary, per-row offsets, one broadcast position row, packed-document positions, angles
past 16K and 123K, token and head blocks other than the defaults) and the sigmoid output gate (elementwise and
headwise, o a transposed view, gate a strided slice) in float32, bfloat16 and float16, see test_rope_*.
Tolerances (relative L2 vs float64, measured ~1e-7 everywhere): outputs and states 2e-6, every gradient 5e-6
(dA_log / ddt_bias are sums over all tokens: 1e-5). Final states are copies of inputs: exact.
bfloat16: three cases (conv + SiLU, gated RMSNorm, SwiGLU) at the GPU's bf16 bars (5e-3 outputs, 1e-2 gradients),
possible since hybridlm fixes the interpreter's bf16 casts (it truncated); the GPU check
(scripts/gpu_check_glue.py, tests/ops/test_gpu_check_glue.py) covers every kernel, and the `gpu` test below does
a small one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

HERE = Path(__file__).parent
TOL_OUT, TOL_GRAD, TOL_SUM = 2e-6, 5e-6, 1e-5
SUMS = ("dA_log", "ddt_bias")


@pytest.fixture(scope="module")
def interp_results(interp_job):
    """interp_glue.py ops (started at collection in the suite's second lane: tests/conftest.py)."""
    return interp_job("glue_ops")


CONV = ["conv_W2_bias_h0_T37_C70", "conv_W3_noact_h0_T5", "conv_W6_bias_h0_T40", "conv_W4_varlen_1_2_17_5",
        "conv_W4_varlen_h0_bias", "conv_W4_T1_h0", "conv_W4_varlen_h0_bias_blocks", "conv_W4_varlen_h0_bias_split",
        "conv_W3_noact_split", "conv_W4_varlen_h0_bias_walk", "conv_W8_varlen_h0_bias_walk",
        "conv_W8_varlen_h0_bias_walk_bt4", "conv_W1_bias_h0_walk", "conv_W4_noact_split_walk"]
NORM = ["gnorm_silu_D128", "gnorm_silu_D128_blocks", "gnorm_silu_noweight_D100", "gnorm_sigmoid_fp32out_D64",
        "gnorm_silu_D256", "rms_zero_centered_D2048", "rms_llama_D96", "rms_fp32w_D2560", "rms_noweight_D48"]
GATES = ["gates_gdn", "gates_gdn_beta2", "gates_kda_K16"]
SWIGLU = ["swiglu_2x7x300", "swiglu_5x16"]
EXPECTED_GRADS = {"conv_W2_bias_h0_T37_C70": 4, "conv_W3_noact_h0_T5": 3, "conv_W6_bias_h0_T40": 4,
                  "conv_W4_varlen_1_2_17_5": 2, "conv_W4_varlen_h0_bias": 4, "conv_W4_T1_h0": 4, "gnorm_silu_D128": 3,
                  "conv_W4_varlen_h0_bias_blocks": 4, "gnorm_silu_D128_blocks": 3,
                  "conv_W4_varlen_h0_bias_split": 4, "conv_W3_noact_split": 3,
                  "conv_W4_varlen_h0_bias_walk": 4, "conv_W8_varlen_h0_bias_walk": 4,
                  "conv_W8_varlen_h0_bias_walk_bt4": 4,
                  "conv_W1_bias_h0_walk": 4, "conv_W4_noact_split_walk": 2,
                  "gnorm_silu_noweight_D100": 2, "gnorm_sigmoid_fp32out_D64": 3, "gnorm_silu_D256": 3,
                  "rms_zero_centered_D2048": 2, "rms_llama_D96": 2, "rms_fp32w_D2560": 2, "rms_noweight_D48": 1,
                  "gates_gdn": 4, "gates_gdn_beta2": 4, "gates_kda_K16": 4, "swiglu_2x7x300": 2, "swiglu_5x16": 2}


@pytest.mark.parametrize("case", CONV + NORM + GATES + SWIGLU)
def test_glue_kernels_match_float64(interp_results, case):
    res, seed = interp_results[case], interp_results["seed"]
    assert res.pop("dtype_ok") == 1.0
    # split cases: the parts are their own contiguous tensors and equal the unsplit output bit for bit
    assert res.pop("split_ok", 1.0) == 1.0, f"{case}: split parts are views, strided, or differ from the whole"
    grads = [n for n in res if n.startswith("d")]
    assert len(grads) == EXPECTED_GRADS[case], grads
    if "final_state" in res:
        assert res.pop("final_state") == 0.0, f"{case} final_state (seed {seed})"
    for name, err in res.items():
        tol = TOL_SUM if name in SUMS else TOL_GRAD if name.startswith("d") else TOL_OUT
        assert err <= tol, f"{case} {name}: rel {err:.3g} > {tol} (seed {seed})"


@pytest.mark.parametrize("case", ["bf16_conv_W4_bias_T40", "bf16_gnorm_silu_D128", "bf16_swiglu_5x256"])
def test_glue_kernels_bf16_within_bf16_bars(interp_results, case):
    """bf16 inputs and outputs (the GPU default) against float64 on the same rounded inputs: 5e-3 for the output,
    1e-2 for every gradient, the GPU check's bf16 bars (measured 1.7-3.3e-3)."""
    res, seed = dict(interp_results[case]), interp_results["seed"]
    assert res.pop("dtype_ok") == 1.0
    assert len([n for n in res if n.startswith("d")]) == (2 if "swiglu" in case else 3)
    for name, err in res.items():
        tol = 1e-2 if name.startswith("d") else 5e-3
        assert err <= tol, f"{case} {name}: rel {err:.3g} > {tol} (seed {seed})"


ROPE = {"rope_gqa_fp32_offsets": torch.float32, "rope_partial_bf16_broadcast": torch.bfloat16,
        "rope_packed_fp16": torch.float16, "rope_long_bf16_blocks": torch.bfloat16,
        "rope_long_fp32_blocks": torch.float32}
GATE = {"gate_elementwise_fp32": torch.float32, "gate_headwise_fp32": torch.float32,
        "gate_elementwise_bf16": torch.bfloat16, "gate_headwise_fp16": torch.float16,
        "gate_elementwise_fp32_blocks": torch.float32}
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.mark.parametrize("case", list(ROPE))
def test_rope_matches_float64_and_the_torch_path(interp_results, case):
    """RoPE on q, k and its backward (interp_glue.rope_case) vs float64 on the same rounded inputs (the float32
    angle of the layers, cos/sin in float64): float32 within 2e-6 (outputs) / 5e-6 (gradients) relative L2
    (measured ~5e-8); bf16 / fp16 within the dtype's unit roundoff (one rounding; measured 0.3x of it) and no
    farther than the PyTorch path (measured 0.7x of its error). Against the PyTorch path in the same dtype: at most
    2 ulps at the scale of each rotated pair (measured 2.0 over 20 seeds, each dtype)."""
    res, seed, dtype = dict(interp_results[case]), interp_results["seed"], ROPE[case]
    assert res.pop("dtype_ok") == 1.0, f"{case}: outputs not contiguous in the inputs' dtype"
    for n in ("q", "k", "dq", "dk"):
        err, err_torch, ulps = res[n], res["torch_" + n], res["ulps_" + n]
        if dtype == torch.float32:
            tol = TOL_GRAD if n.startswith("d") else TOL_OUT
            assert err <= tol, f"{case} {n}: rel {err:.3g} > {tol} (seed {seed})"
        else:
            tol = UNIT_ROUNDOFF[dtype]
            assert err <= min(tol, err_torch), f"{case} {n}: rel {err:.3g}, bar {tol:.3g}, torch {err_torch:.3g} " \
                                               f"(seed {seed})"
        assert ulps <= 2.0, f"{case} {n}: {ulps} ulps from the PyTorch path (seed {seed})"


@pytest.mark.parametrize("case", list(GATE))
def test_sigmoid_gate_matches_float64(interp_results, case):
    """o * sigmoid(gate) and both gradients (interp_glue.gate_case) vs float64: float32 within 2e-6 / 5e-6 relative
    L2 (measured <= 4e-7), bf16 / fp16 within the unit roundoff (measured 0.5x); the gate's slice of the
    projection gets its gradient, the query's slice none."""
    res, seed, dtype = dict(interp_results[case]), interp_results["seed"], GATE[case]
    assert res.pop("dtype_ok") == 1.0 and res.pop("untouched") == 1.0, case
    assert set(res) == {"y", "do", "dgate"}
    for n, err in res.items():
        tol = UNIT_ROUNDOFF.get(dtype, TOL_GRAD if n.startswith("d") else TOL_OUT)
        assert err <= tol, f"{case} {n}: rel {err:.3g} > {tol} (seed {seed})"


def test_rope_and_gate_compiled_fullgraph_match_eager(interp_results):
    res = interp_results["rope_compiled"]
    assert set(res) == {"q", "k", "y", "dq", "dk", "do", "dgate"}
    assert all(v <= TOL_OUT for v in res.values()), res


@pytest.mark.parametrize("case", ["conv_decode_W4_pool", "conv_decode_W2"])
def test_conv_decode_matches_float64(interp_results, case):
    res = interp_results[case]
    assert res["y"] <= TOL_OUT, res
    assert res["state"] == 0.0 and res["others_unchanged"] == 1.0, res


def test_compiled_fullgraph_matches_eager(interp_results):
    res = interp_results["compiled"]
    assert all(v <= TOL_OUT for v in res.values()), res


def test_fake_kernels_trace():
    from torch._subclasses.fake_tensor import FakeTensorMode

    import hybridlm.ops.triton.conv  # noqa: F401  (registers the ops)
    import hybridlm.ops.triton.gates  # noqa: F401
    import hybridlm.ops.triton.norm  # noqa: F401
    import hybridlm.ops.triton.rope  # noqa: F401

    ops = torch.ops.hybridlm
    with FakeTensorMode():
        x, w, h0 = torch.empty(1, 50, 96, dtype=torch.bfloat16), torch.empty(96, 4), torch.empty(3, 96, 4)
        cu = torch.empty(4, dtype=torch.int32)
        y, ht = ops.conv_fwd(x, w, None, h0, cu, True, True)
        assert y.shape == x.shape and y.dtype == torch.bfloat16 and ht.shape == (3, 96, 4)
        dx, dw, db, dh0 = ops.conv_bwd(y, x, w, None, h0, cu, True, True)
        assert dx.shape == x.shape and dw.shape == w.shape and dh0.shape == h0.shape
        assert ops.conv_decode(x[0, :3], h0, None, w, None, True).shape == (3, 96)
        r, gt = torch.empty(10, 128, dtype=torch.bfloat16), torch.empty(10, 128, dtype=torch.bfloat16)
        yn, rstd = ops.norm_fwd(r, gt, torch.empty(128), 1e-6, False, True, False, 1)
        assert yn.shape == r.shape and rstd.shape == (10,)
        assert [t.shape for t in ops.norm_bwd(yn, r, gt, torch.empty(128), 1e-6, False, True, False, 1)] == [
            r.shape, gt.shape, (128,)]
        a, b = torch.empty(10, 32, dtype=torch.bfloat16), torch.empty(10, 32, dtype=torch.bfloat16)
        g, beta = ops.gates_fwd(a, b, torch.empty(32), torch.empty(32), 1.0)
        assert g.dtype == torch.float32 and beta.dtype == torch.bfloat16
        assert [t.shape for t in ops.gates_bwd(g, beta, a, b, torch.empty(32), torch.empty(32), 1.0)] == [
            a.shape, b.shape, (32,), (32,)]
        proj = torch.empty(2, 50, 4 * 256 + 2 * 128, dtype=torch.bfloat16)
        q, k = proj[..., :1024].view(2, 50, 4, 256)[..., :128], proj[..., 1024:].view(2, 50, 2, 128)
        pos = torch.empty(1, 50, dtype=torch.long)
        for fn in (ops.rope_fwd, ops.rope_bwd):
            qo, ko = fn(q, k, pos, 64, 1e4)
            assert qo.shape == q.shape and ko.shape == k.shape and qo.is_contiguous() and qo.dtype == q.dtype
        y = ops.sigmoid_gate_fwd(q, proj[..., :1024].view(2, 50, 4, 256)[..., 128:129])
        assert y.shape == q.shape and y.is_contiguous()
        do, dg = ops.sigmoid_gate_bwd(y, q, proj[..., :1024].view(2, 50, 4, 256)[..., 128:129])
        assert do.shape == q.shape and dg.shape == (2, 50, 4, 1)


def test_norm_backward_launch_plan_by_width():
    """The gated norm's backward: rows up to NARROW_D wide in 1024-element blocks at 4 warps, 64 looping programs
    per SM; wider rows 2048 elements at 8 warps (16 from 8K), 4 per SM; the fp32 dweight partials never above
    DWP_BYTES; a setting out of range is a clear error."""
    from hybridlm.ops.triton import norm as tnorm
    from hybridlm.ops.triton.tune import tuned

    assert tnorm._blocks_bwd(128) == (128, 8, 4)
    assert tnorm._blocks_bwd(2048) == (2048, 1, 8)
    assert tnorm._blocks_bwd(8192) == (8192, 1, 16)
    assert tnorm._bwd_programs(524288, 8, 128, 132) == 64 * 132
    assert tnorm._bwd_programs(16384, 1, 2048, 132) == 4 * 132
    with tuned(tnorm.TUNE, bwd_programs_per_sm=1024):  # more programs than the partials' cap allows
        assert tnorm._bwd_programs(4 * 524288, 8, 128, 132) == tnorm.DWP_BYTES // (4 * 128)
    with tuned(tnorm.TUNE, bwd_programs_per_sm=2):
        assert tnorm._bwd_programs(524288, 8, 128, 132) == 264
    for bad in (0, "fast", 1.5):
        with tuned(tnorm.TUNE, bwd_programs_per_sm=bad), pytest.raises(
                ValueError, match=rf"norm.TUNE.bwd_programs_per_sm: expected None or a positive int, got {bad!r}"):
            tnorm._bwd_programs(524288, 8, 128, 132)
    assert tnorm.TUNE.bwd_programs_per_sm is None


def test_launch_tables_refuse_unknown_settings():
    from hybridlm.ops.triton import conv, norm
    from hybridlm.ops.triton.tune import tuned

    for table in (conv.TUNE, norm.TUNE):
        with pytest.raises(ValueError, match=r"unknown settings \['dw_acc'\]"), tuned(table, dw_acc=True):
            pass
    with tuned(conv.TUNE, bwd_bt=16):
        assert conv.TUNE.bwd_bt == 16
    assert conv.TUNE.bwd_bt == 32


def test_conv_backward_settings_are_checked():
    """A token block that is not four phases of a power of two rows is a clear error (before any launch)."""
    from hybridlm.ops.triton import conv
    from hybridlm.ops.triton.tune import tuned

    x, w = torch.randn(1, 12, 8), torch.randn(8, 8)
    for bt in (2, 12):
        with tuned(conv.TUNE, bwd_bt=bt), pytest.raises(
                ValueError, match=rf"conv.TUNE.bwd_bt: expected a power of two >= 4 .* got {bt}"):
            conv._bwd_launch((x,), x, w, None, None, None, True, False, 0, 0)


def test_split_block_falls_back_below_the_default_channel_block():
    """A split's channel block is the largest power of two <= the table's (and >= 16) dividing C0 and C1, so no
    block straddles q and k; none at all keeps one output tensor."""
    from hybridlm.ops.triton import conv

    assert conv.TUNE.bwd_bc == 64
    assert conv.split_block(1024, 1024, 128) == 128  # the 357M layer's q, k
    assert conv.split_block(2048, 192, 128) == 64
    assert conv.split_block(16, 32, 128) == 16
    assert conv.split_block(24, 40, 128) == 0  # 8 divides both, below the 16-channel floor


def test_bad_inputs_are_clear_errors():
    from hybridlm.ops.triton import conv, gates, norm, rope

    x, w = torch.randn(1, 5, 8), torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"weight: expected shape \[C=8, W\]"):
        conv.causal_conv1d(x, torch.randn(7, 4))
    with pytest.raises(ValueError, match="W=9"):
        conv.causal_conv1d(x, torch.randn(8, 9))
    with pytest.raises(TypeError, match="x: expected dtype"):
        conv.causal_conv1d(x.double(), w)
    with pytest.raises(ValueError, match="activation"):
        conv.causal_conv1d(x, w, activation="gelu")
    with pytest.raises(ValueError, match=r"initial_state: expected shape \(1, 8, 4\)"):
        conv.causal_conv1d(x, w, initial_state=torch.randn(2, 8, 4))
    with pytest.raises(ValueError, match="B == 1 with cu_seqlens"):
        conv.causal_conv1d(torch.randn(2, 5, 8), w, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="state_indices"):
        conv.causal_conv1d_update(x[0, :2], torch.randn(4, 8, 4), w, state_indices=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"conv_state: expected shape \[P, 8, 4\]"):
        conv.causal_conv1d_update(x[0, :2], torch.randn(4, 8, 3), w)
    with pytest.raises(ValueError, match="gate: expected the shape of x"):
        norm.gated_rms_norm(x, x[:, :2], None)
    with pytest.raises(ValueError, match=r"weight: expected shape \(8,\)"):
        norm.rms_norm(x, torch.randn(7))
    with pytest.raises(ValueError, match="activation"):
        norm.gated_rms_norm(x, x, None, activation="relu")
    with pytest.raises(ValueError, match="A_log: expected 3 elements"):
        gates.gdn_gates(torch.randn(2, 3), torch.randn(2, 3), torch.randn(4), torch.randn(3))
    with pytest.raises(ValueError, match=r"f, b: expected \[B, T, H \* K\]"):
        gates.kda_gates(torch.randn(2, 10), torch.randn(2, 3), torch.randn(3), torch.randn(10))
    q, k, pos = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 16), torch.arange(5)[None]
    for rd in (7, 0, 18, 8.0):
        with pytest.raises(ValueError, match=rf"rotary_dim: expected an even int in 2..16 \(the head dim\), got {rd}"):
            rope.rotary(q, k, pos, rotary_dim=rd, theta=1e4)
    with pytest.raises(ValueError, match=r"q, k: expected \[B, T, nH, hd\] and \[B, T, nKV, hd\], got "
                                         r"\(2, 5, 4, 16\) and \(2, 5, 2, 8\)"):
        rope.rotary(q, k[..., :8], pos, rotary_dim=8, theta=1e4)
    for bad in (pos[:, :4], torch.arange(5), pos.expand(3, 5)):
        msg = f"position_ids: expected shape [2 or 1, 5], got {tuple(bad.shape)}"
        with pytest.raises(ValueError, match=re.escape(msg)):
            rope.rotary(q, k, bad, rotary_dim=8, theta=1e4)
    with pytest.raises(TypeError, match="k: expected dtype"):
        rope.rotary(q, k.double(), pos, rotary_dim=8, theta=1e4)
    with pytest.raises(ValueError, match=r"gate: expected shape \[B, T, h, d or 1\] with o's \[B, T, h, d\] = "
                                         r"\(2, 5, 4, 16\), got \(2, 5, 4, 2\)"):
        rope.sigmoid_gate(q, q[..., :2])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs the interpreter off")
def test_cpu_tensors_are_refused_outside_the_interpreter():
    from hybridlm.ops.triton import conv

    with pytest.raises(RuntimeError, match="need CUDA tensors"):
        conv.causal_conv1d(torch.randn(1, 5, 8), torch.randn(8, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_small(dtype):
    """conv, gated norm and gates on CUDA vs float64 on the same rounded inputs (bf16: 1e-2, fp32: 1e-5)."""
    from hybridlm.ops import causal_conv1d, gated_rms_norm
    from hybridlm.ops.triton import conv, gates, norm

    tol = 1e-5 if dtype == torch.float32 else 1e-2
    dev = "cuda"
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    x, w = torch.randn(2, 300, 200, device=dev).to(dtype), torch.randn(200, 4, device=dev) / 2
    y, _ = conv.causal_conv1d(x, w, activation="silu")
    y2, _ = causal_conv1d(x.double(), w.double(), activation="silu")
    assert rel(y, y2) <= tol
    z = torch.randn_like(x)
    wn = torch.randn(200, device=dev)
    assert rel(norm.gated_rms_norm(x, z, wn), gated_rms_norm(x.double(), z.double(), wn.double())) <= tol
    a, b = torch.randn(2, 300, 8, device=dev).to(dtype), torch.randn(2, 300, 8, device=dev).to(dtype)
    A, dt = torch.rand(8, device=dev) * 2, torch.randn(8, device=dev)
    g, beta = gates.gdn_gates(a, b, A, dt)
    g2 = -A.double().exp() * torch.nn.functional.softplus(a.double() + dt.double())
    assert rel(g, g2) <= tol and rel(beta, b.double().sigmoid()) <= tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_rope_and_gate(dtype):
    """RoPE on q, k as views of a fused projection at positions up to 2^17 (per-row offsets) and the output gate,
    on CUDA vs float64 (the float32 angle, cos/sin in float64): outputs and gradients within the dtype's unit
    roundoff relative L2 (float32: 2e-6; the GPU's own sin/cos on the reduced angle), and no farther from float64
    than the PyTorch path in bf16 / fp16."""
    from hybridlm.ops.rope import inv_freq, rope_ref
    from hybridlm.ops.triton import rope

    tol = {torch.float32: 2e-6, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, nH, nKV, hd, rd = 2, 1000, 8, 2, 128, 128
    proj = torch.randn(B, T, nH * 2 * hd + nKV * hd, device="cuda", generator=g).to(dtype)
    pos = torch.arange(T, device="cuda")[None] + torch.tensor([[0], [130000]], device="cuda")

    def views(p):
        return p[..., :nH * 2 * hd].view(B, T, nH, 2 * hd)[..., :hd], p[..., nH * 2 * hd:].view(B, T, nKV, hd)

    def f64(x):
        ang = (pos[..., None].float() * inv_freq(rd, 1e4, "cuda")).double()[:, :, None]
        c, s, h = ang.cos(), ang.sin(), rd // 2
        return torch.cat([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], -1)

    cot = torch.randn(proj.shape, device="cuda", generator=g).to(dtype)
    outs = {}
    for name, fn, dt in (("kernel", rope.rotary, dtype), ("torch", rope_ref, dtype), ("f64", None, torch.float64)):
        leaf = proj.to(dt).requires_grad_()
        q, k = views(leaf)
        qo, ko = (f64(q), f64(k)) if fn is None else fn(q, k, pos, rotary_dim=rd, theta=1e4)
        cq, ck = views(cot.to(dt))
        (dp,) = torch.autograd.grad((qo * cq).sum() + (ko * ck).sum(), [leaf])
        outs[name] = (qo, ko, *views(dp))
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    for i, n in enumerate(("q", "k", "dq", "dk")):
        err = rel(outs["kernel"][i], outs["f64"][i])
        assert err <= tol, f"{dtype} {n}: rel {err:.3g} > {tol:.3g}"
        if dtype != torch.float32:
            assert err <= rel(outs["torch"][i], outs["f64"][i]), f"{dtype} {n}: farther from float64 than PyTorch"
    o = torch.randn(B, nH, T, hd, device="cuda", generator=g).to(dtype).transpose(1, 2)
    for gate in (views(proj)[0], proj[..., :nH * 2 * hd].view(B, T, nH, 2 * hd)[..., hd:hd + 1]):
        ol, gl = o.detach().requires_grad_(), gate.detach().requires_grad_()
        o64, g64 = o.double().requires_grad_(), gate.double().requires_grad_()
        y, y64 = rope.sigmoid_gate(ol, gl), o64 * torch.sigmoid(g64)
        dy = torch.randn(y.shape, device="cuda", generator=g).to(dtype)
        grads = torch.autograd.grad((y * dy).sum(), [ol, gl])
        grads64 = torch.autograd.grad((y64 * dy.double()).sum(), [o64, g64])
        for n, a, b in zip(("y", "do", "dgate"), (y, *grads), (y64, *grads64)):
            err = rel(a, b)
            assert err <= max(tol, 2e-6), f"gate {tuple(gate.shape)} {dtype} {n}: rel {err:.3g}"
