# Sourced by the scripts/gpu_ncu_*.sh scripts: gpu_env.sh's setup, the ncu binary (exits when the machine has
# none) and the report sections every one of them asks for.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
if [ -z "$NCU" ]; then echo "no ncu on this machine"; exit 1; fi
"$NCU" --version | tail -n 1
NCU_SECTIONS=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis)
