#!/usr/bin/env bash
# compute-sanitizer memcheck over the GPU check's T63 case under the state passes' launch settings that sped up
# B1 T32768 H32 (2026-11-24 15:08, scripts/gpu_gdn_recur.sh) but stopped that case with an illegal memory access
# (fwd_warps 4 with rbwd_warps 4): each setting alone, so the report names the kernel and the setting.
#
# From d7f4aca to 2026-11-25 4 warps were refused on CUDA for these kernels; since then `gdn._state_warps` takes
# them only when the chunk loop runs at least fwd_stages times (the fault is the one-chunk loop, as T63 has:
# scripts/gpu_four_warps.sh), so the T63 runs here now get 8 warps. To rerun them as they ran, let
# `_state_warps` return TUNE[key] on CUDA (scripts/gpu_four_warps.py does).
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
