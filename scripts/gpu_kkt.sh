#!/usr/bin/env bash
# A and its solve in one launch (gdn.TUNE prep_kkt, `_kkt_solve`) against the split prep's A-then-solve, H100:
# forward launch sweeps at two shapes (gpu_tune_gdn.py --grid, bf16, errors against our fp32 run), then the
# forward's kernels one by one (CUDA time, torch profiler) with and without it.
#   OUT=out bash scripts/gpu_kkt.sh
set -u
OUT=${OUT:-out}
K='"prep_kkt": true'
G4="[{}, {$K}, {$K, \"kkt_warps\": 2}, {$K, \"kkt_warps\": 8}, {$K, \"kkt_bk\": 32}, {$K, \"kkt_prec\": \"ieee\"},
     {$K, \"kkt_prec\": \"ieee\", \"kkt_warps\": 8}, {$K, \"kkt_prec\": \"tf32x3\"}, {$K, \"kkt_warps\": 1, \"kkt_bk\": 32}, {}]"
timeout 200 python3 scripts/gpu_tune_gdn.py --grid "$G4" --grid-fwd-only --shape 4,4096,16,128 \
  --json "$OUT/kkt_4_4096_16.json" --max-seconds 170
G32="[{}, {$K}, {$K, \"kkt_warps\": 2}, {$K, \"kkt_warps\": 8}, {$K, \"kkt_prec\": \"ieee\", \"kkt_warps\": 8}, {}, {$K}]"
timeout 150 python3 scripts/gpu_tune_gdn.py --grid "$G32" --grid-fwd-only --shape 1,32768,32,128 \
  --json "$OUT/kkt_1_32768_32.json" --max-seconds 120
timeout 120 python3 scripts/gpu_profile_fwd.py --no-fla --shapes 4,4096,16,128 1,32768,32,128 --tune prep_kkt=True
