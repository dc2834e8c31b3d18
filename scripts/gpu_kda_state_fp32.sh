#!/usr/bin/env bash
# kda.TUNE state_fp32 (chunk states and Kd in fp32 for 16-bit inputs): its cost, forward and forward+backward at B4
# T4096 H16 D128 bf16 on the bench's gates and a fresh layer's (gpu_tune_kda.py --grid), then its errors on the
# strong-decay tail over 20 seeds (gpu_kda_tail.py) beside the KDA cases of the float64 check under it.
#   OUT=out bash scripts/gpu_kda_state_fp32.sh
set -u
OUT=${OUT:-out}
G='[{}, {"state_fp32": true}, {}, {"state_fp32": true}]'
timeout 200 python3 scripts/gpu_tune_kda.py --no-fla --gates bench --grid "$G" --json "$OUT/kda_sf_bench.json" \
  --max-seconds 180
timeout 130 python3 scripts/gpu_tune_kda.py --no-fla --gates init --grid "$G" --json "$OUT/kda_sf_init.json" \
  --max-seconds 110
(cd scripts && python3 gpu_kda_tail.py --seeds 20 --kda-tune '{"state_fp32": true}' --label "state_fp32" \
  --json "$OUT/tail_sf.json" > "$OUT/tail_sf.log" 2>&1) &
for i in 0 1 2; do
  python3 scripts/gpu_check_gdn.py --only kda --part $i/3 --kda-tune '{"state_fp32": true}' \
    --json "$OUT/kdacheck$i.json" > "$OUT/kdacheck$i.log" 2>&1 &
done
wait
grep -hE "^(PASS|FAIL)" "$OUT"/kdacheck*.log
tail -n 2 "$OUT/tail_sf.log"
