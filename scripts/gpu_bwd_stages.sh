#!/usr/bin/env bash
# The K-blocked chunk backward's latency (ncu 2026-11-25 03:17, scripts/gpu_ncu_bwd.sh: 255 registers, 2 programs of
# 4 warps per SM, half the cycles stalled on global loads): pipelined loads (gdn.TUNE bwd_stages 2), V block 32
# (bwd_bv), a register cap of 168 (3 programs per SM, ~330 B of spills on the sm_90 compile), forward+backward at
# B4 T4096 H16 and B1 T32768 H32 (gpu_tune_gdn.py --grid, errors against our fp32 run).
#   OUT=out bash scripts/gpu_bwd_stages.sh
set -u
OUT=${OUT:-out}
G='[{}, {"bwd_stages": 2}, {"bwd_bv": 32}, {"bwd_stages": 2, "bwd_bv": 32}, {"bwd_maxnreg": 168}, {}]'
for s in 4,4096,16,128 1,32768,32,128; do
  timeout 200 python3 scripts/gpu_tune_gdn.py --grid "$G" --shape $s --json "$OUT/bwdst_${s//,/_}.json" \
    --max-seconds 180
done
