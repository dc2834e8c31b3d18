"""Cases for the Triton KDA kernels (forward, backward, decode), run in a child process under TRITON_INTERPRET=1
(CPU) by tests/ops/test_triton_kda.py. Prints one JSON line {case: {tensor: relative RMS error vs float64}}: the
naive recurrence for o and the states, the float64 chunk path's autograd for every gradient. Fresh random inputs
every run (seed printed). The interpreter's fixes (interp_patches.py) are applied before any kernel runs."""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from hybridlm.ops import kda  # noqa: E402
from hybridlm.ops.triton import fused_recurrent_kda_update  # noqa: E402
from hybridlm.ops.triton import gdn as _gdn  # noqa: E402
from hybridlm.ops.triton import kda as _kda  # noqa: E402
from hybridlm.ops.triton.kda import chunk_kda  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interp_gdn import ODD_DIMS, cliff_bounds, sums_case  # noqa: E402  (also applies the interpreter's fixes)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ops
from float64_check import gate_sum_errors  # noqa: E402
from recompute_check import recompute_case  # noqa: E402

_gdn.POISON = True  # kernel outputs start as NaN: an element a kernel forgets to write fails the comparison
F64 = torch.float64


def rel(a, b):
    a, b = a.to(F64), b.to(F64)
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def chunk_case(gen, *, B, T, H, HV, K, V, l2, h0, cu=None, decay=1.5, public=False, dtype=torch.float32):
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k = r(B, T, H, K), r(B, T, H, K)
    if not l2:
        q, k = q / K**0.5, k / K**0.5
    v = r(B, T, HV, V)
    g = -decay * torch.rand(B, T, HV, K, generator=gen)
    beta = 2.0 * torch.rand(B, T, HV, generator=gen)
    N = B if cu is None else len(cu) - 1
    xs = [q, k, v, g, beta, r(N, HV, K, V)]
    # 16-bit runs: q, k, v, beta in `dtype` (g and the state stay fp32); the reference gets the same rounded values
    xs = [x.to(dtype).float() if i in (0, 1, 2, 4) else x for i, x in enumerate(xs)]
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    leaf = [(x.to(dtype) if i in (0, 1, 2, 4) else x.clone()).requires_grad_() for i, x in enumerate(xs)]
    kw = dict(g=leaf[3], beta=leaf[4], initial_state=leaf[5] if h0 else None, output_final_state=True,
              cu_seqlens=cu_t, use_qk_l2norm=l2)
    o, ht = (kda(*leaf[:3], impl="triton", **kw) if public else chunk_kda(*leaf[:3], **kw))
    do, dht = torch.randn(o.shape, generator=gen).to(dtype), torch.randn(ht.shape, generator=gen)
    wrt = leaf if h0 else leaf[:5]
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), wrt)
    ref = [x.detach().to(F64).requires_grad_() for x in xs]
    kwr = dict(g=ref[3], beta=ref[4], initial_state=ref[5] if h0 else None, output_final_state=True,
               cu_seqlens=cu_t, use_qk_l2norm=l2)
    o2, ht2 = kda(*ref[:3], impl="chunk", **kwr)  # the float64 chunk path (itself tested against the naive one)
    grads2 = torch.autograd.grad((o2 * do.to(F64)).sum() + (ht2 * dht.to(F64)).sum(), ref if h0 else ref[:5])
    with torch.no_grad():
        o3, ht3 = kda(*ref[:3], impl="naive", **kwr)
    out = {"o": rel(o, o2), "final_state": rel(ht, ht2), "o_vs_naive": rel(o, o3), "state_vs_naive": rel(ht, ht3)}
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], grads, grads2):
        out[name] = rel(a, b)
    return out


def decode_case(gen, *, N, P, H, HV, K, V):
    idx = torch.randperm(P, generator=gen)[:N].to(torch.int32)
    q, k = torch.randn(N, H, K, generator=gen), torch.randn(N, H, K, generator=gen)
    v = torch.randn(N, HV, V, generator=gen)
    g = -torch.rand(N, HV, K, generator=gen)
    beta = 2.0 * torch.rand(N, HV, generator=gen)
    pool = torch.randn(P, HV, K, V, generator=gen)
    pool0 = pool.clone()
    o = fused_recurrent_kda_update(q, k, v, g=g, beta=beta, state_pool=pool, state_indices=idx, use_qk_l2norm=True)
    d = lambda x: x[:, None].to(F64)  # noqa: E731  (N sequences of one token each)
    o2, s2 = kda(d(q), d(k), d(v), g=d(g), beta=d(beta), initial_state=pool0[idx.long()].to(F64),
                 output_final_state=True, use_qk_l2norm=True, impl="naive")
    untouched = torch.ones(P, dtype=torch.bool)
    untouched[idx.long()] = False
    return {"o": rel(o, o2[:, 0]), "state": rel(pool[idx.long()], s2),
            "others_unchanged": float(torch.equal(pool[untouched], pool0[untouched]))}


def gate_case(gen, *, B, T, H, HV, K, V, lower_bound=None, cu=None, A_log=True, dt_bias=True, strong=False,
              dtype=torch.float32, recompute=False, saturated=0.0) -> dict:
    """Kimi's gate inside the public op, `kda(..., impl="triton", g=raw, A_log=, dt_bias=, lower_bound=)` (the
    kernels make g from raw and the gate's gradients themselves), against the float64 chunk path, whose gate is
    PyTorch's applied before the recurrence (`hybridlm.ops.kda_gate`): o, the final state and every gradient (q,
    k, v, raw, beta, A_log, dt_bias, initial_state). strong: A = 16 and raw ~ N(2, 1), log-decays of ~-35 a step
    (the exact launches); 16-bit dtype: q, k, v, raw and beta in it (the reference gets the rounded values).
    recompute: also 1.0 when recompute=True gives the same o, state and gradients bit for bit, else 0.0.
    saturated: that fraction of raw is -1000 (softplus 0: no decay and no gradient there, as fla's masked tests;
    the rest decays strongly)."""
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    N = B if cu is None else len(cu) - 1
    raw = r(B, T, HV, K) + 2.0 if strong else 2.0 * r(B, T, HV, K)
    if saturated:
        raw = torch.where(torch.rand(raw.shape, generator=gen) < saturated, -1000.0, raw)
    alog = torch.full((HV,), 16.0).log() if strong else torch.rand(HV, generator=gen) * 2 - 1
    xs = [r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V), raw, 2.0 * torch.rand(B, T, HV, generator=gen), alog,
          r(HV * K), r(N, HV, K, V)]
    xs = [x.to(dtype).float() if i < 5 else x for i, x in enumerate(xs)]
    names = ["dq", "dk", "dv", "draw", "dbeta", "dA_log", "ddt_bias", "dh0"]
    use = [True] * 5 + [A_log, dt_bias, True]
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)

    def run(leaf, impl, rc=False):
        return kda(*leaf[:3], g=leaf[3], beta=leaf[4], A_log=leaf[5] if A_log else None,
                   dt_bias=leaf[6] if dt_bias else None, lower_bound=lower_bound, initial_state=leaf[7],
                   output_final_state=True, use_qk_l2norm=True, cu_seqlens=cu_t, impl=impl, recompute=rc)

    def grads(rc):
        leaf = [(x.to(dtype) if i < 5 else x.clone()).requires_grad_(u) for i, (x, u) in enumerate(zip(xs, use))]
        o, ht = run(leaf, "triton", rc)
        return [o, ht, *torch.autograd.grad((o.float() * do).sum() + (ht * dht).sum(),
                                            [x for x, u in zip(leaf, use) if u])]

    do, dht = torch.randn(B, T, HV, V, generator=gen).to(dtype).float(), torch.randn(N, HV, K, V, generator=gen)
    got = grads(False)
    ref = [x.to(F64).requires_grad_(u) for x, u in zip(xs, use)]
    o2, ht2 = run(ref, "chunk")
    want = [o2, ht2, *torch.autograd.grad((o2 * do.to(F64)).sum() + (ht2 * dht.to(F64)).sum(),
                                          [x for x, u in zip(ref, use) if u])]
    out = {n: rel(a, b) for n, a, b in zip(["o", "final_state", *(n for n, u in zip(names, use) if u)], got, want)}
    sums = dict(zip([n for n, u in zip(names, use) if u], zip(got[2:], want[2:])))
    dg = _log_decay_grad(ref, cu_t, lower_bound, do, dht, A_log, dt_bias)
    pick = lambda n, i: sums[n][i] if n in sums else None  # noqa: E731
    out.update(gate_sum_errors(pick("dA_log", 0), pick("dA_log", 1), pick("ddt_bias", 0), pick("ddt_bias", 1),
                               ref[3].detach(), ref[5].detach() if A_log else None,
                               ref[6].detach() if dt_bias else None, lower_bound, dg))
    if recompute:
        out["recompute_bitwise"] = float(all(torch.equal(a, b) for a, b in zip(got, grads(True))))
    return out


def _log_decay_grad(ref, cu_t, lower_bound, do, dht, A_log: bool, dt_bias: bool):
    """dL/dg of the float64 chunk path, g = PyTorch's gate of ref's raw gate (a leaf here)."""
    from hybridlm.ops.kda_gate import kda_gate

    leaf = [x.detach() for x in ref]
    g = kda_gate(leaf[3], leaf[5] if A_log else None, leaf[6] if dt_bias else None, lower_bound,
                 dtype=F64).requires_grad_()
    o, ht = kda(*leaf[:3], g=g, beta=leaf[4], initial_state=leaf[7], output_final_state=True, use_qk_l2norm=True,
                cu_seqlens=cu_t, impl="chunk")
    return torch.autograd.grad((o * do.to(F64)).sum() + (ht * dht.to(F64)).sum(), g)[0]


def main() -> int:
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    res = {"seed": seed}
    res["gva2_l2_h0_T70"] = chunk_case(gen, B=2, T=70, H=1, HV=2, K=64, V=64, l2=True, h0=True)
    res["varlen_1_15_64_70"] = chunk_case(gen, B=1, T=150, H=2, HV=2, K=64, V=64, l2=False, h0=True,
                                          cu=[0, 1, 16, 80, 150])
    res["strong_decay_K64_V128_T65_public"] = chunk_case(gen, B=1, T=65, H=1, HV=1, K=64, V=128, l2=True, h0=False,
                                                         decay=30.0, public=True)
    # the H100 check's one fp32 miss (dg 2.1e-5): the exponents of the decay factors were differences of the
    # cumulative log-decay (|b| ~ 1e3 here, fp32 ulp ~ 6e-5); now summed from g directly (dg ~ 2e-6)
    res["strong_decay_K64_V128_T300_fp32_1e-5"] = chunk_case(gen, B=1, T=300, H=1, HV=1, K=64, V=128, l2=True,
                                                             h0=False, decay=30.0)
    # decay 30 a step in head 0's second chunk and in key block 1 (channels 32-63) of head 1's first chunk, mild
    # elsewhere: in each K-blocked kernel's launches a dot launch takes (chunk 0, head 0) and (chunk 1, head 1),
    # the exact launch the other two (kda_decay._diag_pass)
    mixed = torch.full((1, 70, 2, 64), 1.5)
    mixed[:, 64:, 0] = 30.0
    mixed[:, :64, 1, 32:] = 30.0
    res["mixed_decay_by_chunk_and_head_T70"] = chunk_case(gen, B=1, T=70, H=1, HV=2, K=64, V=64, l2=True, h0=True,
                                                          decay=mixed)
    # log-decays averaging 1.9 a step: |b_i - b_m| over half a chunk near the whole-chunk dot's bound of 60, so some
    # chunks (and heads) take the one-dot launch with factors up to ~e^60 and the others the blocks
    res["whole_chunk_bound_decay3.75_T150"] = chunk_case(gen, B=2, T=150, H=1, HV=2, K=64, V=64, l2=True, h0=True,
                                                         decay=3.75)
    # a decay cliff (in every chunk 32 steps of up to -30, then 32 of up to -0.05): the later rows' exponents are
    # small differences of a cumulative sum near -500 (the strong half keeps every chunk off both dots: the exact
    # launches)
    cliff = cliff_bounds(150)[:, :, None]  # [T, 1, 1]: the same bound for every channel
    res["cliff_gva2_T150"] = chunk_case(gen, B=1, T=150, H=1, HV=2, K=64, V=64, l2=True, h0=True, decay=cliff)
    # log-decays near the whole-chunk bound over varlen chunks (whole-chunk and diagonal-dot launches)
    res["varlen_decay3.75"] = chunk_case(gen, B=1, T=150, H=2, HV=2, K=64, V=64, l2=True, h0=True,
                                         cu=[0, 1, 16, 80, 150], decay=3.75)
    # log-decays uniform in [-20, 0): beyond the diagonal-block dot's bound, within the 8-row halves' for most
    # chunks (DIAG 4), exact for the rest
    res["half_blocks_decay20_gva2_T150"] = chunk_case(gen, B=1, T=150, H=1, HV=2, K=64, V=64, l2=True, h0=True,
                                                      decay=20.0)
    res["T1"] = chunk_case(gen, B=2, T=1, H=1, HV=1, K=64, V=64, l2=True, h0=True)
    res["gate_in_op_gva4_T70"] = gate_case(gen, B=1, T=70, H=1, HV=4, K=64, V=64, recompute=True)
    res["gate_lower_bound_varlen_gva2_T70"] = gate_case(gen, B=1, T=70, H=1, HV=2, K=64, V=64, lower_bound=-5.0,
                                                        cu=[0, 5, 70])
    # no A_log (exp(A_log) read as 1) and a padded head dim (K=32 runs at 64: the padded channels' g is 0)
    res["gate_lower_bound_no_A_log_K32_T40"] = gate_case(gen, B=2, T=40, H=1, HV=1, K=32, V=16, lower_bound=-3.0,
                                                         A_log=False)
    # float16 with 90% of the raw gate saturated (fla's test_chunk_varlen mask_p 0.9): float32 intermediates
    # (`kda._numerics`; with float16 ones dt_bias's gradient was 3.6e-3 off here, 1.6e-2 on an H100 with tf32 dots)
    res["gate_fp16_saturated_varlen_T150"] = gate_case(gen, B=1, T=150, H=1, HV=2, K=64, V=64, cu=[0, 60, 150],
                                                       dtype=torch.float16, saturated=0.9)
    res["gate_strong_decay_K48_no_dt_bias_T70"] = gate_case(gen, B=1, T=70, H=1, HV=2, K=48, V=48, dt_bias=False,
                                                            strong=True)
    # the largest head dims; float32 there runs at chunk size 32 (kda._chunk_size), so three chunks at T=70
    res["K256_V256_T70"] = chunk_case(gen, B=1, T=70, H=1, HV=1, K=256, V=256, l2=True, h0=True)
    # 16-bit inputs: bf16 keeps W, U, states, Vn, Qg, Kd, P in 16 bits with 16-bit dot operands in the recurrences
    # and the backward (it runs with the interpreter's bf16 fixed, interp_patches.py); fp16 keeps them in float32
    # (`kda._numerics`)
    res["bf16_varlen_gva2_T150"] = chunk_case(gen, B=1, T=150, H=1, HV=2, K=64, V=64, l2=True, h0=True,
                                              cu=[0, 15, 150], dtype=torch.bfloat16)
    res["fp16_varlen_gva2_T150"] = chunk_case(gen, B=1, T=150, H=1, HV=2, K=64, V=64, l2=True, h0=True,
                                              cu=[0, 15, 150], dtype=torch.float16)
    res["gate_bf16_varlen_gva2_T70"] = gate_case(gen, B=1, T=70, H=1, HV=2, K=64, V=64, cu=[0, 15, 70],
                                                 dtype=torch.bfloat16)
    res["decode"] = decode_case(gen, N=3, P=6, H=1, HV=2, K=64, V=64)
    # head dims off the native 64/128/256: the chunk ops run zero-padded (a zero log-decay on the padded key
    # channels), the decode step masked
    res["K48_V48_gva2_T70"] = chunk_case(gen, B=1, T=70, H=1, HV=2, K=48, V=48, l2=True, h0=True)
    res["K96_V192_T70"] = chunk_case(gen, B=1, T=70, H=1, HV=1, K=96, V=192, l2=True, h0=True)
    res["K32_V16_varlen_T70"] = chunk_case(gen, B=1, T=70, H=1, HV=1, K=32, V=16, l2=False, h0=True, cu=[0, 5, 70])
    for K, V in ODD_DIMS:
        res[f"decode_K{K}_V{V}"] = decode_case(gen, N=2, P=4, H=1, HV=2, K=K, V=V)
    # recompute=True: only the inputs kept, the same outputs and gradients bit for bit (2 sequences, 3 chunks)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    xs = [r(1, 150, 1, 64), r(1, 150, 1, 64), r(1, 150, 2, 64), -1.5 * torch.rand(1, 150, 2, 64, generator=gen),
          2.0 * torch.rand(1, 150, 2, generator=gen), r(2, 2, 64, 64)]
    res["recompute_varlen"] = recompute_case(chunk_kda, xs, gen, cu_seqlens=torch.tensor([0, 40, 150],
                                                                                         dtype=torch.int32),
                                             use_qk_l2norm=True)
    res["recompute_frees_early"] = frees_early_case(xs)
    res["launch_marks"] = marks_case(gen)
    # o.sum() + ht.sum(): both gradients reach the backward as expanded (stride-0) tensors
    xs = [r(1, 65, 1, 64), r(1, 65, 1, 64), r(1, 65, 2, 64), -1.5 * torch.rand(1, 65, 2, 64, generator=gen),
          2.0 * torch.rand(1, 65, 2, generator=gen), r(1, 2, 64, 64)]
    res["expanded_grads_T65"] = sums_case(chunk_kda, kda, xs)
    print("RESULT " + json.dumps(res))
    return 0


def marks_case(gen) -> dict:
    """The marks that route each chunk to one launch (`kda_decay._diag_pass`): four chunks of
    constant log-decay 0.5, 4, 12 and 30 a step (|b_i - b_m| over 32 rows: 16, 128, 384, 960; over 8 rows within a
    16-row block: 4, 32, 96, 240; over 4 rows within an 8-row half: 2, 16, 48, 120). The prep and the backward
    (launches 3, 1, 4, 2), after both backward kernels: 0 (whole chunk), 2 (diagonal blocks by dot), 3 (by 8-row
    halves), 1 (exact)."""
    T, K = 256, 64
    g = torch.cat([torch.full((1, 64, 1, K), -d) for d in (0.5, 4.0, 12.0, 30.0)], 1)
    q, k, v = (torch.randn(1, T, 1, K, generator=gen).requires_grad_() for _ in range(3))
    beta = torch.rand(1, T, 1, generator=gen)
    bufs, make = [], _kda._redo

    def spy(*a):
        bufs.append(make(*a))
        return bufs[-1]

    _kda._redo = spy
    try:
        o, _ = chunk_kda(q, k, v, g=g, beta=beta, use_qk_l2norm=True)
        o.sum().backward()
    finally:
        _kda._redo = make
    return {"prep": bufs[0].flatten().tolist(), "bwd": bufs[1].flatten().tolist(), "buffers": len(bufs)}


def frees_early_case(xs) -> dict:
    """With recompute: how many of the rerun forward's W, Qg, Kd, P are alive when the chunk backward's launches
    start (weak references; `_bwd_warps` is evaluated just before them)."""
    import weakref

    fwd, warps = _kda.kda_chunk_fwd, _kda._bwd_warps
    refs, alive = [], []

    def fwd_spy(*a, **kw):
        out = fwd(*a, **kw)
        refs[:] = [weakref.ref(out[i]) for i in (3, 6, 7, 8)]  # [o, ht, T, W, h, Vn, Qg, Kd, P, bL]
        return out

    def warps_spy(dev):
        alive.append(sum(r() is not None for r in refs))
        return warps(dev)

    _kda.kda_chunk_fwd, _kda._bwd_warps = fwd_spy, warps_spy
    try:
        leaf = [x.clone().requires_grad_() for x in xs]
        o, _ = chunk_kda(*leaf[:3], g=leaf[3], beta=leaf[4], initial_state=leaf[5], use_qk_l2norm=True,
                         cu_seqlens=torch.tensor([0, 40, 150], dtype=torch.int32), recompute=True)
        o.sum().backward()
    finally:
        _kda.kda_chunk_fwd, _kda._bwd_warps = fwd, warps
    return {"refs": float(len(refs)), "alive_at_chunk_bwd": [float(a) for a in alive]}


if __name__ == "__main__":
    raise SystemExit(main())
