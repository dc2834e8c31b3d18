"""hybridlm: hybrid linear-attention language models (Gated DeltaNet and family), exact and fast."""

__version__ = "0.1.0"
