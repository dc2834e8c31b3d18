#!/usr/bin/env bash
# Nsight Compute on GDN's serial state passes at B1 T32768 H32 D128 bf16, where they hold the forward and backward
# behind fla's (2026-11-24 15:02 profile: `_recur_fwd` 1300 us against fla's 630, `_recur_bwd` 2543 then ~1.8 ms
# against 1098): the second forward+backward step's `_recur_fwd` and `_recur_bwd` (one launch each per step), with
# throughput, occupancy, L2 and warp-stall sections. The question it answers: whether a chunk step waits on L2
# (every V-block program of a head loads the same W and Kd tiles: ~3.5 TB/s of L2 reads at V block 16 if the step
# takes 2.5 us) or on the dependent dots' latency, before the state pass is changed again.
#
#   OUT=dir bash scripts/gpu_ncu_recur.sh      (the report as text in $OUT/ncu_recur.txt)
source "$(dirname "$0")/ncu_common.sh"
ncu_gdn_steps "_recur_(fwd|bwd)" 1 32768 32 128 "$OUT/ncu_recur.txt"
grep -E "_recur_|Duration|Registers Per|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|Stall|Warp Cycles Per Issued|Block Limit" "$OUT/ncu_recur.txt" | head -n 80
