#!/usr/bin/env bash
# The state passes' V block and pipeline stages since they run at 4 warps (2026-11-25): gdn.TUNE fwd_bv / rbwd_bv
# (default: 32, halved to 16 where the halved grid still fits one wave) and fwd_stages 3, forward and
# forward+backward at B1 T32768 H32 and B4 T4096 H16 (gpu_tune_gdn.py --grid, errors against our fp32 run).
#   OUT=out bash scripts/gpu_state_bv.sh
set -u
OUT=${OUT:-out}
G='[{}, {"fwd_bv": 32}, {"fwd_bv": 64}, {"rbwd_bv": 16}, {"rbwd_bv": 64}, {"fwd_stages": 3}, {}]'
timeout 200 python3 scripts/gpu_tune_gdn.py --grid "$G" --shape 1,32768,32,128 --json "$OUT/bv_1_32768_32.json" \
  --max-seconds 180
G2='[{}, {"fwd_bv": 16}, {"fwd_bv": 64}, {"rbwd_bv": 16}, {"rbwd_bv": 64}, {"fwd_stages": 3}, {}]'
timeout 130 python3 scripts/gpu_tune_gdn.py --grid "$G2" --shape 4,4096,16,128 --json "$OUT/bv_4_4096_16.json" \
  --max-seconds 110
