#!/usr/bin/env bash
# The forward state pass `_recur_fwd` (1049 us at B1 T32768 H32 against fla's ~630, 2026-11-25 00:52) at fla's kinds
# of launch: 2 warps (mma.sync with register operands: 34 KB of shared memory and 200 registers on the sm_90 compile
# at V block 16, against 72 KB / 108 at 4 warps with wgmma), 3 pipeline stages, V block 32; forward only
# (gpu_tune_gdn.py --grid --grid-fwd-only), then the launch config fla's autotuner picks for its own state pass.
#   OUT=out bash scripts/gpu_state_fwd_cfg.sh
set -u
OUT=${OUT:-out}
G='[{}, {"fwd_warps": 2}, {"fwd_warps": 2, "fwd_bv": 32}, {"fwd_stages": 3}, {"fwd_warps": 2, "fwd_stages": 3},
    {"fwd_bv": 32, "fwd_stages": 3}, {}]'
for s in 1,32768,32,128 4,4096,16,128; do
  timeout 170 python3 scripts/gpu_tune_gdn.py --grid "$G" --grid-fwd-only --shape $s \
    --json "$OUT/sfwd_${s//,/_}.json" --max-seconds 150
done
timeout 120 python3 - <<'PY'
import torch
from fla.ops.common import chunk_delta_h as m
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
B, T, H, D = 1, 32768, 32, 128
q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda") + 3)
beta = torch.rand(B, T, H, device="cuda", dtype=torch.bfloat16)
chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
torch.cuda.synchronize()
for name in dir(m):
    obj = getattr(m, name)
    best = getattr(obj, "best_config", None)
    cache = getattr(obj, "cache", None)
    if best is not None or cache:
        print(name, "best_config:", best, "cache:", cache)
PY
