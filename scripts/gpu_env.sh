# Sourced by the one-off scripts/gpu_*.sh calls: stop on unset variables, the results folder $OUT (created), and
# the repository on the import path.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
