#!/usr/bin/env bash
# The driver of one call on a lent GPU machine: installs the carried wheels (fla-core, for the comparisons), then
# runs the named steps, each under its own time limit, so that one slow or failing step keeps the others' results.
# Run it to refresh a table of BENCHMARKS.md (each table names its step) or to check the kernels on a GPU after a
# change to them.
#
#   bash scripts/gpu_call.sh STEP[:SECONDS] ...     (default 300 s a step; results under $OUT/STEP/, logs in
#                                                    $OUT/STEP.log; everything packed into $OUT/gpu_call.tgz)
#
# Steps:
#   info       GPUs, torch, Triton and fla-core versions
#   kernels    `hybridlm bench kernels`: decode, GDN at the four shapes, KDA on both gate kinds, against fla and SDPA
#   layers     `hybridlm bench layers`: the GDN and KDA layers against fla's, one width and length
#   check      scripts/gpu_check_gdn.py: GDN and KDA against float64 (pass/fail), in CHECK_PARTS processes (8)
#   glue       scripts/gpu_check_glue.py: the fused glue (conv, norms, gates, SwiGLU) against float64, and timings
#   precision  scripts/gpu_precision_vs_fla.py: ours and fla-core against float64
#   ncu        scripts/gpu_ncu_bytes.py: bytes and time of every kernel of a GDN and a KDA training step
#   train30m   `hybridlm train` with no arguments (the gpu-30m preset)
#   train350m  `hybridlm bench train`: a 357M hybrid's training tokens/s, ours against fla's model
#   fsdp2      scripts/gpu_fsdp2.sh (two GPUs): the same loss as one GPU, and tokens/s of two against one
#   family     the GPU parity tests of Comba, MesaNet, PaTH and DeltaFormer against fla (tests/ops/test_*_vs_fla.py), one
#              process a file, MesaNet one a case (fla autotunes every kernel on its first call: minutes each on a
#              fresh machine); the PARITY lines go to $OUT/family/parity.txt
#   tests      every test file with gpu-marked tests outside the family's and the float64 check's (found by grep),
#              one process a file, each log under $OUT/tests
#   mqar       `hybridlm bench mqar --preset paper` with CUDA graphs, resuming from results/mqar-paper/results.json
#              until the step's limit (copy the returned results.json there and commit it to go on later)
# Any other STEP runs as a bash command (its log is $OUT/cmdN.log, N counting such steps from 1).
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || echo "wheel install failed"
else
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD  # wheels installed by the caller stay on the path
fi
n_cmd=0
for spec in "$@"; do
  # the limit is what follows the last colon when that is a number, so a command may hold colons (JSON, URLs)
  step=$spec
  secs=300
  if [[ $spec =~ ^(.*):([0-9]+)$ ]]; then step=${BASH_REMATCH[1]}; secs=${BASH_REMATCH[2]}; fi
  echo "=== $step (limit ${secs}s) $(date -u +%H:%M:%S)"
  case $step in
    info) cmd=(bash -c "nvidia-smi -L; git log -1 --format='commit %h %ad' --date=iso 2>/dev/null; python3 -c \
                'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'; \
                python3 -m pip show fla-core 2>/dev/null | head -2") ;;
    kernels) cmd=(python3 -m hybridlm bench kernels --rep 100 --gpu-time --profile --out "$OUT/kernels") ;;
    layers) cmd=(python3 -m hybridlm bench layers --rep 50 --seq-lens 2048 --widths 2048 --rows gdn,kda --no-recompute \
                 --out "$OUT/layers") ;;
    # a fresh machine spends most of the check compiling: more processes compile at once
    check) np=${CHECK_PARTS:-8}
      cmd=(bash -c "for i in \$(seq 0 $((np - 1))); do python3 scripts/gpu_check_gdn.py --part \$i/$np \
             --json $OUT/check\$i.json > $OUT/check\$i.part.log 2>&1 & done; wait; tail -n 3 $OUT/check*.part.log; \
             python3 scripts/gpu_check_gdn.py --merge $OUT/check[0-9]*.json") ;;
    glue) cmd=(python3 scripts/gpu_check_glue.py) ;;
    precision) cmd=(python3 scripts/gpu_precision_vs_fla.py --json "$OUT/precision.json") ;;
    ncu) cmd=(bash -c "python3 scripts/gpu_ncu_bytes.py --op gdn --out $OUT/ncu; \
                       python3 scripts/gpu_ncu_bytes.py --op kda --gates init --out $OUT/ncu") ;;
    train30m) cmd=(python3 -m hybridlm train --out "$OUT/train30m" --no-progress --sample-tokens 200) ;;
    train350m) cmd=(python3 -m hybridlm.bench.train --data bundled,short-docs --out "$OUT/train350m") ;;
    fsdp2) cmd=(env OUT="$OUT" bash scripts/gpu_fsdp2.sh) ;;
    # MesaNet's cases one process each: fla autotunes each of its kernels for minutes on a fresh machine
    family) mkdir -p "$OUT/family"
      cmd=(bash -c "for f in comba path_attn deltaformer; do python3 -m pytest -q -s -p no:cacheprovider \
             tests/ops/test_\${f}_vs_fla.py > $OUT/family/\$f.log 2>&1 & done; \
             for c in fp32-plain fp32-varlen bf16-plain bf16-varlen; do python3 -m pytest -q -s -p no:cacheprovider \
             tests/ops/test_mesa_net_vs_fla.py -k \"\${c%-*} and \${c#*-}\" > $OUT/family/mesa_net-\$c.log 2>&1 & \
             done; wait; tail -n 2 $OUT/family/*.log; grep -h PARITY $OUT/family/*.log | tee $OUT/family/parity.txt") ;;
    tests) mkdir -p "$OUT/tests"
      cmd=(bash -c "for f in \$(grep -rl 'mark.gpu' tests --include='test_*.py' | grep -v -e _vs_fla -e test_gpu_check); \
             do n=\${f#tests/}; python3 -m pytest -q -rxs -m gpu -p no:cacheprovider \$f \
             > $OUT/tests/\${n//\//_}.log 2>&1 & done; wait; tail -n 1 $OUT/tests/*.log") ;;
    mqar) mkdir -p "$OUT/mqar"; cp results/mqar-paper/results.json "$OUT/mqar/" 2>/dev/null
          cmd=(python3 -m hybridlm bench mqar --preset paper --cuda-graphs --out "$OUT/mqar" \
               --max-minutes $(((secs - 60) / 60))) ;;
    *) cmd=(bash -c "$step") ;;
  esac
  log=$step
  if [[ ! $step =~ ^[A-Za-z0-9_]+$ ]]; then n_cmd=$((n_cmd + 1)); log=cmd$n_cmd; fi  # a command is no file name
  timeout -k 10 "$secs" "${cmd[@]}" 2>&1 | tee "$OUT/$log.log" | tail -n 60
  echo "--- $step exit ${PIPESTATUS[0]} $(date -u +%H:%M:%S)"
done
# the lent machine brings back few files: everything goes into one archive
tar czf /tmp/gpu_call.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/gpu_call.tgz "$OUT/"
