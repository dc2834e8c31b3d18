#!/usr/bin/env bash
# KDA's strong-decay bf16 tail over 20 seeds under four storage plans at once (one process each; KDA_FP32 names the
# forward buffers kept in fp32, an experiment switch of kda._fwd_impl), fla-core's chunk_kda beside the default.
#   OUT=out bash scripts/gpu_kda_tail.sh
set -u
OUT=${OUT:-out}
cd "$(dirname "$0")"
python3 gpu_kda_tail.py --seeds 20 --fla --json "$OUT/tail_default.json" > "$OUT/tail_default.log" 2>&1 &
KDA_FP32=hb python3 gpu_kda_tail.py --seeds 20 --label "states fp32" --json "$OUT/tail_hb.json" \
  > "$OUT/tail_hb.log" 2>&1 &
KDA_FP32=hb,Kd python3 gpu_kda_tail.py --seeds 20 --label "states+Kd fp32" --json "$OUT/tail_hbkd.json" \
  > "$OUT/tail_hbkd.log" 2>&1 &
python3 gpu_kda_tail.py --seeds 20 --gdn-tune '{"store_fp32": true}' --label "all fp32 (store_fp32)" \
  --json "$OUT/tail_all.json" > "$OUT/tail_all.log" 2>&1 &
wait
tail -n 4 "$OUT"/tail_*.log
