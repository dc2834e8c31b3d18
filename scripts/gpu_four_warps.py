"""The state passes at 4 warps (refused on CUDA since 2026-11-24: in the GPU check's T63 case they read shared
memory out of bounds) over sequences of one to several chunks, one case, against float64: is the fault tied to a
loop of one chunk (a software-pipelined loop whose trip count is below its stages), or to the partial chunk?

    python scripts/gpu_four_warps.py --T 63 [--warps 4] [--bv 16] [--dtype bf16] [--stages 2]

Lifts `gdn._state_warps`' rule (8 warps for loops shorter than their stages) in this process only: an experiment,
not a launch plan."""

from __future__ import annotations

import argparse
import json

import torch
from gpu_check_gdn import check

from hybridlm.ops.triton import gdn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, required=True, help="tokens per sequence (B2 H2 HV4 K128 V128)")
    ap.add_argument("--warps", type=int, default=4, help="num_warps of both state passes")
    ap.add_argument("--bv", type=int, default=None, help="V block of both passes (default: gdn's rule)")
    ap.add_argument("--stages", type=int, default=2, help="num_stages of the sequential kernels (gdn.TUNE fwd_stages)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="input dtype")
    ap.add_argument("--seed", type=int, default=0, help="inputs' seed")
    args = ap.parse_args(argv)
    gdn._state_warps = lambda key, K, dev, nch=0: gdn.TUNE[key] or 8  # the one-chunk rule lifted: the experiment
    gdn.TUNE.update(fwd_warps=args.warps, rbwd_warps=args.warps, fwd_bv=args.bv, rbwd_bv=args.bv,
                    fwd_stages=args.stages)
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    r = check(gen, f"T{args.T}", B=2, T=args.T, H=2, HV=4, K=128, V=128, dtype=dt)
    tag = f"T{args.T} warps {args.warps} bv {args.bv} stages {args.stages} {args.dtype}"
    print(f"RESULT {tag}: {'pass' if r['pass'] else 'FAIL'} worst {r['worst']} {r['worst_rel']:.2e} "
          + json.dumps({k: float(f"{v:.3g}") for k, v in r["errors"].items()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
