#!/usr/bin/env bash
# One GPU call for kda.TUNE["bwd_factored"] (the backward's off-diagonal factors once per product): the KDA cases of
# the float64 GPU check with it on, then forward and forward+backward times with it off and on, twice each in turn,
# on the gates of a freshly initialised layer (most chunks take the block launches it changes) and once each on the
# bench's mild gates (every chunk takes the whole-chunk dot, which it does not change).
#
#   OUT=dir bash scripts/gpu_kda_bwd_factored.sh      (results under $OUT)
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
for i in 0 1; do
  timeout 240 python3 scripts/gpu_check_gdn.py --only kda --part $i/2 --kda-tune '{"bwd_factored": true}' \
    --json "$OUT/check_kda$i.json" > "$OUT/check_kda$i.log" 2>&1 &
done
wait
tail -n 2 "$OUT"/check_kda?.log
python3 scripts/gpu_check_gdn.py --merge "$OUT"/check_kda?.json
timeout 200 python3 scripts/gpu_tune_kda.py --no-fla --gates init --max-seconds 170 --json "$OUT/init.json" \
  --grid '[{}, {"bwd_factored": true}, {}, {"bwd_factored": true}]'
timeout 100 python3 scripts/gpu_tune_kda.py --no-fla --gates bench --max-seconds 70 --json "$OUT/bench.json" \
  --grid '[{}, {"bwd_factored": true}]'
