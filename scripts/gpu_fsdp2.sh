#!/usr/bin/env bash
# FSDP2 acceptance on a 2-GPU machine (issue #7): three 50-step runs of the gpu-30m preset at seq-len 1024
#   two16: torchrun, 2 GPUs x 16 rows (global batch 32)
#   one32: 1 GPU x 32 rows   (same global batch: the final train loss must agree within 1e-2)
#   one16: 1 GPU x 16 rows   (same per-GPU work: tokens/s of two16 over one16)
#   two64 / one64: the same pair at 64 rows per GPU (scaling once the GPU is busy)
#   two325 / one325: the gpu-325m preset (the shape of bench train's model, byte vocabulary), 4 rows x 4096 tokens
#     per GPU, 30 steps: a model large enough that FSDP's per-block work is not the step
#   >= 1.8x tokens/s is needed at one of the three pairs
# tokens/s is each run's summary.json "tokens_per_s": the median over the steps after the first ten.
# No eval on the way, no sample; the final eval is cut to 64k tokens and the end checkpoints are deleted after.
#
#   bash scripts/gpu_fsdp2.sh        (runs, logs, fsdp2.json and table.md under ${OUT:-out}/fsdp2; exit 1 if a
#                                     check fails, 2 if a run fails)
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

train two16 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m hybridlm.train --batch-size 16
train one32 "$PY" -m hybridlm.train --batch-size 32
train one16 "$PY" -m hybridlm.train --batch-size 16
# throughput at a per-GPU batch that keeps the GPU busy (at 16 x 1024 a 30M model's step is ~35 ms, mostly launch
# and synchronisation overhead that a second GPU cannot share)
train two64 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m hybridlm.train --batch-size 64
train one64 "$PY" -m hybridlm.train --batch-size 64
COMMON=(--preset gpu-325m --max-steps 30 --seq-len 4096 --eval-every 0 --save-every 0 --eval-tokens 65536
        --sample-tokens 0 --no-progress)
train two325 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m hybridlm.train --batch-size 4
train one325 "$PY" -m hybridlm.train --batch-size 4

"$PY" - "$D" <<'EOF'
import json, os, sys

d = sys.argv[1]
runs = {"two16": "2 GPUs x 16 (FSDP2)", "one32": "1 GPU x 32", "one16": "1 GPU x 16",
        "two64": "2 GPUs x 64 (FSDP2)", "one64": "1 GPU x 64", "two325": "325M: 2 GPUs x 4 x 4096 (FSDP2)",
        "one325": "325M: 1 GPU x 4 x 4096"}
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
ok = True
try:
    diff = abs(s["two16"]["final_train_loss"] - s["one32"]["final_train_loss"])
    scale = s["two16"]["tokens_per_s"] / s["one16"]["tokens_per_s"]
    vs32 = s["two16"]["tokens_per_s"] / s["one32"]["tokens_per_s"]
    scale64 = s["two64"]["tokens_per_s"] / s["one64"]["tokens_per_s"]
    t325, o325 = s["two325"].get("tokens_per_s"), s["one325"].get("tokens_per_s")
    scale325 = t325 / o325 if t325 and o325 else 0.0
    best = max(scale, scale64, scale325)
    res.update(loss_abs_diff=diff, scaling_vs_one16=scale, scaling_vs_one32=vs32, scaling_64=scale64,
               scaling_325m=scale325)
    ok = diff <= 1e-2 and best >= 1.8
    lines += ["", f"|loss(two16) - loss(one32)| = {diff:.2e} (<= 1e-2: {'PASS' if diff <= 1e-2 else 'FAIL'})",
              f"tokens/s two16 / one16 = {scale:.2f}x, two64 / one64 = {scale64:.2f}x, two325 / one325 = "
              f"{scale325:.2f}x (>= 1.8x at one of them: {'PASS' if best >= 1.8 else 'FAIL'}); "
              f"two16 / one32 = {vs32:.2f}x (for reference)"]
except (KeyError, TypeError, ZeroDivisionError) as e:
    ok = False
    lines += ["", f"no verdict: a run left no usable summary ({e!r})"]
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
