"""The hybrid model: config, presets, the nn.Module, its generation cache, and the info / generate / memory
subcommands."""

from .cache import HybridCache
from .config import HybridConfig
from .generate import generate
from .hybrid import HybridLM, HybridOutput
from .presets import PRESETS, get_preset

__all__ = ["PRESETS", "HybridCache", "HybridConfig", "HybridLM", "HybridOutput", "generate", "get_preset"]
