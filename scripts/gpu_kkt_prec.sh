#!/usr/bin/env bash
# `_kkt_solve`'s dot precision for bf16 inputs (gdn.TUNE kkt_prec, kkt_diag_prec) against the plan before it (A in
# memory, its solve in fp32, the prep's stage 1): errors against our fp32 run on the same inputs (gpu_tune_gdn.py
# --grid) at K=V=256 and 128, and the forward's time.   OUT=out bash scripts/gpu_kkt_prec.sh
set -u
OUT=${OUT:-out}
G='[{}, {"kkt_diag_prec": "tf32x3"}, {"kkt_prec": "tf32x3"}, {"prep_kkt": false, "fwd_raw_out": false, "state_raw_k": false}]'
timeout 150 python3 scripts/gpu_tune_gdn.py --grid "$G" --shape 1,4096,4,256 --json "$OUT/prec_1_4096_4_256.json" \
  --max-seconds 120
timeout 150 python3 scripts/gpu_tune_gdn.py --grid "$G" --shape 4,4096,16,128 --json "$OUT/prec_4_4096_16_128.json" \
  --max-seconds 120
timeout 120 python3 scripts/gpu_tune_gdn.py --grid "$G" --grid-fwd-only --shape 1,32768,32,128 \
  --json "$OUT/prec_1_32768_32_128.json" --max-seconds 90
