"""RMSNorm flavours as modules over `hybridlm.ops` norms.

Non-standard here: `kind` picks the exact rounding of each released model (checked against transformers):
- "zero_centered": (x_hat * (1 + w)) in float32, cast once (Qwen3-Next / Qwen3.5; weight initialised at 0).
- "llama": w * x_hat.to(dtype) (Kimi Linear; weight initialised at 1).
- "fp32_weight": (w * x_hat) in float32, cast once (OLMo-Hybrid; weight initialised at 1).
`GatedRMSNorm` normalises per head over the last dim and multiplies by act(gate); the weight is plain w.
Under autocast (on x's device) `RMSNorm` returns autocast's dtype, as a torch op under autocast would: computed in
float32 as without autocast and rounded once at the end (for float32 x: the value each following Linear would
have made of a float32 output, without every Linear casting the same activation again); the gradient of x comes
back in x's dtype. Nothing changes without autocast, and the residual stream (the norm's input) stays float32.
`RMSNorm(x, branch)` is the pre-norm with the residual add before it (`hybridlm.ops.add_rms_norm`): it returns
(y, x + branch), the blocks pass their last output on to the next norm instead of adding it themselves.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.ops import glue

NORM_KINDS = ("zero_centered", "llama", "fp32_weight")


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype a torch op under autocast casts x to (autocast on for x's device, x floating and not float64,
    which autocast leaves alone), else None. Devices without autocast (meta) get None."""
    dev = x.device.type
    if not x.is_floating_point() or x.dtype == torch.float64 or not torch.amp.is_autocast_available(dev):
        return None
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


class RMSNorm(nn.Module):
    """x: [..., D] -> [..., D] (x's dtype; autocast's dtype under autocast, see the module docstring). impl "triton"
    (or "auto" on CUDA, see `hybridlm.ops.glue`) runs the fused Triton norm (one pass forward, one backward; saves only
    x and the weight) with the same rounding points and the same output dtype."""

    def __init__(self, dim: int, eps: float = 1e-6, kind: str = "llama", impl: str = "auto"):
        super().__init__()
        if kind not in NORM_KINDS:
            raise ValueError(f"kind: expected one of {NORM_KINDS}, got {kind!r}")
        self.kind, self.eps, self.impl = kind, eps, impl
        self.weight = nn.Parameter(torch.zeros(dim) if kind == "zero_centered" else torch.ones(dim))

    def forward(self, x: torch.Tensor, branch: torch.Tensor | None = None):
        """x: [..., D] -> y. With branch ([..., D], a block's output not yet added to the residual stream x):
        -> (y, x_new) where x_new = x + branch (torch's add) and y = norm(x_new), on one fused kernel."""
        kw = {"zero_centered": True} if self.kind == "zero_centered" else {"cast_before_weight": self.kind == "llama"}
        if branch is None:
            return glue.rms_norm(x, self.weight, self.eps, out_dtype=autocast_dtype(x), impl=self.impl, **kw)
        out = None if torch.promote_types(x.dtype, branch.dtype) == torch.float64 else autocast_dtype(x)
        return glue.add_rms_norm(x, branch, self.weight, self.eps, out_dtype=out, impl=self.impl, **kw)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, kind={self.kind}"


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * act(gate) per head. x, gate: [..., D]; weight [D] shared by heads.

    activation "silu" (Qwen, OLMo: w * x_hat.to(dtype) * silu(gate) in float32, cast once) or
    "sigmoid" with fp32_output=True (Kimi: the whole product in float32)."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu", fp32_output: bool = False,
                 impl: str = "auto"):
        super().__init__()
        self.eps, self.activation, self.fp32_output, self.impl = eps, activation, fp32_output, impl
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, impl: str | None = None) -> torch.Tensor:
        """impl: the owning layer's impl (default self.impl); "triton" runs the fused kernel (`hybridlm.ops.glue`)."""
        return glue.gated_rms_norm(x, gate, self.weight, self.eps, activation=self.activation,
                                   fp32_output=self.fp32_output, impl=self.impl if impl is None else impl)
