#!/usr/bin/env bash
# One GPU call for kda.TUNE["sub_dot"] (DIAG 4: the diagonal 16-row blocks of chunks beyond the diagonal-block dot's
# bound by two masked dots over 8-row halves, before the exact launch): forward and forward+backward times with it
# off and on, twice each in turn, on the gates of a freshly initialised layer, and once each on the bench's mild
# gates (no chunk reaches it there, but the prep gains two launches).
#
#   OUT=dir bash scripts/gpu_kda_sub_dot.sh      (results under $OUT)
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
timeout 200 python3 scripts/gpu_tune_kda.py --no-fla --gates init --max-seconds 170 --json "$OUT/init.json" \
  --grid '[{"sub_dot": []}, {}, {"sub_dot": []}, {}]'
timeout 100 python3 scripts/gpu_tune_kda.py --no-fla --gates bench --max-seconds 70 --json "$OUT/bench.json" \
  --grid '[{"sub_dot": []}, {}]'
