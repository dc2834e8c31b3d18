"""Launch-plan sweep of the Triton KDA kernels on one CUDA device (one shape, bf16), with fla's chunk_kda timed
in the same run when it is installed.

    python scripts/gpu_tune_kda.py [--shape 4,4096,16,128] [--json tune_kda.json] [--max-seconds 240]

Each setting of `hybridlm.ops.triton.kda.TUNE` (variant: K-blocked or whole-K kernels; bk: key-channel block;
split_o: the output kernel of its own; warps; maxnreg: register cap) is timed forward and forward+backward, and its
error is measured against our own fp32 run (fp32 intermediates, IEEE dots) on the same bf16-rounded inputs. The
best setting is the fastest forward+backward whose errors stay within 0.8x of the GPU check's bf16 bars (o 5e-3,
gradients 1e-2).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton.testing
from gpu_tune_gdn import BAR_G, BAR_O, grid_settings, rel, tune_settings  # the GDN sweep's bars, error, settings checks

from hybridlm.bench.cuda_profile import print_kernel_times
from hybridlm.bench.kernels import KDA_GATES, kda_bench_gates
from hybridlm.ops.triton import chunk_kda, gdn, kda


def make(B, T, H, D, seed=0, gates="bench"):
    """The inputs of `hybridlm bench kernels`' KDA rows, bf16-representable (g stays fp32; gates "bench" or "init":
    `hybridlm.bench.kernels.kda_bench_gates`)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = (r(B, T, H, D).bfloat16().float() for _ in range(3))
    g = kda_bench_gates(gates, B, T, H, D, "cuda", gen)
    beta = torch.sigmoid(r(B, T, H)).bfloat16().float()
    return q, k, v, g, beta


def run(xs, dtype, grad, do=None):
    q, k, v, g, beta = xs
    leaf = [x.detach().to(dtype).requires_grad_(grad) for x in (q, k, v)] + [
        g.detach().clone().requires_grad_(grad), beta.detach().to(dtype).requires_grad_(grad)]
    o, _ = chunk_kda(*leaf[:3], g=leaf[3], beta=leaf[4], use_qk_l2norm=True)
    if not grad:
        return o, []
    return o, list(torch.autograd.grad(o, leaf, do.to(o.dtype)))


def fla_times(xs, do, rep):
    """fla's chunk_kda forward and forward+backward (ms), or None when fla is not installed."""
    try:
        from fla.ops.kda import chunk_kda as fla_kda
    except ImportError:
        return None
    q, k, v, g, beta = xs
    leaf = [x.detach().bfloat16().requires_grad_() for x in (q, k, v)] + [
        g.detach().clone().requires_grad_(), beta.detach().bfloat16().requires_grad_()]
    dob = do.bfloat16()

    def fb():
        o = fla_kda(*leaf[:3], leaf[3], leaf[4], use_qk_l2norm_in_kernel=True)[0]
        return torch.autograd.grad(o, leaf, dob)

    with torch.no_grad():
        f = triton.testing.do_bench(lambda: fla_kda(*leaf[:3], leaf[3], leaf[4], use_qk_l2norm_in_kernel=True),
                                    warmup=10, rep=rep, return_mode="median")
    return {"fwd": float(f), "fwdbwd": float(triton.testing.do_bench(fb, warmup=10, rep=rep, return_mode="median"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4,4096,16,128", help="B,T,H,D")
    ap.add_argument("--json", default=None, help="write the rows, fla's times and the best setting here")
    ap.add_argument("--max-seconds", type=float, default=240.0, help="stop sweeping after this long")
    ap.add_argument("--rep", type=int, default=60, help="do_bench rep in ms")
    ap.add_argument("--no-fla", action="store_true", help="do not time fla's chunk_kda")
    ap.add_argument("--gates", choices=KDA_GATES, default="bench",
                    help="log-decays: the kernel bench's mild ones (logsigmoid(N(0,1) + 3)) or those of a freshly "
                         "initialised KDA layer (see make)")
    ap.add_argument("--grid", default=None,
                    help="JSON list of kda.TUNE settings to sweep instead of the built-in grid, each merged over "
                         "the K-blocked default plan (for example '[{}, {\"bk\": 16}]')")
    ap.add_argument("--gdn-tune", default=None,
                    help="JSON object merged into gdn.TUNE for every timed setting (for example "
                         "'{\"store_fp32\": true}': fp32 intermediates; the reference run keeps its own)")
    ap.add_argument("--profile", action="store_true",
                    help="first print the per-kernel CUDA times of 3 forward+backward steps of the default setting")
    args = ap.parse_args(argv)
    B, T, H, D = (int(x) for x in args.shape.split(","))
    t_start = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    xs = make(B, T, H, D, gates=args.gates)
    do = torch.randn(B, T, H, D, device="cuda").bfloat16().float()
    base, gbase = dict(kda.TUNE), dict(gdn.TUNE)
    gdn.TUNE.update(store_fp32=True, fwd_lowp=False, bwd_lowp=False)
    o_ref, g_ref = run(xs, torch.float32, True, do)
    gdn.TUNE.clear()
    gdn.TUNE.update(gbase)
    if args.gdn_tune:
        gdn.TUNE.update(tune_settings(gdn.TUNE, json.loads(args.gdn_tune), "--gdn-tune"))
    fla = None if args.no_fla else fla_times(xs, do, args.rep)
    if args.profile:
        print_kernel_times(f"kda.TUNE defaults, gates {args.gates}", lambda: run(xs, torch.bfloat16, True, do))
    if fla:
        print(f"fla chunk_kda: fwd {fla['fwd']:.3f} ms, fwd+bwd {fla['fwdbwd']:.3f} ms", flush=True)

    def measure(setting):
        kda.TUNE.clear()
        kda.TUNE.update(base, **setting)
        try:
            o, gr = run(xs, torch.bfloat16, True, do)
            err = {"o": rel(o, o_ref)}
            err.update({n: rel(a, b) for n, a, b in zip(["dq", "dk", "dv", "dg", "dbeta"], gr, g_ref)})
            with torch.no_grad():
                fwd = float(triton.testing.do_bench(lambda: run(xs, torch.bfloat16, False), warmup=10, rep=args.rep,
                                                    return_mode="median"))
            fb = float(triton.testing.do_bench(lambda: run(xs, torch.bfloat16, True, do), warmup=10, rep=args.rep,
                                               return_mode="median"))
        except Exception as e:  # an illegal setting on this device: report it and go on
            return {"setting": setting, "fwd_ms": float("inf"), "fwdbwd_ms": float("inf"), "error": repr(e)[:200]}
        ok = err["o"] <= BAR_O and all(v <= BAR_G for n, v in err.items() if n != "o")
        worst = max(err.items(), key=lambda kv: kv[1])
        ratio = f" fla/ours fwd {fla['fwd'] / fwd:.2f} fwd+bwd {fla['fwdbwd'] / fb:.2f}" if fla else ""
        print(f"{setting} fwd {fwd:.3f} ms fwd+bwd {fb:.3f} ms{ratio} worst {worst[0]} {worst[1]:.2e} "
              f"{'ok' if ok else 'INEXACT'}", flush=True)
        return {"setting": setting, "fwd_ms": fwd, "fwdbwd_ms": fb, "errors": err, "ok": ok}

    kb = dict(variant="kblock", bk=32, split_o=True, prep_warps=4, bwd_warps=8,
              whole_dot=("prep", "bwd_out", "bwd_state"))
    # bwd_warps 4 stops with an illegal memory access on the H100 (2026-11-24), which ends the process's CUDA
    # context: it goes last
    # sub_dot without the prep: on the mild gates sub_dot measured +1.3% (2026-11-24 13:45), where the prep's two
    # extra launches (which only read marks there) are the one difference
    grid = [kb, dict(kb, sub_bk=16), dict(kb, sub_dot=()), dict(kb, sub_dot=("bwd_out", "bwd_state")),
            dict(kb, whole_dot=("prep",)),
            dict(kb, diag_dot=()),
            dict(kb, whole_dot=()), dict(kb, bk=64), dict(kb, prep_warps=8), dict(kb, maxnreg=128),
            dict(kb, bk=16, maxnreg=128), dict(kb, bk=16), dict(kb, split_o=False),
            dict(kb, prep_lowp=True), dict(variant="whole", split_o=False), dict(variant="whole", split_o=True),
            dict(kb, prep_warps=4, bwd_warps=4)]
    if args.grid is not None:
        grid = [dict(kb, **e) for e in grid_settings(kda.TUNE, args.grid)]
    rows, best = [], None
    for s in grid:
        if time.time() - t_start > args.max_seconds:
            break
        row = measure(s)
        rows.append(row)
        if row.get("ok") and (best is None or row["fwdbwd_ms"] < best["fwdbwd_ms"]):
            best = row
    print("best:", json.dumps(best and best["setting"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": [B, T, H, D], "device": torch.cuda.get_device_name(), "fla": fla,
                       "best": best and dict(base, **best["setting"]), "rows": rows}, f, indent=1, default=str)
    kda.TUNE.clear()
    kda.TUNE.update(base)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
