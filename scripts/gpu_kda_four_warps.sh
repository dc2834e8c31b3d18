#!/usr/bin/env bash
# KDA's state passes at 4 warps (kda.TUNE state_warps; GDN's run at 4 since 2026-11-25) against 8: forward and
# forward+backward at B4 T4096 H16 D128 bf16 on the bench's gates and a fresh layer's (gpu_tune_kda.py --grid,
# errors against our fp32 run), then the KDA cases of the float64 check at 4 warps.
#   OUT=out bash scripts/gpu_kda_four_warps.sh
set -u
OUT=${OUT:-out}
G='[{}, {"state_warps": 4}, {}, {"state_warps": 4}]'
timeout 230 python3 scripts/gpu_tune_kda.py --no-fla --gates bench --grid "$G" --json "$OUT/kda_w4_bench.json" \
  --max-seconds 210
timeout 130 python3 scripts/gpu_tune_kda.py --no-fla --gates init --grid "$G" --json "$OUT/kda_w4_init.json" \
  --max-seconds 110
for i in 0 1 2 3; do
  python3 scripts/gpu_check_gdn.py --only kda --part $i/4 --kda-tune '{"state_warps": 4}' --json "$OUT/kdacheck$i.json" \
    > "$OUT/kdacheck$i.log" 2>&1 &
done
wait
grep -hE "^(PASS|FAIL)" "$OUT"/kdacheck*.log
