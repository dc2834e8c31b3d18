#!/usr/bin/env bash
# Nsight Compute's DRAM bytes and duration of each launch of our GDN training forward (PASS=fwd, the default: its
# four launches) or backward (PASS=bwd: the state backward and the two chunk-backward launches), bf16, B4 T4096 H16
# D128 unless SHAPE=B,T,H,D, clocks left alone: to check `scripts/gdn_fwd_bytes.py`'s count of what the launch plan
# must move and how close each launch runs to the copy bandwidth. The second of two forward+backward steps is
# profiled (the first compiles).
#
#   OUT=dir [PASS=fwd|bwd] [SHAPE=4,4096,16,128] bash scripts/gpu_ncu_gdn_bytes.sh   (report: $OUT/ncu_PASS_bytes.txt)
source "$(dirname "$0")/ncu_common.sh"
IFS=, read -r B T H D <<< "${SHAPE:-4,4096,16,128}"
PASS=${PASS:-fwd}
case $PASS in
  fwd) REGEX="_kkt_solve|_prep_fwd_blk|_recur_fwd|_out_fwd_raw"; N=4 ;;
  bwd) REGEX="_recur_bwd|_chunk_bwd_state_blk|_chunk_bwd_out_blk"; N=3 ;;
  *) echo "PASS: expected fwd or bwd, got $PASS"; exit 2 ;;
esac
REPORT="$OUT/ncu_${PASS}_bytes.txt"
"$NCU" --clock-control none --kernel-name regex:"$REGEX" --launch-skip "$N" --launch-count "$N" \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
  python3 -c "$(gdn_steps_py "$B" "$T" "$H" "$D")" > "$REPORT" 2>&1
echo "ncu exit $?"
grep -E "\(.*\)x\(|dram__bytes|gpu__time_duration" "$REPORT" | head -n 40
