#!/usr/bin/env bash
# KDA's strong-decay bf16 tail over 20 seeds under three storage plans at once (one process each), fla-core's
# chunk_kda beside the default. (The run of 2026-11-25 02:59 had a fourth, the chunk states alone in fp32, through
# a temporary switch of kda._fwd_impl not kept: dbeta 7.42e-3, dg 5.39e-3.)
#   OUT=out bash scripts/gpu_kda_tail.sh
set -u
OUT=${OUT:-out}
cd "$(dirname "$0")"
python3 gpu_kda_tail.py --seeds 20 --fla --json "$OUT/tail_default.json" > "$OUT/tail_default.log" 2>&1 &
python3 gpu_kda_tail.py --seeds 20 --kda-tune '{"state_fp32": true}' --label "states+Kd fp32" \
  --json "$OUT/tail_hbkd.json" > "$OUT/tail_hbkd.log" 2>&1 &
python3 gpu_kda_tail.py --seeds 20 --gdn-tune '{"store_fp32": true}' --label "all fp32 (store_fp32)" \
  --json "$OUT/tail_all.json" > "$OUT/tail_all.log" 2>&1 &
wait
tail -n 4 "$OUT"/tail_*.log
