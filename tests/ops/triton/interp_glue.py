"""Cases for the fused Triton layer glue, run in a child process under TRITON_INTERPRET=1 (CPU), float32.

    python tests/ops/triton/interp_glue.py ops|layers|full [seed]

Run by tests/ops/test_triton_glue.py ("ops": each kernel vs its float64 PyTorch reference) and by
tests/layers/test_fused_glue.py ("layers": GatedDeltaNet / KimiDeltaAttention with impl="triton", i.e. the fused
glue, vs the same layer on the reference glue; the recurrence is forced to the PyTorch "chunk" path in both so only
the glue differs; "full": the whole layer on Triton, glue and recurrence, vs the float64 reference layer). The
variable must be set before triton decorates the kernels, so these cases cannot share the
pytest process. Prints one JSON line "RESULT {case: {tensor: relative error}}". Fresh random inputs every run
(seed printed); kernel outputs start as NaN (POISON) so an unwritten element fails. float32, and three bf16 cases
(`bf16_cases`: tests/ops/triton/interp_patches.py makes the interpreter round float32 -> bfloat16 to nearest;
Triton 3.6's own cast truncates); bf16 is also checked on the GPU (scripts/gpu_check_glue.py).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interp_patches import patch_interpreter  # noqa: E402  (the interpreter's fixes, before any kernel runs)

patch_interpreter()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hybridlm.ops import causal_conv1d, causal_conv1d_update, gated_rms_norm, rms_norm  # noqa: E402
from hybridlm.ops.triton import conv as tconv  # noqa: E402
from hybridlm.ops.triton import gates as tgates  # noqa: E402
from hybridlm.ops.triton import norm as tnorm  # noqa: E402
from hybridlm.ops.triton import rope as trope  # noqa: E402
from hybridlm.ops.triton import swiglu as tswiglu  # noqa: E402
from hybridlm.ops.triton.tune import tuned  # noqa: E402

tconv.POISON = tnorm.POISON = tgates.POISON = tswiglu.POISON = trope.POISON = True

F64 = torch.float64


def rel(a, b):
    a, b = a.detach().to(F64), b.detach().to(F64)
    if a.shape != b.shape:
        return float("inf")
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def rel_to(a, b, scale):
    """||a - b|| / scale: the error against a yardstick other than ||b|| (b a sum that cancels)."""
    a, b = a.detach().to(F64), b.detach().to(F64)
    if a.shape != b.shape or not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / max(float(scale), 1e-300)).item()


def grads_vs(out, out_ref, leaves, leaves_ref, gen, names):
    """Relative errors of the outputs and of every gradient, for one random cotangent per output."""
    cots = [torch.randn(o.shape, generator=gen) for o in out]
    gr = torch.autograd.grad(sum((o.float() * c).sum() for o, c in zip(out, cots)), leaves)
    gr2 = torch.autograd.grad(sum((o * c.to(F64)).sum() for o, c in zip(out_ref, cots)), leaves_ref)
    return {("d" + n): rel(a, b) for n, a, b in zip(names, gr, gr2)}


# ---------------------------------------------------------------------------------------------------- conv


def conv_case(gen, *, B, T, C, W, bias, h0, silu, cu=None, split=None):
    """split: the output as three tensors (`causal_conv1d(split=)`, a layer's q, k, v), compared part by part, each
    part with its own cotangent; also whether the parts are their own contiguous tensors and equal the unsplit
    output bit for bit."""
    N = B if cu is None else len(cu) - 1
    r = lambda *s: torch.randn(*s, generator=gen)
    xs = {"x": r(B, T, C), "weight": r(C, W) / W**0.5}
    if bias:
        xs["bias"] = r(C)
    if h0:
        xs["initial_state"] = r(N, C, W)
    act = "silu" if silu else None
    leaf = {k: v.clone().requires_grad_() for k, v in xs.items()}
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    y, ht = tconv.causal_conv1d(leaf["x"], leaf["weight"], leaf.get("bias"), activation=act,
                                initial_state=leaf.get("initial_state"), output_final_state=True, cu_seqlens=cu_t,
                                split=split)
    ref = {k: v.to(F64).requires_grad_() for k, v in xs.items()}
    bounds = cu if cu is not None else None
    if bounds is None:
        y2, ht2 = causal_conv1d(ref["x"], ref["weight"], ref.get("bias"), activation=act,
                                initial_state=ref.get("initial_state"), output_final_state=True)
    else:  # documents one by one, each from its own state (zeros without one), as ShortConv does
        ys, hs = [], []
        for n in range(N):
            s0 = ref["initial_state"][n:n + 1] if h0 else None
            a, b = causal_conv1d(ref["x"][:, bounds[n]:bounds[n + 1]], ref["weight"], ref.get("bias"),
                                 activation=act, initial_state=s0, output_final_state=True)
            ys.append(a)
            hs.append(b)
        y2, ht2 = torch.cat(ys, 1), torch.cat(hs, 0)
    if split is not None:
        with torch.no_grad():
            whole = tconv.causal_conv1d(leaf["x"], leaf["weight"], leaf.get("bias"), activation=act,
                                        initial_state=leaf.get("initial_state"), cu_seqlens=cu_t)[0]
        split_ok = all(p.is_contiguous() and p._base is None and torch.equal(p, w)
                       for p, w in zip(y, whole.split(list(split), dim=-1)))
        res = {"y": rel(torch.cat(y, -1), y2), "final_state": rel(ht, ht2), "split_ok": float(split_ok),
               "dtype_ok": float(y[0].dtype == ht.dtype == torch.float32)}
        res.update(grads_vs(list(y), list(y2.split(list(split), dim=-1)), list(leaf.values()), list(ref.values()),
                            gen, list(leaf)))
        return res
    res = {"y": rel(y, y2), "final_state": rel(ht, ht2), "dtype_ok": float(y.dtype == ht.dtype == torch.float32)}
    # the final state is not differentiable: gradients from y only
    res.update(grads_vs([y], [y2], list(leaf.values()), list(ref.values()), gen, list(leaf)))
    return res


def conv_decode_case(gen, *, N, P, C, W, bias, pooled):
    r = lambda *s: torch.randn(*s, generator=gen)
    x, w, b = r(N, C), r(C, W), (r(C) if bias else None)
    idx = torch.randperm(P, generator=gen)[:N].to(torch.int32) if pooled else None
    pool = r(P if pooled else N, C, W)
    pool0 = pool.clone()
    y = tconv.causal_conv1d_update(x, pool, w, b, activation="silu", state_indices=idx)
    rows = idx.long() if pooled else torch.arange(N)
    st = pool0[rows].to(F64).clone()
    y2 = causal_conv1d_update(x.to(F64), st, w.to(F64), None if b is None else b.to(F64), activation="silu")
    others = torch.ones(pool.shape[0], dtype=torch.bool)
    others[rows] = False
    return {"y": rel(y, y2), "state": rel(pool[rows], st),
            "others_unchanged": float(torch.equal(pool[others], pool0[others]))}


# ---------------------------------------------------------------------------------------------------- norms


def norm_case(gen, *, shape, gated, weight, **kw):
    D = shape[-1]
    r = lambda *s: torch.randn(*s, generator=gen)
    xs = {"x": r(*shape)}
    if gated:
        xs["gate"] = 2 * r(*shape)
    if weight:
        xs["weight"] = 1.0 + 0.3 * r(D) if not kw.get("zero_centered") else 0.3 * r(D)
    leaf = {k: v.clone().requires_grad_() for k, v in xs.items()}
    ref = {k: v.to(F64).requires_grad_() for k, v in xs.items()}
    if gated:
        y = tnorm.gated_rms_norm(leaf["x"], leaf["gate"], leaf.get("weight"), 1e-6, **kw)
        y2 = gated_rms_norm(ref["x"], ref["gate"], ref.get("weight"), 1e-6, **kw)
    else:
        y = tnorm.rms_norm(leaf["x"], leaf.get("weight"), 1e-6, **kw)
        y2 = rms_norm(ref["x"], ref.get("weight"), 1e-6, **kw)
    res = {"y": rel(y, y2), "dtype_ok": float(y.dtype == torch.float32)}
    res.update(grads_vs([y], [y2], list(leaf.values()), list(ref.values()), gen, list(leaf)))
    return res


# ---------------------------------------------------------------------------------------------------- swiglu


def swiglu_case(gen, *, shape):
    """silu(gate) * up: the fused kernel against float64 F.silu(gate) * up; gate spread wide (|gate| up to ~10)
    so both tails of the sigmoid count."""
    xs = {"gate": 3 * torch.randn(*shape, generator=gen), "up": torch.randn(*shape, generator=gen)}
    leaf = {k: v.clone().requires_grad_() for k, v in xs.items()}
    ref = {k: v.to(F64).requires_grad_() for k, v in xs.items()}
    y = tswiglu.silu_mul(leaf["gate"], leaf["up"])
    y2 = F.silu(ref["gate"]) * ref["up"]
    res = {"y": rel(y, y2), "dtype_ok": float(y.dtype == torch.float32)}
    res.update(grads_vs([y], [y2], list(leaf.values()), list(ref.values()), gen, list(leaf)))
    return res


# ---------------------------------------------------------------------------------------------------- gates


def gates_case(gen, *, B, T, H, K, beta_scale, kda):
    r = lambda *s: torch.randn(*s, generator=gen)
    a = 4.0 * r(B, T, H * K)
    a[0, 0, 0], a[0, -1, -1] = 30.0, -40.0  # both softplus branches and the tiny-log1p path
    xs = {"a": a, "b": 3.0 * r(B, T, H), "A_log": torch.rand(H, generator=gen) * 2.7, "dt_bias": r(H * K)}
    if kda:
        xs["A_log"] = xs["A_log"].view(1, 1, H, 1)
    leaf = {k: v.clone().requires_grad_() for k, v in xs.items()}
    ref = {k: v.to(F64).requires_grad_() for k, v in xs.items()}
    if kda:
        g, beta = tgates.kda_gates(leaf["a"], leaf["b"], leaf["A_log"], leaf["dt_bias"], beta_scale=beta_scale)
        f = (ref["a"] + ref["dt_bias"]).view(B, T, H, K)
        g2 = -ref["A_log"].exp() * torch.where(f > 20.0, f, torch.log1p(torch.exp(f)))  # as KimiDeltaAttention
    else:
        g, beta = tgates.gdn_gates(leaf["a"], leaf["b"], leaf["A_log"], leaf["dt_bias"], beta_scale=beta_scale)
        g2 = -ref["A_log"].exp() * F.softplus(ref["a"] + ref["dt_bias"])  # as GatedDeltaNet.gates
    beta2 = ref["b"].sigmoid() * beta_scale
    res = {"g": rel(g, g2), "beta": rel(beta, beta2), "dtype_ok": float(g.dtype == torch.float32)}
    res.update(grads_vs([g, beta], [g2, beta2], list(leaf.values()), list(ref.values()), gen, list(leaf)))
    return res


# ---------------------------------------------------------------------------------------------------- RoPE, gate

BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}  # significand bits: unit roundoff 2^-bits


def rope_f64(x, pos, rd, theta):
    """x [B, T, h, hd] (float64) rotated at pos [B|1, T]: the layers' float32 angle, cos/sin in float64."""
    from hybridlm.ops.rope import inv_freq

    ang = (pos[..., None].float() * inv_freq(rd, theta, "cpu")).to(F64)[:, :, None]  # [B|1, T, 1, rd/2]
    c, s, h = ang.cos(), ang.sin(), rd // 2
    return torch.cat([x[..., :h] * c - x[..., h:rd] * s, x[..., h:rd] * c + x[..., :h] * s, x[..., rd:]], -1)


def pair_ulps(a, b, x, rd, dtype):
    """max |a - b| in ulps of dtype at the scale of each rotated pair, max(|x_i|, |x_{i + rd/2}|) (the pass-through
    channels at |x_i|): the PyTorch path rounds products of x, so its error follows the pair, not the result."""
    h = rd // 2
    sc = x.detach().abs().to(F64).clone()
    m = torch.maximum(sc[..., :h], sc[..., h:rd])
    sc[..., :h], sc[..., h:rd] = m, m
    ulp = torch.exp2(torch.floor(torch.log2(sc.clamp_min(1e-30))) - (BITS[dtype] - 1))
    return ((a.detach().to(F64) - b.detach().to(F64)).abs() / ulp).max().item()


def rope_case(gen, *, B, T, nH, nKV, hd, rd, pos, dtype, theta=10000.0):
    """RoPE on q and k read as views of one fused projection [B, T, nH (hd query | hd gate) | nKV hd] (as
    GatedAttention makes it): the kernel against float64 (`rope_f64`; relative L2 within the dtype's unit roundoff
    for bf16/fp16: one rounding) and against the PyTorch path in the same dtype (pair_ulps), outputs and gradients
    (cotangents in the dtype, so the gradient reaching the op is exact)."""
    from hybridlm.ops.rope import rope_ref

    W = nH * 2 * hd + nKV * hd
    proj = torch.randn(B, T, W, generator=gen).to(dtype)
    pos = torch.tensor(pos)

    def views(p):
        return p[..., :nH * 2 * hd].view(B, T, nH, 2 * hd)[..., :hd], p[..., nH * 2 * hd:].view(B, T, nKV, hd)

    cq = torch.randn(B, T, nH, hd, generator=gen).to(dtype)
    ck = torch.randn(B, T, nKV, hd, generator=gen).to(dtype)
    outs = {}
    for name, fn, dt in (("kernel", trope.rotary, dtype), ("torch", rope_ref, dtype), ("f64", None, F64)):
        leaf = proj.to(dt).requires_grad_()
        q, k = views(leaf)
        if fn is None:
            qo, ko = rope_f64(q, pos, rd, theta), rope_f64(k, pos, rd, theta)
        else:
            qo, ko = fn(q, k, pos, rotary_dim=rd, theta=theta)
        (dp,) = torch.autograd.grad((qo * cq.to(dt)).sum() + (ko * ck.to(dt)).sum(), [leaf])
        outs[name] = (qo, ko, *views(dp))
    names = ("q", "k", "dq", "dk")
    ins = views(proj) + (cq, ck)
    res = {"dtype_ok": float(outs["kernel"][0].dtype == outs["kernel"][1].dtype == dtype
                             and outs["kernel"][0].is_contiguous())}
    for i, n in enumerate(names):
        res[n] = rel(outs["kernel"][i], outs["f64"][i])
        res["torch_" + n] = rel(outs["torch"][i], outs["f64"][i])
        res["ulps_" + n] = pair_ulps(outs["kernel"][i], outs["torch"][i], ins[i], rd, dtype)
    return res


def gate_case(gen, *, B, T, h, d, headwise, dtype):
    """o * sigmoid(gate): o a transposed view of [B, h, T, d] (as SDPA's output), gate a strided slice of a fused
    [B, T, h, (d | gate)] projection; against float64 (outputs and both gradients)."""
    gw = 1 if headwise else d
    o0 = torch.randn(B, h, T, d, generator=gen).to(dtype)
    p0 = (3 * torch.randn(B, T, h, d + gw, generator=gen)).to(dtype)
    dy = torch.randn(B, T, h, d, generator=gen).to(dtype)
    outs = []
    for fn, dt in ((trope.sigmoid_gate, dtype), (lambda o, g: o * torch.sigmoid(g), F64)):
        o_leaf, p_leaf = o0.to(dt).requires_grad_(), p0.to(dt).requires_grad_()
        o, g = o_leaf.transpose(1, 2), p_leaf[..., d:]
        y = fn(o, g)
        do, dp = torch.autograd.grad((y * dy.to(dt)).sum(), [o_leaf, p_leaf])
        outs.append((y, do, dp[..., d:], dp[..., :d]))
    res = {"dtype_ok": float(outs[0][0].dtype == dtype and outs[0][0].is_contiguous()),
           "untouched": float(outs[0][3].abs().max().item() == 0.0)}
    res.update({n: rel(a, b) for n, a, b in zip(("y", "do", "dgate"), outs[0], outs[1])})
    return res


def rope_compiled_case(gen):
    """RoPE and the output gate under torch.compile(fullgraph=True, aot_eager) against eager: the fake kernels
    trace, outputs and gradients agree."""
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k, o, g = r(2, 5, 4, 16), r(2, 5, 2, 16), r(2, 5, 4, 16), r(2, 5, 4, 1)
    pos = torch.arange(5)[None] + torch.tensor([[0], [7]])

    def f(q, k, o, g):
        qo, ko = trope.rotary(q, k, pos, rotary_dim=8, theta=500.0)
        return qo, ko, trope.sigmoid_gate(o, g)

    leaves = [[t.clone().requires_grad_() for t in (q, k, o, g)] for _ in range(2)]
    outs = [torch.compile(f, backend="aot_eager", fullgraph=True)(*leaves[0]), f(*leaves[1])]
    res = {n: rel(a, b) for n, a, b in zip(("q", "k", "y"), *outs)}
    grads = [torch.autograd.grad(sum((t * (i + 1)).sum() for i, t in enumerate(out)), lv)
             for out, lv in zip(outs, leaves)]
    res.update({n: rel(a, b) for n, a, b in zip(("dq", "dk", "do", "dgate"), *grads)})
    return res


def rope_cases(gen) -> dict:
    res = {}
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    offs = lambda B, T, o: [[t + o * b for t in range(T)] for b in range(B)]  # noqa: E731
    # GQA, rd = hd, per-row position offsets
    res["rope_gqa_fp32_offsets"] = rope_case(gen, B=2, T=7, nH=4, nKV=2, hd=16, rd=16, pos=offs(2, 7, 1000),
                                             dtype=f32)
    # partial rotary (rd < hd, rd/2 not a power of two), one position row for the batch, odd T
    res["rope_partial_bf16_broadcast"] = rope_case(gen, B=2, T=9, nH=2, nKV=1, hd=32, rd=12, pos=[list(range(9))],
                                                   dtype=bf16)
    # packed documents: positions restart at each document (positions_for)
    res["rope_packed_fp16"] = rope_case(gen, B=1, T=13, nH=3, nKV=3, hd=24, rd=16,
                                        pos=[[0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6]], dtype=f16)
    # long-context angles (the float64 reduction), several token blocks and head groups crossing q -> k
    with tuned(trope.TUNE, bt=4, heads=3):
        res["rope_long_bf16_blocks"] = rope_case(gen, B=1, T=11, nH=4, nKV=1, hd=64, rd=64,
                                                 pos=offs(1, 11, 16370), dtype=bf16, theta=1e6)
        res["rope_long_fp32_blocks"] = rope_case(gen, B=2, T=6, nH=2, nKV=2, hd=32, rd=32,
                                                 pos=offs(2, 6, 123457), dtype=f32)
    res["gate_elementwise_fp32"] = gate_case(gen, B=2, T=5, h=3, d=16, headwise=False, dtype=f32)
    res["gate_headwise_fp32"] = gate_case(gen, B=1, T=7, h=2, d=24, headwise=True, dtype=f32)
    res["gate_elementwise_bf16"] = gate_case(gen, B=1, T=9, h=2, d=32, headwise=False, dtype=bf16)
    res["gate_headwise_fp16"] = gate_case(gen, B=2, T=3, h=3, d=16, headwise=True, dtype=f16)
    with tuned(trope.TUNE, gate_rows=4):
        res["gate_elementwise_fp32_blocks"] = gate_case(gen, B=1, T=7, h=3, d=20, headwise=False, dtype=f32)
    res["rope_compiled"] = rope_compiled_case(gen)
    return res


def compiled_case(gen):
    """conv + SwiGLU + gated norm + gates under torch.compile(fullgraph=True, aot_eager): the fake kernels
    trace."""
    r = lambda *s: torch.randn(*s, generator=gen)
    x, w, z = r(1, 9, 40).requires_grad_(), r(40, 4).requires_grad_(), r(1, 9, 40).requires_grad_()
    a, b, A, dt = r(1, 9, 4), r(1, 9, 4), r(4), r(4)

    def f(x, w, z, a, b, A, dt):
        y, _ = tconv.causal_conv1d(x, w, activation="silu")
        g, beta = tgates.gdn_gates(a, b, A, dt)
        return tnorm.gated_rms_norm(tswiglu.silu_mul(y, z), z, None), g, beta

    out = torch.compile(f, backend="aot_eager", fullgraph=True)(x, w, z, a, b, A, dt)
    ref = f(x, w, z, a, b, A, dt)
    res = {"y": rel(out[0], ref[0]), "g": rel(out[1], ref[1]), "beta": rel(out[2], ref[2])}
    gr = torch.autograd.grad(out[0].sum(), [x, w, z])
    gr2 = torch.autograd.grad(ref[0].sum(), [x, w, z])
    res.update({n: rel(p, q) for n, p, q in zip(["dx", "dweight", "dgate"], gr, gr2)})
    return res


def bf16_cases(gen) -> dict:
    """bf16 inputs (the GPU default) of the short conv + SiLU, the gated RMSNorm and SwiGLU, against float64 on the
    same rounded inputs (the interpreter rounds fp32 -> bf16 to nearest with tests/ops/triton/interp_patches.py;
    Triton 3.6's own cast truncates)."""
    bf = lambda *s, scale=1.0, shift=0.0: (shift + scale * torch.randn(*s, generator=gen)).bfloat16()  # noqa: E731
    cases = {
        "bf16_conv_W4_bias_T40": (lambda x, weight, bias: tconv.causal_conv1d(x, weight, bias, activation="silu")[0],
                                  lambda x, weight, bias: causal_conv1d(x, weight, bias, activation="silu")[0],
                                  {"x": bf(2, 40, 64), "weight": bf(64, 4, scale=0.5), "bias": bf(64)}),
        "bf16_gnorm_silu_D128": (lambda x, gate, weight: tnorm.gated_rms_norm(x, gate, weight, 1e-6),
                                 lambda x, gate, weight: gated_rms_norm(x, gate, weight, 1e-6),
                                 {"x": bf(3, 40, 128), "gate": bf(3, 40, 128, scale=2.0),
                                  "weight": bf(128, scale=0.3, shift=1.0)}),
        "bf16_swiglu_5x256": (tswiglu.silu_mul, lambda gate, up: F.silu(gate) * up,
                              {"gate": bf(5, 256, scale=3.0), "up": bf(5, 256)}),
    }
    res = {}
    for name, (fn, ref_fn, xs) in cases.items():
        leaf = {k: v.clone().requires_grad_() for k, v in xs.items()}
        ref = {k: v.to(F64).requires_grad_() for k, v in xs.items()}
        y, y2 = fn(**leaf), ref_fn(**ref)
        res[name] = {"y": rel(y, y2), "dtype_ok": float(y.dtype == torch.bfloat16)}
        res[name].update(grads_vs([y], [y2], list(leaf.values()), list(ref.values()), gen, list(leaf)))
    return res


def ops_cases(gen) -> dict:
    res = bf16_cases(gen)
    res["conv_W2_bias_h0_T37_C70"] = conv_case(gen, B=2, T=37, C=70, W=2, bias=True, h0=True, silu=True)
    res["conv_W3_noact_h0_T5"] = conv_case(gen, B=2, T=5, C=24, W=3, bias=False, h0=True, silu=False)
    res["conv_W6_bias_h0_T40"] = conv_case(gen, B=1, T=40, C=24, W=6, bias=True, h0=True, silu=True)
    res["conv_W4_varlen_1_2_17_5"] = conv_case(gen, B=1, T=25, C=33, W=4, bias=False, h0=False, silu=True,
                                               cu=[0, 1, 3, 20, 25])
    res["conv_W4_varlen_h0_bias"] = conv_case(gen, B=1, T=25, C=33, W=4, bias=True, h0=True, silu=True,
                                              cu=[0, 2, 20, 25])
    res["conv_W4_T1_h0"] = conv_case(gen, B=3, T=1, C=16, W=4, bias=True, h0=True, silu=True)
    # the output as a layer's q, k, v (three tensors written by the kernel, their gradients read as they are): over
    # packed documents with an initial state (its gradient reads the split gradients too), and without an activation
    res["conv_W4_varlen_h0_bias_split"] = conv_case(gen, B=1, T=25, C=64, W=4, bias=True, h0=True, silu=True,
                                                    cu=[0, 3, 25], split=(16, 32, 16))
    res["conv_W3_noact_split"] = conv_case(gen, B=2, T=21, C=64, W=3, bias=False, h0=True, silu=False,
                                           split=(32, 16, 16))
    # other launch blocks than the defaults (the GPU sweeps' candidates): partial token and channel blocks, and
    # backward programs looping over several token blocks
    with tuned(tconv.TUNE, fwd_bt=64, fwd_bc=128, bwd_bc=32, bwd_bt=8):
        res["conv_W4_varlen_h0_bias_blocks"] = conv_case(gen, B=1, T=27, C=33, W=4, bias=True, h0=True, silu=True,
                                                         cu=[0, 2, 22, 27])
    # the backward's programs walking token ranges of 8 (one 8-row block each, or two 4-row blocks: one row a phase),
    # so that documents span several programs: a document shorter than the W-1 rows a token's dx reads past it (2 <
    # 3, and 3 < 7 at W = 8), ranges ending inside a document (the rows after them computed by both programs) and at
    # its end (a partial block); W = 1 (no rows past a token)
    with tuned(tconv.TUNE, bwd_bt=8, bwd_chunk=8):
        res["conv_W4_varlen_h0_bias_walk"] = conv_case(gen, B=1, T=30, C=33, W=4, bias=True, h0=True, silu=True,
                                                       cu=[0, 2, 19, 30])
        res["conv_W8_varlen_h0_bias_walk"] = conv_case(gen, B=1, T=30, C=40, W=8, bias=True, h0=True, silu=True,
                                                       cu=[0, 3, 21, 30])
    with tuned(tconv.TUNE, bwd_bt=4, bwd_chunk=8):
        res["conv_W8_varlen_h0_bias_walk_bt4"] = conv_case(gen, B=1, T=30, C=40, W=8, bias=True, h0=True,
                                                           silu=True, cu=[0, 3, 21, 30])
    with tuned(tconv.TUNE, bwd_bt=8, bwd_chunk=8, bwd_bc=16):
        res["conv_W1_bias_h0_walk"] = conv_case(gen, B=2, T=21, C=24, W=1, bias=True, h0=True, silu=True)
        res["conv_W4_noact_split_walk"] = conv_case(gen, B=1, T=25, C=64, W=4, bias=False, h0=False, silu=False,
                                                    cu=[0, 3, 25], split=(16, 32, 16))
    # backward programs looping over row blocks (one program on the CPU: every block), 2-row blocks
    with tuned(tnorm.TUNE, fwd_elems=1024, fwd_warps=2, bwd_elems=256, bwd_warps=2, bwd_programs_per_sm=1):
        res["gnorm_silu_D128_blocks"] = norm_case(gen, shape=(3, 7, 2, 128), gated=True, weight=True,
                                                  activation="silu")
    res["conv_decode_W4_pool"] = conv_decode_case(gen, N=3, P=7, C=70, W=4, bias=True, pooled=True)
    res["conv_decode_W2"] = conv_decode_case(gen, N=2, P=2, C=33, W=2, bias=False, pooled=False)
    res["gnorm_silu_D128"] = norm_case(gen, shape=(2, 5, 3, 128), gated=True, weight=True, activation="silu")
    res["gnorm_silu_noweight_D100"] = norm_case(gen, shape=(7, 100), gated=True, weight=False, activation="silu")
    res["gnorm_sigmoid_fp32out_D64"] = norm_case(gen, shape=(3, 4, 2, 64), gated=True, weight=True,
                                                 activation="sigmoid", fp32_output=True)
    res["gnorm_silu_D256"] = norm_case(gen, shape=(9, 256), gated=True, weight=True, activation="silu")
    res["rms_zero_centered_D2048"] = norm_case(gen, shape=(3, 2048), gated=False, weight=True, zero_centered=True)
    res["rms_llama_D96"] = norm_case(gen, shape=(2, 6, 96), gated=False, weight=True, cast_before_weight=True)
    res["rms_fp32w_D2560"] = norm_case(gen, shape=(2, 2560), gated=False, weight=True, cast_before_weight=False)
    res["rms_noweight_D48"] = norm_case(gen, shape=(5, 48), gated=False, weight=False)
    res["gates_gdn"] = gates_case(gen, B=2, T=9, H=6, K=1, beta_scale=1.0, kda=False)
    res["gates_gdn_beta2"] = gates_case(gen, B=1, T=20, H=4, K=1, beta_scale=2.0, kda=False)
    res["gates_kda_K16"] = gates_case(gen, B=2, T=5, H=3, K=16, beta_scale=1.0, kda=True)
    res["swiglu_2x7x300"] = swiglu_case(gen, shape=(2, 7, 300))  # 4200 elements: 3 blocks, the last partial
    res["swiglu_5x16"] = swiglu_case(gen, shape=(5, 16))
    res["compiled"] = compiled_case(gen)
    res.update(rope_cases(gen))
    return res


# ---------------------------------------------------------------------------------------------------- layers


def _force_chunk_recurrence():
    """Both runs use the PyTorch chunk recurrence, so the comparison sees only the glue."""
    from hybridlm.layers import gdn as gdn_mod
    from hybridlm.layers import kda as kda_mod
    from hybridlm.ops import gated_delta_rule, kda

    gdn_mod.gated_delta_rule = lambda *a, impl=None, **kw: gated_delta_rule(*a, impl="chunk", **kw)
    kda_mod.kda = lambda *a, impl=None, **kw: kda(*a, impl="chunk", **kw)


def _layer_pair(layer):
    ref = copy.deepcopy(layer)
    ref.impl = "chunk"
    layer.impl = "triton"
    return layer, ref


SUMS = ("A_log", "dt_bias")  # the gate parameters: few numbers, each a sum over every token (and channel)


@contextlib.contextmanager
def _keep_gate(kept: list):
    """While active, the layers' recurrence calls (GDN, KDA) append their log-decay g (the gates' output) to kept.
    KDA hands its raw gate to the op (A_log, dt_bias): the wrapper computes the op's gate itself (the same function,
    in the op's compute dtype) and passes the log-decay on, so that g is a tensor of the graph."""
    from hybridlm.layers import gdn as gdn_mod
    from hybridlm.layers import kda as kda_mod
    from hybridlm.ops.kda_gate import kda_gate

    saved = gdn_mod.gated_delta_rule, kda_mod.kda

    def wrap(f):
        def call(*a, g, A_log=None, dt_bias=None, **kw):
            if A_log is not None:
                cd = torch.float64 if a[2].dtype == torch.float64 else torch.float32
                g = kda_gate(g, A_log, dt_bias, dtype=cd)
            kept.append(g)
            return f(*a, g=g, **kw)
        return call

    gdn_mod.gated_delta_rule, kda_mod.kda = wrap(saved[0]), wrap(saved[1])
    try:
        yield
    finally:
        gdn_mod.gated_delta_rule, kda_mod.kda = saved


def _gate_scales(g, G, params):
    """The scale of the gate parameters' gradient errors: ||G|| * max_i ||dg/dtheta_i|| for each parameter theta
    (A_log, dt_bias), G = dL/dg and g the log-decay (the gates' output) of the reference run.

    Each element of d theta is a sum over every token (and channel), J_i^T G = sum_t G_t * dg_t/dtheta_i, that
    can cancel: |sum| down to 7e-5 of sum |terms|, where an error relative to |sum| measures the condition number,
    not the code. full_gdn_olmo_varlen over 400 seeds: the kernels over 1e-4 relative on dA_log or ddt_bias for 13
    seeds, a float32 PyTorch layer (impl="chunk") for 15, worst 1.6e-2 and 1.7e-3 (seed 112). The sum is as exact
    as its input allows: an error of relative L2 size eps in G (the bar of every other tensor) moves J_i^T G by up
    to eps * ||G|| * ||J_i|| (Cauchy-Schwarz), so ||err(d theta)|| <= eps * ||G|| * max_i ||J_i|| is the
    yardstick; the reduction's own rounding (~eps32 * sqrt(T) * sum |terms|) is far below it. Against it both
    layers stay within 0.82x G's own relative error (<= 8e-6, seed 294, where da_proj.weight, G times x, is at
    1.2e-5). A lost or doubled token moves the sum by about 1/T of it.

    J_i (dg/dtheta_i over the entries of g that theta_i feeds): each entry of g depends on one element of theta
    (broadcast), so J 1 (a Jacobian-vector product, by double backward) holds dg_e/dtheta_i(e) in every entry e,
    and J^T (J 1) sums its squares per element."""
    u = torch.zeros_like(g, requires_grad=True)
    jt_u = torch.autograd.grad(g, params, u, create_graph=True)  # J^T u, linear in u
    out = []
    for p, ju in zip(params, jt_u):
        j1 = torch.autograd.grad(ju, u, torch.ones_like(p), retain_graph=True)[0]  # J 1
        jj = torch.autograd.grad(g, p, j1, retain_graph=True)[0]  # ||J_i||^2 per element
        out.append(G.detach().norm() * jj.detach().max().sqrt())
    return out


def layer_case(gen, layer, *, B, T, D, cu=None, mask=False, ref64=False):
    """Fused glue vs reference glue: output, input gradient and every parameter gradient (float32; with ref64 the
    reference runs in float64). Relative L2 errors, except for the gate parameters A_log / dt_bias (SUMS), see
    _gate_scales: their error is taken relative to ||G|| * ||dg/dtheta|| (G = dL/dg of the reference), not to the
    gradient's own norm."""
    with torch.no_grad():  # randomise every parameter (norm weights around 1, A_log in its init range)
        for n, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.5)
                    + (1.0 if "norm" in n else 0.0))
    fused, ref = _layer_pair(layer)
    if ref64:
        ref = ref.double()
    x = torch.randn(B, T, D, generator=gen)
    am = None
    if mask:
        am = torch.ones(B, T)
        am[0, :3] = 0  # left padding
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    outs, grads = [], []
    split_calls = []
    for m in (fused, ref):
        dt = next(m.parameters()).dtype
        xi = x.to(dt).requires_grad_()
        kept = []
        with _keep_gate(kept), _count_split(split_calls):
            y = m(xi, attention_mask=None if am is None else am.to(dt), cu_seqlens=cu_t)
        outs.append(y)
        cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dt)
        names = ["x"] + [n for n, _ in m.named_parameters()]
        gr = torch.autograd.grad((y * cot).sum(), [xi] + list(m.parameters()) + kept, retain_graph=True)
        grads.append(dict(zip(names, gr)))
    (g,), G = kept, gr[-1]
    sums = [(n, p) for n, p in ref.named_parameters() if n in SUMS]
    scale = dict(zip([n for n, _ in sums], _gate_scales(g, G, [p for _, p in sums])))
    res = {"y": rel(outs[0], outs[1]), "split_calls": len(split_calls)}
    res.update({"d" + n: rel(grads[0][n], grads[1][n]) if n not in scale else
                rel_to(grads[0][n], grads[1][n], scale[n]) for n in grads[1]})
    return res


@contextlib.contextmanager
def _count_split(calls: list):
    """While active, every conv that writes its output as three tensors (`tconv._CausalConv1dSplit`) appends to
    calls: the fused layers must take it (their q, k, v are then not strided views)."""
    saved = tconv._CausalConv1dSplit.apply

    def apply(*a):
        calls.append(a[-2:])
        return saved(*a)

    tconv._CausalConv1dSplit.apply = apply
    try:
        yield
    finally:
        tconv._CausalConv1dSplit.apply = saved


def layer_decode_case(gen, layer, *, B, T, D, steps):
    """Prefill T tokens into a cache, then `steps` single-token decode steps: outputs and cache states."""
    from hybridlm.model.cache import LinearState

    with torch.no_grad():
        for n, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.5)
                    + (1.0 if "norm" in n else 0.0))
    fused, ref = _layer_pair(layer)
    x = torch.randn(B, T + steps, D, generator=gen)
    res = {}
    with torch.no_grad():
        cf, cr = LinearState(), LinearState()
        yf = [fused(x[:, :T], cache=cf)] + [fused(x[:, T + i:T + i + 1], cache=cf) for i in range(steps)]
        yr = [ref(x[:, :T], cache=cr)] + [ref(x[:, T + i:T + i + 1], cache=cr) for i in range(steps)]
    res["y_prefill"] = rel(yf[0], yr[0])
    res["y_decode"] = rel(torch.cat(yf[1:], 1), torch.cat(yr[1:], 1))
    res["conv_state"] = rel(cf.conv, cr.conv)
    res["recurrent_state"] = rel(cf.recurrent, cr.recurrent)
    return res


def layer_compiled_case(gen):
    """The GDN layer's glue calls (conv, gates, gated norm) with impl="triton" under torch.compile(fullgraph=True,
    aot_eager): no graph break in the wiring; outputs and gradients vs the reference glue (eager)."""
    from hybridlm.layers import GatedDeltaNet

    layer = GatedDeltaNet(32, 2, 4, 16, 16, layout="split", impl="triton")
    B, T = 2, 9
    r = lambda *s: torch.randn(*s, generator=gen)
    xs = [r(B, T, 2 * layer.key_dim + layer.value_dim), r(B, T, 4), r(B, T, 4), r(B, T, 4, 16), r(B, T, 4, 16)]

    def glue(qkv, a, b, o, z):
        g, beta = layer.gates(a, b)
        q, k, v = layer.conv1d(qkv, None, None, impl=layer.impl, split=(layer.key_dim, layer.key_dim, layer.value_dim))
        return q, k, v, g, beta, layer.norm(o, z, impl=layer.impl)

    comp = torch.compile(glue, backend="aot_eager", fullgraph=True)
    res, outs = {}, []
    for fn, impl in ((comp, "triton"), (glue, "chunk")):
        layer.impl = impl
        leaf = [x.clone().requires_grad_() for x in xs]
        out = fn(*leaf)
        params = list(layer.parameters())
        gr = torch.autograd.grad(sum((o * (k + 1)).sum() for k, o in enumerate(out)), leaf + params,
                                 allow_unused=True)
        outs.append((out, gr))
    names = ["conv_q", "conv_k", "conv_v", "g", "beta", "norm"]
    res.update({n: rel(a, b) for n, a, b in zip(names, outs[0][0], outs[1][0])})
    pnames = ["dqkv", "da", "db", "do", "dz"] + ["d" + n for n, _ in layer.named_parameters()]
    res.update({n: rel(a, b) for n, a, b in zip(pnames, outs[0][1], outs[1][1]) if b is not None})
    return res


def attention_case(gen, layer, *, B, T, pos_offset=0, cu=None, ref64=False):
    """GatedAttention with impl="triton" (fused q/k norms, RoPE and output gate) against the same layer on the
    PyTorch glue (impl="naive" everywhere; float64 with ref64): output, dx and every parameter gradient, relative
    L2. Positions: per-row offsets (row b starts at b * pos_offset), or restarting at each packed document."""
    from hybridlm.layers.attention import Documents, positions_for

    with torch.no_grad():
        for n, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.3)
                    + (1.0 if "norm" in n and layer.q_norm.kind != "zero_centered" else 0.0))
    ref = copy.deepcopy(layer)
    for m in layer.modules():
        if hasattr(m, "impl"):
            m.impl = "triton"
    for m in ref.modules():
        if hasattr(m, "impl"):
            m.impl = "naive"
    if ref64:
        ref = ref.double()
    D = layer.q_proj.in_features
    x = torch.randn(B, T, D, generator=gen)
    cot = torch.randn(B, T, D, generator=gen)
    if cu is None:
        mask, pos = None, torch.arange(T)[None] + pos_offset * torch.arange(B)[:, None]
    else:
        cu_t = torch.tensor(cu, dtype=torch.int32)
        mask, pos = Documents(cu_t), positions_for(T, cu_t, "cpu")
    outs, calls = [], []
    for m in (layer, ref):
        dt = next(m.parameters()).dtype
        xi = x.to(dt).requires_grad_()
        with _count_calls(calls):
            y = m(xi, mask, pos)
        gr = torch.autograd.grad((y * cot.to(dt)).sum(), [xi] + list(m.parameters()))
        outs.append([y, *gr])
    names = ["y", "dx"] + ["d" + n for n, _ in layer.named_parameters()]
    res = {n: rel(a, b) for n, a, b in zip(names, *outs)}
    res["kernel_calls"] = len(calls)
    return res


@contextlib.contextmanager
def _count_calls(calls: list):
    """While active, each call of the RoPE and output-gate kernels' autograd functions appends its name to calls."""
    saved = trope._Rope.apply, trope._SigmoidGate.apply

    def counted(name, f):
        def apply(*a):
            calls.append(name)
            return f(*a)
        return apply

    trope._Rope.apply, trope._SigmoidGate.apply = counted("rope", saved[0]), counted("gate", saved[1])
    try:
        yield
    finally:
        trope._Rope.apply, trope._SigmoidGate.apply = saved


def attention_cases(gen, ref64=False) -> dict:
    from hybridlm.layers import GatedAttention

    pre = "full_" if ref64 else ""
    return {
        # the 357M bench's attention in small: elementwise gate, head q/k norms, rd = hd, GQA; per-row offsets
        pre + "attn_elementwise_gqa": attention_case(
            gen, GatedAttention(32, 4, 2, 16, gate="elementwise", qk_norm="head", rotary_dim=16), B=2, T=9,
            pos_offset=300, ref64=ref64),
        # headwise gate, no q/k norm (q and k strided views of the projection), partial rotary, packed documents
        pre + "attn_headwise_partial_packed": attention_case(
            gen, GatedAttention(32, 4, 1, 16, gate="headwise", qk_norm="none", rotary_dim=8), B=1, T=13,
            cu=[0, 4, 5, 13], ref64=ref64),
        # no gate, whole-projection norms (OLMo), Llama-style norm weights
        pre + "attn_nogate_full_norm": attention_case(
            gen, GatedAttention(32, 2, 2, 8, gate="none", qk_norm="full", norm_kind="llama", rotary_dim=8), B=2,
            T=6, ref64=ref64),
    }


def layer_cases(gen) -> dict:
    from hybridlm.layers import GatedDeltaNet, KimiDeltaAttention

    _force_chunk_recurrence()
    D = 32
    gdn = lambda **kw: GatedDeltaNet(D, 2, 4, 16, 16, conv_kernel=4, **kw)
    res = {}
    res["gdn_split_B2_T20"] = layer_case(gen, gdn(layout="split"), B=2, T=20, D=D)
    res["gdn_fused_varlen"] = layer_case(gen, gdn(layout="fused"), B=1, T=30, D=D, cu=[0, 2, 21, 30])
    res["gdn_olmo_beta2_mask"] = layer_case(gen, gdn(layout="olmo", beta_scale=2.0), B=2, T=12, D=D, mask=True)
    res["kda_B2_T17"] = layer_case(gen, KimiDeltaAttention(D, 2, 16, conv_kernel=4), B=2, T=17, D=D)
    res["kda_varlen_W3"] = layer_case(gen, KimiDeltaAttention(D, 2, 16, conv_kernel=3), B=1, T=20, D=D,
                                      cu=[0, 7, 20])
    res["gdn_decode"] = layer_decode_case(gen, gdn(layout="split"), B=2, T=6, D=D, steps=2)
    res["kda_decode"] = layer_decode_case(gen, KimiDeltaAttention(D, 2, 16), B=2, T=5, D=D, steps=2)
    res["gdn_glue_compiled"] = layer_compiled_case(gen)
    for kind in ("zero_centered", "llama", "fp32_weight"):
        res[f"rmsnorm_{kind}"] = rmsnorm_module_case(gen, kind)
    res.update(attention_cases(gen))
    return res


def rmsnorm_module_case(gen, kind, D=48):
    """The RMSNorm module with impl="triton" vs impl="naive" (PyTorch reference), fp32: y, dx, dweight."""
    from hybridlm.layers.norm import RMSNorm

    fused = RMSNorm(D, 1e-6, kind, impl="triton")
    with torch.no_grad():
        fused.weight.copy_(torch.randn(D, generator=gen) * 0.3 + (0.0 if kind == "zero_centered" else 1.0))
    ref = copy.deepcopy(fused)
    ref.impl = "naive"
    x = torch.randn(3, 7, D, generator=gen) * 2.0
    dy = torch.randn(3, 7, D, generator=gen)
    outs = []
    for m in (fused, ref):
        xi = x.clone().requires_grad_()
        y = m(xi)
        dx, dw = torch.autograd.grad((y * dy).sum(), [xi, m.weight])
        outs.append((y, dx, dw))
    return {n: rel(a, b) for n, a, b in zip(["y", "dx", "dweight"], outs[0], outs[1])}


def layer_full_cases(gen) -> dict:
    """The whole layer on Triton (glue and recurrence kernels, impl="triton", float32) against the whole layer on
    the PyTorch reference path in float64 (impl="chunk"): head dims 64 (the kernels take 64/128/256), T across a
    chunk edge, varlen with beta up to 2; batches of several rows are the glue cases' and the kernel tests'."""
    from hybridlm.layers import GatedDeltaNet, KimiDeltaAttention

    D = 64
    res = {}
    res["full_gdn_split_T70"] = layer_case(gen, GatedDeltaNet(D, 1, 2, 64, 64, layout="split"), B=1, T=70, D=D,
                                           ref64=True)
    res["full_gdn_olmo_varlen"] = layer_case(gen, GatedDeltaNet(D, 1, 1, 64, 64, layout="olmo", beta_scale=2.0),
                                             B=1, T=80, D=D, cu=[0, 5, 80], ref64=True)
    res["full_kda_T66"] = layer_case(gen, KimiDeltaAttention(D, 1, 64), B=1, T=66, D=D, ref64=True)
    # prefill on the chunk kernels, then decode steps on the fused step kernels (state updated in place)
    res["full_gdn_decode"] = layer_decode_case(gen, GatedDeltaNet(D, 1, 2, 64, 64, layout="split"), B=2, T=66, D=D,
                                               steps=3)
    res["full_kda_decode"] = layer_decode_case(gen, KimiDeltaAttention(D, 1, 64), B=2, T=5, D=D, steps=3)
    res.update(attention_cases(gen, ref64=True))
    return res


def main() -> int:
    which = sys.argv[1] if len(sys.argv) > 1 else "ops"
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    res = {"seed": seed}
    res.update({"ops": ops_cases, "layers": layer_cases, "full": layer_full_cases, "rope": rope_cases,
                "attention": attention_cases, "attention64": lambda g: attention_cases(g, ref64=True)}[which](gen))
    print("RESULT " + json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
