#!/usr/bin/env bash
# One GPU call for the warps of the two state passes (`_recur_fwd`: gdn.TUNE fwd_warps; `_recur_bwd`: rbwd_warps)
# and the V block (fwd_bv) at the H32 shapes, where the 2026-11-24 15:02 profile had them at 2.1x and 2.3x fla's
# per-chunk state kernels at B1 T32768 H32. Then the GPU check's T63 case (a non-finite bf16 final state once at
# fwd_warps 4, 2026-11-24 02:05) four times with fwd_warps 4, and the quick (awkward-shape) check once with it.
#
# From d7f4aca to 2026-11-25 4 warps were refused on CUDA for these kernels; since then `gdn._state_warps` takes
# them only when the chunk loop runs at least fwd_stages times (the fault is the one-chunk loop, as T63 has:
# scripts/gpu_four_warps.sh), so the T63 runs here now get 8 warps. To rerun them as they ran, let
# `_state_warps` return TUNE[key] on CUDA (scripts/gpu_four_warps.py does).
#
#   OUT=dir bash scripts/gpu_gdn_recur.sh      (results under $OUT)
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
timeout 250 python3 scripts/gpu_tune_gdn.py --shape 1,32768,32,128 --max-seconds 220 --json "$OUT/b1.json" \
  --grid '[{}, {"fwd_warps": 4}, {"rbwd_warps": 4}, {"fwd_warps": 4, "rbwd_warps": 4},
           {"fwd_bv": 32, "fwd_warps": 4, "rbwd_warps": 4}, {"fwd_warps": 4, "rbwd_warps": 4, "fwd_stages": 3}, {}]'
timeout 100 python3 scripts/gpu_tune_gdn.py --shape 8,2048,32,128 --max-seconds 80 --json "$OUT/b8.json" \
  --grid '[{}, {"fwd_warps": 4, "rbwd_warps": 4}, {}, {"fwd_warps": 4, "rbwd_warps": 4}]'
echo '{"best": {"fwd_warps": 4, "rbwd_warps": 4}}' > "$OUT/w4.json"
for i in 0 1 2 3; do
  timeout 60 python3 scripts/gpu_check_gdn.py --only T63 --tune-json "$OUT/w4.json" --json "$OUT/t63_$i.json" | tail -3
done
timeout 150 python3 scripts/gpu_check_gdn.py --quick --tune-json "$OUT/w4.json" --json "$OUT/quick_w4.json" | tail -4
