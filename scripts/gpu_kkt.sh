#!/usr/bin/env bash
# A and its solve in one launch (gdn.TUNE prep_kkt, `_kkt_solve`) against the split prep's A-then-solve, H100.
#   OUT=out bash scripts/gpu_kkt.sh [sweep|pick|check]
# sweep (21:34): forward launch sweeps at two shapes (gpu_tune_gdn.py --grid, bf16, errors against our fp32 run),
#   then the forward's kernels one by one (CUDA time, torch profiler) with and without it.
# pick: 1 and 2 warps at key blocks 32 and 64, both shapes, and the profile at the pick.
# check: the full GPU check (scripts/gpu_check_gdn.py, 8 processes) with prep_kkt at 1 warp, key block 32.
set -u
OUT=${OUT:-out}
K='"prep_kkt": true'
case ${1:-sweep} in
  sweep)
    G4="[{}, {$K}, {$K, \"kkt_warps\": 2}, {$K, \"kkt_warps\": 8}, {$K, \"kkt_bk\": 32}, {$K, \"kkt_prec\": \"ieee\"},
         {$K, \"kkt_prec\": \"ieee\", \"kkt_warps\": 8}, {$K, \"kkt_prec\": \"tf32x3\"}, {$K, \"kkt_warps\": 1, \"kkt_bk\": 32}, {}]"
    timeout 200 python3 scripts/gpu_tune_gdn.py --grid "$G4" --grid-fwd-only --shape 4,4096,16,128 \
      --json "$OUT/kkt_4_4096_16.json" --max-seconds 170
    G32="[{}, {$K}, {$K, \"kkt_warps\": 2}, {$K, \"kkt_warps\": 8}, {$K, \"kkt_prec\": \"ieee\", \"kkt_warps\": 8}, {}, {$K}]"
    timeout 150 python3 scripts/gpu_tune_gdn.py --grid "$G32" --grid-fwd-only --shape 1,32768,32,128 \
      --json "$OUT/kkt_1_32768_32.json" --max-seconds 120
    timeout 120 python3 scripts/gpu_profile_fwd.py --no-fla --shapes 4,4096,16,128 1,32768,32,128 --tune prep_kkt=True
    ;;
  pick)
    G="[{}, {$K, \"kkt_warps\": 1, \"kkt_bk\": 32}, {$K, \"kkt_warps\": 1, \"kkt_bk\": 64}, {$K, \"kkt_warps\": 2, \"kkt_bk\": 32},
        {$K, \"kkt_warps\": 2, \"kkt_bk\": 64}, {$K, \"kkt_warps\": 1, \"kkt_bk\": 16}, {}, {$K, \"kkt_warps\": 1, \"kkt_bk\": 32}]"
    for s in 4,4096,16,128 1,32768,32,128 8,2048,32,128; do
      timeout 75 python3 scripts/gpu_tune_gdn.py --grid "$G" --grid-fwd-only --shape $s \
        --json "$OUT/kkt_pick_${s//,/_}.json" --max-seconds 55
    done
    timeout 60 python3 scripts/gpu_profile_fwd.py --no-fla --shapes 4,4096,16,128 \
      --tune prep_kkt=True kkt_warps=1 kkt_bk=32
    ;;
  check)
    echo "{\"best\": {$K, \"kkt_warps\": 1, \"kkt_bk\": 32}}" > "$OUT/kkt_tune.json"
    for i in $(seq 0 7); do
      python3 scripts/gpu_check_gdn.py --part $i/8 --json "$OUT/check$i.json" --tune-json "$OUT/kkt_tune.json" \
        > "$OUT/check$i.part.log" 2>&1 &
    done
    wait
    tail -n 3 "$OUT"/check*.part.log
    python3 scripts/gpu_check_gdn.py --merge "$OUT"/check[0-9]*.json
    ;;
  *) echo "unknown mode $1"; exit 2 ;;
esac
