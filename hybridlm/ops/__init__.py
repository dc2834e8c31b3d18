"""Functional math of hybrid linear-attention models: references, chunkwise forms, kernels and their dispatch.

Layout is sequence-first everywhere (`[B, T, H, D]`); gates are keyword-only, `g` before `beta`.
See docs/math.md for the recurrences and the chunkwise derivation.
"""

from .chunk import recurrence_chunk
from .comba import comba
from .conv import causal_conv1d, causal_conv1d_update
from .deltaformer import deltaformer_attention
from .mesa_net import mesa_net
from .naive import recurrence_naive
from .norm import add_rms_norm, gated_rms_norm, l2norm, rms_norm
from .path_attn import path_attention
from .recurrence import (
    TRITON_KERNELS,
    delta_rule,
    gated_delta_rule,
    gated_linear_attention,
    kda,
    linear_attention,
    resolve_impl,
)

__all__ = [
    "TRITON_KERNELS",
    "add_rms_norm",
    "causal_conv1d",
    "causal_conv1d_update",
    "comba",
    "delta_rule",
    "deltaformer_attention",
    "gated_delta_rule",
    "gated_linear_attention",
    "gated_rms_norm",
    "kda",
    "l2norm",
    "linear_attention",
    "mesa_net",
    "path_attention",
    "recurrence_chunk",
    "recurrence_naive",
    "resolve_impl",
    "rms_norm",
]

try:  # registers the Triton kernels (impl="triton", and "auto" on CUDA) when triton is installed
    from . import triton as _triton  # noqa: F401
except ImportError:
    pass
