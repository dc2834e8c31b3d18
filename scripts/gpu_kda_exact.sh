#!/usr/bin/env bash
# One GPU call for a change to KDA's exact launches: the KDA cases of the float64 GPU check (four parts at once),
# then forward and forward+backward times on the gates of a freshly initialised layer (about half the chunks take
# the exact launches) and on the bench's mild gates (none do), then the Nsight Compute sections of the backward
# launches (scripts/gpu_ncu_kda.sh).
#
#   OUT=dir [INIT_GRID='[{}, {"sub_dot": []}]'] bash scripts/gpu_kda_exact.sh      (results under $OUT)
#
# INIT_GRID: the kda.TUNE settings timed on the init gates (scripts/gpu_tune_kda.py --grid; default the built-in
# plan twice).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
for i in 0 1 2 3; do
  timeout 250 python3 scripts/gpu_check_gdn.py --only kda --part $i/4 --json "$OUT/check_kda$i.json" \
    > "$OUT/check_kda$i.log" 2>&1 &
done
wait
tail -n 2 "$OUT"/check_kda?.log
python3 scripts/gpu_check_gdn.py --merge "$OUT"/check_kda?.json
timeout 150 python3 scripts/gpu_tune_kda.py --no-fla --gates init --profile --grid "${INIT_GRID:-[{}, {}]}" \
  --json "$OUT/init.json"
timeout 90 python3 scripts/gpu_tune_kda.py --no-fla --gates bench --grid '[{}]' --json "$OUT/bench.json"
OUT=$OUT/ncu timeout 120 bash scripts/gpu_ncu_kda.sh | grep -E "_kda_bwd|Duration|ncu exit"
