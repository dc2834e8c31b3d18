"""Triton kernels of the delta-rule family. Importing this package registers them in
`hybridlm.ops.recurrence.TRITON_KERNELS` (impl="triton", and impl="auto" on CUDA).

Needs triton; without it the import raises ImportError and nothing is registered. Entry points:
`chunk_gated_delta_rule` (differentiable chunked forward/backward) and `fused_recurrent_gated_delta_rule_update`
(one decode step on a state pool, in place). See docs/kernels.md.
"""

from __future__ import annotations

import triton  # noqa: F401  (ImportError here means: no Triton, nothing registered)

from ..recurrence import TRITON_KERNELS, TRITON_SUPPORTS
from .gdn import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule_update, unsupported_reason

TRITON_KERNELS["gated_delta_rule"] = chunk_gated_delta_rule
TRITON_SUPPORTS["gated_delta_rule"] = unsupported_reason

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule_update"]
