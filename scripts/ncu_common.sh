# Sourced by the scripts/gpu_ncu_*.sh scripts: gpu_env.sh's setup, the ncu binary (exits when the machine has
# none), the report sections every one of them asks for, and the GDN runs two of them profile (ncu_gdn_steps).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
if [ -z "$NCU" ]; then echo "no ncu on this machine"; exit 1; fi
"$NCU" --version | tail -n 1
NCU_SECTIONS=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis)
# gdn_steps_py B T H D: the Python program the GDN profiling runs hand to ncu: two forward+backward steps in bf16
# (gpu_tune_gdn's make and run, inputs rounded to bf16), so that the first step's compiles can be skipped
gdn_steps_py() {
  cat <<EOF
import sys; sys.path.insert(0, 'scripts')
import torch
from gpu_tune_gdn import make, run
xs = [x.to(torch.bfloat16).float() if i != 3 else x for i, x in enumerate(make($1, $2, $3, $4))]
do = torch.randn($1, $2, $3, $4, device='cuda')
for _ in range(2):
    run(xs, torch.bfloat16, True, do)
torch.cuda.synchronize()
EOF
}
# ncu_gdn_steps REGEX B T H D REPORT [more ncu arguments]: the report sections of the second step's two launches
# matching REGEX (the first step's compiles and autotuning stay out), written as text to REPORT
ncu_gdn_steps() {
  local regex=$1 B=$2 T=$3 H=$4 D=$5 report=$6
  shift 6
  "$NCU" --kernel-name regex:"$regex" --launch-skip 2 --launch-count 2 "${NCU_SECTIONS[@]}" "$@" \
    python3 -c "$(gdn_steps_py "$B" "$T" "$H" "$D")" > "$report" 2>&1
  echo "ncu exit $?"
}
