"""hybridlm: hybrid linear-attention language models (Gated DeltaNet and family), exact and fast."""

__version__ = "0.1.0"

from hybridlm.model.config import HybridConfig as HybridConfig  # noqa: E402
from hybridlm.model.hybrid import HybridLM as HybridLM  # noqa: E402
