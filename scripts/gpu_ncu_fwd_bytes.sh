#!/usr/bin/env bash
# Nsight Compute's DRAM bytes and duration of each launch of our GDN training forward (bf16, B4 T4096 H16 D128 unless
# SHAPE=B,T,H,D), clocks left alone, to check `scripts/gdn_fwd_bytes.py`'s count of what the launch plan must move
# and how close each launch runs to the copy bandwidth. The second of two forward+backward steps is profiled (the
# first compiles); only its four forward launches match the regex.
#
#   OUT=dir [SHAPE=4,4096,16,128] bash scripts/gpu_ncu_fwd_bytes.sh     (report: $OUT/ncu_fwd_bytes.txt)
source "$(dirname "$0")/ncu_common.sh"
IFS=, read -r B T H D <<< "${SHAPE:-4,4096,16,128}"
"$NCU" --clock-control none --kernel-name regex:"_kkt_solve|_prep_fwd_blk|_recur_fwd|_out_fwd_raw" \
  --launch-skip 4 --launch-count 4 \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
  python3 -c "
import sys; sys.path.insert(0, 'scripts')
import torch
from gpu_tune_gdn import make, run
xs = [x.to(torch.bfloat16).float() if i != 3 else x for i, x in enumerate(make($B, $T, $H, $D))]
do = torch.randn($B, $T, $H, $D, device='cuda')
for _ in range(2):
    run(xs, torch.bfloat16, True, do)
torch.cuda.synchronize()
" > "$OUT/ncu_fwd_bytes.txt" 2>&1
echo "ncu exit $?"
grep -E "_kkt_solve|_prep_fwd_blk|_recur_fwd|_out_fwd_raw|dram__bytes|gpu__time_duration" "$OUT/ncu_fwd_bytes.txt" | head -n 40
