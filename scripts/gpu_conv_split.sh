#!/usr/bin/env bash
# The conv writing the layers' q, k, v as three tensors (conv.TUNE split_out, 2026-11-25): its GPU check against
# float64 (the conv cases of gpu_check_glue.py, bf16 and fp32), then the GDN layer's forward+backward at Qwen3-Next
# widths (B8 T2048, bf16) with split_out off / on / off in separate processes (ours only), then on with fla's layer
# in the same run, and the KDA layer off / on (ours only: fla's KDA layer autotunes for minutes).
#
#   OUT=dir bash scripts/gpu_conv_split.sh      (tables under $OUT/<variant>/layers.md)
source "$(dirname "$0")/gpu_env.sh"
python3 scripts/gpu_check_glue.py --only conv --no-timing
echo "check exit $?"
layers() {  # TAG SPLIT_OUT ROWS [more bench.layers arguments]
  local tag=$1 split=$2 rows=$3
  shift 3
  python3 -c "
import sys
from hybridlm.ops.triton import conv
conv.TUNE['split_out'] = $split
from hybridlm.bench.layers import main
sys.exit(main(sys.argv[1:]))
" --rep 50 --seq-lens 2048 --widths 2048 --rows "$rows" --no-recompute --out "$OUT/$tag" "$@" 2>&1 | grep -E "^\||ms|GiB" | tail -n 4
}
for v in "gdn_off False" "gdn_on True" "gdn_off2 False"; do set -- $v; echo "=== $1"; layers "$1" "$2" gdn --no-fla; done
echo "=== gdn_on_fla"; layers gdn_on_fla True gdn
for v in "kda_off False" "kda_on True"; do set -- $v; echo "=== $1"; layers "$1" "$2" kda --no-fla; done
