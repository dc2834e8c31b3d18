"""One GPU run: the Triton gated-delta-rule and KDA kernels vs the float64 reference, pass/fail table.

    python scripts/gpu_check_gdn.py [--quick] [--json PATH]

The same cases run as pytest tests marked `gpu` in tests/ops/test_gpu_check.py (`cases(quick=True)` there).

Cases: the benchmark shapes (bf16) and awkward ones (T = 1, 63, 65, 1000; varlen lengths 1, 15, 100, 700;
HV/H = 1, 2, 4; K=64 V=128; K=V=256; head dims off 64/128/256: OLMo-Hybrid's K=96 V=192, 48 and 32/16; strong
decays, a decay cliff and a freshly initialised layer's gates), in bf16, fp16 and fp32, with autograd and without
(the inference forward); the decode step on a state pool [256, 32, 128, 128] and at K=96 V=192.
Fresh random inputs each run (seed printed); outputs are NaN-poisoned by the kernels' wrappers and every
non-finite value fails. Bars (relative RMS vs float64 on the same rounded inputs): bf16 and fp16 o/final state
<= 5e-3, every gradient <= 1e-2; fp32 <= 1e-5 (TF32 off; the kernels use IEEE fp32 dots for fp32 inputs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from hybridlm.ops import gated_delta_rule
from hybridlm.ops.triton import fused_recurrent_gated_delta_rule_update
from hybridlm.ops.triton import gdn as _gdn
from hybridlm.ops.triton import kda as _kda

_gdn.POISON = True  # outputs start as NaN: an unwritten element fails

F64 = torch.float64
BARS = {torch.bfloat16: (5e-3, 1e-2), torch.float16: (5e-3, 1e-2), torch.float32: (1e-5, 1e-5)}


def rel(a, b):
    a, b = a.to(F64), b.to(F64)
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def cliff_bounds(T: int, device="cuda") -> torch.Tensor:
    """[T, 1] bounds of a "decay cliff": in every chunk of 64 steps, log-decays down to -30 for 32 steps, then down
    to -0.05 for 32, so the later rows' exponents are small differences of a cumulative sum near -500."""
    return torch.where(torch.arange(T, device=device) % 64 < 32, 30.0, 0.05)[:, None]


def fresh_layer_gates(shape: tuple[int, ...], HV: int, gen) -> torch.Tensor:
    """Log-decays as a freshly initialised GDN or KDA layer makes them: -A softplus(f), A ~ U(1, 16) per value head
    (A_log's init), f ~ N(0, 0.33) (the gate projection of unit inputs, dt_bias 0): about -5.5 a step.
    shape: [B, T, HV] or [B, T, HV, K]."""
    A = 1.0 + 15.0 * torch.rand(HV, device=gen.device, generator=gen)
    A = A.view(HV, *([1] * (len(shape) - 3)))
    return -A * torch.nn.functional.softplus(0.33 * torch.randn(*shape, device=gen.device, generator=gen))


def check(gen, name, *, B, T, H, HV, K, V, dtype, cu=None, h0=True, l2=True, grads=True, compiled=False,
          recompute=False, decay=None, g_first=None, final=True):
    """One case vs float64; grads=False: the inference forward (no autograd, nothing kept for a backward);
    final=False: no final state asked for (the backward runs without its cotangent); decay:
    log-decays uniform in [-decay, 0) instead of logsigmoid(N(3, 1)); "cliff": in every chunk of 64, 32 steps of
    [-30, 0) then 32 of [-0.05, 0); "init": a fresh layer's (`fresh_layer_gates`). g_first: every sequence's first
    log-decay (e^b of every row under float16's range at -25: `chunk_jit._chunk_scale`)."""
    dev = "cuda"
    N = B if cu is None else len(cu) - 1
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
    if not l2:
        q, k = q / K**0.5, k / K**0.5
    g = torch.nn.functional.logsigmoid(r(B, T, HV) + 3.0)  # log-decays mostly near 0, some strong
    if decay == "init":
        g = fresh_layer_gates((B, T, HV), HV, gen)
    elif decay is not None:
        bound = cliff_bounds(T, dev) if decay == "cliff" else decay
        g = -bound * torch.rand(B, T, HV, device=dev, generator=gen)
    if g_first is not None:
        g[:, 0] = g_first
    beta = 2.0 * torch.rand(B, T, HV, device=dev, generator=gen)
    xs = [x.to(dtype) for x in (q, k, v)] + [g, beta.to(dtype)] + [r(N, HV, K, V)]
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    leaf = [x.clone().requires_grad_(grads) for x in xs]
    t0 = time.perf_counter()
    fn = gated_delta_rule
    if compiled:  # inductor, no graph breaks: the custom ops trace through their fake kernels
        fn = torch.compile(lambda *a, **kw: gated_delta_rule(*a, **kw),
                           fullgraph=True)
    o, ht = fn(*leaf[:3], g=leaf[3], beta=leaf[4], initial_state=leaf[5] if h0 else None,
               output_final_state=final, cu_seqlens=cu_t, use_qk_l2norm=l2, impl="triton", recompute=recompute)
    do, dht = _cotangents(o, ht, gen)
    if grads:
        gr = torch.autograd.grad(_loss(o.float(), do, ht, dht), leaf if h0 else leaf[:5])
    torch.cuda.synchronize()
    t_ours = time.perf_counter() - t0
    ref = [x.detach().to(F64).requires_grad_(grads) for x in xs]
    o2, ht2 = gated_delta_rule(*ref[:3], g=ref[3], beta=ref[4], initial_state=ref[5] if h0 else None,
                               output_final_state=final, cu_seqlens=cu_t, use_qk_l2norm=l2, impl="chunk")
    res = {"o": rel(o, o2)} | ({"final_state": rel(ht, ht2)} if final else {})
    if grads:
        gr2 = torch.autograd.grad(_loss(o2, do.to(F64), ht2, dht), ref if h0 else ref[:5])
        for n, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], gr, gr2):
            res[n] = rel(a, b)
    bars = gdn_bars(dtype, decay)
    held = {n: v for n, v in res.items() if n in bars}
    ok = all(v <= bars[n] for n, v in held.items())
    worst = max(held.items(), key=lambda kv: kv[1] / bars[kv[0]])
    return {"case": name, "dtype": str(dtype).replace("torch.", ""), "pass": ok, "worst": worst[0],
            "worst_rel": worst[1], "errors": res, "seconds_ours": t_ours}


def _cotangents(o, ht, gen):
    """Random cotangents of o and of the final state (None when none was asked for)."""
    do = torch.randn(o.shape, device=o.device, generator=gen)
    return do, None if ht is None else torch.randn(ht.shape, device=o.device, generator=gen)


def _loss(o, do, ht, dht):
    """<o, do> + <ht, dht> (the second term only with a final state), in o's dtype."""
    loss = (o * do).sum()
    return loss if ht is None else loss + (ht * dht.to(ht.dtype)).sum()


def gdn_bars(dtype, decay) -> dict[str, float]:
    """The bar of each tensor of a GDN case: BARS, except where log-decays reach -30 a step and with a fresh
    layer's gates (about -5.5 a step, down to about -25), where the 16-bit paths are held to the CPU tests'
    decay-30 bars (tests/ops/test_triton_gdn.py BF16_DECAY30_BARS: dg and dbeta have a seed-dependent tail from
    the 16-bit W, U and chunk states, dg up to 1.2e-1 over 90 seeds; with a fresh layer's gates bf16 dg drew
    1.66e-2 on an H200, and over 38 seeds under the interpreter up to 1.24e-2, 3 of them above 1e-2)."""
    tol_o, tol_g = BARS[dtype]
    bars = {n: tol_o for n in ("o", "final_state")} | {n: tol_g for n in ("dq", "dk", "dv", "dg", "dbeta", "dh0")}
    if decay in (30.0, "cliff", "init") and dtype != torch.float32:
        bars.update(dg=2.5e-1, dbeta=3e-2)
    return bars


def check_kda(gen, name, *, B, T, H, HV, K, V, dtype, cu=None, h0=True, l2=True, decay=1.0, grads=True,
              recompute=False, final=True):
    """KDA forward and every gradient vs the float64 chunk reference; per-channel log-decays uniform in [-decay, 0)
    or, with decay "init", a fresh layer's (`fresh_layer_gates`); final as `check`'s. Runs where gen is."""
    from hybridlm.ops import kda

    dev = gen.device
    N = B if cu is None else len(cu) - 1
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
    if not l2:
        q, k = q / K**0.5, k / K**0.5
    if decay == "init":
        g = fresh_layer_gates((B, T, HV, K), HV, gen)
    else:
        g = -decay * torch.rand(B, T, HV, K, device=dev, generator=gen)
    beta = 2.0 * torch.rand(B, T, HV, device=dev, generator=gen)
    xs = [x.to(dtype) for x in (q, k, v)] + [g, beta.to(dtype), r(N, HV, K, V)]
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    leaf = [x.clone().requires_grad_(grads) for x in xs]
    o, ht = kda(*leaf[:3], g=leaf[3], beta=leaf[4], initial_state=leaf[5] if h0 else None, output_final_state=final,
                cu_seqlens=cu_t, use_qk_l2norm=l2, impl="triton", recompute=recompute)
    do, dht = _cotangents(o, ht, gen)
    if grads:
        gr = torch.autograd.grad(_loss(o.float(), do, ht, dht), leaf if h0 else leaf[:5])
    ref = [x.detach().to(F64).requires_grad_(grads) for x in xs]
    o2, ht2 = kda(*ref[:3], g=ref[3], beta=ref[4], initial_state=ref[5] if h0 else None, output_final_state=final,
                  cu_seqlens=cu_t, use_qk_l2norm=l2, impl="chunk")
    res = {"o": rel(o, o2)} | ({"final_state": rel(ht, ht2)} if final else {})
    if grads:
        gr2 = torch.autograd.grad(_loss(o2, do.to(F64), ht2, dht), ref if h0 else ref[:5])
        for nm, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], gr, gr2):
            res[nm] = rel(a, b)
    tol_o, tol_g = BARS[dtype]
    ok = all(x <= (tol_o if nm in ("o", "final_state") else tol_g) for nm, x in res.items())
    worst = max(res.items(), key=lambda kv: kv[1] / (tol_o if kv[0] in ("o", "final_state") else tol_g))
    return {"case": "kda " + name, "dtype": str(dtype).replace("torch.", ""), "pass": ok, "worst": worst[0],
            "worst_rel": worst[1], "errors": res}


def check_kda_decode(gen, *, P=256, N=256, HV=32, H=32, K=128, V=128, dtype=torch.bfloat16):
    from hybridlm.ops import kda
    from hybridlm.ops.triton import fused_recurrent_kda_update

    dev = "cuda"
    idx = torch.randperm(P, device=dev, generator=gen)[:N].to(torch.int32)
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)
    q, k, v = r(N, H, K).to(dtype), r(N, H, K).to(dtype), r(N, HV, V).to(dtype)
    g = -torch.rand(N, HV, K, device=dev, generator=gen)
    beta = 2.0 * torch.rand(N, HV, device=dev, generator=gen)
    pool = r(P, HV, K, V)
    pool0 = pool.clone()
    o = fused_recurrent_kda_update(q, k, v, g=g, beta=beta, state_pool=pool, state_indices=idx, use_qk_l2norm=True)
    d = lambda x: x.to(F64)[:, None]  # noqa: E731
    o2, s2 = kda(d(q), d(k), d(v), g=d(g), beta=d(beta), initial_state=pool0[idx.long()].to(F64),
                 output_final_state=True, use_qk_l2norm=True, impl="naive")
    res = {"o": rel(o, o2[:, 0]), "state": rel(pool[idx.long()], s2)}
    tol = BARS[dtype][0]
    return {"case": f"kda decode P{P} N{N} HV{HV} K{K} V{V}", "dtype": str(dtype).replace("torch.", ""),
            "pass": all(x <= tol for x in res.values()), "worst": max(res, key=res.get),
            "worst_rel": max(res.values()), "errors": res}


def check_decode(gen, *, P=256, N=256, HV=32, H=16, K=128, V=128, dtype=torch.bfloat16):
    dev = "cuda"
    idx = torch.randperm(P, device=dev, generator=gen)[:N].to(torch.int32)
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)
    q, k, v = r(N, H, K).to(dtype), r(N, H, K).to(dtype), r(N, HV, V).to(dtype)
    g = torch.nn.functional.logsigmoid(r(N, HV) + 3.0)
    beta = 2.0 * torch.rand(N, HV, device=dev, generator=gen)
    pool = r(P, HV, K, V)
    pool0 = pool.clone()
    o = fused_recurrent_gated_delta_rule_update(q, k, v, g=g, beta=beta, state_pool=pool, state_indices=idx,
                                                use_qk_l2norm=True)
    s0 = pool0[idx.long()].to(F64)
    o2, s2 = gated_delta_rule(q.to(F64).unsqueeze(0).transpose(0, 1), k.to(F64).unsqueeze(0).transpose(0, 1),
                              v.to(F64).unsqueeze(0).transpose(0, 1), g=g.to(F64)[:, None],
                              beta=beta.to(F64)[:, None], initial_state=s0, output_final_state=True,
                              use_qk_l2norm=True, impl="naive")
    res = {"o": rel(o, o2[:, 0]), "state": rel(pool[idx.long()], s2)}
    mask = torch.ones(P, dtype=torch.bool, device=dev)
    mask[idx.long()] = False
    untouched = bool(torch.equal(pool[mask], pool0[mask]))
    tol = BARS[dtype][0] if dtype != torch.float32 else 1e-5
    ok = all(x <= tol for x in res.values()) and untouched
    return {"case": f"decode P{P} N{N} HV{HV} H{H} K{K} V{V}", "dtype": str(dtype).replace("torch.", ""), "pass": ok,
            "worst": max(res, key=res.get), "worst_rel": max(res.values()), "errors": res}


def cases(quick: bool = False, bench_only: bool = False) -> list[tuple[str, dict]]:
    """(name, keyword arguments) of every chunked case; names starting "kda:" are KDA's (`run_case`)."""
    out = []
    dtypes = (torch.bfloat16, torch.float16, torch.float32) if not bench_only else ()
    for dt in dtypes:
        for T in (1, 63, 65, 1000):
            out.append((f"T{T} B2 H2 HV4 K128 V128", dict(B=2, T=T, H=2, HV=4, K=128, V=128, dtype=dt)))
        out.append(("varlen 1,15,100,700 H2 HV4", dict(B=1, T=816, H=2, HV=4, K=128, V=128, dtype=dt,
                                                       cu=[0, 1, 16, 116, 816])))
        out.append(("T300 H1 HV2 K64 V128 no-h0", dict(B=2, T=300, H=1, HV=2, K=64, V=128, dtype=dt, h0=False)))
        # one chunk a sequence without an initial state (the state passes' chunk loop runs once from zero)
        out.append(("T63 B2 H2 HV4 no-h0", dict(B=2, T=63, H=2, HV=4, K=128, V=128, dtype=dt, h0=False)))
        out.append(("varlen 63,64 no-h0 no final state", dict(B=1, T=127, H=2, HV=4, K=128, V=128, dtype=dt,
                                                              cu=[0, 63, 127], h0=False, final=False)))
        out.append(("T200 H1 HV4 K128", dict(B=1, T=200, H=1, HV=4, K=128, V=128, dtype=dt)))
        out.append(("T200 H2 HV2 K256 V256", dict(B=1, T=200, H=2, HV=2, K=256, V=256, dtype=dt)))
        out.append(("T130 H2 HV4 K128 V64 no-l2", dict(B=1, T=130, H=2, HV=4, K=128, V=64, dtype=dt, l2=False)))
        # head dims the kernels run zero-padded (OLMo-Hybrid 7B's K 96 / V 192; cpu-tiny's 48; a small 32 / 16)
        out.append(("T300 B2 H2 HV2 K96 V192", dict(B=2, T=300, H=2, HV=2, K=96, V=192, dtype=dt)))
        out.append(("varlen 1,15,100,700 K48 V48", dict(B=1, T=816, H=2, HV=4, K=48, V=48, dtype=dt,
                                                         cu=[0, 1, 16, 116, 816])))
        out.append(("T130 H1 HV2 K32 V16 no-l2", dict(B=1, T=130, H=1, HV=2, K=32, V=16, dtype=dt, l2=False)))
        # log-decays down to -30 a step: each exponent keeps its own precision (chunk_jit `_cum_split`)
        out.append(("T300 HV2 K128 decay30", dict(B=1, T=300, H=1, HV=2, K=128, V=128, dtype=dt, decay=30.0)))
        out.append(("T300 HV2 K128 decay cliff", dict(B=1, T=300, H=1, HV=2, K=128, V=128, dtype=dt,
                                                      decay="cliff")))
        out.append(("T200 B2 H2 HV2 K128 first decay -25", dict(B=2, T=200, H=2, HV=2, K=128, V=128, dtype=dt,
                                                                 g_first=-25.0)))
        out.append(("T300 H2 HV2 K128 fresh-layer gates", dict(B=1, T=300, H=2, HV=2, K=128, V=128, dtype=dt,
                                                               decay="init")))
        # the inference forward (no autograd: nothing kept for a backward)
        for T in (1, 65, 1000):
            out.append((f"no-grad T{T} B2 H2 HV4", dict(B=2, T=T, H=2, HV=4, K=128, V=128, dtype=dt, grads=False)))
        out.append(("no-grad varlen 1,15,100,700", dict(B=1, T=816, H=2, HV=4, K=128, V=128, dtype=dt, grads=False,
                                                        cu=[0, 1, 16, 116, 816])))
        out.append(("no-grad T64 B2 H2 HV4 no-h0", dict(B=2, T=64, H=2, HV=4, K=128, V=128, dtype=dt, grads=False,
                                                        h0=False)))
        out.append(("no-grad T200 K256 V256", dict(B=1, T=200, H=2, HV=2, K=256, V=256, dtype=dt, grads=False)))
    for dt in dtypes:
        out.append(("kda:T65 B2 H2 HV4 K128", dict(B=2, T=65, H=2, HV=4, K=128, V=128, dtype=dt)))
        out.append(("kda:T63 H1 HV4 K128", dict(B=1, T=63, H=1, HV=4, K=128, V=128, dtype=dt)))
        out.append(("kda:varlen 63,64 no-h0 no final state", dict(B=1, T=127, H=1, HV=2, K=128, V=128, dtype=dt,
                                                                  cu=[0, 63, 127], h0=False, final=False)))
        out.append(("kda:T64 B2 no-h0", dict(B=2, T=64, H=1, HV=2, K=128, V=128, dtype=dt, h0=False)))
        for T in (1, 1000):
            out.append((f"kda:T{T} B2 H2 HV4 K128", dict(B=2, T=T, H=2, HV=4, K=128, V=128, dtype=dt)))
        out.append(("kda:T300 H2 HV2 K128 fresh-layer gates", dict(B=1, T=300, H=2, HV=2, K=128, V=128, dtype=dt,
                                                                   decay="init")))
        out.append(("kda:T200 H2 HV2 K256 V256", dict(B=1, T=200, H=2, HV=2, K=256, V=256, dtype=dt)))
        out.append(("kda:varlen 1,15,100,700", dict(B=1, T=816, H=2, HV=2, K=128, V=128, dtype=dt,
                                                     cu=[0, 1, 16, 116, 816])))
        out.append(("kda:T300 H2 HV2 K96 V192", dict(B=1, T=300, H=2, HV=2, K=96, V=192, dtype=dt)))
        out.append(("kda:T300 K64 V128 decay30 no-h0", dict(B=1, T=300, H=1, HV=1, K=64, V=128, dtype=dt, h0=False,
                                                           decay=30.0)))
    if not bench_only:
        # recompute=True (the backward reruns the forward inside its own op and frees part of it early)
        out.append(("recompute varlen 1,15,100,700", dict(B=1, T=816, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                                                          cu=[0, 1, 16, 116, 816], recompute=True)))
        out.append(("kda:recompute varlen 1,15,100,700", dict(B=1, T=816, H=2, HV=2, K=128, V=128,
                                                              dtype=torch.bfloat16, cu=[0, 1, 16, 116, 816],
                                                              recompute=True)))
        out.append(("torch.compile T300 H2 HV4", dict(B=2, T=300, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                                                      compiled=True)))
    if not quick:
        out.append(("kda:bench B4 T4096 H16 D128", dict(B=4, T=4096, H=16, HV=16, K=128, V=128,
                                                        dtype=torch.bfloat16, h0=False)))
        for B, T, H in ((4, 4096, 16), (8, 2048, 32), (1, 32768, 32)):
            out.append((f"bench B{B} T{T} H{H} D128", dict(B=B, T=T, H=H, HV=H, K=128, V=128,
                                                           dtype=torch.bfloat16, h0=False)))
            out.append((f"no-grad bench B{B} T{T} H{H} D128", dict(B=B, T=T, H=H, HV=H, K=128, V=128,
                                                                   dtype=torch.bfloat16, h0=False, grads=False)))
    return out


def run_case(gen, name: str, kw: dict) -> dict:
    """One case's row (an exception is a failing row, so one table covers the whole run)."""
    try:
        return check_kda(gen, name[4:], **kw) if name.startswith("kda:") else check(gen, name, **kw)
    except Exception as e:  # noqa: BLE001
        return {"case": name, "dtype": str(kw["dtype"]), "pass": False, "worst": "error",
                "worst_rel": float("nan"), "errors": {"exception": repr(e)[:300]}}


DECODE_DIMS = ((128, 128), (96, 192))  # (K, V) of the decode rows: native, and masked (OLMo-Hybrid's)


def run_decode(gen, kda: bool, dtype, K: int = 128, V: int = 128) -> dict:
    """The decode step's row (GDN's, or KDA's with kda) at head dims K, V."""
    try:
        return check_kda_decode(gen, dtype=dtype, K=K, V=V) if kda else check_decode(gen, dtype=dtype, K=K, V=V)
    except Exception as e:  # noqa: BLE001
        return {"case": "kda decode" if kda else "decode", "dtype": str(dtype), "pass": False, "worst": "error",
                "worst_rel": float("nan"), "errors": {"exception": repr(e)[:300]}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="awkward shapes only, no benchmark shapes")
    ap.add_argument("--bench-only", action="store_true", help="benchmark shapes and decode only")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--part", default="0/1", help="I/N: run every N-th case starting at I (parallel processes "
                    "share one GPU; compiling dominates); decode runs in part 0")
    ap.add_argument("--tune-json", default=None, help="GDN launch settings from scripts/gpu_tune.py (its 'best')")
    ap.add_argument("--only", default=None, help="run only the cases whose name contains this text (no decode cases)")
    ap.add_argument("--merge", nargs="+", default=None, help="only print the table of these --json files")
    ap.add_argument("--seed", type=int, default=None, help="the inputs' seed (default: fresh); with the same --part "
                    "it repeats an earlier run's inputs case for case")
    ap.add_argument("--gdn-tune", default=None, help="JSON object of gdn.TUNE settings for this run (to compare "
                    "launch settings on the same --seed)")
    ap.add_argument("--kda-tune", default=None, help="JSON object of kda.TUNE settings for this run (for example "
                    "'{\"bk\": 16}')")
    args = ap.parse_args(argv)
    if args.merge:
        return _merge(args.merge)
    if args.tune_json:
        with open(args.tune_json) as f:
            _gdn.TUNE.update(**json.load(f)["best"])
    if args.gdn_tune is not None:
        _gdn.TUNE.update(**json.loads(args.gdn_tune))
    if args.kda_tune is not None:
        _kda.TUNE.update(**json.loads(args.kda_tune))
    part, nparts = (int(x) for x in args.part.split("/"))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    seed = torch.seed() % 2**31 if args.seed is None else args.seed
    gen = torch.Generator(device="cuda").manual_seed(seed)
    print(f"seed {seed}; device {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    todo = cases(args.quick, args.bench_only)
    if args.only:
        todo = [c for c in todo if args.only in c[0]]
    rows = []
    for name, kw in todo[part::nparts]:
        row = run_case(gen, name, kw)
        rows.append(row)
        print(f"{'PASS' if row['pass'] else 'FAIL'} {row['case']:<34} {row['dtype']:<9} worst {row['worst']:<11} "
              f"{row['worst_rel']:.2e}", flush=True)
        torch.cuda.empty_cache()
    for dt in (torch.bfloat16, torch.float32) if part == 0 and not args.only else ():
        for K, V in DECODE_DIMS:
            rows += [run_decode(gen, True, dt, K, V), run_decode(gen, False, dt, K, V)]
    n_fail = _print_table(rows, seed)
    print("chunk sizes that fit (K, V, dtype, pass):", {str(k): v for k, v in _gdn._BT_OK.items()})
    print("launch settings:", json.dumps(_gdn.TUNE.as_dict()))
    print("KDA launch settings:", json.dumps(_kda.TUNE.as_dict()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seed": seed, "rows": rows, "tune": _gdn.TUNE.as_dict(), "kda_tune": _kda.TUNE.as_dict()}, f,
                      indent=1, default=str)
    return 1 if n_fail else 0


def _print_table(rows, seed) -> int:
    print("\n| case | dtype | result | worst tensor | rel RMS |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['dtype']} | {'PASS' if r['pass'] else 'FAIL'} | {r['worst']} | "
              f"{r['worst_rel']:.2e} |")
    n_fail = sum(not r["pass"] for r in rows)
    print(f"\n{len(rows) - n_fail}/{len(rows)} passed (seed {seed})")
    return n_fail


def _merge(paths) -> int:
    rows, seeds = [], []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        rows += d["rows"]
        seeds.append(d["seed"])
    return 1 if _print_table(rows, seeds) else 0


if __name__ == "__main__":
    sys.exit(main())
