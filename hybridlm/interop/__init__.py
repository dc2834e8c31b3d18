"""Comparison with Hugging Face transformers: per-layer hooks on two models (compare.py).

Reading and writing transformers checkpoints is part of the model (`hybridlm.model.hf`, behind
`HybridLM.from_pretrained` / `save_pretrained`), since generation and training both need it.
"""

from .compare import Comparison, LayerDiff, compare_layers

__all__ = ["Comparison", "LayerDiff", "compare_layers"]
