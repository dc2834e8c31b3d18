#!/usr/bin/env bash
# The same GPU-check inputs (part and seed of an earlier run) under several gdn.TUNE plans, to tell a plan's
# error from a seed's: OUT=out bash scripts/gpu_check_ab.sh PART SEED TUNE_JSON...
set -u
OUT=${OUT:-out}
part=$1; seed=$2; shift 2
i=0
for t in "$@"; do
  python3 scripts/gpu_check_gdn.py --part "$part" --seed "$seed" --gdn-tune "$t" --json "$OUT/ab_${seed}_$i.json" \
    > "$OUT/ab_${seed}_$i.log" 2>&1 &
  i=$((i + 1))
done
wait
i=0
for t in "$@"; do
  echo "=== part $part seed $seed tune $t"
  grep -E "^(PASS|FAIL)" "$OUT/ab_${seed}_$i.log" | grep -v decode
  i=$((i + 1))
done
