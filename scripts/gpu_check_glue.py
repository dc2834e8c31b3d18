"""One GPU run: the fused Triton layer glue vs the float64 reference (pass/fail table), then timings.

    python scripts/gpu_check_glue.py [--quick] [--no-timing] [--only NAME_PART] [--sweep-conv] [--sweep-norm]
        [--json PATH]

Run it on a GPU after changing a glue kernel or its launch settings (`conv.TUNE`, `norm.TUNE`), and before
quoting glue timings; `pytest -m gpu tests/ops/test_gpu_check_glue.py` runs the same cases (--quick, no timing).

Kernels (hybridlm/ops/triton/{conv,norm,gates,swiglu}.py): causal depthwise conv1d + SiLU forward/backward
(widths 2, 3, 4, 6, bias, initial/final state, varlen with documents shorter than the kernel, T = 1) and its pooled
decode step; gated RMSNorm (SiLU, sigmoid + fp32 output; D = 64, 128, 256) and RMSNorm kinds (D = 2048, 4096); the
GDN gates (beta_scale 1 and 2) and Kimi's channel-wise gates; SwiGLU's silu(gate) * up. Each in bfloat16 and
float32, on fresh random inputs (seed printed), outputs NaN-poisoned (an unwritten element fails). Errors are
relative L2 against float64 PyTorch on the same rounded inputs, for every output and every gradient; "ref" is the
error of the PyTorch reference path run in the same dtype, for scale. Bars: bf16 1e-2 (the kernels round the fp32
weight to bf16 as the reference does, ~2e-3, plus one output rounding), fp32 1e-5.
Timings (median of CUDA-event timed repeats, bf16, Qwen3-Next widths B4 T4096): fused kernel vs the PyTorch
reference path, forward and forward+backward; --sweep-conv / --sweep-norm also time the conv's / the gated norm's
launch settings (`hybridlm.ops.triton.conv.TUNE` / `norm.TUNE`). Exit status 1 if any case fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
import torch.nn.functional as F

from hybridlm.bench.cuda_profile import kernel_table
from hybridlm.ops import causal_conv1d, causal_conv1d_update, gated_rms_norm, glue, rms_norm
from hybridlm.ops.triton import conv as tconv
from hybridlm.ops.triton import gates as tgates
from hybridlm.ops.triton import norm as tnorm
from hybridlm.ops.triton import swiglu as tswiglu
from hybridlm.ops.triton.tune import LaunchTable, tuned

F64 = torch.float64
DEV = "cuda"
BARS = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def rel(a, b):
    a, b = a.detach().to(F64), b.detach().to(F64)
    if a.shape != b.shape or not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def compare(fused, ref, inputs, dtype, gen):
    """fused, ref: f(**inputs) -> tuple of outputs. Returns {name: (err fused, err same-dtype reference)}."""
    cd = {k: v for k, v in inputs.items() if v is not None}
    names = [k for k, v in cd.items() if v.is_floating_point()]
    leaf = {k: (v.clone().requires_grad_() if k in names else v) for k, v in cd.items()}
    same = {k: (v.clone().requires_grad_() if k in names else v) for k, v in cd.items()}
    f64 = {k: (v.to(F64).requires_grad_() if k in names else v) for k, v in cd.items()}
    outs = [fused(**leaf), ref(**same), ref(**f64)]
    cots = [torch.randn(o.shape, device=DEV, generator=gen) for o in outs[2]]
    diff = [o.requires_grad for o in outs[0]]  # the fused path's differentiable outputs (not the final state)
    grads = []
    for out, args in zip(outs, (leaf, same, f64)):
        ins = [args[k] for k in names]
        terms = [(o.to(F64) * c.to(F64)).sum() for o, c, d in zip(out, cots, diff) if d]
        grads.append(torch.autograd.grad(sum(terms), ins, allow_unused=True) if terms else [None] * len(ins))
    res = {}
    for i, (a, b, c) in enumerate(zip(*outs)):
        res[f"out{i}"] = (rel(a, c), rel(b, c))
    for n, a, b, c in zip(names, *grads):
        if c is not None:
            res["d" + n] = (rel(a, c) if a is not None else float("inf"), rel(b, c) if b is not None else 0.0)
    return res


def rnd(gen, *shape, scale=1.0, dtype=torch.float32):
    return (scale * torch.randn(*shape, device=DEV, generator=gen)).to(dtype)


# ------------------------------------------------------------------------------------------------------ cases


def conv_case(gen, dtype, *, B, T, C, W, bias=False, h0=False, cu=None, silu=True, split=None):
    """split: the output as a layer's q, k, v (three tensors, `causal_conv1d(split=)`), compared part by part."""
    N = B if cu is None else len(cu) - 1
    act = "silu" if silu else None
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEV)
    inp = {"x": rnd(gen, B, T, C, dtype=dtype), "weight": rnd(gen, C, W, scale=W**-0.5),
           "bias": rnd(gen, C) if bias else None, "initial_state": rnd(gen, N, C, W, dtype=dtype) if h0 else None}

    def fused(x, weight, bias=None, initial_state=None):
        y, h = tconv.causal_conv1d(x, weight, bias, activation=act, initial_state=initial_state,
                                   output_final_state=True, cu_seqlens=cu_t, split=split)
        return (*y, h) if split else (y, h)

    def ref(x, weight, bias=None, initial_state=None):
        y, h = ref_whole(x, weight, bias, initial_state)
        return (*y.split(list(split), dim=-1), h) if split else (y, h)

    def ref_whole(x, weight, bias=None, initial_state=None):
        if cu is None:
            return causal_conv1d(x, weight, bias, activation=act, initial_state=initial_state,
                                 output_final_state=True)
        ys, hs = [], []
        for n in range(N):
            y, h = causal_conv1d(x[:, cu[n]:cu[n + 1]], weight, bias, activation=act, output_final_state=True,
                                 initial_state=None if initial_state is None else initial_state[n:n + 1])
            ys.append(y)
            hs.append(h)
        return torch.cat(ys, 1), torch.cat(hs, 0)

    return compare(fused, ref, inp, dtype, gen)


def conv_decode_case(gen, dtype, *, N, P, C, W):
    idx = torch.randperm(P, device=DEV, generator=gen)[:N].to(torch.int32)
    x, w, b = rnd(gen, N, C, dtype=dtype), rnd(gen, C, W, scale=W**-0.5), rnd(gen, C)
    pool = rnd(gen, P, C, W, dtype=dtype)
    pool0 = pool.clone()
    y = tconv.causal_conv1d_update(x, pool, w, b, activation="silu", state_indices=idx)
    st64, st = pool0[idx.long()].to(F64), pool0[idx.long()].clone()
    y64 = causal_conv1d_update(x.to(F64), st64, w.to(F64), b.to(F64), activation="silu")
    y_same = causal_conv1d_update(x, st, w, b, activation="silu")
    others = torch.ones(P, dtype=torch.bool, device=DEV)
    others[idx.long()] = False
    untouched = 0.0 if torch.equal(pool[others], pool0[others]) else float("inf")
    return {"out0": (rel(y, y64), rel(y_same, y64)), "state": (rel(pool[idx.long()], st64), rel(st, st64)),
            "others_unchanged": (untouched, 0.0)}


def gnorm_case(gen, dtype, *, M, D, activation, fp32_output=False, weight=True):
    inp = {"x": rnd(gen, M, D, dtype=dtype), "gate": rnd(gen, M, D, scale=2.0, dtype=dtype),
           "weight": (1 + rnd(gen, D, scale=0.3)) if weight else None}
    kw = dict(activation=activation, fp32_output=fp32_output)
    return compare(lambda x, gate, weight=None: (tnorm.gated_rms_norm(x, gate, weight, 1e-6, **kw),),
                   lambda x, gate, weight=None: (gated_rms_norm(x, gate, weight, 1e-6, **kw),), inp, dtype, gen)


def rms_case(gen, dtype, *, M, D, kind):
    kw = dict(zero_centered=kind == "zero_centered", cast_before_weight=kind == "llama")
    w = rnd(gen, D, scale=0.3) + (0.0 if kind == "zero_centered" else 1.0)
    inp = {"x": rnd(gen, M, D, dtype=dtype), "weight": w}
    return compare(lambda x, weight: (tnorm.rms_norm(x, weight, 1e-6, **kw),),
                   lambda x, weight: (rms_norm(x, weight, 1e-6, **kw),), inp, dtype, gen)


def gates_case(gen, dtype, *, B, T, H, K, beta_scale, kda):
    inp = {"a": rnd(gen, B, T, H * K, scale=4.0, dtype=dtype), "b": rnd(gen, B, T, H, scale=3.0, dtype=dtype),
           "A_log": torch.rand(H, device=DEV, generator=gen) * 2.7, "dt_bias": rnd(gen, H * K)}

    def fused(a, b, A_log, dt_bias):
        fn = tgates.kda_gates if kda else tgates.gdn_gates
        return fn(a, b, A_log, dt_bias, beta_scale=beta_scale)

    def ref(a, b, A_log, dt_bias):
        f = a.float() if a.dtype != F64 else a
        f = (f + dt_bias).view(B, T, H, K) if kda else f + dt_bias
        sp = torch.where(f > 20.0, f, torch.log1p(torch.exp(f))) if kda else F.softplus(f)
        Af = A_log.float() if A_log.dtype != F64 else A_log
        g = -Af.exp().view(H, 1) * sp if kda else -Af.exp() * sp
        return g, b.sigmoid() * beta_scale

    return compare(fused, ref, inp, dtype, gen)


def swiglu_case(gen, dtype, *, shape):
    inp = {"gate": rnd(gen, *shape, scale=3.0, dtype=dtype), "up": rnd(gen, *shape, dtype=dtype)}
    return compare(lambda gate, up: (tswiglu.silu_mul(gate, up),), lambda gate, up: (F.silu(gate) * up,), inp,
                   dtype, gen)


def cases(quick: bool):
    B, T = (2, 1024) if quick else (4, 4096)
    C = 8192  # Qwen3-Next conv channels: 2 * 16 * 128 + 32 * 128
    yield "conv W4 silu", lambda g, d: conv_case(g, d, B=B, T=T // 2, C=C, W=4)
    yield "conv W2 bias h0", lambda g, d: conv_case(g, d, B=2, T=300, C=1000, W=2, bias=True, h0=True)
    yield "conv W3 no-act", lambda g, d: conv_case(g, d, B=2, T=63, C=520, W=3, silu=False)
    yield "conv W6 bias h0", lambda g, d: conv_case(g, d, B=2, T=100, C=300, W=6, bias=True, h0=True)
    yield "conv W4 varlen 1,2,15,700,1000", lambda g, d: conv_case(
        g, d, B=1, T=1718, C=2048, W=4, cu=[0, 1, 3, 18, 718, 1718])
    yield "conv W4 varlen h0 bias", lambda g, d: conv_case(g, d, B=1, T=333, C=768, W=4, bias=True, h0=True,
                                                           cu=[0, 2, 200, 333])
    yield "conv W4 T1 h0", lambda g, d: conv_case(g, d, B=8, T=1, C=C, W=4, h0=True)
    # the output as the GDN layer's q, k, v (Qwen3-Next widths), and over packed documents with a state and a bias
    yield "conv W4 silu split 2048,2048,4096", lambda g, d: conv_case(g, d, B=B, T=T // 2, C=C, W=4,
                                                                      split=(2048, 2048, 4096))
    yield "conv W4 varlen h0 bias split 256,256,256", lambda g, d: conv_case(
        g, d, B=1, T=333, C=768, W=4, bias=True, h0=True, cu=[0, 1, 40, 333], split=(256, 256, 256))
    yield "conv decode pool", lambda g, d: conv_decode_case(g, d, N=256, P=512, C=C, W=4)
    yield "gnorm silu D128", lambda g, d: gnorm_case(g, d, M=B * T * 8, D=128, activation="silu")
    yield "gnorm silu D256 no-w", lambda g, d: gnorm_case(g, d, M=5000, D=256, activation="silu", weight=False)
    yield "gnorm sigmoid fp32out D128", lambda g, d: gnorm_case(g, d, M=B * T * 4, D=128, activation="sigmoid",
                                                                fp32_output=True)
    yield "gnorm silu D64", lambda g, d: gnorm_case(g, d, M=3001, D=64, activation="silu")
    yield "rms zero_centered D2048", lambda g, d: rms_case(g, d, M=B * T, D=2048, kind="zero_centered")
    yield "rms llama D2304", lambda g, d: rms_case(g, d, M=999, D=2304, kind="llama")
    yield "rms fp32_weight D4096", lambda g, d: rms_case(g, d, M=1000, D=4096, kind="fp32_weight")
    yield "gates gdn HV32", lambda g, d: gates_case(g, d, B=B, T=T, H=32, K=1, beta_scale=1.0, kda=False)
    yield "gates gdn beta2 HV6", lambda g, d: gates_case(g, d, B=2, T=777, H=6, K=1, beta_scale=2.0, kda=False)
    yield "gates kda H16 K128", lambda g, d: gates_case(g, d, B=2, T=1000, H=16, K=128, beta_scale=1.0, kda=True)
    yield "swiglu [B,T,2816]", lambda g, d: swiglu_case(g, d, shape=(B, T, 2816))
    yield "swiglu 4097x3", lambda g, d: swiglu_case(g, d, shape=(4097, 3))  # a partial last block


# ----------------------------------------------------------------------------------------------------- timing


def bench_ms(fn, reps=20, warmup=3, inner=10) -> float:
    """Median ms per call of fn, timed over `inner` back-to-back calls: one call between two events also times the
    host's launch latency (the GPU idles while the call's Python runs), which for a ~0.1 ms kernel behind a custom
    op is most of it. Back to back, the GPU runs one call while the host launches the next."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(inner):
            fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / inner)
    times.sort()
    return times[len(times) // 2]


def timings(gen, quick: bool):
    B, T = (2, 1024) if quick else (4, 4096)
    bf = torch.bfloat16
    rows = []

    def pair(name, fused, ref, inputs, grads=True):
        """fused/ref(**inputs) -> tuple of outputs; times fwd and fwd+bwd (sum of outputs as the loss)."""
        leaf = {k: (v.clone().requires_grad_(grads and v.is_floating_point()) if isinstance(v, torch.Tensor)
                    else v) for k, v in inputs.items()}
        row = {"op": name}
        try:  # one failing op should not hide the others' timings
            for tag, fn in (("fused", fused), ("torch", ref)):
                with torch.no_grad():
                    row[f"{tag}_fwd_ms"] = bench_ms(lambda fn=fn: fn(**leaf))
                if grads:
                    def fb(fn=fn):
                        outs = [o for o in fn(**leaf) if o.requires_grad]
                        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
                    row[f"{tag}_fwdbwd_ms"] = bench_ms(fb)
        except Exception as e:
            print(f"timing {name} failed: {type(e).__name__}: {e}")
        rows.append(row)

    C = 8192
    x = rnd(gen, B, T, C, dtype=bf)
    w = rnd(gen, C, 4, scale=0.5).to(bf)
    pair(f"conv W4 silu [{B},{T},{C}]", lambda x, w: tconv.causal_conv1d(x, w, activation="silu")[:1],
         lambda x, w: causal_conv1d(x, w, activation="silu")[:1], {"x": x, "w": w})
    # as q, k, v: three tensors written and their gradients read as they are, against the views of one output
    pair(f"conv W4 silu split q,k,v [{B},{T},{C}]",
         lambda x, w: tconv.causal_conv1d(x, w, activation="silu", split=(2048, 2048, 4096))[0],
         lambda x, w: causal_conv1d(x, w, activation="silu")[0].split([2048, 2048, 4096], dim=-1),
         {"x": x, "w": w})
    del x
    pool = rnd(gen, 512, C, 4, dtype=bf)
    xd = rnd(gen, 256, C, dtype=bf)
    idx = torch.randperm(512, device=DEV, generator=gen)[:256].to(torch.int32)
    sub = pool[idx.long()].clone()
    pair(f"conv decode N256 C{C}",
         lambda x: (tconv.causal_conv1d_update(x, pool, w, activation="silu", state_indices=idx),),
         lambda x: (causal_conv1d_update(x, sub, w, activation="silu"),), {"x": xd}, grads=False)
    M = B * T * 32
    xn, zn, wn = rnd(gen, M, 128, dtype=bf), rnd(gen, M, 128, dtype=bf), 1 + rnd(gen, 128, scale=0.3)
    pair(f"gated rmsnorm silu [{M},128]", lambda x, z, w: (tnorm.gated_rms_norm(x, z, w),),
         lambda x, z, w: (gated_rms_norm(x, z, w),), {"x": xn, "z": zn, "w": wn})
    pair(f"gated rmsnorm sigmoid fp32out [{M // 2},128]",
         lambda x, z, w: (tnorm.gated_rms_norm(x, z, w, activation="sigmoid", fp32_output=True),),
         lambda x, z, w: (gated_rms_norm(x, z, w, activation="sigmoid", fp32_output=True),),
         {"x": xn[: M // 2], "z": zn[: M // 2], "w": wn})
    del xn, zn
    xr = rnd(gen, B * T, 2048, dtype=bf)
    pair(f"rmsnorm zero_centered [{B * T},2048]", lambda x, w: (tnorm.rms_norm(x, w, zero_centered=True),),
         lambda x, w: (rms_norm(x, w, zero_centered=True),), {"x": xr, "w": rnd(gen, 2048, scale=0.3)})
    a, b = rnd(gen, B, T, 32, dtype=bf), rnd(gen, B, T, 32, dtype=bf)
    A, dt = torch.rand(32, device=DEV, generator=gen), rnd(gen, 32)

    def gdn_ref(a, b, A, dt):
        return -A.float().exp() * F.softplus(a.float() + dt), b.sigmoid()

    pair(f"gates gdn [{B},{T},32]", lambda a, b, A, dt: tgates.gdn_gates(a, b, A, dt), gdn_ref,
         {"a": a, "b": b, "A": A, "dt": dt})
    f, bk = rnd(gen, B, T, 16 * 128, dtype=bf), rnd(gen, B, T, 16, dtype=bf)
    Ak, dtk = torch.rand(1, 1, 16, 1, device=DEV, generator=gen), rnd(gen, 16 * 128)

    def kda_ref(f, b, A, dt):
        ff = (f.float() + dt.float()).view(B, T, 16, 128)
        return -A.float().exp() * torch.where(ff > 20.0, ff, torch.log1p(torch.exp(ff))), torch.sigmoid(b)

    pair(f"gates kda [{B},{T},16x128]", lambda f, b, A, dt: tgates.kda_gates(f, b, A, dt), kda_ref,
         {"f": f, "b": bk, "A": Ak, "dt": dtk})
    del f
    gs, us = rnd(gen, B, T, 2816, dtype=bf), rnd(gen, B, T, 2816, dtype=bf)
    pair(f"swiglu silu(gate) * up [{B},{T},2816]", lambda g, u: (tswiglu.silu_mul(g, u),),
         lambda g, u: (glue.silu_mul(g, u, impl="torch"),), {"g": gs, "u": us})
    return rows


def sweep(title: str, tune: LaunchTable, settings, run):
    """Time run() under each (name, settings) of `settings`, applied to the launch table `tune` for that run only;
    each setting's outputs are checked against the first setting's (same math, other blocking) as relative errors."""
    ref = None
    print(f"\n{title} (ms per call, then the summed CUDA time of its kernels; outputs vs the first setting)")
    for name, upd in settings:
        try:
            with tuned(tune, **upd):
                outs = run()
                if ref is None:
                    ref = outs
                ms = bench_ms(run)
                gpu = sum(r[1] for r in kernel_table(run, 5)) / 1e3  # the kernels alone, without host overhead
            errs = "  ".join(f"{k} {rel(v, ref[k]):.1e}" for k, v in outs.items())
            print(f"  {name:46s} {ms:8.3f}  gpu {gpu:6.3f}   {errs}", flush=True)
        except Exception as e:
            print(f"  {name:46s} FAILED {type(e).__name__}: {e}", flush=True)


def sweep_conv(gen, quick: bool):
    """Time the conv forward, and forward+backward, (bf16, W=4, SiLU) under launch settings
    (hybridlm.ops.triton.conv.TUNE): the forward on as many elements as the GDN layer's conv at Qwen3-Next widths,
    B8 T2048; the backward as the 357M hybrid's layer calls it (`bench train`)."""
    B, T, C = (2, 1024, 8192) if quick else (4, 4096, 8192)
    x = rnd(gen, B, T, C, dtype=torch.bfloat16).requires_grad_()
    w = rnd(gen, C, 4, scale=0.5).requires_grad_()
    fwd_settings = [("default", {})] + [
        (f"fwd bt {bt}, bc {bc}, {nw} warps", dict(fwd_bt=bt, fwd_bc=bc, fwd_warps=nw))
        for bt, bc, nw in [(64, 64, 4), (64, 64, 8), (64, 128, 4), (64, 128, 8), (128, 64, 8), (32, 128, 4),
                           (32, 128, 8), (64, 256, 8), (128, 128, 8), (16, 256, 4), (32, 256, 8)]]

    def fwd():
        with torch.no_grad():
            return {"y": tconv.causal_conv1d(x, w, activation="silu")[0]}

    sweep(f"conv forward sweep, bf16 [{B},{T},{C}] W4 SiLU", tconv.TUNE, fwd_settings, fwd)
    # the backward at the 357M hybrid's layer: q, k, v of 1024 channels each, 4 x 4096 tokens packed as 16 documents
    Tb = 4096 if quick else 16384
    xb = rnd(gen, 1, Tb, 3072, dtype=torch.bfloat16).requires_grad_()
    wb = rnd(gen, 3072, 4, scale=0.5).requires_grad_()
    dys = [rnd(gen, 1, Tb, 1024, dtype=torch.bfloat16) for _ in range(3)]
    cuts = torch.randperm(Tb - 1, generator=torch.Generator().manual_seed(1))[:15].add(1).sort().values
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([Tb])]).to(DEV, torch.int32)
    settings = [("default", {})] + [
        (f"bt {bt}, bc {bc}, {nw} warps, chunk {ch}", dict(bwd_bt=bt, bwd_bc=bc, bwd_warps=nw, bwd_chunk=ch))
        for bt, bc, nw, ch in [(64, 64, 4, 512), (64, 64, 8, 512), (32, 128, 4, 512), (32, 64, 8, 512),
                               (16, 128, 4, 512), (32, 64, 4, 256), (32, 64, 4, 1024), (64, 64, 4, 256)]]

    def fb():
        ys = tconv.causal_conv1d(xb, wb, activation="silu", cu_seqlens=cu, split=(1024, 1024, 1024))[0]
        dx, dw = torch.autograd.grad(ys, [xb, wb], dys)
        return {"dx": dx, "dweight": dw}

    sweep(f"conv fwd+bwd sweep, bf16 [1,{Tb},3072] split 1024 x 3, 16 documents, W4 SiLU", tconv.TUNE, settings, fb)


def sweep_norm(gen, quick: bool):
    """Time the gated RMSNorm (SiLU gate, D 128, fp32 weight, bf16 rows) forward, and forward+backward, under launch
    settings (hybridlm.ops.triton.norm.TUNE): the GDN layer's output norm at 32 value heads, B8 T2048."""
    M, D = (8 * 1024 * 32, 128) if quick else (8 * 2048 * 32, 128)
    x = rnd(gen, M, D, dtype=torch.bfloat16).requires_grad_()
    z = rnd(gen, M, D, dtype=torch.bfloat16).requires_grad_()
    w = (1 + 0.1 * rnd(gen, D)).requires_grad_()
    dy = rnd(gen, M, D, dtype=torch.bfloat16)

    def fwd():
        with torch.no_grad():
            return {"y": tnorm.gated_rms_norm(x, z, w)}

    fwd_settings = [("default", {})] + [
        (f"fwd {e} elements, {nw} warps", dict(fwd_elems=e, fwd_warps=nw))
        for e, nw in [(2048, 4), (4096, 8), (8192, 8), (8192, 4), (16384, 8), (2048, 2), (1024, 2)]]
    sweep(f"gated norm forward sweep, bf16 [{M},{D}]", tnorm.TUNE, fwd_settings, fwd)

    def fb():
        y = tnorm.gated_rms_norm(x, z, w)
        dx, dz, dw = torch.autograd.grad(y, [x, z, w], dy)
        return {"dx": dx, "dgate": dz, "dweight": dw}

    settings = [("default", {})] + [
        (f"bwd {e} el, {nw} warps, {pp} programs/SM", dict(bwd_elems=e, bwd_warps=nw, bwd_programs_per_sm=pp))
        for e, nw, pp in [(1024, 4, 4), (1024, 4, 16), (2048, 8, 8), (2048, 8, 32), (4096, 8, 8)]]
    sweep(f"gated norm fwd+bwd sweep, bf16 [{M},{D}]", tnorm.TUNE, settings, fb)


def run_checks(gen: torch.Generator, quick: bool, only: str = "") -> tuple[list[dict], bool]:
    """Every correctness case whose name contains `only`, in bf16 and fp32, with NaN-poisoned kernel outputs;
    prints the table. Returns (one row per case and dtype, whether all passed)."""
    results, ok_all = [], True
    print(f"{'case':34s} {'dtype':9s} {'pass':5s} {'worst':18s} {'rel err':>9s} {'ref path':>9s}")
    tconv.POISON = tnorm.POISON = tgates.POISON = tswiglu.POISON = True  # outputs start as NaN
    try:
        for name, fn in cases(quick):
            if only not in name:
                continue
            for dtype in (torch.bfloat16, torch.float32):
                row = check_case(name, fn, gen, dtype)
                ok_all &= row["pass"]
                results.append(row)
                torch.cuda.empty_cache()
    finally:
        tconv.POISON = tnorm.POISON = tgates.POISON = tswiglu.POISON = False
    return results, ok_all


def check_case(name: str, fn, gen: torch.Generator, dtype: torch.dtype) -> dict:
    """One case in one dtype against its bar; a case that raises is a failure, reported, not fatal."""
    try:
        res = fn(gen, dtype)
        bar = BARS[dtype]
        worst = max(res, key=lambda k: res[k][0])
        ok = all(v[0] <= bar for v in res.values())
        row = {"case": name, "dtype": str(dtype)[6:], "pass": ok, "worst": worst, "rel": res[worst][0],
               "ref_rel": res[worst][1], "errors": res}
        print(f"{name:34s} {row['dtype']:9s} {'ok' if ok else 'FAIL':5s} {worst:18s} {row['rel']:9.2e} "
              f"{row['ref_rel']:9.2e}")
    except Exception as e:  # report and go on: one broken case should not hide the others
        row = {"case": name, "dtype": str(dtype)[6:], "pass": False, "error": repr(e)}
        print(f"{name:34s} {row['dtype']:9s} FAIL  {type(e).__name__}: {e}")
        traceback.print_exc()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller shapes")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--only", default="", help="run the correctness cases whose name contains this")
    ap.add_argument("--sweep-conv", action="store_true", help="also time the conv's launch settings")
    ap.add_argument("--sweep-norm", action="store_true", help="also time the gated norm's launch settings")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    seed = args.seed if args.seed is not None else torch.seed() % 2**31
    gen = torch.Generator(device=DEV).manual_seed(seed)
    import triton

    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"seed {seed}")
    results, ok_all = run_checks(gen, args.quick, args.only)
    rows = []
    if not args.no_timing:
        try:
            rows = timings(gen, args.quick)
        except Exception as e:
            print(f"timing failed: {type(e).__name__}: {e}")
            traceback.print_exc()
        print(f"\n{'op (bf16)':44s} {'fused fwd':>10s} {'torch fwd':>10s} {'fused f+b':>10s} {'torch f+b':>10s}  (ms)")
        for r in rows:
            fb = lambda k, r=r: f"{r[k]:10.3f}" if k in r else f"{'-':>10s}"
            print(f"{r['op']:44s} {fb('fused_fwd_ms')} {fb('torch_fwd_ms')} {fb('fused_fwdbwd_ms')} "
                  f"{fb('torch_fwdbwd_ms')}")
    for flag, fn in ((args.sweep_conv, sweep_conv), (args.sweep_norm, sweep_norm)):
        if flag:
            try:
                fn(gen, args.quick)
            except Exception as e:
                print(f"{fn.__name__} failed: {type(e).__name__}: {e}")
                traceback.print_exc()
    print("\nALL PASS" if ok_all else "\nSOME FAILED")
    if args.json:  # written atomically: a temporary file beside it, then renamed
        tmp = f"{args.json}.tmp"
        with open(tmp, "w") as fh:
            json.dump({"seed": seed, "device": torch.cuda.get_device_name(), "checks": results, "timings": rows},
                      fh, indent=1)
        os.replace(tmp, args.json)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
