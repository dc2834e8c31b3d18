#!/usr/bin/env bash
# Nsight Compute on GDN's two parallel chunk-backward launches at B4 T4096 H16 D128 bf16, the largest kernels of a
# forward+backward there (2026-11-25 00:52 profile: `_chunk_bwd_state_blk` 599 us, `_chunk_bwd_out_blk` 486 us of
# 1924). Counted bytes put each at ~50% of the DRAM roofline (~215 and ~180 KB per chunk and head, 4096 of them):
# the report says whether they wait on memory, on latency (occupancy, stalls) or on the SM's pipes.
#
#   OUT=dir bash scripts/gpu_ncu_bwd.sh      (the report as text in $OUT/ncu_bwd.txt)
source "$(dirname "$0")/ncu_common.sh"
ncu_gdn_steps "_chunk_bwd_(state|out)_blk" 4 4096 16 128 "$OUT/ncu_bwd.txt" --section SourceCounters
grep -E "_chunk_bwd_|Duration|Registers Per|Shared Memory Configuration Size|Dynamic Shared|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|L2 Cache Throughput|Stall|Warp Cycles Per Issued|Block Limit|Issue Slots Busy|Executed Ipc" "$OUT/ncu_bwd.txt" | head -n 90
