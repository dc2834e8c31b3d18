#!/usr/bin/env bash
# One GPU call for kda.TUNE["sub_bk"] (the key block of the half-block launches alone; at 16 they compile on sm_90
# without spills): forward and forward+backward with the default (the launch's key block) and with 16, twice each
# in turn, on the gates of a freshly initialised layer. Each row prints its worst error against fp32, so a key block
# below the V block that goes wrong on the GPU (as GDN's dk once did) shows here.
#
#   OUT=dir bash scripts/gpu_kda_sub_bk.sh      (results under $OUT)
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
timeout 230 python3 scripts/gpu_tune_kda.py --no-fla --gates init --max-seconds 200 --json "$OUT/sub_bk.json" \
  --grid '[{}, {"sub_bk": 16}, {}, {"sub_bk": 16}]'
