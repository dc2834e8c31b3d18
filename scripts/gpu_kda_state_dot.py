"""One GPU run: isolate the fault of KDA's state backward with its diagonal 16x16 blocks by dot.

    python scripts/gpu_kda_state_dot.py [--json PATH]

`kda.TUNE["diag_dot"]` with "bwd_state" gave wrong bf16 gradients on an H100 (dk, dg, dbeta 8-5240 relative,
2026-11-24 02:05, with 16-bit operands in the diagonal dot; right in fp32 and in the CPU interpreter). This
script runs each variant below on one small case against the float64 chunk reference (relative RMS per
gradient; bars as the GPU check: 1e-2 in bf16) and times forward + backward at the benchmark shape (B4 T4096
H16 D128, bf16, median of `triton.testing.do_bench` as in the kernel bench; the 03:52 run used 20 CUDA-event
repeats). Its 03:52 run found the fp32-operand dot right (the default since):

  exact       the exact loop in the state backward (the dot in the output backward only)
  dot         the state backward's dot (fp32 operands, tf32 dots for 16-bit inputs): the default
  dot_ieee    the same with IEEE fp32 dots for 16-bit inputs too (is tf32 the trigger?)
  dot_nolowp  the same with fp32 operands in every backward dot (gdn.TUNE bwd_lowp off)
  dot_w4      the same at 4 warps (kda.TUNE bwd_warps; a layout-dependent codegen fault moves with the warps)
  exact_nolowp  the exact loop with bwd_lowp off (dot_nolowp hit an illegal memory access at 03:53: which part?)

compute-sanitizer over the last two (2026-11-24 06:16-06:31, the `kdasan` step of gpu_call.sh): exact_nolowp reads
an out-of-range shared address in `_recur_bwd` (its dS update); dot_w4 reads shared memory out of bounds in a
reduction of `_kda_bwd_out_blk`. Both settings are refused on CUDA since (`gdn.bwd_lowp`, `kda._bwd_warps`), so
those variants now report that ValueError.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from hybridlm.bench.kernels import _bench
from hybridlm.ops import kda
from hybridlm.ops.triton import gdn as _gdn
from hybridlm.ops.triton import kda as _kda

F64 = torch.float64
_prec0 = _gdn._prec


VARIANTS = {
    "exact": dict(),
    "dot": dict(state=True),
    "dot_ieee": dict(state=True, ieee=True),
    "dot_nolowp": dict(state=True, lowp=False),
    "dot_w4": dict(state=True, warps=4),
    "exact_nolowp": dict(lowp=False),
}


def apply(v: dict) -> None:
    _kda.TUNE["diag_dot"] = ("bwd_out", "bwd_state") if v.get("state") else ("bwd_out",)
    _gdn._prec = (lambda dt: "ieee") if v.get("ieee") else _prec0
    _gdn.TUNE["bwd_lowp"] = v.get("lowp", LOWP0)
    _kda.TUNE["bwd_warps"] = v.get("warps", WARPS0)


def rel(a, b):
    a, b = a.to(F64), b.to(F64)
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def inputs(B, T, H, D, gen, dtype=torch.bfloat16):
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = (r(B, T, H, D).to(dtype) for _ in range(3))
    g = F.logsigmoid(r(B, T, H, D) + 3.0)  # the benchmark's decays: every chunk within the dot's bound
    beta = torch.sigmoid(r(B, T, H)).to(dtype)
    do = r(B, T, H, D).to(dtype)
    return [q, k, v, g, beta], do


def grads(xs, do, impl):
    leaf = [x.detach().clone().requires_grad_() for x in xs]
    o = kda(*leaf[:3], g=leaf[3], beta=leaf[4], use_qk_l2norm=True, impl=impl)[0]
    return torch.autograd.grad((o.to(do.dtype) * do).sum() if impl == "chunk" else o, leaf,
                               None if impl == "chunk" else do)


def errors(gen):
    xs, do = inputs(1, 1024, 2, 128, gen)
    ref = grads([x.to(F64) for x in xs], do.to(F64), "chunk")
    got = grads(xs, do, "triton")
    return {nm: rel(a, b) for nm, a, b in zip(["dq", "dk", "dv", "dg", "dbeta"], got, ref)}


def time_fb(xs, do, rep=50):
    leaf = [x.detach().clone().requires_grad_() for x in xs]

    def step():
        o = kda(*leaf[:3], g=leaf[3], beta=leaf[4], use_qk_l2norm=True, impl="triton")[0]
        torch.autograd.grad(o, leaf, do)

    return _bench(step, rep)  # the kernel bench's timer (triton's do_bench, median)


def main() -> int:
    global LOWP0, WARPS0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variants to run")
    ap.add_argument("--no-time", action="store_true", help="errors only")
    args = ap.parse_args()
    LOWP0, WARPS0 = _gdn.TUNE["bwd_lowp"], _kda.TUNE["bwd_warps"]
    diag0 = _kda.TUNE["diag_dot"]
    torch.backends.cuda.matmul.allow_tf32 = False
    seed = torch.seed() % 2**31
    print(f"seed {seed}; {torch.cuda.get_device_name()}; torch {torch.__version__}; bwd_lowp {LOWP0}, "
          f"bwd_warps {WARPS0}", flush=True)
    bench_xs, bench_do = inputs(4, 4096, 16, 128, torch.Generator(device="cuda").manual_seed(seed + 1))
    rows = []
    print(f"{'variant':<11} {'dq':>9} {'dk':>9} {'dv':>9} {'dg':>9} {'dbeta':>9} {'fwd+bwd ms':>11} {'s':>5}")
    for name in args.variants.split(","):
        apply(VARIANTS[name])
        t0 = time.time()
        try:
            err = errors(torch.Generator(device="cuda").manual_seed(seed))
            ms = None if args.no_time else time_fb(bench_xs, bench_do)
        except Exception as e:  # a variant that does not compile or run is a row, not the end of the run
            print(f"{name:<11} failed: {e!r}", flush=True)
            rows.append({"variant": name, "error": repr(e)})
            continue
        rows.append({"variant": name, "errors": err, "fwd_bwd_ms": ms})
        print(f"{name:<11} " + " ".join(f"{err[k]:>9.2e}" for k in ("dq", "dk", "dv", "dg", "dbeta"))
              + f" {ms if ms is not None else float('nan'):>11.3f} {time.time() - t0:>5.0f}", flush=True)
    apply({})
    _kda.TUNE["diag_dot"] = diag0  # the settings as found
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seed": seed, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
