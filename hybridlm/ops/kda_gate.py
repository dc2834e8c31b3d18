"""Kimi's gate: KDA's per-channel log-decay from the raw gate input, the one definition `hybridlm.ops.kda` (its
A_log / dt_bias / lower_bound arguments), the KDA layer and the fla-compatible `chunk_kda` use.

    g = -exp(A_log[h]) * softplus(raw[..., h, c] + dt_bias[h, c])                    (no lower_bound)
    g = lower_bound * sigmoid(exp(A_log[h]) * (raw[..., h, c] + dt_bias[h, c]))      (lower_bound, < 0)

Non-standard here:
- softplus(x) = x for x > 20 (F.softplus's threshold, as Kimi writes it).
- A_log may be None with lower_bound (then exp(A_log) reads as 1, as fla's chunk_kda takes it); dt_bias may be
  None (no bias). Without lower_bound A_log is required.
- `fused=True` computes the first form on the Triton gates kernel (`hybridlm.ops.triton.gates.kda_decay`, one
  launch forward and one backward, row sums of dA_log / ddt_bias in fp32): the layer's cached decode token, whose
  step kernel takes g. Everything else here is PyTorch under autograd, in the compute dtype: the reference, and
  the gate of the PyTorch impls. The Triton chunk op does not call this: its kernels compute both forms themselves
  (`hybridlm.ops.triton.kda`, `kda_decay._kimi_gate`), with no launch of their own.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F


def check_kda_gate(raw: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                   lower_bound: float | None) -> None:
    """One-line errors for the gate arguments of raw [B, T, HV, K]: A_log [HV], dt_bias [HV * K], lower_bound a
    real number."""
    HV, K = raw.shape[-2], raw.shape[-1]
    if lower_bound is not None and (not isinstance(lower_bound, numbers.Real) or isinstance(lower_bound, bool)):
        raise TypeError(f"lower_bound: expected a float (< 0) or None, got {type(lower_bound).__name__}")
    if A_log is None and lower_bound is None:
        raise ValueError("A_log: expected a tensor [HV] for the gate (dt_bias was given without A_log or "
                         "lower_bound), got None")
    for name, x, shape, layout in (("A_log", A_log, (HV,), "[HV]"), ("dt_bias", dt_bias, (HV * K,), "[HV * K]")):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            what = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"{name}: expected a floating-point tensor {layout}, got {what}")
        if tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} ({layout}, HV={HV}, K={K}), got {tuple(x.shape)}")
        if x.device != raw.device:
            raise ValueError(f"{name}: expected a tensor on {raw.device} (g's device), got {x.device}")


def kda_gate(raw: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None = None,
             lower_bound: float | None = None, *, dtype: torch.dtype = torch.float32,
             fused: bool = False) -> torch.Tensor:
    """raw: [..., HV, K]; A_log: [HV]; dt_bias: [HV * K]. Returns g [..., HV, K] in dtype (float32 when fused),
    differentiable in raw, A_log and dt_bias (module docstring)."""
    HV, K = raw.shape[-2], raw.shape[-1]
    if fused and lower_bound is None and dtype == torch.float32:
        from .triton.gates import kda_decay

        bias = dt_bias if dt_bias is not None else raw.new_zeros(HV * K, dtype=torch.float32)
        return kda_decay(raw, A_log, bias)
    x = raw.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).view(HV, K)
    if lower_bound is None:
        return -A_log.to(dtype).exp().view(HV, 1) * F.softplus(x)
    if A_log is not None:
        x = A_log.to(dtype).exp().view(HV, 1) * x
    return lower_bound * torch.sigmoid(x)


__all__ = ["check_kda_gate", "kda_gate"]
