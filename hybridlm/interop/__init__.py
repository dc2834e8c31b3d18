"""Checkpoint interop with Hugging Face transformers (no transformers import at run time)."""

from .files import CheckpointError
from .hf import config_from_hf, config_to_hf, key_map, load_pretrained, save_pretrained

__all__ = ["CheckpointError", "config_from_hf", "config_to_hf", "key_map", "load_pretrained", "save_pretrained"]
