#!/usr/bin/env bash
# Context parallelism on one host of 4 GPUs: the context-parallel table of BENCHMARKS.md. Run it after a change to
# hybridlm/ops/context_parallel.py, the layers' cp_group paths or the training loop's mesh, or to refresh that table.
#   ops:      `torchrun -m hybridlm.bench.context_parallel`: GDN and KDA, B1 T32768 H16 D128 bf16, CP 4 against one GPU
#             on the whole sequence (agreement at the float64 check's bars, fwd+bwd time); ops2: the same at CP 2
#             (a host of 2 GPUs)
#   cp1_32k / cp2_32k / cp4_32k: the gpu-325m preset, one row of 32768 tokens a step, 30 steps, on 1, 2 and 4 GPUs
#             (--context-parallel 2 / 4): their per-step train losses against cp1_32k are reported (bf16 rounding
#             differences grow with the steps)
#   cp1_32k_fp32 / cp4_32k_fp32: the same 30 steps in float32 (activation checkpointing, so one GPU holds 32K): the
#             exactness check, cp4's per-step train losses must match cp1's within 1e-2
#   cp4_128k: 131072 tokens a row over 4 GPUs, 12 steps; cp1_128k: the same row on one GPU (expected not to fit)
# tokens/s is summary.json's (median over the steps after the first ten), memory its peak_gpu_memory_gib (rank 0).
#
#   bash scripts/gpu_cp.sh     (logs, cp.json and table.md under ${OUT:-out}/cp; exit 1 if a check fails)
#   RUNS="ops cp4_128k" bash scripts/gpu_cp.sh
set -u
OUT=${OUT:-out}
D="$OUT/cp"
PY=${PYTHON:-python3}
mkdir -p "$D"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# a 5% held-out tail: the bundled corpus's 2% is shorter than one 128K row
COMMON=(--preset gpu-325m --batch-size 1 --eval-every 0 --save-every 0 --eval-tokens 131072 --sample-tokens 0
        --no-progress --val-fraction 0.05)
run() {  # NAME NPROC COMMAND ARGS...: one run into $D/NAME, its log in $D/NAME.log
  local name=$1 n=$2
  shift 2
  echo "=== $name $(date -u +%H:%M:%S): $*"
  if [ "$n" = 1 ]; then "$PY" "$@" >"$D/$name.log" 2>&1
  else "$PY" -m torch.distributed.run --standalone --nproc_per_node "$n" "$@" >"$D/$name.log" 2>&1; fi
  local rc=$?
  tail -n 3 "$D/$name.log"
  echo "--- $name exit $rc $(date -u +%H:%M:%S)"
  rm -rf "$D/$name/checkpoints"
}
for r in ${RUNS:-ops cp1_32k cp4_32k cp4_128k cp1_128k cp2_32k cp1_32k_fp32 cp4_32k_fp32}; do
  case $r in
    ops) run ops 4 -m hybridlm.bench.context_parallel --out "$D/ops" ;;
    ops2) run ops2 2 -m hybridlm.bench.context_parallel --out "$D/ops2" ;;
    cp1_32k) run "$r" 1 -m hybridlm.train "${COMMON[@]}" --seq-len 32768 --max-steps 30 --out "$D/$r" ;;
    cp2_32k) run "$r" 2 -m hybridlm.train "${COMMON[@]}" --seq-len 32768 --max-steps 30 --context-parallel 2 \
               --out "$D/$r" ;;
    cp4_32k) run "$r" 4 -m hybridlm.train "${COMMON[@]}" --seq-len 32768 --max-steps 30 --context-parallel 4 \
               --out "$D/$r" ;;
    cp1_32k_fp32) run "$r" 1 -m hybridlm.train "${COMMON[@]}" --seq-len 32768 --max-steps 30 --precision fp32 \
                    --activation-checkpointing --out "$D/$r" ;;
    cp4_32k_fp32) run "$r" 4 -m hybridlm.train "${COMMON[@]}" --seq-len 32768 --max-steps 30 --precision fp32 \
                    --activation-checkpointing --context-parallel 4 --out "$D/$r" ;;
    cp4_128k) run "$r" 4 -m hybridlm.train "${COMMON[@]}" --seq-len 131072 --max-steps 12 --context-parallel 4 \
                --out "$D/$r" ;;
    cp1_128k) run "$r" 1 -m hybridlm.train "${COMMON[@]}" --seq-len 131072 --max-steps 2 --out "$D/$r" ;;
    *) echo "RUNS: unknown run $r (expected ops ops2 cp1_32k cp2_32k cp4_32k cp4_128k cp1_128k cp1_32k_fp32"\
              "cp4_32k_fp32)"; exit 2 ;;
  esac
done

"$PY" - "$D" <<'EOF'
import json, os, sys

d = sys.argv[1]


def load(name, file):
    try:
        with open(os.path.join(d, name, file)) as f:
            return json.load(f) if file.endswith(".json") else [json.loads(x) for x in f if x.strip()]
    except (OSError, ValueError):
        return None


runs = {"cp1_32k": "1 GPU, 32768", "cp2_32k": "CP 2, 32768", "cp4_32k": "CP 4, 32768",
        "cp4_128k": "CP 4, 131072", "cp1_128k": "1 GPU, 131072", "cp1_32k_fp32": "1 GPU, 32768, float32",
        "cp4_32k_fp32": "CP 4, 32768, float32"}
fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
lines = ["| run | GPUs, tokens a row | steps | final train loss | tokens/s | peak GiB a GPU |", "|---|---|---|---|---|---|"]
res = {}
for name, what in runs.items():
    s = load(name, "summary.json") or {}
    res[name] = s
    lines.append(f"| {name} | {what} | {fmt(s.get('final_step'), 'd')} | {fmt(s.get('final_train_loss'), '.4f')} | "
                 f"{fmt(s.get('tokens_per_s'), ',.0f')} | {fmt(s.get('peak_gpu_memory_gib'), '.1f')} |")
ok = True
# float32 is the exactness check (held to 1e-2); bf16 pairs are reported: their rounding differs with the split
for one, cp, held in (("cp1_32k_fp32", "cp4_32k_fp32", True), ("cp1_32k", "cp4_32k", False),
                      ("cp1_32k", "cp2_32k", False)):
    a, b = load(one, "metrics.jsonl"), load(cp, "metrics.jsonl")
    if not (a and b):
        continue
    la = {r["step"]: r["loss"] for r in a if "loss" in r}
    lb = {r["step"]: r["loss"] for r in b if "loss" in r}
    common = sorted(set(la) & set(lb))
    diff = max(abs(la[k] - lb[k]) for k in common) if common else None
    good = diff is not None and diff <= 1e-2 and len(common) >= 30
    if held:
        ok = ok and good
    lines += [f"max |train loss {cp} - {one}| over {len(common)} steps: {fmt(diff, '.2e')} "
              + (f"(<= 1e-2: {'PASS' if good else 'FAIL'})" if held else "(bf16, reported)")]
    res[f"loss_max_abs_diff {cp} - {one}"] = diff
for name in ("ops", "ops2"):
    ops = load(name, "cp.json")
    if ops:
        ok = ok and all(r["pass_"] for r in ops)
res["pass"] = ok
table = "\n".join(lines)
print(table)
with open(os.path.join(d, "table.md"), "w") as f:
    f.write(table + "\n")
with open(os.path.join(d, "cp.json"), "w") as f:
    json.dump(res, f, indent=1)
sys.exit(0 if ok else 1)
EOF
