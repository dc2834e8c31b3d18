#!/usr/bin/env bash
# The state passes at 4 warps (gdn.TUNE fwd_warps / rbwd_warps; taken from two chunks up since 2026-11-25) against
# the 8-warp defaults, forward and forward+backward, H100, bf16 (gpu_tune_gdn.py --grid, errors against our fp32
# run), then a per-kernel profile at B1 T32768 H32.   OUT=out bash scripts/gpu_four_warps_time.sh
set -u
OUT=${OUT:-out}
F='"fwd_warps": 4'
R='"rbwd_warps": 4'
G="[{}, {$F}, {$R}, {$F, $R}, {$F, $R, \"rbwd_bv\": 16}, {}, {$F, $R}]"
timeout 170 python3 scripts/gpu_tune_gdn.py --grid "$G" --shape 1,32768,32,128 --json "$OUT/w4_1_32768_32.json" \
  --max-seconds 150
G2="[{}, {$F}, {$R}, {$F, $R}, {}, {$F, $R}]"
for s in 4,4096,16,128 8,2048,32,128; do
  timeout 120 python3 scripts/gpu_tune_gdn.py --grid "$G2" --shape $s --json "$OUT/w4_${s//,/_}.json" \
    --max-seconds 100
done
timeout 90 python3 scripts/gpu_profile_fwd.py --no-fla --bwd --shapes 1,32768,32,128 --tune fwd_warps=4 rbwd_warps=4
