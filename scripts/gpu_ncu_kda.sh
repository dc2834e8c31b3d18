#!/usr/bin/env bash
# Nsight Compute on the K-blocked KDA backward at B4 T4096 H16 D128 bf16, on the gates of a freshly initialised layer:
# the second forward+backward step's launches of `_kda_bwd_out_blk` and `_kda_bwd_state_blk` (DIAG 3 whole chunk,
# 1 diagonal-block dot, 4 half-block dots, 2 exact, for each kernel: LAUNCHES=8 per step), with throughput,
# occupancy, launch and warp-stall sections,
# so that the next change to the block launches aims at what they wait on.
#
#   OUT=dir [GATES=init|bench] bash scripts/gpu_ncu_kda.sh      (the report as text in $OUT/ncu_kda.txt)
source "$(dirname "$0")/ncu_common.sh"
"$NCU" --kernel-name regex:"_kda_bwd_(out|state)_blk" --launch-skip "${LAUNCHES:-8}" --launch-count "${LAUNCHES:-8}" \
  "${NCU_SECTIONS[@]}" \
  python3 -c "
import sys; sys.path.insert(0, 'scripts')
import torch
from gpu_tune_kda import make, run
xs = make(4, 4096, 16, 128, gates='${GATES:-init}')
do = torch.randn(4, 4096, 16, 128, device='cuda').bfloat16().float()
for _ in range(2):
    run(xs, torch.bfloat16, True, do)
torch.cuda.synchronize()
" > "$OUT/ncu_kda.txt" 2>&1
echo "ncu exit $?"
grep -E "_kda_bwd|Duration|Registers Per|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput|Stall|Warp Cycles Per Issued|Local Memory|Block Limit" "$OUT/ncu_kda.txt" | head -n 120
