"""The bf16 error of `_kkt_solve`'s dot precisions against float64, seed by seed, on the same inputs for each plan:
the GPU check's K=V=256 case and a K=128 GVA case (gdn.TUNE kkt_prec / kkt_diag_prec, and the plan before
`_kkt_solve`: A in memory, its solve in fp32, the prep's stage 1).

    python scripts/gpu_kkt_accuracy.py [--seeds 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from gpu_check_gdn import check

from hybridlm.ops.triton import gdn

PLANS = {"tf32 (default)": {}, "diag tf32x3": {"kkt_diag_prec": "tf32x3"}, "tf32x3": {"kkt_prec": "tf32x3"},
         "before (A in memory, fp32 solve)": {"prep_kkt": False, "fwd_raw_out": False, "state_raw_k": False}}
CASES = {"T200 H2 HV2 K256 V256": dict(B=1, T=200, H=2, HV=2, K=256, V=256),
         "T1000 B2 H2 HV4 K128 V128": dict(B=2, T=1000, H=2, HV=4, K=128, V=128)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8, help="seeds 0 .. N-1, each case's inputs the same for every plan")
    ap.add_argument("--json", default=None, help="write every row here")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    base = dict(gdn.TUNE)
    rows = []
    for case, shape in CASES.items():
        for name, plan in PLANS.items():
            gdn.TUNE.clear()
            gdn.TUNE.update(base, **plan)
            worst = []
            for seed in range(args.seeds):
                gen = torch.Generator(device="cuda").manual_seed(seed)
                r = check(gen, case, dtype=torch.bfloat16, **shape)
                rows.append({"plan": name, "seed": seed, **r})
                worst.append(r["errors"])
            med = {t: statistics.median(e[t] for e in worst) for t in worst[0]}
            mx = {t: max(e[t] for e in worst) for t in worst[0]}
            print(f"{case:28} {name:34} dg median {med['dg']:.2e} max {mx['dg']:.2e} | dk max {mx['dk']:.2e} "
                  f"| o max {mx['o']:.2e} | worst of all tensors {max(mx.values()):.2e}", flush=True)
    gdn.TUNE.clear()
    gdn.TUNE.update(base)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
