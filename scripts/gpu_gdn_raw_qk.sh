#!/usr/bin/env bash
# GPU calls for gdn.TUNE["bwd_raw_qk"] (the forward keeps no Qg and Kd; the state backward reads the raw q and k;
# the default since 2026-11-24 16:49, after these runs; "off" below is {"bwd_raw_qk": false}, "on" the defaults):
#   PART=check  compute-sanitizer over the GPU check's T63 case with it, then the full GPU check with it (eight
#               parallel parts: a fresh machine's compiles took over 450 s at four)
#   PART=time   forward and forward+backward at the three benchmark shapes, off and on in turn
#               (`gpu_tune_gdn.py --grid`), then the GDN layer row (hidden 2048, T 2048) off and on: speed and peak
#               memory beside fla's layer (predicted: peak -0.25 GiB, 3.09 -> ~2.84; `_recur_bwd` within a few %)
#
#   OUT=dir PART=check|time bash scripts/gpu_gdn_raw_qk.sh      (results under $OUT)
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
echo '{"best": {"bwd_raw_qk": true}}' > "$OUT/raw.json"
echo '{"best": {"bwd_raw_qk": false}}' > "$OUT/saved.json"
case ${PART:-check} in
  check)
    timeout 100 compute-sanitizer --tool memcheck --print-limit 3 \
      python3 scripts/gpu_check_gdn.py --only T63 --tune-json "$OUT/raw.json" > "$OUT/san.log" 2>&1
    grep -E "Invalid|^=========     at|PASS|FAIL|ERROR SUMMARY" "$OUT/san.log" | head -8
    for i in 0 1 2 3 4 5 6 7; do
      timeout 460 python3 scripts/gpu_check_gdn.py --part $i/8 --tune-json "$OUT/raw.json" --json "$OUT/check$i.json" \
        > "$OUT/check$i.log" 2>&1 &
    done
    wait
    python3 scripts/gpu_check_gdn.py --merge "$OUT"/check?.json | tail -6 ;;
  time)
    for s in 1,32768,32,128 8,2048,32,128 4,4096,16,128; do
      timeout 110 python3 scripts/gpu_tune_gdn.py --shape $s --max-seconds 90 --json "$OUT/t_$s.json" \
        --grid '[{"bwd_raw_qk": false}, {"bwd_raw_qk": true}, {"bwd_raw_qk": false}, {"bwd_raw_qk": true}]' | grep -v "^best"
    done
    timeout 240 python3 -m hybridlm.bench.layers --rep 50 --seq-lens 2048 --widths 2048 --rows gdn --no-recompute \
      --tune-json "$OUT/saved.json" --out "$OUT/layer_off" | tail -3
    timeout 120 python3 -m hybridlm.bench.layers --rep 50 --seq-lens 2048 --widths 2048 --rows gdn --no-recompute \
      --no-fla --tune-json "$OUT/raw.json" --out "$OUT/layer_raw" | tail -3 ;;
  *) echo "PART: expected check or time, got ${PART}"; exit 2 ;;
esac
