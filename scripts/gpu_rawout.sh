#!/usr/bin/env bash
# The training forward without the prep's stage 1 (gdn.TUNE fwd_raw_out: Kd from the W/U launch, P and Q's scales
# in the output launch from the raw q and k) against the default, H100, bf16 (errors against our fp32 run).
#   OUT=out bash scripts/gpu_rawout.sh
set -u
OUT=${OUT:-out}
R='"fwd_raw_out": true'
G="[{}, {$R}, {$R, \"rawout_warps\": 4}, {$R, \"rawout_bv\": 128}, {$R, \"rawout_bv\": 128, \"rawout_warps\": 4},
    {$R, \"rawout_bv\": 32, \"rawout_warps\": 4}, {}, {$R}]"
timeout 110 python3 scripts/gpu_tune_gdn.py --grid "$G" --grid-fwd-only --shape 4,4096,16,128 \
  --json "$OUT/rawout_4_4096_16.json" --max-seconds 90
G2="[{}, {$R}, {$R, \"rawout_bv\": 128}, {$R, \"rawout_bv\": 128, \"rawout_warps\": 4}, {}, {$R}]"
for s in 1,32768,32,128 8,2048,32,128; do
  timeout 90 python3 scripts/gpu_tune_gdn.py --grid "$G2" --grid-fwd-only --shape $s \
    --json "$OUT/rawout_${s//,/_}.json" --max-seconds 70
done
# forward+backward: the backward reads the P this forward's output launch stored
timeout 100 python3 scripts/gpu_tune_gdn.py --grid "[{}, {$R}, {}, {$R}]" --shape 4,4096,16,128 \
  --json "$OUT/rawout_fb_4_4096_16.json" --max-seconds 80
timeout 60 python3 scripts/gpu_profile_fwd.py --no-fla --shapes 4,4096,16,128 --tune fwd_raw_out=True
