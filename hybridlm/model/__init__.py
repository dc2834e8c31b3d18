"""The hybrid model: config, presets, the nn.Module, its generation cache, tokenizers, transformers checkpoint
folders (hf.py), and the info / generate / memory subcommands."""

from .cache import HybridCache
from .config import HybridConfig
from .generate import generate
from .hybrid import HybridLM, HybridOutput
from .presets import PRESETS, get_preset
from .safetensors_folder import CheckpointError

__all__ = ["PRESETS", "CheckpointError", "HybridCache", "HybridConfig", "HybridLM", "HybridOutput", "generate",
           "get_preset"]
