#!/usr/bin/env bash
# fla's own op tests (tests/ops/test_gdn.py and test_kda.py of fla-org/flash-linear-attention) against
# hybridlm.ops.fla: copies the two files and scripts/fla_tests/conftest.py (which swaps fla's four public functions
# for ours) into a scratch folder and runs fla's selection there, in LANES parallel processes; a test that failed
# beside the others (out of GPU memory) is run once more alone. Prints the counts. fla-core must be importable.
# Usage: bash scripts/fla_tests.sh FLA_TESTS_OPS_DIR [LANES]   (docs/fla.md "fla's own tests"); FLA_TESTS_K: an
# extra pytest -k expression; FLA_TESTS_WORK, FLA_TESTS_GPUS: see below
set -uo pipefail
SRC=${1:?usage: fla_tests.sh FLA_TESTS_OPS_DIR [LANES]}; LANES=${2:-1}
HERE=$(cd "$(dirname "$0")/.." && pwd)
# FLA_TESTS_WORK: the scratch folder, kept (each lane's log there survives a run stopped by a time limit)
if [ -n "${FLA_TESTS_WORK:-}" ]; then W=$FLA_TESTS_WORK; mkdir -p "$W"; else W=$(mktemp -d); trap 'rm -rf "$W"' EXIT; fi
cp "$SRC/test_gdn.py" "$SRC/test_kda.py" "$HERE/scripts/fla_tests/conftest.py" "$W/"
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" FLA_DISABLE_BACKEND_DISPATCH=1
# fla's internals, not the four public functions: its backends, wy_repr, the gate helpers, the Blackwell and
# Ascend guards, its two references against each other, and its vLLM entry (not swapped)
SEL="not flash_qla and not flash_kda and not test_gate and not wy_repr and not blackwell and not ascend"
SEL="$SEL and not naive_chunk and not vllm_decode"
[ -n "${FLA_TESTS_K:-}" ] && SEL="$SEL and ($FLA_TESTS_K)"  # narrower, for a quick look
cd "$W"
python3 -m pytest --collect-only -q -p no:cacheprovider test_gdn.py test_kda.py -k "$SEL" 2>/dev/null \
  | grep '::' > ids
echo "$(wc -l < ids) tests selected"
split -n "r/$LANES" ids lane.
# FLA_TESTS_GPUS: spread the lanes round-robin over this many GPUs (default: all on the visible ones as CUDA picks);
# -v puts each test's result in its lane's log as it ends, so a run stopped by a time limit still counts them
i=0
for f in lane.*; do
  mapfile -t ids < "$f"
  gpu=()
  [ -n "${FLA_TESTS_GPUS:-}" ] && gpu=(env CUDA_VISIBLE_DEVICES=$((i % FLA_TESTS_GPUS)))
  "${gpu[@]}" python3 -m pytest -v -p no:cacheprovider -rA --tb=line "${ids[@]}" > "$f.log" 2>&1 &
  i=$((i + 1))
done
wait
grep -h '^PASSED' lane.*.log | sed 's/^PASSED //' | sort -u > passed
grep -h '^FAILED' lane.*.log | sed 's/^FAILED //; s/ - .*//' | sort -u > failed
if [ -s failed ] && [ "$LANES" -gt 1 ]; then
  mapfile -t again < failed
  python3 -m pytest -q -p no:cacheprovider -rA --tb=line "${again[@]}" > alone.log 2>&1
  grep -h '^PASSED' alone.log | sed 's/^PASSED //' >> passed
  grep -h '^FAILED' alone.log | sed 's/^FAILED //; s/ - .*//' > failed
  grep -h 'AssertionError' alone.log | sort -u
fi
echo "passed $(sort -u passed | wc -l), failed $(wc -l < failed)"
sed 's/^/FAILED /' failed
