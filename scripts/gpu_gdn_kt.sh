#!/usr/bin/env bash
# GPU calls for the state passes' KT plan (gdn.TUNE fwd_kt / rbwd_kt, on trial since 2026-11-24 19:50): the
# transposed operands loaded as [K, BT] tiles and accumulating dots, as fla's state kernels are written; it lifts
# the 4-warp refusal of `_state_warps` for its pass, to find out whether that form compiles correctly at 4 warps.
#   PART=san   compute-sanitizer memcheck over the GPU check's T63 case (float64 pass/fail) under each setting
#   PART=time  forward and forward+backward at the three benchmark shapes under each setting
#              (`gpu_tune_gdn.py --grid`, the defaults first and last for the run's drift)
#
#   OUT=dir PART=san|time bash scripts/gpu_gdn_kt.sh      (results under $OUT)
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
SETTINGS=('{"fwd_kt": true, "fwd_warps": 4}' '{"rbwd_kt": true, "rbwd_warps": 4}'
          '{"rbwd_kt": true, "rbwd_warps": 4, "rbwd_bv": 32}' '{"fwd_kt": true, "rbwd_kt": true}')
case ${PART:-san} in
  san)
    i=0
    for s in "${SETTINGS[@]}"; do
      echo "{\"best\": $s}" > "$OUT/s$i.json"
      echo "=== $s"
      timeout ${SAN_SECS:-100} compute-sanitizer --tool memcheck --print-limit 3 \
        python3 scripts/gpu_check_gdn.py --only T63 --tune-json "$OUT/s$i.json" > "$OUT/san$i.log" 2>&1
      grep -E "Invalid|^=========     at|PASS|FAIL|ERROR SUMMARY|passed" "$OUT/san$i.log" | head -10
      i=$((i + 1))
    done ;;
  time)
    grid='[{}, {"fwd_kt": true}, {"fwd_kt": true, "fwd_warps": 4}, {"fwd_kt": true, "fwd_warps": 4, "fwd_bv": 32},
           {"rbwd_kt": true}, {"rbwd_kt": true, "rbwd_warps": 4}, {"rbwd_kt": true, "rbwd_warps": 4, "rbwd_bv": 16}, {}]'
    for s in ${SHAPES:-1,32768,32,128 8,2048,32,128 4,4096,16,128}; do
      timeout ${TIME_SECS:-120} python3 scripts/gpu_tune_gdn.py --shape $s --max-seconds $((${TIME_SECS:-120} - 20)) \
        --json "$OUT/t_$s.json" --grid "$grid" | grep -v "^best"
    done ;;
  *) echo "PART: expected san or time, got ${PART}"; exit 2 ;;
esac
