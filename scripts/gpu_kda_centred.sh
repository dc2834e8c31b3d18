#!/usr/bin/env bash
# KDA's dot bound taken about the midpoint of each block's log-decay range (`kda_kernels._centred`) against the
# block's middle row (the kernels before it): forward and forward+backward at B4 T4096 H16 D128 bf16, ours only,
# on a fresh layer's gates (where it moves chunks from the half-block launches to the 16-row dot) and the bench's
# (every chunk whole either way), new / old / new, each in its own process. PART=check: the KDA cases of the
# float64 check (three parts) beside the strong-decay bf16 tail over 20 seeds, on the new kernels.
#   git show <commit before it>:hybridlm/ops/triton/kda_kernels.py > .ab/kda_kernels_old.py
#   OUT=out [PART=time|check] [RUNS="init:new init:old ..."] [LIMIT=seconds a run] bash scripts/gpu_kda_centred.sh
# (carry .ab; a fresh machine needs over 150 s a run to compile the bf16 and fp32 kernels)
set -u
OUT=${OUT:-out}
F=hybridlm/ops/triton/kda_kernels.py
if [ "${PART:-time}" = time ]; then
  cp "$F" /tmp/kda_kernels_new.py
  cp .ab/kda_kernels_old.py /tmp/kda_kernels_old.py
  for run in ${RUNS:-init:new init:old init:new bench:new bench:old}; do
    gates=${run%%:*} v=${run##*:}
    cp "/tmp/kda_kernels_$v.py" "$F"
    echo "== $gates $v"
    timeout "${LIMIT:-280}" python3 scripts/gpu_tune_kda.py --no-fla --gates "$gates" --grid '[{}]' \
      --json "$OUT/centred_${gates}_$v.json" --max-seconds $((${LIMIT:-280} - 20)) 2>&1 | tail -n 2
  done
  cp /tmp/kda_kernels_new.py "$F"
else
  (cd scripts && python3 gpu_kda_tail.py --seeds 20 --label centred --json "$OUT/tail_centred.json" \
    > "$OUT/tail_centred.log" 2>&1) &
  for i in 0 1 2; do
    python3 scripts/gpu_check_gdn.py --only kda --part $i/3 --json "$OUT/kdacheck$i.json" > "$OUT/kdacheck$i.log" 2>&1 &
  done
  wait
  grep -hE "^\| .*(PASS|FAIL)" "$OUT"/kdacheck*.log
  tail -n 3 "$OUT"/kdacheck*.log
  tail -n 4 "$OUT/tail_centred.log"
fi
