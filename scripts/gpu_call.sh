#!/usr/bin/env bash
# One lent-GPU call: install carried wheels (fla for the comparisons), then run the named steps, each under its
# own time limit so that one slow or failing step does not take the others' results with it.
#
#   bash scripts/gpu_call.sh STEP[:SECONDS] ...      (results under $OUT/STEP/, logs in $OUT/STEP.log)
#
# Steps: info, profile (bench kernels, first shape, per-kernel CUDA times), tune (launch sweep -> tune.json),
# tunebwd (the GDN chunk-backward plans only, old default first, built-in forward -> tune_bwd.json),
# tunelean (the inference-forward plans vs the training forward and fla, forward only, three shapes),
# tunewarps (each launch's warps alone, forward and backward, two shapes), checklean (the GPU check under tunelean's best), profstages (the prep's launches timed one by one, four variants), proffwd (per-kernel CUDA times of ours, ours lean and fla, forward and forward+backward, two shapes),
# tunekda (KDA launch plans vs fla's chunk_kda, B4 T4096 H16 D128; fla's autotuning alone takes over 4 minutes),
# tunekdainit (the same without fla, on the log-decays of a freshly initialised KDA layer: most chunks outside the
# whole-chunk dot's bound),
# kernels (full kernel table, with tune.json when the tune step ran), kernelsq / kdagdn (first shape only; with
# the KDA row), layers / layersq (whole-layer table; one width and length), layerskda (the KDA layer row alone,
# no recompute variant: fla's KDA layer autotunes for over 4 minutes; rows are saved as they finish), layersprof (the GDN layer row with
# per-kernel CUDA times of ours, ours with recompute and fla's), check (GDN/KDA vs float64, pass/fail), checkdiag (check, and the KDA cases under three kda.TUNE diag_dot settings),
# glue (fused glue vs float64), train30m (the no-argument GPU run, gpu-30m), mqar (paper-preset cells in six
# concurrent shards until the step's limit, resuming from results/mqar-paper/results.json: copy the returned
# results.json there and commit it to go on in a later call; MQAR_SHARDS, MQAR_ARGS), mqargroups (the same, one
# CUDA-graph process per flag group of MQAR_GROUPS), mqarcheck (CUDA graphs vs eager: the GPU test, then ms/step
# of one process at the paper setting both ways), train350m (bench train: 357M hybrid training tokens/s, ours vs
# fla, one GPU), fsdp2 (scripts/gpu_fsdp2.sh: two GPUs vs one, loss and tokens/s), kdasan (compute-sanitizer
# memcheck over the two KDA settings that stopped with an illegal memory access, bwd_lowp off and bwd_warps 4: since
# 2026-11-24 both are refused on CUDA with a ValueError, so the step now shows that refusal),
# swiglu (the fused SwiGLU kernel's GPU check and timing row), kktacc (scripts/gpu_kkt_accuracy.py: the GDN
# solve's dot precisions against float64 over 8 seeds), kdasolve (kda.TUNE solve_blocks on both gate kinds).
# Any other STEP runs as a bash command.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || echo "wheel install failed"
else
  export PYTHONPATH=$PWD
fi
TUNE_ARG=()
n_cmd=0
for spec in "$@"; do
  # the limit is what follows the last colon when that is a number, so a command may hold colons (JSON, URLs)
  step=$spec
  secs=300
  if [[ $spec =~ ^(.*):([0-9]+)$ ]]; then step=${BASH_REMATCH[1]}; secs=${BASH_REMATCH[2]}; fi
  echo "=== $step (limit ${secs}s) $(date -u +%H:%M:%S)"
  case $step in
    info) cmd=(bash -c "nvidia-smi -L; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'; python3 -m pip show fla-core 2>/dev/null | head -2") ;;
    profile) cmd=(python3 -m hybridlm.bench.kernels --quick --profile --rep 50 --no-sdpa --out "$OUT/profile" "${TUNE_ARG[@]}") ;;
    tune) cmd=(python3 scripts/gpu_tune_gdn.py --json "$OUT/tune.json" --max-seconds $((secs - 40))) ;;
    tunebwd) cmd=(python3 scripts/gpu_tune_gdn.py --bwd-only --json "$OUT/tune_bwd.json" --max-seconds $((secs - 40))) ;;
    tunelean) cmd=(bash -c "for s in 4,4096,16,128 1,32768,32,128 8,2048,32,128; do python3 scripts/gpu_tune_gdn.py \
                     --lean --shape \$s --json $OUT/lean_\${s//,/_}.json --max-seconds 150; done") ;;
    proffwd) cmd=(python3 scripts/gpu_profile_fwd.py --bwd --tune fwd_variant=lean lean_warps=4 out_warps=4) ;;
    tunewarps) cmd=(bash -c "for s in 4,4096,16,128 1,32768,32,128; do python3 scripts/gpu_tune_gdn.py \
                     --warps --shape \$s --json $OUT/warps_\${s//,/_}.json --max-seconds 120; done") ;;
    profstages) # the forward prep's launches one by one (CUDA events), built-in settings and four variants, ours only
          cmd=(bash -c "for t in '' 'prep_warps=4' 'prep_lowp=True' 'solve_warps=2' \
                 'fwd_variant=lean lean_warps=4 out_warps=4 out_bv=128'; do python3 scripts/gpu_profile_fwd.py \
                 --no-fla --shapes 4,4096,16,128 \${t:+--tune \$t}; done") ;;
    checklean) # the full GPU check under the best setting of the tunelean step at the first shape
          cmd=(bash -c "for i in 0 1 2 3; do python3 scripts/gpu_check_gdn.py --part \$i/4 --json $OUT/check\$i.json \
                 --tune-json $OUT/lean_4_4096_16_128.json > $OUT/check\$i.part.log 2>&1 & done; wait; \
                 tail -n 3 $OUT/check?.part.log; python3 scripts/gpu_check_gdn.py --merge $OUT/check?.json") ;;
    tunekda) cmd=(python3 scripts/gpu_tune_kda.py --json "$OUT/tune_kda.json" --max-seconds $((secs - 40))) ;;
    tunekdainit) cmd=(python3 scripts/gpu_tune_kda.py --no-fla --gates init --json "$OUT/tune_kda_init.json" \
                      --max-seconds $((secs - 90))) ;;
    kernels) cmd=(python3 -m hybridlm.bench.kernels --rep 100 --profile --out "$OUT/kernels" "${TUNE_ARG[@]}") ;;
    kernelsq) cmd=(python3 -m hybridlm.bench.kernels --rep 100 --quick --profile --out "$OUT/kernelsq" "${TUNE_ARG[@]}") ;;
    kdagdn) cmd=(python3 -m hybridlm.bench.kernels --rep 100 --quick --parts kda,gdn --profile --out "$OUT/kdagdn" "${TUNE_ARG[@]}") ;;
    layers) cmd=(python3 -m hybridlm.bench.layers --rep 50 --out "$OUT/layers") ;;
    layersq) cmd=(python3 -m hybridlm.bench.layers --rep 50 --seq-lens 2048 --widths 2048 --rows gdn,kda --out "$OUT/layersq") ;;
    layerskda) cmd=(python3 -m hybridlm.bench.layers --rep 50 --seq-lens 2048 --widths 2048 --rows kda --no-recompute \
                    --out "$OUT/layerskda") ;;
    layersprof) cmd=(python3 -m hybridlm.bench.layers --rep 50 --seq-lens 2048 --widths 2048 --rows gdn --profile \
                     --out "$OUT/layersprof") ;;
    # check: CHECK_PARTS processes (default 8; 4 before 2026-11-24 16:30): on a fresh machine the compiles take
    # most of the time (more than 450 s at 4 parts, 53-87 s warm), so more of the 16 CPUs compile at once
    check) np=${CHECK_PARTS:-8}
      cmd=(bash -c "for i in \$(seq 0 $((np - 1))); do python3 scripts/gpu_check_gdn.py --part \$i/$np --json $OUT/check\$i.json ${TUNE_ARG[*]} > $OUT/check\$i.part.log 2>&1 & done; wait; tail -n 3 $OUT/check*.part.log; python3 scripts/gpu_check_gdn.py --merge $OUT/check[0-9]*.json") ;;
    checkdiag) # the full check (four parts) beside the KDA cases with the diagonal-block dot in fewer kernels
          cmd=(bash -c "for i in 0 1 2 3; do python3 scripts/gpu_check_gdn.py --part \$i/4 --json $OUT/check\$i.json \
                 > $OUT/check\$i.part.log 2>&1 & done; for d in prep,bwd_out prep none; do python3 scripts/gpu_check_gdn.py \
                 --only kda --kda-diag \$d --json $OUT/diag_\$d.json > $OUT/diag_\$d.log 2>&1 & done; wait; \
                 for d in prep,bwd_out prep none; do echo diag \$d; grep -E 'FAIL|passed' $OUT/diag_\$d.log; done; \
                 python3 scripts/gpu_check_gdn.py --merge $OUT/check?.json") ;;
    glue) cmd=(python3 scripts/gpu_check_glue.py) ;;
    precision) cmd=(python3 scripts/gpu_precision_vs_fla.py --json "$OUT/precision.json") ;;  # ours and fla vs float64
    train30m) cmd=(python3 -m hybridlm train --out "$OUT/train30m" --no-progress --sample-tokens 200) ;;
    mqar) mkdir -p "$OUT/mqar"; cp results/mqar-paper/results*.json "$OUT/mqar/" 2>/dev/null
          # MQAR_SHARDS processes (default 6) share the GPU, each small model leaving it idle between launches;
          # MQAR_ARGS adds flags (e.g. --cuda-graphs); then one run merges the shards' files
          n=${MQAR_SHARDS:-6}
          cmd=(bash -c "for i in \$(seq 0 $((n - 1))); do OMP_NUM_THREADS=2 python3 -m hybridlm bench mqar \
                 --preset paper ${MQAR_ARGS:-} --out $OUT/mqar --shard \$i/$n --max-minutes $(((secs - 45) / 60)) \
                 > $OUT/mqar/shard\$i.log 2>&1 & done; wait; tail -n 3 $OUT/mqar/shard*.log; \
                 python3 -m hybridlm bench mqar --preset paper ${MQAR_ARGS:-} --out $OUT/mqar --max-cells 0") ;;
    mqargroups) # one process per '|'-separated group of flags in MQAR_GROUPS (e.g. "--mixers gdn|--mixers kda"), CUDA
          # graphs on, no time budget of their own (each writes after every cell: the step limit loses only the cell
          # in progress); then one run merges their files (few processes: eight shared the GPU worse than one)
          mkdir -p "$OUT/mqar"; cp results/mqar-paper/results*.json "$OUT/mqar/" 2>/dev/null
          IFS='|' read -r -a groups <<< "${MQAR_GROUPS:?set MQAR_GROUPS}"
          script=""
          for g in "${!groups[@]}"; do
            script+="mkdir -p $OUT/g$g; cp $OUT/mqar/results.json $OUT/g$g/; (OMP_NUM_THREADS=4 timeout $((secs - 25)) \
              python3 -m hybridlm bench mqar --preset paper --cuda-graphs ${groups[$g]} --out $OUT/g$g --no-plot \
              > $OUT/mqar/group$g.log 2>&1; cp $OUT/g$g/results.json $OUT/mqar/results.shardgroup$g.json) & "
          done
          cmd=(bash -c "$script wait; tail -n 4 $OUT/mqar/group*.log; python3 -m hybridlm bench mqar --preset paper \
               --out $OUT/mqar --max-cells 0") ;;
    mqarcheck) # CUDA graphs against eager (the GPU test), then one process's ms/step at the paper setting both ways
          cmd=(bash -c "python3 -m pytest -q -x tests/bench/test_mqar.py -k cuda_graphs 2>&1 | tail -n 3; \
                 for g in eager --cuda-graphs; do python3 -m hybridlm bench mqar --preset paper --mixers attention \
                 gdn kda --widths 64 --lrs 0.003 --steps 300 --no-plot --out $OUT/mqarcheck\$g \
                 \$([ \$g = eager ] || echo \$g) | grep -E 'ms/step'; done") ;;
    train350m) cmd=(python3 -m hybridlm.bench.train --out "$OUT/train350m") ;;
    fsdp2) cmd=(env OUT="$OUT" bash scripts/gpu_fsdp2.sh) ;;
    kdasan) cmd=(bash -c "for v in exact_nolowp dot_w4; do compute-sanitizer --tool memcheck --print-limit 5 \
                 python3 scripts/gpu_kda_state_dot.py --variants \$v --no-time 2>&1 | grep -v 'Host Frame' | head -n 60; done") ;;
    swiglu) cmd=(python3 scripts/gpu_check_glue.py --only swiglu --json "$OUT/swiglu.json") ;;
    kktacc) cmd=(python3 scripts/gpu_kkt_accuracy.py --seeds 8 --json "$OUT/kkt_acc.json") ;;
    kdasolve) # KDA's UT solve by blocks (kda.TUNE solve_blocks) against _kda_solve, the bench's gates then a fresh
          # layer's, ours only
          cmd=(bash -c "for gates in bench init; do python3 scripts/gpu_tune_kda.py --no-fla --gates \$gates \
                 --grid '[{}, {\"solve_blocks\": true}, {}, {\"solve_blocks\": true}]' \
                 --json $OUT/kdasolve_\$gates.json --max-seconds 120; done") ;;
    *) cmd=(bash -c "$step") ;;  # its log is $OUT/cmdN.log (N counts the free-form steps from 1)
  esac
  log=$step
  if [[ ! $step =~ ^[A-Za-z0-9_]+$ ]]; then n_cmd=$((n_cmd + 1)); log=cmd$n_cmd; fi  # a command is no file name
  timeout -k 10 "$secs" "${cmd[@]}" 2>&1 | tee "$OUT/$log.log" | tail -n 60
  echo "--- $step exit ${PIPESTATUS[0]} $(date -u +%H:%M:%S)"
  if [ "$step" = tune ] && [ -f "$OUT/tune.json" ]; then TUNE_ARG=(--tune-json "$OUT/tune.json"); fi
done
# the tool brings back at most 8 files: pack everything into one archive beside the step logs' tails
tar czf /tmp/gpu_call.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/gpu_call.tgz "$OUT/"
