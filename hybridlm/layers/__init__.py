"""Token mixers, norms and MLPs of hybrid linear-attention models (nn.Modules over `hybridlm.ops`)."""

from .attention import GatedAttention, Rotary, apply_rotary, build_attention_mask, positions_for
from .comba import Comba
from .conv import ShortConv
from .deltaformer import DeltaFormerAttention
from .gdn import GatedDeltaNet
from .kda import KimiDeltaAttention
from .mesa_net import MesaNet
from .mla import MLA
from .mlp import MoE, SwiGLU
from .norm import GatedRMSNorm, RMSNorm
from .path_attn import PaTHAttention

__all__ = [
    "MLA",
    "Comba",
    "DeltaFormerAttention",
    "MesaNet",
    "GatedAttention",
    "GatedDeltaNet",
    "GatedRMSNorm",
    "KimiDeltaAttention",
    "MoE",
    "PaTHAttention",
    "RMSNorm",
    "Rotary",
    "ShortConv",
    "SwiGLU",
    "apply_rotary",
    "build_attention_mask",
    "positions_for",
]
