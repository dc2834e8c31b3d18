"""The hybrid model: config, presets, the nn.Module, and its `info` subcommand."""

from .config import HybridConfig
from .hybrid import HybridLM, HybridOutput

__all__ = ["HybridConfig", "HybridLM", "HybridOutput"]
