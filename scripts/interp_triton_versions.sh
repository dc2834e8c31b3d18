#!/usr/bin/env bash
# The Triton kernels' CPU-interpreter cases (tests/ops/triton/interp_gdn.py and interp_kda.py) under several Triton
# versions, each in its own venv that reuses this Python's torch. Run it before changing the supported Triton range
# and after a kernel change that uses a language feature new to some version. Needs pip access to PyPI. It checks the
# Python front end of every version (language features, interpreter); GPU code generation is not covered here.
#   scripts/interp_triton_versions.sh [VERSION ...]      (default: 3.4.0 3.5.1 3.6.0 3.7.1 3.8.0 3.9.0)
set -uo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
[ ${#versions[@]} -eq 0 ] && versions=(3.4.0 3.5.1 3.6.0 3.7.1 3.8.0 3.9.0)
# the verdict on one RESULT line: every error within its bar (fp16 cases: 16-bit intermediates, the tests' fp16 bar;
# bf16 cases: the GPU check's bars, which need the test tree's interpreter bf16 fix to apply to that version's
# interpreter); the recompute cases hold counts and equality flags, checked by the pytest tests instead
VERDICT='
import json, sys
d = json.load(sys.stdin)
# errors only: flags, counts and the launch-marks case (lists) are checked by the pytest tests
worst = {c: max(x for n, x in r.items() if n not in ("o_dtype_ok", "others_unchanged") and isinstance(x, float))
         for c, r in d.items() if isinstance(r, dict) and not c.startswith(("recompute", "launch_marks"))}
bar = lambda c: 2e-3 if "fp16" in c else 1e-2 if "bf16" in c else 1e-5  # bf16: the gradient bar of the GPU check
bad = {c: w for c, w in worst.items() if w > bar(c)}
fp32_worst = max(w for c, w in worst.items() if "fp16" not in c and "bf16" not in c)
print("triton", sys.argv[1], sys.argv[2], "PASS" if not bad else f"FAIL {bad}", "worst rel err (fp32 cases)",
      f"{fp32_worst:.2e}", "seed", d["seed"])
'
for v in "${versions[@]}"; do
  venv="${TMPDIR:-/tmp}/hybridlm_triton_$v"
  [ -x "$venv/bin/python" ] || python -m venv --system-site-packages "$venv" >/dev/null
  "$venv/bin/python" -m pip install -q "triton==$v" >/dev/null 2>&1 || { echo "triton $v: install failed"; continue; }
  for script in interp_gdn interp_kda; do
    out=$(TRITON_INTERPRET=1 PYTHONPATH="$PWD" timeout 600 "$venv/bin/python" "tests/ops/triton/$script.py" 2>&1)
    echo "$out" | grep '^RESULT ' | tail -1 | cut -c8- | "$venv/bin/python" -c "$VERDICT" "$v" "$script" \
      || echo "triton $v $script: FAIL (no result) $(echo "$out" | tail -2)"
  done
done
