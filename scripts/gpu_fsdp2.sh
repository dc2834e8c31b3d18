#!/usr/bin/env bash
# Multi-GPU training on one host (FSDP2 through torchrun) against one GPU: the multi-GPU table of BENCHMARKS.md.
# Run it on a machine with two GPUs after a change to the training loop's distributed parts (sharding, loss scaling,
# gradient reduction, host synchronisation) or to refresh that table.
#   two16 / one32: the gpu-30m preset at seq-len 1024, 50 steps, 2 GPUs x 16 rows against 1 GPU x 32 (the same
#                  global batch: the final train losses must agree within 1e-2)
#   one16:         1 GPU x 16 rows (the same per-GPU work as two16: tokens/s of two16 over one16)
#   two64 / one64: the same pair at 64 rows per GPU (scaling once the GPU is busy)
#   two325 / one325: the gpu-325m preset (the shape of `hybridlm bench train`'s model, byte vocabulary), 4 rows x
#                  4096 tokens per GPU, 50 steps: a model whose per-block work is larger than FSDP's collectives
#   two325r8 / one325r8: the same at 8 rows per GPU (at 4 rows one GPU's step is bound by the host, not the GPU);
#                  two325 and one325r8 share the global batch: their final train losses must agree within 1e-2
#   four325r8:     8 rows per GPU on 4 GPUs (only when RUNS names it; on a machine with 4 GPUs) against one325r8
#   two325pb:      two325 with one FSDP unit per block (--fsdp-min-unit-params 0; only when RUNS names it)
#   two325nr:      two325 with --no-reshard-after-forward (parameters kept gathered from forward to backward; only
#                  when RUNS names it)
# tokens/s is each run's summary.json "tokens_per_s": the median over the steps after the first ten. No eval on the
# way, no sample; the final eval is cut to 64k tokens and the end checkpoints are deleted after.
#
#   bash scripts/gpu_fsdp2.sh        (runs, logs, fsdp2.json and table.md under ${OUT:-out}/fsdp2; exit 1 if the
#                                     loss check fails, 2 if a run fails; the scalings are printed, not judged)
#   RUNS="two325 one325 two16 one32" bash scripts/gpu_fsdp2.sh   (only those runs, in that order: the loss check
#                                     needs two16 and one32, a scaling any complete pair)
#   STEPS325=30 RUNS="one325r8 four325r8" bash scripts/gpu_fsdp2.sh   (the 325M runs at 30 steps)
set -u
OUT=${OUT:-out}
D="$OUT/fsdp2"
PY=${PYTHON:-python3}
mkdir -p "$D"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
COMMON=(--preset gpu-30m --max-steps 50 --seq-len 1024 --eval-every 0 --save-every 0 --eval-tokens 65536
        --sample-tokens 0 --no-progress)
failed=0

train() {  # NAME COMMAND...: one run into $D/NAME, its log in $D/NAME.log
  local name=$1
  shift
  echo "=== $name $(date -u +%H:%M:%S): $*"
  "$@" "${COMMON[@]}" --out "$D/$name" >"$D/$name.log" 2>&1
  local rc=$?
  tail -n 2 "$D/$name.log"
  echo "--- $name exit $rc $(date -u +%H:%M:%S)"
  [ $rc -eq 0 ] || failed=1
  rm -rf "$D/$name/checkpoints"  # 30M params + optimizer state: not worth carrying back
}

C325=(--preset gpu-325m --max-steps "${STEPS325:-50}" --seq-len 4096 --eval-every 0 --save-every 0 --eval-tokens 65536
      --sample-tokens 0 --no-progress)
TWO=("$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m hybridlm.train)
FOUR=("$PY" -m torch.distributed.run --standalone --nproc_per_node 4 -m hybridlm.train)
ONE=("$PY" -m hybridlm.train)
# throughput at 64 rows: a per-GPU batch that keeps the GPU busy (at 16 x 1024 a 30M model's step is ~35 ms, mostly
# launch and synchronisation overhead that a second GPU cannot share); at 325M: FSDP's per-block work is not the step
for run in ${RUNS:-two16 one32 one16 two64 one64 two325 one325}; do
  case $run in
    two16) train two16 "${TWO[@]}" --batch-size 16 ;;
    one32) train one32 "${ONE[@]}" --batch-size 32 ;;
    one16) train one16 "${ONE[@]}" --batch-size 16 ;;
    two64) train two64 "${TWO[@]}" --batch-size 64 ;;
    one64) train one64 "${ONE[@]}" --batch-size 64 ;;
    two325) C30=("${COMMON[@]}"); COMMON=("${C325[@]}"); train two325 "${TWO[@]}" --batch-size 4; COMMON=("${C30[@]}") ;;
    two325nr) C30=("${COMMON[@]}"); COMMON=("${C325[@]}")
              train two325nr "${TWO[@]}" --batch-size 4 --no-reshard-after-forward; COMMON=("${C30[@]}") ;;
    two325pb) C30=("${COMMON[@]}"); COMMON=("${C325[@]}")
              train two325pb "${TWO[@]}" --batch-size 4 --fsdp-min-unit-params 0; COMMON=("${C30[@]}") ;;
    two325r8) C30=("${COMMON[@]}"); COMMON=("${C325[@]}"); train two325r8 "${TWO[@]}" --batch-size 8; COMMON=("${C30[@]}") ;;
    four325r8) C30=("${COMMON[@]}"); COMMON=("${C325[@]}"); train four325r8 "${FOUR[@]}" --batch-size 8; COMMON=("${C30[@]}") ;;
    one325r8) C30=("${COMMON[@]}"); COMMON=("${C325[@]}"); train one325r8 "${ONE[@]}" --batch-size 8; COMMON=("${C30[@]}") ;;
    one325) C30=("${COMMON[@]}"); COMMON=("${C325[@]}"); train one325 "${ONE[@]}" --batch-size 4; COMMON=("${C30[@]}") ;;
    *) echo "RUNS: unknown run $run (expected two16 one32 one16 two64 one64 two325 one325 two325r8 one325r8 two325pb"\
            "two325nr four325r8)"; exit 2 ;;
  esac
done

"$PY" - "$D" <<'EOF'
import json, os, sys

d = sys.argv[1]
runs = {"two16": "2 GPUs x 16 (FSDP2)", "one32": "1 GPU x 32", "one16": "1 GPU x 16",
        "two64": "2 GPUs x 64 (FSDP2)", "one64": "1 GPU x 64", "two325": "325M: 2 GPUs x 4 x 4096 (FSDP2)",
        "one325": "325M: 1 GPU x 4 x 4096", "two325r8": "325M: 2 GPUs x 8 x 4096 (FSDP2)",
        "one325r8": "325M: 1 GPU x 8 x 4096", "four325r8": "325M: 4 GPUs x 8 x 4096 (FSDP2)",
        "two325pb": "325M: 2 GPUs x 4, one FSDP unit per block",
        "two325nr": "325M: 2 GPUs, --no-reshard-after-forward"}
s = {}
for name in runs:
    try:
        with open(os.path.join(d, name, "summary.json")) as f:
            s[name] = json.load(f)
    except OSError:
        s[name] = {}
fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
lines = ["| run | rows x GPUs | final train loss | tokens/s (median after step 10) |", "|---|---|---|---|"]
for name, what in runs.items():
    lines.append(f"| {name} | {what} | {fmt(s[name].get('final_train_loss'), '.6f')} | "
                 f"{fmt(s[name].get('tokens_per_s'), ',.0f')} |")
res = {"summaries": s}


def ratio(a, b):
    """tokens/s of run a over run b, None unless both left one."""
    ta, tb = s[a].get("tokens_per_s"), s[b].get("tokens_per_s")
    return ta / tb if ta and tb else None




def loss_diff(a, b):
    """|final train loss of a - that of b|, None unless both left one."""
    la, lb = s[a].get("final_train_loss"), s[b].get("final_train_loss")
    return abs(la - lb) if la is not None and lb is not None else None


diff, diff325 = loss_diff("two16", "one32"), loss_diff("two325", "one325r8")
scales = {"two16 / one16": ratio("two16", "one16"), "two64 / one64": ratio("two64", "one64"),
          "two325 / one325": ratio("two325", "one325"), "two325r8 / one325r8": ratio("two325r8", "one325r8"),
          "two325pb / one325": ratio("two325pb", "one325"), "two325nr / one325": ratio("two325nr", "one325"),
          "four325r8 / one325r8": ratio("four325r8", "one325r8")}
res.update(loss_abs_diff=diff, loss_abs_diff_325=diff325, scalings=scales, scaling_vs_one32=ratio("two16", "one32"))
ok = all(d is None or d <= 1e-2 for d in (diff, diff325))  # the scalings are measurements, not a verdict
lines += ["", "|loss(two16) - loss(one32)| = " + ("no verdict (a run is missing)" if diff is None else
                                                   f"{diff:.2e} (<= 1e-2: {'PASS' if diff <= 1e-2 else 'FAIL'})"),
          "|loss(two325) - loss(one325r8)| = " + ("no verdict (a run is missing)" if diff325 is None else
                                                  f"{diff325:.2e} (<= 1e-2: {'PASS' if diff325 <= 1e-2 else 'FAIL'})"),
          "tokens/s " + ", ".join(f"{k} = {fmt(v, '.2f')}x" for k, v in scales.items())
          + f"; two16 / one32 = {fmt(ratio('two16', 'one32'), '.2f')}x (for reference)"]
res["pass"] = ok
table = "\n".join(lines)
print(table)
with open(os.path.join(d, "table.md"), "w") as f:
    f.write(table + "\n")
with open(os.path.join(d, "fsdp2.json"), "w") as f:
    json.dump(res, f, indent=1)
sys.exit(0 if ok else 1)
EOF
verdict=$?
[ $failed -eq 0 ] || exit 2
exit $verdict
