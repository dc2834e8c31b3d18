#!/usr/bin/env bash
# Nsight Compute on GDN's two parallel chunk-backward launches at B4 T4096 H16 D128 bf16, the largest kernels of a
# forward+backward there (2026-11-25 00:52 profile: `_chunk_bwd_state_blk` 599 us, `_chunk_bwd_out_blk` 486 us of
# 1924). Counted bytes put each at ~50% of the DRAM roofline (~215 and ~180 KB per chunk and head, 4096 of them):
# the report says whether they wait on memory, on latency (occupancy, stalls) or on the SM's pipes.
#
#   OUT=dir bash scripts/gpu_ncu_bwd.sh      (the report as text in $OUT/ncu_bwd.txt)
source "$(dirname "$0")/ncu_common.sh"
"$NCU" --kernel-name regex:"_chunk_bwd_(state|out)_blk" --launch-skip 2 --launch-count 2 \
  "${NCU_SECTIONS[@]}" --section SourceCounters \
  python3 -c "
import sys; sys.path.insert(0, 'scripts')
import torch
from gpu_tune_gdn import make, run
xs = [x.to(torch.bfloat16).float() if i != 3 else x for i, x in enumerate(make(4, 4096, 16, 128))]
do = torch.randn(4, 4096, 16, 128, device='cuda')
for _ in range(2):
    run(xs, torch.bfloat16, True, do)
torch.cuda.synchronize()
" > "$OUT/ncu_bwd.txt" 2>&1
echo "ncu exit $?"
grep -E "_chunk_bwd_|Duration|Registers Per|Shared Memory Configuration Size|Dynamic Shared|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|L2 Cache Throughput|Stall|Warp Cycles Per Issued|Block Limit|Issue Slots Busy|Executed Ipc" "$OUT/ncu_bwd.txt" | head -n 90
