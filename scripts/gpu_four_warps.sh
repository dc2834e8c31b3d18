#!/usr/bin/env bash
# The 4-warp state passes by sequence length (scripts/gpu_four_warps.py, one process per case: an illegal memory
# access ends its process), then compute-sanitizer memcheck on a few.   OUT=out bash scripts/gpu_four_warps.sh
set -u
OUT=${OUT:-out}
cd scripts
for T in 63 1 64 65 128 129 200 1000; do
  timeout 60 python3 gpu_four_warps.py --T $T 2>&1 | grep -E "RESULT|Error|error" | head -3
done
for a in "--T 63 --bv 32" "--T 200 --bv 32" "--T 63 --stages 3" "--T 129 --stages 3" "--T 63 --warps 8"; do
  timeout 60 python3 gpu_four_warps.py $a 2>&1 | grep -E "RESULT|Error|error" | head -3
done
for T in 63 64 128; do
  timeout 90 compute-sanitizer --tool memcheck --print-limit 3 python3 gpu_four_warps.py --T $T 2>&1 \
    | grep -E "RESULT|ERROR SUMMARY|Invalid|at .*_recur" | head -8
done
