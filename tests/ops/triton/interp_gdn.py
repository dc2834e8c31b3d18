"""Cases for the Triton gated-delta-rule kernels, run in a child process under TRITON_INTERPRET=1 (CPU).

Run by tests/ops/test_triton_gdn.py (the variable must be set before triton decorates the kernels, so these
cases cannot share the pytest process with tests that import hybridlm.ops first). Prints one JSON line:
{case: {tensor: relative RMS error vs the float64 reference}} plus "unwritten" checks. Fresh random inputs
every run (seed printed). The interpreter's fixes (interp_patches.py) are applied before any kernel runs.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interp_patches import patch_interpreter  # noqa: E402

patch_interpreter()

import torch  # noqa: E402
from recompute_check import recompute_case  # noqa: E402

from hybridlm.ops import gated_delta_rule  # noqa: E402
from hybridlm.ops.triton import (  # noqa: E402
    chunk_bwd,
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule_update,
    state_pass,
)
from hybridlm.ops.triton import gdn as _gdn  # noqa: E402

_gdn.POISON = True  # kernel outputs start as NaN: an element a kernel forgets to write fails the comparison

F64 = torch.float64


def rel(a, b):
    a, b = a.to(F64), b.to(F64)
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def cliff_bounds(T: int) -> torch.Tensor:
    """[T, 1] bounds of a "decay cliff": in every chunk of 64 steps, log-decays down to -30 for 32 steps, then down
    to -0.05 for 32, so the later rows' exponents are small differences of a cumulative sum near -500."""
    return torch.where(torch.arange(T) % 64 < 32, 30.0, 0.05)[:, None]


def inputs(gen, B, T, H, HV, K, V, N, l2, dtype, decay=1.5, g_first=None):
    """decay: a number, or a [T, 1] tensor of per-step bounds; log-decays are uniform in [-decay, 0); g_first: the
    first step's log-decay, when given."""
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k = r(B, T, H, K), r(B, T, H, K)
    if not l2:  # keep ||k|| ~ 1 so the recurrence stays bounded without the in-kernel norm
        q, k = q / K**0.5, k / K**0.5
    v = r(B, T, HV, V)
    g = -decay * torch.rand(B, T, HV, generator=gen)  # log-decays in [-decay, 0)
    if g_first is not None:
        g[:, 0] = g_first
    beta = 2.0 * torch.rand(B, T, HV, generator=gen)  # up to 2
    h0 = r(N, HV, K, V)
    return [x.to(dtype) for x in (q, k, v, g, beta)] + [h0]


def run_case(gen, *, B, T, H, HV, K, V, l2, h0, cu=None, dtype=torch.float32, public=False, compiled=False,
             decay=1.5, g_first=None):
    N = B if cu is None else len(cu) - 1
    xs = inputs(gen, B, T, H, HV, K, V, N, l2, dtype, decay, g_first)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    leaf = [x.clone().requires_grad_() for x in xs]
    kw = dict(g=leaf[3], beta=leaf[4], initial_state=leaf[5] if h0 else None, output_final_state=True,
              cu_seqlens=cu_t, use_qk_l2norm=l2)
    if public:
        o, ht = gated_delta_rule(*leaf[:3], impl="triton", **kw)
    elif compiled:  # torch.compile traces through the custom ops (fake kernels), no graph break allowed
        fn = torch.compile(lambda q, k, v, kw: chunk_gated_delta_rule(q, k, v, **kw), backend="aot_eager",
                           fullgraph=True)
        o, ht = fn(*leaf[:3], kw)
    else:
        o, ht = chunk_gated_delta_rule(*leaf[:3], **kw)
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
    grads = torch.autograd.grad((o.float() * do).sum() + (ht * dht).sum(), leaf if h0 else leaf[:5])
    ref = [x.detach().to(F64).requires_grad_() for x in xs]
    kwr = dict(g=ref[3], beta=ref[4], initial_state=ref[5] if h0 else None, output_final_state=True,
               cu_seqlens=cu_t, use_qk_l2norm=l2)
    o2, ht2 = gated_delta_rule(*ref[:3], impl="chunk", **kwr)
    grads2 = torch.autograd.grad((o2 * do.to(F64)).sum() + (ht2 * dht.to(F64)).sum(), ref if h0 else ref[:5])
    out = {"o": rel(o, o2), "final_state": rel(ht, ht2)}
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], grads, grads2):
        out[name] = rel(a, b)
    out["o_dtype_ok"] = float(o.dtype == dtype)
    return out


def bt_case(gen, bt: int, **kw):
    """run_case with the chunk size forced to bt (gdn._bt_for), as when the 64-token kernels do not fit a device."""
    saved = _gdn._bt_for
    _gdn._bt_for = lambda K, V, dtype, save: bt
    try:
        return run_case(gen, **kw)
    finally:
        _gdn._bt_for = saved


def no_grad_case(gen, *, B, T, H, HV, K, V):
    """Inference (no autograd: the kernels keep no intermediates), with an initial and a final state."""
    xs = inputs(gen, B, T, H, HV, K, V, B, True, torch.float32)
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule(*xs[:3], g=xs[3], beta=xs[4], initial_state=xs[5], output_final_state=True,
                                       use_qk_l2norm=True)
        d = [x.to(F64) for x in xs]
        o2, ht2 = gated_delta_rule(*d[:3], g=d[3], beta=d[4], initial_state=d[5], output_final_state=True,
                                   use_qk_l2norm=True, impl="naive")
    return {"o": rel(o, o2), "final_state": rel(ht, ht2)}


def decode_case(gen, *, N, P, H, HV, K, V, l2):
    idx = torch.randperm(P, generator=gen)[:N].to(torch.int32)
    q, k = torch.randn(N, H, K, generator=gen), torch.randn(N, H, K, generator=gen)
    v = torch.randn(N, HV, V, generator=gen)
    g = -1.5 * torch.rand(N, HV, generator=gen)
    beta = 2.0 * torch.rand(N, HV, generator=gen)
    pool = torch.randn(P, HV, K, V, generator=gen)
    pool0 = pool.clone()
    o = fused_recurrent_gated_delta_rule_update(q, k, v, g=g, beta=beta, state_pool=pool, state_indices=idx,
                                                use_qk_l2norm=l2)
    # reference: one token of the float64 recurrence per sequence, from its slot
    o2, s2 = _decode_ref(q, k, v, g, beta, pool0, idx, l2)
    untouched = torch.ones(P, dtype=torch.bool)
    untouched[idx.long()] = False
    return {"o": rel(o, o2), "state": rel(pool[idx.long()], s2),
            "others_unchanged": float(torch.equal(pool[untouched], pool0[untouched]))}


def _decode_ref(q, k, v, g, beta, pool0, idx, l2):
    outs, states = [], []
    for n in range(q.shape[0]):
        s0 = pool0[idx[n].long()].to(F64).unsqueeze(0)
        o, s = gated_delta_rule(q[n:n + 1, None].to(F64), k[n:n + 1, None].to(F64), v[n:n + 1, None].to(F64),
                                g=g[n:n + 1, None].to(F64), beta=beta[n:n + 1, None].to(F64), initial_state=s0,
                                output_final_state=True, use_qk_l2norm=l2, impl="naive")
        outs.append(o[0, 0])
        states.append(s[0])
    return torch.stack(outs), torch.stack(states)


def pool_prefill_case(gen, *, chunk=40, lengths=(70, 25, 90), rows=(4, 0, 2), H=1, HV=2, K=64, V=64) -> dict:
    """Chunked prefill through a state pool with impl="triton": each call packs the next `chunk` tokens of every
    unfinished sequence (varlen), reads its pool row and writes the final state back; against one float64 call
    per sequence from the same row."""
    P = max(rows) + 2
    seqs = [dict(q=torch.randn(1, n, H, K, generator=gen), k=torch.randn(1, n, H, K, generator=gen),
                 v=torch.randn(1, n, HV, V, generator=gen), g=-1.5 * torch.rand(1, n, HV, generator=gen),
                 beta=torch.rand(1, n, HV, generator=gen)) for n in lengths]
    pool0 = torch.randn(P, HV, K, V, generator=gen)
    pool = pool0.clone()
    outs = [[] for _ in lengths]
    for start in range(0, max(lengths), chunk):
        live = [i for i, n in enumerate(lengths) if n > start]
        lens = [min(chunk, lengths[i] - start) for i in live]
        part = {x: torch.cat([seqs[i][x][:, start:start + chunk] for i in live], dim=1) for x in seqs[0]}
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        idx = torch.tensor([rows[i] for i in live])
        o, _ = gated_delta_rule(part["q"], part["k"], part["v"], g=part["g"], beta=part["beta"], cu_seqlens=cu,
                                use_qk_l2norm=True, state_pool=pool, state_indices=idx, impl="triton")
        for i, s, n in zip(live, cu[:-1].tolist(), lens):
            outs[i].append(o[:, s:s + n])
    res = {"o": 0.0, "state": 0.0}
    for i, x in enumerate(seqs):
        o2, s2 = gated_delta_rule(*(x[n].to(F64) for n in "qkv"), g=x["g"].to(F64), beta=x["beta"].to(F64),
                                  initial_state=pool0[rows[i]:rows[i] + 1].to(F64), output_final_state=True,
                                  use_qk_l2norm=True, impl="naive")
        res["o"] = max(res["o"], rel(torch.cat(outs[i], dim=1), o2))
        res["state"] = max(res["state"], rel(pool[rows[i]], s2[0]))
    others = [r for r in range(P) if r not in rows]
    res["others_unchanged"] = float(torch.equal(pool[others], pool0[others]))
    return res


ODD_DIMS = ((48, 48), (96, 192), (32, 16))


def sums_case(op, ref_op, xs) -> dict:
    """Gradients of o.sum() + final_state.sum() (both arrive at the backward expanded, stride 0) of the kernel op
    against ref_op(..., impl="chunk") in float64; xs = [q, k, v, g, beta, h0] (fp32)."""
    def grads(fn, xs, **kw):
        leaf = [x.clone().requires_grad_() for x in xs]
        o, ht = fn(*leaf[:3], g=leaf[3], beta=leaf[4], initial_state=leaf[5], output_final_state=True,
                   use_qk_l2norm=True, **kw)
        (o.sum() + ht.sum()).backward()
        return [o, ht] + [x.grad for x in leaf]

    a = grads(op, xs)
    b = grads(ref_op, [x.to(F64) for x in xs], impl="chunk")
    names = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    return {n: rel(x, y) for n, x, y in zip(names, a, b)}


def main() -> int:
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    res = {"seed": seed}
    res["gva2_l2_h0_T70"] = run_case(gen, B=2, T=70, H=1, HV=2, K=64, V=64, l2=True, h0=True)
    res["varlen_1_15_64_70"] = run_case(gen, B=1, T=150, H=2, HV=2, K=64, V=64, l2=False, h0=True,
                                        cu=[0, 1, 16, 80, 150])
    res["gva4_K64_V128_T65_public"] = run_case(gen, B=1, T=65, H=1, HV=4, K=64, V=128, l2=True, h0=False,
                                               public=True)
    res["K256_V256_T70"] = run_case(gen, B=1, T=70, H=1, HV=1, K=256, V=256, l2=True, h0=True)  # largest head dims
    res["compiled_T70"] = run_case(gen, B=1, T=70, H=1, HV=2, K=64, V=64, l2=True, h0=True, compiled=True)
    res["no_grad_prefill"] = no_grad_case(gen, B=2, T=70, H=1, HV=2, K=64, V=64)
    res["T1"] = run_case(gen, B=2, T=1, H=1, HV=1, K=64, V=64, l2=True, h0=True)
    # log-decays down to -30 a step: every exponent must keep its own precision, not |b|'s (`_cum_split`)
    res["decay30_gva2_T130"] = run_case(gen, B=1, T=130, H=1, HV=2, K=64, V=64, l2=True, h0=True, decay=30.0)
    # a decay cliff: in every chunk 32 steps of log-decay down to -30, then 32 of at most -0.05, so the later rows'
    # exponents are small differences of a cumulative sum near -500 (o was off by 3-5e-5 and dg by up to 7e-5
    # before `_cum_split` and `_dg_rows`; now ~2e-7 and ~4e-7)
    res["decay_cliff_gva2_T130"] = run_case(gen, B=1, T=130, H=1, HV=2, K=64, V=64, l2=True, h0=True,
                                            decay=cliff_bounds(130))
    # bf16 inputs, the GPU's default path (bf16 intermediates, bf16 dot operands), with the interpreter's bf16 fixed
    # (interp_patches.py)
    res["bf16_varlen_gva2_T150"] = run_case(gen, B=1, T=150, H=1, HV=2, K=64, V=64, l2=True, h0=True,
                                            cu=[0, 15, 150], dtype=torch.bfloat16)
    res["bf16_decay30_gva2_T130"] = run_case(gen, B=1, T=130, H=1, HV=2, K=64, V=64, l2=True, h0=True,
                                             dtype=torch.bfloat16, decay=30.0)
    # fp16 inputs: the 16-bit path (intermediates stored in fp16, 16-bit dot operands, dKK parked in fp16)
    res["fp16_varlen_gva2_T150"] = run_case(gen, B=1, T=150, H=1, HV=2, K=64, V=64, l2=True, h0=True,
                                            cu=[0, 15, 150], dtype=torch.float16)
    # fp16 after a strong first decay: e^{g_0} = 1.4e-11 is under fp16's range; W and dO diag(qs) are kept divided
    # by the chunk's scale (`chunk_jit._chunk_scale`; without it dh0 rounded to zero, rel 1.0), in both sequences
    res["fp16_strong_first_decay"] = run_case(gen, B=2, T=100, H=1, HV=2, K=64, V=64, l2=True, h0=True,
                                              dtype=torch.float16, g_first=-25.0)
    # the chunk sizes 32 and 16 (`_kkt_solve`'s two- and one-block forms), taken when the 64-token kernels do not fit
    for bt in (32, 16):
        res[f"bt{bt}_gva2_varlen"] = bt_case(gen, bt, B=1, T=100, H=1, HV=2, K=64, V=64, l2=True, h0=True,
                                             cu=[0, 1, 40, 100])
    res["decode"] = decode_case(gen, N=3, P=6, H=1, HV=2, K=64, V=64, l2=True)
    res["pool_prefill"] = pool_prefill_case(gen)
    # head dims off the native 64/128/256: the chunk ops run zero-padded, the decode step masked (OLMo-Hybrid's
    # K 96 / V 192, the cpu-tiny preset's 48, and dims below 64)
    res["K48_V48_gva2_T70"] = run_case(gen, B=1, T=70, H=1, HV=2, K=48, V=48, l2=True, h0=True)
    res["K96_V192_T70"] = run_case(gen, B=1, T=70, H=1, HV=1, K=96, V=192, l2=True, h0=True)
    res["K32_V16_varlen_T70"] = run_case(gen, B=1, T=70, H=1, HV=1, K=32, V=16, l2=False, h0=True, cu=[0, 5, 70])
    for K, V in ODD_DIMS:
        res[f"decode_K{K}_V{V}"] = decode_case(gen, N=2, P=4, H=1, HV=2, K=K, V=V, l2=True)
    # o.sum() + ht.sum(): both gradients reach the backward as expanded (stride-0) tensors
    res["expanded_grads_T65"] = sums_case(chunk_gated_delta_rule, gated_delta_rule,
                                          inputs(gen, 1, 65, 1, 2, 64, 64, 1, True, torch.float32))
    # recompute=True: only the inputs kept, the same outputs and gradients bit for bit (2 sequences, 3 chunks)
    res["recompute_varlen"] = recompute_case(chunk_gated_delta_rule, inputs(gen, 1, 150, 1, 2, 64, 64, 2, True,
                                                                            torch.float32), gen,
                                             cu_seqlens=torch.tensor([0, 40, 150], dtype=torch.int32),
                                             use_qk_l2norm=True)
    res["recompute_frees_early"] = frees_early_case(gen)
    res["t16_same_bits"] = t16_same_bits_case(gen)
    res["state_grads_freed"] = state_grads_freed_case(gen)
    print("RESULT " + json.dumps(res))
    return 0


def t16_same_bits_case(gen) -> dict:
    """fp16 inputs (GVA 2, varlen, l2norm, initial state): the forward keeps T in 16 bits (`gdn._t_dtype`), and
    outputs, final state and every gradient equal bit for bit those of a run that keeps T in fp32 (every dot that
    reads T rounds it to 16 bits first). Returns the kept T's dtype and the largest absolute difference."""
    xs = inputs(gen, 1, 150, 1, 2, 64, 64, 2, True, torch.float16)
    cu = torch.tensor([0, 15, 150], dtype=torch.int32)
    do = torch.randn(1, 150, 2, 64, generator=gen).half()
    dht = torch.randn(2, 2, 64, 64, generator=gen)
    fwd, t_dtype, kept = _gdn._fwd_impl, _gdn._t_dtype, []

    def fwd_spy(*a, **kw):
        out = fwd(*a, **kw)
        kept.append(out[2].dtype)
        return out

    def run():
        leaf = [x.clone().requires_grad_() for x in xs]
        o, ht = chunk_gated_delta_rule(*leaf[:3], g=leaf[3], beta=leaf[4], initial_state=leaf[5],
                                       output_final_state=True, cu_seqlens=cu, use_qk_l2norm=True)
        grads = torch.autograd.grad((o.float() * do.float()).sum() + (ht * dht).sum(), leaf)
        return [o, ht, *grads]

    _gdn._fwd_impl = fwd_spy
    try:
        a = run()
        _gdn._t_dtype = lambda sd: torch.float32
        b = run()
    finally:
        _gdn._fwd_impl, _gdn._t_dtype = fwd, t_dtype
    diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))
    return {"kept_16bit": float(kept[0] == torch.float16), "kept_fp32_then": float(kept[1] == torch.float32),
            "max_abs_diff": diff}


class _Spy:
    """Stands in for a kernel: `on_launch(args)` sees each launch's arguments, then the kernel runs."""

    def __init__(self, fn, on_launch):
        self.fn, self.on_launch = fn, on_launch

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.on_launch(args)
            return self.fn[grid](*args, **kw)

        return launch


def state_grads_freed_case(gen) -> dict:
    """The K-blocked chunk backward frees dS and dVn (made for `_recur_bwd`) before its second launch, which alone
    writes dq: how many of the two are alive (weak references) when `_chunk_bwd_out_blk` is launched, and whether dq
    exists only from then on (it is the launch's seventh argument)."""
    import weakref

    refs, seen = [], {}
    recur, out = state_pass._recur_bwd, chunk_bwd._chunk_bwd_out_blk
    state_pass._recur_bwd = _Spy(recur, lambda a: refs.extend(weakref.ref(a[i]) for i in (8, 9)))  # dhb, dvn
    chunk_bwd._chunk_bwd_out_blk = _Spy(out, lambda a: seen.update(alive=sum(r() is not None for r in refs),
                                                                    dq_shape=tuple(a[6].shape)))
    try:
        xs = inputs(gen, 1, 130, 1, 2, 64, 64, 1, True, torch.float32)
        leaf = [x.clone().requires_grad_() for x in xs]
        o, _ = chunk_gated_delta_rule(*leaf[:3], g=leaf[3], beta=leaf[4], initial_state=leaf[5], use_qk_l2norm=True)
        o.sum().backward()
    finally:
        state_pass._recur_bwd, chunk_bwd._chunk_bwd_out_blk = recur, out
    return {"alive_at_out_launch": float(seen["alive"]), "refs": float(len(refs)),
            "dq_ok": float(seen["dq_shape"] == (130, 2, 64))}


def frees_early_case(gen) -> dict:
    """How many of the forward's W and P are still alive when the chunk backward starts (weak references), with and
    without recompute."""
    import weakref

    fwd, bwd = _gdn._fwd_impl, _gdn._chunk_bwd
    refs, alive = [], {}

    def fwd_spy(*a, **kw):
        out = fwd(*a, **kw)
        if out[3].numel():  # the run that saves intermediates: W, P at 3, 6 of (o, ht, T, W, h, Vn, P)
            refs[:] = [weakref.ref(out[i]) for i in (3, 6)]
        return out

    def bwd_spy(*a, **kw):
        alive[mode] = sum(r() is not None for r in refs)
        return bwd(*a, **kw)

    _gdn._fwd_impl, _gdn._chunk_bwd = fwd_spy, bwd_spy
    try:
        xs = inputs(gen, 1, 130, 1, 2, 64, 64, 1, True, torch.float32)
        for mode in (False, True):
            leaf = [x.clone().requires_grad_() for x in xs]
            o, _ = chunk_gated_delta_rule(*leaf[:3], g=leaf[3], beta=leaf[4], initial_state=leaf[5],
                                          use_qk_l2norm=True, recompute=mode)
            o.sum().backward()
    finally:
        _gdn._fwd_impl, _gdn._chunk_bwd = fwd, bwd
    return {"alive_without": float(alive[False]), "alive_with": float(alive[True])}


if __name__ == "__main__":
    raise SystemExit(main())
