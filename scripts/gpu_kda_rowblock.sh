#!/usr/bin/env bash
# One GPU call for kda.TUNE["rowblock"] (the off-diagonal 16-row blocks of every row block in one batched dot, and
# the diagonal blocks' dot as a batched [NB, 16, 16] dot): the KDA cases of the float64 GPU check with it on (the
# default), then forward and forward+backward times with it off and on, twice each in turn, on the gates of a
# freshly initialised layer (most chunks take the block launches it changes), and once each on the bench's mild
# gates (every chunk takes the whole-chunk dot, which it does not change).
#
#   OUT=dir bash scripts/gpu_kda_rowblock.sh      (results under $OUT)
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
for i in 0 1 2 3; do
  timeout 250 python3 scripts/gpu_check_gdn.py --only kda --part $i/4 --json "$OUT/check_kda$i.json" \
    > "$OUT/check_kda$i.log" 2>&1 &
done
wait
tail -n 2 "$OUT"/check_kda?.log
python3 scripts/gpu_check_gdn.py --merge "$OUT"/check_kda?.json
timeout 190 python3 scripts/gpu_tune_kda.py --no-fla --gates init --profile --max-seconds 165 --json "$OUT/init.json" \
  --grid '[{"rowblock": false}, {}, {"rowblock": false}, {}, {"prep_warps": 8}]'
timeout 100 python3 scripts/gpu_tune_kda.py --no-fla --gates bench --max-seconds 70 --json "$OUT/bench.json" \
  --grid '[{"rowblock": false}, {}]'
