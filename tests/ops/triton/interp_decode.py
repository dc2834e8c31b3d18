"""The multi-token decode kernel's cases (tests/ops/decode_cases.py) in a child process under TRITON_INTERPRET=1.

Run by tests/ops/test_multi_token_decode.py with the test's seed as the argument (the variable must be set before
triton decorates the kernels). Prints the seed, then one line: RESULT {"seed": s, case: {result: value}}. The
kernel's outputs start as NaN (gdn.POISON).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from interp_patches import patch_interpreter  # noqa: E402

patch_interpreter()

import torch  # noqa: E402
from decode_cases import case_names, run_case  # noqa: E402

from hybridlm.ops.triton import fused_recurrent_gated_delta_rule_update, fused_recurrent_kda_update  # noqa: E402
from hybridlm.ops.triton import gdn as _gdn  # noqa: E402

_gdn.POISON = True


def kernel(op, *args, **kw):
    fn = fused_recurrent_kda_update if op == "kda" else fused_recurrent_gated_delta_rule_update
    return fn(*args, **kw, impl="triton")


def main() -> int:
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else int(torch.randint(0, 2**31 - 1, ()))
    print(f"seed {seed}", flush=True)
    res = {"seed": seed}
    for i, name in enumerate(case_names()):
        res[name] = run_case(name, kernel, seed + i)
    print("RESULT " + json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
