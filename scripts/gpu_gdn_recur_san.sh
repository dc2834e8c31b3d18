#!/usr/bin/env bash
# compute-sanitizer memcheck over the GPU check's T63 case under the state passes' launch settings that sped up
# B1 T32768 H32 (2026-11-24 15:08, scripts/gpu_gdn_recur.sh) but stopped that case with an illegal memory access
# (fwd_warps 4 with rbwd_warps 4): each setting alone, so the report names the kernel and the setting.
#
# Since commit d7f4aca 4 warps are refused on CUDA for these kernels (`gdn._state_warps`, from these findings),
# so the 4-warp settings now stop with that ValueError. They ran on the tree of d7f4aca before that check was in
# it; to rerun them, let `_state_warps` return TUNE[key] on CUDA too.
#
#   OUT=dir bash scripts/gpu_gdn_recur_san.sh      (results under $OUT)
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
i=0
for s in '{"fwd_warps": 4}' '{"rbwd_warps": 4}' '{"rbwd_bv": 32, "rbwd_warps": 4}' '{"rbwd_bv": 32}' '{}'; do
  echo "{\"best\": $s}" > "$OUT/s$i.json"
  echo "=== $s"
  timeout 110 compute-sanitizer --tool memcheck --print-limit 3 \
    python3 scripts/gpu_check_gdn.py --only T63 --tune-json "$OUT/s$i.json" > "$OUT/san$i.log" 2>&1
  grep -E "Invalid|^=========     at|by thread|PASS|FAIL|ERROR SUMMARY|passed" "$OUT/san$i.log" | head -14
  i=$((i + 1))
done
