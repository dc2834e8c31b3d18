"""hybridlm: hybrid linear-attention language models (Gated DeltaNet and family), exact and fast.

Non-standard here: `HybridConfig` and `HybridLM` are imported on first use (module __getattr__), so that
`import hybridlm.cli` (and `hybridlm --help`) does not load torch.
"""

__version__ = "0.1.0"

__all__ = ["HybridConfig", "HybridLM"]


def __getattr__(name: str):
    if name == "HybridConfig":
        from hybridlm.model.config import HybridConfig

        return HybridConfig
    if name == "HybridLM":
        from hybridlm.model.hybrid import HybridLM

        return HybridLM
    raise AttributeError(f"module 'hybridlm' has no attribute {name!r}")
