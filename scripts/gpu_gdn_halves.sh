#!/usr/bin/env bash
# One GPU call for the state passes (2026-11-24): compute-sanitizer over the GPU check's T63 case with the forward's
# state in two key halves (gdn.TUNE fwd_halves) at 4 and 8 warps; then forward and forward+backward at the three
# benchmark shapes: the default (since 15:25 the backward state pass's V block by waves), the old backward V block
# (rbwd_bv 16), and the halves at 8 and 4 warps; then the quick GPU check with the halves at 4 warps.
#
#   OUT=dir bash scripts/gpu_gdn_halves.sh      (results under $OUT)
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
i=0
for s in '{"fwd_halves": true, "fwd_warps": 4}' '{"fwd_halves": true}'; do
  echo "{\"best\": $s}" > "$OUT/s$i.json"
  echo "=== sanitizer $s"
  timeout 100 compute-sanitizer --tool memcheck --print-limit 3 \
    python3 scripts/gpu_check_gdn.py --only T63 --tune-json "$OUT/s$i.json" > "$OUT/san$i.log" 2>&1
  grep -E "Invalid|^=========     at|PASS|FAIL|ERROR SUMMARY" "$OUT/san$i.log" | head -8
  i=$((i + 1))
done
timeout 200 python3 scripts/gpu_tune_gdn.py --shape 1,32768,32,128 --max-seconds 170 --json "$OUT/b1.json" \
  --grid '[{}, {"rbwd_bv": 16}, {"fwd_halves": true}, {"fwd_halves": true, "fwd_warps": 4},
           {"fwd_halves": true, "fwd_warps": 4, "fwd_bv": 32}, {}]'
timeout 90 python3 scripts/gpu_tune_gdn.py --shape 8,2048,32,128 --max-seconds 60 --json "$OUT/b8.json" \
  --grid '[{}, {"fwd_halves": true, "fwd_warps": 4}, {}, {"fwd_halves": true, "fwd_warps": 4}]'
timeout 70 python3 scripts/gpu_tune_gdn.py --shape 4,4096,16,128 --max-seconds 45 --json "$OUT/b4.json" \
  --grid '[{}, {"fwd_halves": true, "fwd_warps": 4}, {}, {"fwd_halves": true, "fwd_warps": 4}]'
echo '{"best": {"fwd_halves": true, "fwd_warps": 4}}' > "$OUT/h4.json"
timeout 120 python3 scripts/gpu_check_gdn.py --quick --tune-json "$OUT/h4.json" --json "$OUT/quick_h4.json" | tail -4
