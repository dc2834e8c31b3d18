"""Normalisations used by the hybrid layers, as plain functions.

Non-standard here: the released models disagree on small things, and each is an explicit argument rather than
a class per model:
- `rms_norm(..., zero_centered=True)` multiplies by (1 + w) (Qwen3-Next / Qwen3.5, weights initialised at 0);
  `zero_centered=False` multiplies by w (Llama, Kimi, OLMo).
- `cast_before_weight=True` rounds the normalised x to the input dtype before the weight multiply (Llama-style,
  `w * x_hat.to(dtype)`); False multiplies in float32 and rounds once at the end (Qwen3-Next's zero-centred norm).
- `gated_rms_norm` gates with SiLU (Qwen, OLMo) or sigmoid (Kimi) and can keep everything in float32 (Kimi).
- `rms_norm(..., out_dtype=)`: the result computed as above in x's dtype, then cast to out_dtype (the RMSNorm module
  passes autocast's dtype, so that the Linears after it do not each cast a float32 copy; for float32 x that is
  one rounding of the float32 result, the value those Linears would have used).
- `add_rms_norm(x, branch, ...)`: a pre-norm block's residual add and the next norm as one op, returning
  (rms_norm(x + branch), x + branch); the add is torch's (promoted dtype, one rounding), so the fused kernel has an
  exact reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim, in x's dtype (callers pass float32/float64)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    zero_centered: bool = False,
    cast_before_weight: bool = True,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x: [..., D]; weight: [D] or None. Normalised in float32 (float64 for float64 x); output in x's dtype, then
    cast to out_dtype if given (its gradient comes back in x's dtype)."""
    y = _rms_norm(x, weight, eps, zero_centered, cast_before_weight)
    return y if out_dtype is None or out_dtype == y.dtype else y.to(out_dtype)


def add_rms_norm(
    x: torch.Tensor,
    branch: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    zero_centered: bool = False,
    cast_before_weight: bool = True,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, branch: [..., D] (the residual stream and a block's output, e.g. float32 and bfloat16); weight: [D] or
    None. Returns (y = rms_norm(x_new, weight, ...) [..., D], x_new = x + branch [..., D] in their promoted dtype)."""
    if branch.shape != x.shape:
        raise ValueError(f"branch: expected the shape of x {tuple(x.shape)}, got {tuple(branch.shape)}")
    x_new = x + branch
    y = rms_norm(x_new, weight, eps, zero_centered=zero_centered, cast_before_weight=cast_before_weight,
                 out_dtype=out_dtype)
    return y, x_new


def _rms_norm(x, weight, eps, zero_centered, cast_before_weight):
    dtype = x.dtype
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    xf = x.to(cd)
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is None:
        return y.to(dtype)
    w = (1.0 + weight.to(cd)) if zero_centered else weight
    if cast_before_weight:
        return (w.to(dtype) * y.to(dtype)) if not zero_centered else (y * w).to(dtype)
    return (y * w.to(cd)).to(dtype)


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    activation: str = "silu",
    fp32_output: bool = False,
) -> torch.Tensor:
    """RMSNorm(x) * act(gate), per head. x, gate: [..., D]; weight: [D] (plain w, not zero-centred).

    activation "silu" (Qwen3-Next/Qwen3.5/OLMo-Hybrid): w * x_hat.to(dtype) * silu(gate.float()), cast at the end.
    activation "sigmoid" (Kimi Linear) with fp32_output=True keeps the whole product in float32 before the cast.
    """
    if activation not in ("silu", "sigmoid"):
        raise ValueError(f"activation: expected 'silu' or 'sigmoid', got {activation!r}")
    if gate.shape != x.shape:
        raise ValueError(f"gate: expected the shape of x {tuple(x.shape)}, got {tuple(gate.shape)}")
    dtype = x.dtype
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    xf = x.to(cd)
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    act = F.silu(gate.to(cd)) if activation == "silu" else torch.sigmoid(gate.to(cd))
    if fp32_output:
        w = weight.to(cd) if weight is not None else 1.0
        return (w * y * act).to(dtype)
    y = y.to(dtype)
    if weight is not None:
        y = weight * y
    return (y.to(cd) * act).to(dtype)
