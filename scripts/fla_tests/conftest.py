"""Run fla 0.6.0's op tests against hybridlm.ops.fla: fla's four public functions are swapped for ours in every
module that exports them, before the test modules import them. fla's references (naive_*) and tolerances stay.

On a machine without a GPU, fla.utils.device is 'cuda' (fla falls back to it on CPU for torch >= 2.4); it is set
to 'cpu' here so the tests build their tensors on the CPU. On a GPU machine nothing about the device is changed.
"""
import os
import sys

import fla.utils
import fla.utils.hardware
import torch

import hybridlm.ops.fla as ours

if not torch.cuda.is_available():
    fla.utils.device = fla.utils.hardware.device = "cpu"

import fla.ops  # noqa: E402
import fla.ops.gated_delta_rule  # noqa: E402
import fla.ops.gated_delta_rule.chunk  # noqa: E402
import fla.ops.gated_delta_rule.fused_recurrent  # noqa: E402
import fla.ops.kda  # noqa: E402
import fla.ops.kda.chunk  # noqa: E402
import fla.ops.kda.fused_recurrent  # noqa: E402

SWAPS = {
    "chunk_gated_delta_rule": ours.chunk_gated_delta_rule,
    "chunk_gdn": ours.chunk_gated_delta_rule,
    "fused_recurrent_gated_delta_rule": ours.fused_recurrent_gated_delta_rule,
    "fused_recurrent_gdn": ours.fused_recurrent_gated_delta_rule,
    "chunk_kda": ours.chunk_kda,
    "fused_recurrent_kda": ours.fused_recurrent_kda,
}
PATCHED = []
for name, mod in list(sys.modules.items()):
    if not name.startswith("fla"):
        continue
    for fn_name, fn in SWAPS.items():
        if hasattr(mod, fn_name) and getattr(mod, fn_name) is not fn:
            setattr(mod, fn_name, fn)
            PATCHED.append(f"{name}.{fn_name}")


def pytest_report_header(config):
    return [f"hybridlm.ops.fla swapped in for: {', '.join(sorted(PATCHED))}",
            f"fla.utils.device = {fla.utils.device!r}; hybridlm from {os.path.dirname(ours.__file__)}"]
