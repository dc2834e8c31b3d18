#!/usr/bin/env bash
# Two forward changes against the defaults, H100, bf16 (errors against our fp32 run, gpu_tune_gdn.py --grid):
# the state pass on raw k with W/U's key scales (gdn.TUNE state_raw_k: W/U writes no Kd tile), and the output launch
# by key blocks so its loads pipeline (rawout_bk, rawout_stages).   OUT=out bash scripts/gpu_sk_out.sh
set -u
OUT=${OUT:-out}
R='"state_raw_k": true'
B='"rawout_bk": 64'
G="[{}, {$R}, {$B}, {$B, \"rawout_stages\": 3}, {$B, \"rawout_warps\": 8}, {$B, \"rawout_bv\": 64},
    {\"rawout_bk\": 32}, {$R, $B}, {}, {$R}, {$B}]"
timeout 130 python3 scripts/gpu_tune_gdn.py --grid "$G" --grid-fwd-only --shape 4,4096,16,128 \
  --json "$OUT/skout_4_4096_16.json" --max-seconds 110
G2="[{}, {$R}, {$B}, {$R, $B}, {}, {$R}, {$B}]"
for s in 1,32768,32,128 8,2048,32,128; do
  timeout 100 python3 scripts/gpu_tune_gdn.py --grid "$G2" --grid-fwd-only --shape $s \
    --json "$OUT/skout_${s//,/_}.json" --max-seconds 80
done
timeout 100 python3 scripts/gpu_tune_gdn.py --grid "[{}, {$R, $B}, {}, {$R, $B}]" --shape 4,4096,16,128 \
  --json "$OUT/skout_fb_4_4096_16.json" --max-seconds 80
timeout 60 python3 scripts/gpu_profile_fwd.py --no-fla --shapes 4,4096,16,128 --tune state_raw_k=True rawout_bk=64
