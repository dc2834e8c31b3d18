"""Triton kernels of the delta-rule family. Importing this package registers them in
`hybridlm.ops.dispatch.TRITON_KERNELS` (impl="triton", and impl="auto" on CUDA).

Needs triton; without it the import raises ImportError and nothing is registered. Entry points:
`chunk_gated_delta_rule` (differentiable chunked forward/backward), `fused_recurrent_gated_delta_rule_update`
(1..8 decode tokens on a state pool), `chunk_kda` (differentiable) and `fused_recurrent_kda_update`.
See docs/kernels.md.
"""

from __future__ import annotations

import triton  # noqa: F401  (ImportError here means: no Triton, nothing registered)

from ..dispatch import TRITON_KERNELS, TRITON_SUPPORTS
from . import add_norm, ce, conv, gates, norm, rope, swiglu  # noqa: F401  (fused glue: hybridlm::conv_*, norm_*, ...)
from . import kda as _kda
from .decode_entry import fused_recurrent_gated_delta_rule_update, fused_recurrent_kda_update
from .gdn import chunk_gated_delta_rule, unsupported_reason
from .kda import chunk_kda

TRITON_KERNELS["gated_delta_rule"] = chunk_gated_delta_rule
TRITON_SUPPORTS["gated_delta_rule"] = unsupported_reason
TRITON_KERNELS["kda"] = chunk_kda
TRITON_SUPPORTS["kda"] = _kda.unsupported_reason

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule_update", "chunk_kda",
           "fused_recurrent_kda_update"]
