#!/usr/bin/env bash
# GPU calls for gdn.TUNE["fwd_raw_qk"] (the training forward writes no Qg and Kd: stage 1 makes P and A only, the
# state pass reads raw k, the output raw q; predicted at the GDN layer's shape ~0.13 ms off a 1.38 ms forward):
#   PART=san    compute-sanitizer memcheck over the GPU check's T63 case with it (float64 pass/fail)
#   PART=check  the full GPU check with it (eight parallel parts)
#   PART=time   forward and forward+backward at the three benchmark shapes, off and on twice
#               (`gpu_tune_gdn.py --grid`), then the GDN layer row (hidden 2048, T 2048, ours only) off and on
#
#   OUT=dir PART=san|check|time bash scripts/gpu_gdn_raw_fwd.sh      (results under $OUT)
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
echo '{"best": {"fwd_raw_qk": true}}' > "$OUT/raw.json"
echo '{"best": {"fwd_raw_qk": false}}' > "$OUT/saved.json"
case ${PART:-san} in
  san)
    timeout ${SAN_SECS:-100} compute-sanitizer --tool memcheck --print-limit 3 \
      python3 scripts/gpu_check_gdn.py --only T63 --tune-json "$OUT/raw.json" > "$OUT/san.log" 2>&1
    grep -E "Invalid|^=========     at|PASS|FAIL|ERROR SUMMARY" "$OUT/san.log" | head -8 ;;
  check)
    for i in 0 1 2 3 4 5 6 7; do
      timeout ${CHECK_SECS:-460} python3 scripts/gpu_check_gdn.py --part $i/8 --tune-json "$OUT/raw.json" \
        --json "$OUT/check$i.json" > "$OUT/check$i.log" 2>&1 &
    done
    wait
    python3 scripts/gpu_check_gdn.py --merge "$OUT"/check?.json | tail -8 ;;
  time)
    for s in ${SHAPES:-8,2048,32,128 1,32768,32,128 4,4096,16,128}; do
      timeout ${TIME_SECS:-90} python3 scripts/gpu_tune_gdn.py --shape $s --max-seconds $((${TIME_SECS:-90} - 15)) \
        --json "$OUT/t_$s.json" \
        --grid '[{"fwd_raw_qk": false}, {"fwd_raw_qk": true}, {"fwd_raw_qk": false}, {"fwd_raw_qk": true}]' \
        | grep -v "^best"
    done
    for t in saved raw; do
      timeout 100 python3 -m hybridlm.bench.layers --rep 50 --seq-lens 2048 --widths 2048 --rows gdn --no-recompute \
        --no-fla --tune-json "$OUT/$t.json" --out "$OUT/layer_$t" | tail -1
    done ;;
  *) echo "PART: expected san, check or time, got ${PART}"; exit 2 ;;
esac
