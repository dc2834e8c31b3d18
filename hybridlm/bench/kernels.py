"""Kernel benchmark: our Triton gated delta rule vs fla-core and PyTorch SDPA (causal, flash), on CUDA.

    python -m hybridlm.bench.kernels [--out DIR] [--shapes ...] [--no-fla]      (or: hybridlm bench kernels)

Median ms (triton.testing.do_bench, return_mode="median") of forward and forward+backward at
B4 T4096 H16 D128, B1 T32768 H32 D128, B8 T2048 H32 D128 and B4 T4096 H16 HV32 D128 (grouped value heads, no SDPA
row; bf16 q/k/v/beta, fp32 g, q/k l2norm in kernel),
one decode step of GDN and KDA on an fp32 state pool [N, 32, 128, 128] (N = 64 and 256 sequences, one token
each: `DECODE_ROWS`), and 4 draft tokens for 64 sequences (`DRAFT`), keeping every token's state, or writing the
pool at accepted counts or after the last token; the decode rows' GB/s count the fewest bytes (`bytes_decode`)
against the copy ceilings. KDA (chunk_kda against fla's) at the first shape (each of --shapes when given), on two
kinds of log-decays (`kda_bench_gates`): mild ones, where our kernels take one dot per chunk, and those of a freshly
initialised layer, where most chunks take the slower 16-row block path; fla does the same work on both.
Ceilings are measured in the same run: device-to-device copy bandwidth (bytes read + written) and a bf16
8192^3 matmul. TFLOP/s use a nominal flop count of the chunked algorithm (the same count for ours and fla,
see `flops_gdn`), forward+backward counted as 3x forward; SDPA uses 2*B*H*T^2*D (causal fwd), 3.5x for fwd+bwd.
fla 0.6.0 refuses its gated backward on Hopper with Triton < 3.7.1 (its #640); it is timed with that guard lifted
(`fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True`), as the table says. fla's autotune keys leave out B and T, so
its tuned configs are cleared before each chunked shape (`--no-fla-retune` keeps them: then a shape inherits the
choice made at an earlier shape with the same heads). --gpu-time adds each call's GPU time (its kernels' time,
side-by-side kernels counted once), ours and fla's: fla's host work per call (many small launches) shows in the
median ms at the smaller shapes and not there. `--parts prefill` (not in the default) times our forward as
impl="auto" takes it for inference (the Gluon forward on sm_90) against fla's at the few-heads prefill shapes
(`PREFILL_SHAPES`): median ms, CUDA-graph replay ms and (with --gpu-time) GPU time, fla/ours for each, and our
wall / GPU time (the host's share of a call). Writes kernels.json, kernels.md and kernels.png to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

from hybridlm.bench.cuda_profile import busy_ms, capture_graph, print_kernel_times
from hybridlm.files import atomic_write_text

SHAPES = [(4, 4096, 16, 128), (1, 32768, 32, 128), (8, 2048, 32, 128)]
GVA_SHAPES = [(4, 4096, 16, 128, 32)]  # B, T, H, D, HV: grouped value heads (Qwen3.5's 16 key heads to 32 value heads)
# one long prompt with few heads per GPU (tensor parallelism): where the Gluon forward's grid is small
PREFILL_SHAPES = [(1, 32768, 8, 128), (2, 16384, 8, 128), (1, 8192, 16, 128), (1, 4096, 16, 128),
                  (4, 4096, 16, 128)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench_out", help="folder for kernels.json / kernels.md / kernels.png")
    parser.add_argument("--no-fla", action="store_true", help="skip fla-core even if installed")
    parser.add_argument("--no-sdpa", action="store_true", help="skip the PyTorch SDPA (FlashAttention) rows")
    parser.add_argument("--rep", type=int, default=200, help="do_bench rep (ms of repeats)")
    parser.add_argument("--quick", action="store_true", help="first shape only")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="B,T,H,D[,HV]",
                        help="chunked shapes to run instead of the benchmark shapes (e.g. 1,32768,32,128; HV: value "
                        "heads, a multiple of H, default H)")
    parser.add_argument("--parts", default="decode,gdn,kda",
                        help="comma-separated rows to run, in this order: decode (one-token step, and 4 draft tokens "
                        "at N 64: every state kept, at accepted counts, the last), kda (first shape, or --shapes), "
                        "gdn (the chunked shapes), prefill (our inference forward as impl='auto' takes it against "
                        "fla's at the few-heads prefill shapes; not in the default)")
    parser.add_argument("--kda-gates", default="bench,init",
                        help="comma-separated KDA rows by log-decays: bench (logsigmoid(N(0,1) + 3), about -0.05 a "
                        "step: every chunk within the whole-chunk dot) and init (those of a freshly initialised "
                        "KDA layer, about -5.5 a step: most chunks through the 16-row blocks); see kda_bench_gates")
    parser.add_argument("--profile", action="store_true",
                        help="per-kernel CUDA times: ours and fla's GDN at the first shape, ours at each KDA row")
    parser.add_argument("--no-fla-retune", action="store_true",
                        help="keep fla's tuned launch configs from one chunked shape to the next (its autotune keys "
                        "leave out B and T, so a later shape with the same heads reuses an earlier shape's choice; "
                        "by default they are cleared before each shape, as running that shape alone would have it)")
    parser.add_argument("--gpu-time", action="store_true",
                        help="also each call's GPU time (its kernels' time, side-by-side ones once; torch profiler, "
                        "5 calls), ours and fla's, GDN and KDA rows: what the kernels take without the host's launch "
                        "overhead")
    parser.add_argument("--tune-json", default=None,
                        help="launch settings from scripts/gpu_tune.py --json (its 'best'); default: built-in")


def _shapes(args) -> list[tuple[int, int, int, int, int]]:
    """The chunked shapes of this run as (B, T, H, D, HV): --shapes, else the first benchmark shape with --quick,
    else the three and the grouped-value-head one."""
    if args.shapes:
        out = []
        for spec in args.shapes:
            parts = spec.split(",")
            if len(parts) not in (4, 5) or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise SystemExit(f"--shapes: expected B,T,H,D or B,T,H,D,HV with positive integers, got {spec!r}")
            B, T, H, D, *hv = (int(p) for p in parts)
            HV = hv[0] if hv else H
            if HV % H:
                raise SystemExit(f"--shapes: expected HV a multiple of H, got H={H} HV={HV} in {spec!r}")
            out.append((B, T, H, D, HV))
        return out
    return [(*s, s[2]) for s in SHAPES[:1]] if args.quick else [(*s, s[2]) for s in SHAPES] + GVA_SHAPES


def _kda_shapes(args) -> list[tuple[int, int, int, int]]:
    """The KDA rows' (B, T, H, D): those of --shapes without grouped value heads, else the first benchmark shape
    alone (fla's chunk_kda autotunes for minutes on each new shape)."""
    if args.shapes:
        return [(B, T, H, D) for B, T, H, D, HV in _shapes(args) if HV == H]
    return [SHAPES[0]]


def _bench(fn, rep):
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def flops_gdn(B, T, H, K, V, BT=64):
    """Nominal matmul flops of one chunked GDN forward (per chunk of BT: K K^T, the triangular solve ~BT^3/3,
    W and U, W S, Q K^T, Q S, P Vn, K^T Vn); H: the value heads (each has its own chunk products)."""
    nc = B * H * math.ceil(T / BT)
    per = 2 * BT * BT * K + 2 * BT**3 / 3 + 2 * BT * BT * K + 2 * BT * BT * V
    per += 2 * BT * K * V + 2 * BT * BT * K + 2 * BT * K * V + 2 * BT * BT * V + 2 * BT * K * V
    return nc * per


def bytes_gdn_fwd(B, T, H, K, V, elt=2, HV=None):
    """Fewest bytes of a forward: q, k (H heads), v, beta read (elt bytes), g read (fp32), o written (HV heads)."""
    HV = H if HV is None else HV
    return B * T * (2 * H * K * elt + HV * (V * elt + elt + 4 + V * elt))


def ceilings(dev):
    x = torch.empty(1 << 28, dtype=torch.float32, device=dev).normal_()  # 1 GiB
    y = torch.empty_like(x)
    t = _bench(lambda: y.copy_(x), 200)
    copy_gbs = 2 * x.numel() * 4 / (t * 1e-3) / 1e9
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    t = _bench(lambda: a @ b, 200)
    mm_tflops = 2 * n**3 / (t * 1e-3) / 1e12
    return copy_gbs, mm_tflops


def _profile_once(args, part: str, fn) -> bool:
    """With --profile, print the per-kernel CUDA times of 3 calls of fn (after one warm-up), once per part (the
    first shape of GDN, each KDA row); True when it printed."""
    done = getattr(args, "_profiled", set())
    if not getattr(args, "profile", False) or part in done:
        return False
    args._profiled = done | {part}
    print_kernel_times(part, fn)
    return True


def _fla_retune() -> int:
    """Clear the tuned-config caches of every Triton autotuner in the loaded fla modules, so each is tuned again at
    its next call; returns how many it cleared."""
    from triton.runtime.autotuner import Autotuner

    seen, n = set(), 0
    for name, mod in list(sys.modules.items()):
        if not (name == "fla" or name.startswith("fla.")) or mod is None:
            continue
        for obj in list(vars(mod).values()):
            for _ in range(4):  # @triton.heuristics (and the like) wrap the autotuner: follow .fn
                if isinstance(obj, Autotuner) and id(obj) not in seen:
                    seen.add(id(obj))
                    if obj.cache:
                        obj.cache.clear()
                        n += 1
                obj = getattr(obj, "fn", None)
                if obj is None:
                    break
    return n


def _gpu_ms(fn, steps: int = 5) -> float:
    """GPU time of fn's kernels per call (ms; `busy_ms`: side-by-side kernels count once), after a warm-up call."""
    return busy_ms(fn, steps)


def _gpu_times(res: dict, who: str, f, fb, args) -> None:
    """With --gpu-time: res[who_fwd_gpu_ms], res[who_fwdbwd_gpu_ms] (fb: None when that pass failed)."""
    if not getattr(args, "gpu_time", False):
        return
    with torch.no_grad():
        res[f"{who}_fwd_gpu_ms"] = _gpu_ms(f)
    if fb is not None:
        res[f"{who}_fwdbwd_gpu_ms"] = _gpu_ms(fb)


def _gluon_fwd_times(res: dict, q, k, v, g, beta, ours_f, args) -> None:
    """On sm_90 with Gluon: res["gluon_fwd_ms"] of the Gluon GDN forward through the public op
    (gated_delta_rule(..., impl="gluon") under torch.no_grad, what impl="auto" runs for inference there, host checks
    included) and res["gluon_vs_ours_rel"], its relative difference from our Triton forward; an error is recorded as
    res["gluon_error"]."""
    from hybridlm.ops import gated_delta_rule
    from hybridlm.ops.gluon import gdn_fwd

    if not gdn_fwd.gluon_available() or torch.cuda.get_device_capability() != (9, 0):
        return
    f = lambda: gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm=True, impl="gluon")[0]  # noqa: E731
    try:
        with torch.no_grad():
            res["gluon_fwd_ms"] = _bench(f, args.rep)
            a, b = f().float(), ours_f().float()
        res["gluon_vs_ours_rel"] = ((a - b).norm() / b.norm()).item()
        _gpu_times(res, "gluon", f, None, args)
    except Exception as e:  # noqa: BLE001
        res["gluon_error"] = repr(e)[:200]


def _bench_shape(B, T, H, D, dev, gen, fla, args, HV=None):
    """One chunked shape: q, k [B, T, H, D]; v, do [B, T, HV, D]; g, beta [B, T, HV] (HV defaults to H)."""
    from hybridlm.ops.triton import chunk_gated_delta_rule

    HV = H if HV is None else HV
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)
    q, k = (r(B, T, H, D).to(torch.bfloat16) for _ in range(2))
    v = r(B, T, HV, D).to(torch.bfloat16)
    g = F.logsigmoid(r(B, T, HV) + 3.0)
    beta = torch.sigmoid(r(B, T, HV)).to(torch.bfloat16)
    do = r(B, T, HV, D).to(torch.bfloat16)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    fl = flops_gdn(B, T, HV, D, D)
    by = bytes_gdn_fwd(B, T, H, D, D, HV=HV)

    def ours_f():
        return chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm=True)[0]

    def ours_fb():
        o = chunk_gated_delta_rule(*leaves[:3], g=leaves[3], beta=leaves[4], use_qk_l2norm=True)[0]
        return torch.autograd.grad(o, leaves, do)

    res = {"shape": f"B{B} T{T} H{H} D{D}" + (f" HV{HV}" if HV != H else ""), "flops_fwd": fl, "bytes_fwd": by}
    if _profile_once(args, "gdn", ours_fb):
        from hybridlm.ops.triton import gdn

        print("chunk sizes in use:", {str(k): v for k, v in gdn._BT_OK.items()}, flush=True)
    with torch.no_grad():
        res["ours_fwd_ms"] = _bench(ours_f, args.rep)
    res["ours_fwdbwd_ms"] = _bench(ours_fb, args.rep)
    _gluon_fwd_times(res, q, k, v, g, beta, ours_f, args)
    _gpu_times(res, "ours", ours_f, ours_fb, args)
    if fla is not None:
        if not getattr(args, "no_fla_retune", False):
            res["fla_autotuners_cleared"] = _fla_retune()

        def fla_f():
            return fla[0](q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]

        def fla_fb():
            o = fla[0](*leaves[:3], g=leaves[3], beta=leaves[4], use_qk_l2norm_in_kernel=True)[0]
            return torch.autograd.grad(o, leaves, do)

        try:
            with torch.no_grad():
                res["fla_fwd_ms"] = _bench(fla_f, args.rep)
            res["fla_fwdbwd_ms"] = _bench(fla_fb, args.rep)
        except Exception as e:  # noqa: BLE001  (e.g. a layout this fla does not take)
            res["fla_fwdbwd_error"] = repr(e)[:200]
        if "fla_fwd_ms" in res:
            _gpu_times(res, "fla", fla_f, fla_fb if "fla_fwdbwd_ms" in res else None, args)
            # same function? (bf16, so only a sanity check of the comparison, not the correctness test)
            with torch.no_grad():
                a, b = ours_f().float(), fla_f().float()
                res["ours_vs_fla_rel"] = ((a - b).norm() / b.norm()).item()
        if "fla_fwdbwd_ms" in res:
            _profile_once(args, "fla gdn", fla_fb)
    if not args.no_sdpa and HV == H:
        qs, ks, vs = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        ls = [x.clone().requires_grad_() for x in (qs, ks, vs)]
        dos = do.transpose(1, 2).contiguous()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            with torch.no_grad():
                res["sdpa_fwd_ms"] = _bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True),
                                            args.rep)
            res["sdpa_fwdbwd_ms"] = _bench(lambda: torch.autograd.grad(
                F.scaled_dot_product_attention(*ls, is_causal=True), ls, dos), args.rep)
        res["sdpa_flops_fwd"] = 2 * B * H * T * T * D
    return res


def _graph_ms(fn, rep) -> float:
    """Median ms of replaying a CUDA graph of fn (captured after warm-up calls): its GPU time plus one launch."""
    return _bench(capture_graph(fn).replay, rep)


def _bench_prefill(B, T, H, D, dev, gen, fla, args) -> dict:
    """Our forward as impl="auto" takes it under torch.no_grad (q/k l2norm; "impl" names the backend, the Gluon
    forward on sm_90) and fla's: median ms, graph replay ms (an error recorded as *_graph_error), GPU ms with
    --gpu-time, and fla's output against ours (relative norm of the difference)."""
    from hybridlm.ops import dispatch, gated_delta_rule

    r = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    q, k, v = (r(B, T, H, D).to(torch.bfloat16) for _ in range(3))
    g = F.logsigmoid(r(B, T, H) + 3.0)
    beta = torch.sigmoid(r(B, T, H)).to(torch.bfloat16)
    impl = dispatch.resolve_impl("gated_delta_rule", "auto", dev, q, v, needs_grad=False)
    row = {"prefill": True, "shape": f"B{B} T{T} H{H} D{D}", "impl": impl}
    calls = {"ours": lambda: gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm=True, impl="auto")[0]}
    if fla is not None:
        if not getattr(args, "no_fla_retune", False):
            _fla_retune()
        calls["fla"] = lambda: fla[0](q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    with torch.no_grad():
        for who, f in calls.items():
            row[f"{who}_ms"] = _bench(f, args.rep)
            try:
                row[f"{who}_graph_ms"] = _graph_ms(f, args.rep)
            except Exception as e:  # noqa: BLE001
                row[f"{who}_graph_error"] = repr(e)[:200]
            if getattr(args, "gpu_time", False):
                row[f"{who}_gpu_ms"] = _gpu_ms(f)
        if "fla" in calls:
            a, b = calls["fla"]().float(), calls["ours"]().float()
            row["fla_vs_ours_rel"] = ((a - b).norm() / b.norm()).item()
    return row


KDA_GATES = ("bench", "init")


def op_inputs(op: str, B: int, T: int, H: int, D: int, gates: str = "bench", seed: int = 0,
              device="cuda") -> list[torch.Tensor]:
    """[q, k, v, g, beta] for the GDN ("gdn") or KDA op at [B, T, H, D], bf16-representable fp32 (g stays fp32):
    q, k, v ~ N(0, 1); GDN's g = logsigmoid(N(3, 1)) [B, T, H], KDA's `kda_bench_gates(gates)` [B, T, H, D]; beta
    sigmoid(N(0, 1)) [B, T, H]. The tuner and the byte counter time the same inputs."""
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    q, k, v = (r(B, T, H, D).bfloat16().float() for _ in range(3))
    g = F.logsigmoid(r(B, T, H) + 3.0) if op == "gdn" else kda_bench_gates(gates, B, T, H, D, device, gen)
    beta = torch.sigmoid(r(B, T, H)).bfloat16().float()
    return [q, k, v, g, beta]


def kda_bench_gates(kind: str, B: int, T: int, H: int, D: int, device, gen: torch.Generator) -> torch.Tensor:
    """g [B, T, H, D] fp32 log-decays for the KDA rows. "bench": logsigmoid(N(0, 1) + 3), about -0.05 a step, so
    every chunk takes the kernels' whole-chunk dot. "init": as a freshly initialised `KimiDeltaAttention` makes
    them, -A softplus(f) with A ~ U(1, 16) per head (A_log's init) and f ~ N(0, 0.33) (its low-rank gate f_b(f_a(x))
    at x ~ N(0, 1), dt_bias 0): about -5.5 a step, so most chunks go through the 16-row blocks. fla's chunk_kda
    does the same work on either."""
    r = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    if kind == "bench":
        return F.logsigmoid(r(B, T, H, D) + 3.0)
    if kind == "init":
        A = 1.0 + 15.0 * torch.rand(1, 1, H, 1, device=device, generator=gen)
        return -A * F.softplus(0.33 * r(B, T, H, D))
    raise ValueError(f"kda gates: expected one of {', '.join(KDA_GATES)}, got {kind!r}")


def _bench_kda(B, T, H, D, dev, gen, args, gates="bench"):
    from hybridlm.ops.triton import chunk_kda

    r = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    q, k, v = (r(B, T, H, D).to(torch.bfloat16) for _ in range(3))
    g = kda_bench_gates(gates, B, T, H, D, dev, gen)
    beta = torch.sigmoid(r(B, T, H)).to(torch.bfloat16)
    do = r(B, T, H, D).to(torch.bfloat16)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    res = {"shape": f"KDA B{B} T{T} H{H} D{D}" + ("" if gates == "bench" else f" {gates} gates"), "kda": True,
           "gates": gates}

    def ours_fb():
        o = chunk_kda(*leaves[:3], g=leaves[3], beta=leaves[4], use_qk_l2norm=True)[0]
        return torch.autograd.grad(o, leaves, do)

    _profile_once(args, f"kda {gates}", ours_fb)
    def ours_f():
        return chunk_kda(q, k, v, g=g, beta=beta, use_qk_l2norm=True)

    with torch.no_grad():
        res["ours_fwd_ms"] = _bench(ours_f, args.rep)
    res["ours_fwdbwd_ms"] = _bench(ours_fb, args.rep)
    _gpu_times(res, "ours", ours_f, ours_fb, args)
    try:
        from fla.ops.kda import chunk_kda as fla_kda

        def fla_fb():
            o = fla_kda(*leaves[:3], leaves[3], leaves[4], use_qk_l2norm_in_kernel=True)[0]
            return torch.autograd.grad(o, leaves, do)

        with torch.no_grad():
            res["fla_fwd_ms"] = _bench(lambda: fla_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True), args.rep)
            a = chunk_kda(q, k, v, g=g, beta=beta, use_qk_l2norm=True)[0].float()
            b = fla_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0].float()
            res["ours_vs_fla_rel"] = ((a - b).norm() / b.norm()).item()
        res["fla_fwdbwd_ms"] = _bench(fla_fb, args.rep)
        _gpu_times(res, "fla", lambda: fla_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True), fla_fb, args)
    except Exception as e:  # noqa: BLE001
        res["fla_error"] = repr(e)[:200]
    return res


DECODE = (32, 128, 128)  # one-token decode rows: HV (= H), K, V; pool rows P = N
DECODE_ROWS = (("GDN", 256), ("GDN", 64), ("KDA", 64), ("KDA", 256))  # (op, N sequences)


def _bench_decode(dev, gen, fla, args) -> list[dict]:
    """One token for N sequences on an fp32 state pool [N, 32, 128, 128] (`DECODE`), in place at shuffled rows: GDN
    and KDA (a log-decay per key channel) at N 64 and 256 (`DECODE_ROWS`); fla's fused recurrences, which write the
    final state out of place, beside them where they load. GB/s count the fewest bytes (`bytes_decode`)."""
    return [_decode_row(op, N, dev, gen, fla, args) for op, N in DECODE_ROWS]


def _decode_row(op: str, N: int, dev, gen, fla, args) -> dict:
    from hybridlm.ops.triton import fused_recurrent_gated_delta_rule_update, fused_recurrent_kda_update

    HV, K, V = DECODE
    kda = op == "KDA"
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    pool = r(N, HV, K, V)
    idx = torch.randperm(N, device=dev, generator=gen).to(torch.int32)
    q, k, v = (r(N, HV, d).to(torch.bfloat16) for d in (K, K, V))
    g = F.logsigmoid((r(N, HV, K) if kda else r(N, HV)) + 3.0)
    beta = torch.sigmoid(r(N, HV)).to(torch.bfloat16)
    fn = fused_recurrent_kda_update if kda else fused_recurrent_gated_delta_rule_update
    row = {"shape": f"{op} decode N{N} pool [{N},{HV},{K},{V}] fp32",
           "bytes": bytes_decode(N, 1, HV, HV, K, V, written=N, channel=kda)}
    row["ours_ms"] = _bench(lambda: fn(q, k, v, g=g, beta=beta, state_pool=pool, state_indices=idx,
                                       use_qk_l2norm=True), args.rep)
    ref = None if fla is None else fla[2] if kda else fla[1]
    if ref is not None:
        h0 = r(N, HV, K, V)
        try:
            row["fla_ms"] = _bench(lambda: ref(q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None],
                                               initial_state=h0, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True), args.rep)
        except Exception as e:  # noqa: BLE001
            row["fla_error"] = repr(e)[:200]
    return row


DRAFT = (64, 4, 16, 32, 128, 128)  # multi-token decode rows: N, T, H, HV, K, V (Qwen3-Next's heads, 4 draft tokens)


def bytes_decode(N: int, T: int, H: int, HV: int, K: int, V: int, *, written: int, channel: bool = False,
                 elt: int = 2) -> int:
    """Fewest bytes of a decode call: N fp32 states read and `written` written; q, k, v, beta read and o written
    (elt bytes each), g read (fp32, KDA one per key channel); the int32 rows (and accepted counts) read."""
    state = HV * K * V * 4
    per_token = 2 * H * K * elt + 2 * HV * V * elt + HV * elt + HV * (K if channel else 1) * 4
    return (N + written) * state + N * T * per_token + 2 * N * 4


def _bench_decode_multi(dev, gen, fla, args) -> list[dict]:
    """T = 4 draft tokens for 64 sequences on an fp32 state pool [64, 32, 128, 128] (`DRAFT`), as speculative decoding
    runs it: every token's state kept in a buffer (GDN, KDA), the pool written at random accepted counts 1..4, and
    the last token's state written back (against fla's fused recurrence, which writes its final state out of place)."""
    from hybridlm.ops.triton import fused_recurrent_gated_delta_rule_update, fused_recurrent_kda_update

    N, T, H, HV, K, V = DRAFT
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    pool = r(N, HV, K, V)
    idx = torch.randperm(N, device=dev, generator=gen).to(torch.int32)
    q, k, v = (r(N, T, h, d).to(torch.bfloat16) for h, d in ((H, K), (H, K), (HV, V)))
    g, gk = F.logsigmoid(r(N, T, HV) + 3.0), F.logsigmoid(r(N, T, HV, K) + 3.0)
    beta = torch.sigmoid(r(N, T, HV)).to(torch.bfloat16)
    inter = torch.empty(N, T, HV, K, V, device=dev)
    acc = torch.randint(1, T + 1, (N,), device=dev, generator=gen, dtype=torch.int32)
    common = dict(beta=beta, state_pool=pool, state_indices=idx, use_qk_l2norm=True)
    name = f"N{N} T{T} H{H} HV{HV} K{K} V{V}"
    rows = []
    for label, fn, gate, kw, written in (
        ("GDN", fused_recurrent_gated_delta_rule_update, g, dict(intermediate_states=inter), N * T),
        ("KDA", fused_recurrent_kda_update, gk, dict(intermediate_states=inter), N * T),
        ("GDN", fused_recurrent_gated_delta_rule_update, g, dict(num_accepted=acc), N),
        ("GDN", fused_recurrent_gated_delta_rule_update, g, {}, N),
    ):
        mode = ("every state to a buffer" if "intermediate_states" in kw else
                "pool at accepted counts" if kw else "pool after the last token")
        row = {"shape": f"{label} decode {name}, {mode}",
               "bytes": bytes_decode(N, T, H, HV, K, V, written=written, channel=label == "KDA")}
        row["ours_ms"] = _bench(lambda: fn(q, k, v, g=gate, **common, **kw), args.rep)  # noqa: B023
        if fla is not None and not kw:
            h0 = r(N, HV, K, V)
            try:
                row["fla_ms"] = _bench(lambda: fla[1](q, k, v, g=g, beta=beta, initial_state=h0,  # noqa: B023
                                                      output_final_state=True, use_qk_l2norm_in_kernel=True),
                                       args.rep)
            except Exception as e:  # noqa: BLE001
                row["fla_error"] = repr(e)[:200]
        rows.append(row)
    return rows


def _rows_asked(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """--parts and --kda-gates as lists, checked before anything runs."""
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = set(parts) - {"decode", "kda", "gdn", "prefill"}
    if unknown:
        raise SystemExit(f"--parts: unknown {sorted(unknown)}; expected a subset of decode,kda,gdn,prefill")
    kda_gates = [x.strip() for x in args.kda_gates.split(",") if x.strip()]
    if not kda_gates or set(kda_gates) - set(KDA_GATES):
        raise SystemExit(f"--kda-gates: expected a subset of {','.join(KDA_GATES)}, got {args.kda_gates!r}")
    return parts, kda_gates


def run(args: argparse.Namespace) -> int:
    parts, kda_gates = _rows_asked(args)
    if not torch.cuda.is_available():
        print("hybridlm bench kernels: needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    dev = torch.device("cuda")
    os.makedirs(args.out, exist_ok=True)
    from hybridlm.ops.triton import gdn

    if args.tune_json:
        with open(args.tune_json) as f:
            gdn.TUNE.update(**json.load(f)["best"])  # names checked
    print("launch settings:", json.dumps(gdn.TUNE.as_dict()), flush=True)
    fla = None
    fla_version = None
    if not args.no_fla:
        try:
            import fla.ops.common.chunk_o as fla_chunk_o
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_rec

            fla_chunk_o.TRITON_ABOVE_3_7_1 = True  # lift fla 0.6.0's Hopper guard on its gated backward (#640)
            try:
                from fla.ops.kda import fused_recurrent_kda as fla_kda_rec
            except ImportError:
                fla_kda_rec = None
            fla = (fla_chunk, fla_rec, fla_kda_rec)
            from importlib.metadata import version

            fla_version = version("fla-core")
        except Exception as e:  # noqa: BLE001
            print(f"fla-core not usable: {e!r}", file=sys.stderr)
    copy_gbs, mm_tflops = ceilings(dev)
    info = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "fla_core": fla_version, "python": platform.python_version(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "copy_GBps": copy_gbs, "bf16_matmul_TFLOPs": mm_tflops,
        "fla_guard_lifted": fla is not None, "tune": gdn.TUNE.as_dict(),
    }
    print(f"{info['device']}: copy {copy_gbs:.0f} GB/s, bf16 matmul {mm_tflops:.0f} TFLOP/s", flush=True)
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for part in parts:  # in the order given; the default puts KDA last: fla's chunk_kda autotunes for minutes
        if part == "decode":
            for row in _bench_decode(dev, gen, fla, args) + _bench_decode_multi(dev, gen, fla, args):
                rows.append(row)
                print(json.dumps(row), flush=True)
        elif part == "prefill":
            for shape in PREFILL_SHAPES:
                rows.append(_bench_prefill(*shape, dev, gen, fla, args))
                print(json.dumps(rows[-1]), flush=True)
                torch.cuda.empty_cache()
        elif part == "kda":
            for shape in _kda_shapes(args):
                for gates in kda_gates:  # fla autotunes on a shape's first row only
                    try:
                        rows.append(_bench_kda(*shape, dev, gen, args, gates))
                    except Exception as e:  # noqa: BLE001
                        print(f"kda row {shape} ({gates} gates) skipped: {e!r}", file=sys.stderr)
                        continue
                    print(json.dumps(rows[-1]), flush=True)
                torch.cuda.empty_cache()
        else:
            for B, T, H, D, HV in _shapes(args):
                rows.append(_bench_shape(B, T, H, D, dev, gen, fla, args, HV=HV))
                print(json.dumps(rows[-1]), flush=True)
                torch.cuda.empty_cache()

    table = _table(info, rows)
    print(table)
    atomic_write_text(os.path.join(args.out, "kernels.json"), json.dumps({"info": info, "rows": rows}, indent=1))
    atomic_write_text(os.path.join(args.out, "kernels.md"), table + "\n")
    try:
        _plot(rows, os.path.join(args.out, "kernels.png"))
    except Exception as e:  # noqa: BLE001
        print(f"plot skipped: {e!r}", file=sys.stderr)
    return 0


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def _table(info, rows):
    cg, mm = info["copy_GBps"], info["bf16_matmul_TFLOPs"]
    lines = [
        f"device {info['device']}, torch {info['torch']}, triton {info['triton']}, fla-core {info['fla_core']}, "
        f"{info['date_utc']} UTC; ceilings measured here: copy {cg:.0f} GB/s, bf16 matmul {mm:.0f} TFLOP/s"
        + ("; fla gated backward timed with its Hopper guard lifted (TRITON_ABOVE_3_7_1 = True)"
           if info["fla_guard_lifted"] else ""),
        "",
        "| shape | pass | ours ms | fla ms | fla/ours | SDPA ms | ours TFLOP/s | ours GB/s (fwd min bytes) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("prefill"):
            continue
        if r.get("kda"):
            for mode, key in (("fwd", "fwd"), ("fwd+bwd", "fwdbwd")):
                o, fl = r.get(f"ours_{key}_ms"), r.get(f"fla_{key}_ms")
                if o is None:
                    continue
                ratio = None if fl is None else fl / o
                lines.append(f"| {r['shape']} | {mode} | {o:.3f} | {_fmt(fl)} | {_fmt(ratio, '.2f')} | - | - | - |")
        elif "ours_fwd_ms" in r:
            for mode, key, mult in (("fwd", "fwd", 1), ("fwd+bwd", "fwdbwd", 3)):
                o, fl, sd = r[f"ours_{key}_ms"], r.get(f"fla_{key}_ms"), r.get(f"sdpa_{key}_ms")
                tf = mult * r["flops_fwd"] / (o * 1e-3) / 1e12
                gbs = r["bytes_fwd"] / (o * 1e-3) / 1e9 if mode == "fwd" else None
                ratio = None if fl is None else fl / o
                lines.append(f"| {r['shape']} | {mode} | {o:.3f} | {_fmt(fl)} | {_fmt(ratio, '.2f')} | {_fmt(sd)} | "
                             f"{tf:.1f} ({100 * tf / mm:.0f}% of mm) | {_fmt(gbs, '.0f')} |")
        else:
            o, fl = r["ours_ms"], r.get("fla_ms")
            gbs = r["bytes"] / (o * 1e-3) / 1e9
            ratio = None if fl is None else fl / o
            lines.append(f"| {r['shape']} | decode | {o:.3f} | {_fmt(fl)} | {_fmt(ratio, '.2f')}"
                         f" | - | - | {gbs:.0f} ({100 * gbs / cg:.0f}% of copy) |")
    fused = [r for r in rows if any(key.startswith("gluon_") for key in r)]
    if fused:
        lines += ["", "Gluon GDN forward (sm_90; hybridlm.ops.gluon.gdn_fwd, what impl=\"auto\" runs for inference "
                  "there; timed as gated_delta_rule(..., impl=\"gluon\") under torch.no_grad):", "",
                  "| shape | ms | ours/it | fla/it | GPU ms | ours/it GPU | fla/it GPU | rel vs ours |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in fused:
            ms = r.get("gluon_fwd_ms")
            if ms is None:
                lines.append(f"| {r['shape']} | failed: {r.get('gluon_error', '-')} | | | | | | |")
                continue
            fl, gm = r.get("fla_fwd_ms"), r.get("gluon_fwd_gpu_ms")
            og, fg = r.get("ours_fwd_gpu_ms"), r.get("fla_fwd_gpu_ms")
            ratio = lambda x, y: None if x is None or y is None else x / y  # noqa: E731
            lines.append(f"| {r['shape']} | {ms:.3f} | {r['ours_fwd_ms'] / ms:.2f} | {_fmt(ratio(fl, ms), '.2f')} "
                         f"| {_fmt(gm)} | {_fmt(ratio(og, gm), '.2f')} | {_fmt(ratio(fg, gm), '.2f')} "
                         f"| {r['gluon_vs_ours_rel']:.1e} |")
    lines += _prefill_table([r for r in rows if r.get("prefill")])
    gpu = [r for r in rows if "ours_fwd_gpu_ms" in r]
    if gpu:
        lines += ["", "GPU time of the kernels per call (torch profiler, 5 calls; no host launch overhead):",
                  "", "| shape | pass | ours GPU ms | fla GPU ms | fla/ours |", "|---|---|---|---|---|"]
        for r in gpu:
            for mode, key in (("fwd", "fwd"), ("fwd+bwd", "fwdbwd")):
                o, fl = r[f"ours_{key}_gpu_ms"], r.get(f"fla_{key}_gpu_ms")
                lines.append(f"| {r['shape']} | {mode} | {o:.3f} | {_fmt(fl)} | "
                             f"{_fmt(None if fl is None else fl / o, '.2f')} |")
    return "\n".join(lines)


def _prefill_table(rows: list[dict]) -> list[str]:
    """The prefill rows: our forward as impl="auto" takes it against fla's; fla/ours (speed-ups of ours) on median
    ms, graph replay ms and GPU ms, and our wall / GPU time (median ms over GPU ms: 1.00 when the host keeps up)."""
    if not rows:
        return []
    ratio = lambda x, y: None if x is None or y is None else x / y  # noqa: E731
    lines = ["", "Few-heads prefill, our forward as impl=\"auto\" takes it for inference against fla's (fla/ours: "
             "speed-ups of ours; wall/GPU: our median ms over our GPU ms):", "",
             "| shape | impl | ours ms | fla/ours | ours graph ms | fla/ours graph | ours GPU ms | fla/ours GPU "
             "| ours wall/GPU | rel fla vs ours |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["shape"], r["impl"]]
        for kind in ("", "_graph", "_gpu"):
            ours = r.get(f"ours{kind}_ms")
            cells += [_fmt(ours), _fmt(ratio(r.get(f"fla{kind}_ms"), ours), ".2f")]
        cells += [_fmt(ratio(r.get("ours_ms"), r.get("ours_gpu_ms")), ".2f"), _fmt(r.get("fla_vs_ours_rel"), ".1e")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, ours, fla, sdpa = [], [], [], []
    for r in rows:
        if "ours_fwd_ms" not in r or r.get("kda"):
            continue
        for key in ("fwd", "fwdbwd"):
            labels.append(f"{r['shape']}\n{key}")
            ours.append(r[f"ours_{key}_ms"])
            fla.append(r.get(f"fla_{key}_ms") or 0)
            sdpa.append(r.get(f"sdpa_{key}_ms") or 0)
    x = range(len(labels))
    fig, ax = plt.subplots(figsize=(12, 4.5))
    w = 0.27
    ax.bar([i - w for i in x], ours, w, label="hybridlm (Triton)")
    ax.bar(list(x), fla, w, label="fla-core (bwd guard lifted)")
    ax.bar([i + w for i in x], sdpa, w, label="SDPA causal (flash)")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("median ms (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybridlm.bench.kernels", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
