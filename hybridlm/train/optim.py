"""AdamW with weight-decay groups, the warmup + cosine learning-rate schedule, and the bf16 autocast of a step."""

from __future__ import annotations

import contextlib
import math

import torch

# Parameters whose name contains one of these get no weight decay (besides every 1-D parameter).
NO_DECAY_NAMES = ("norm", "bias", "embed", "A_log", "dt_bias", "wte")


def param_groups(model: torch.nn.Module, weight_decay: float, no_decay: tuple[str, ...] = NO_DECAY_NAMES) -> list[dict]:
    """Two groups: matrices decay; every vector and the parameters whose name contains one of `no_decay` (default:
    norms, biases, embeddings, A_log, dt_bias) do not."""
    decay, kept, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.ndim < 2 or any(k in name for k in no_decay):
            kept.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": kept, "weight_decay": 0.0},
    ]


def no_decay_names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.ndim < 2 or any(k in n for k in NO_DECAY_NAMES)]


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95),
                    eps: float = 1e-8, no_decay: tuple[str, ...] = NO_DECAY_NAMES) -> torch.optim.AdamW:
    """AdamW over `param_groups(model, weight_decay, no_decay)`: fused on CUDA, foreach elsewhere."""
    fused = all(p.is_cuda for p in model.parameters())
    return torch.optim.AdamW(param_groups(model, weight_decay, no_decay), lr=lr, betas=betas, eps=eps,
                             **({"fused": True} if fused else {"foreach": True}))


def lr_at(step: int, *, lr: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warmup from lr/warmup to lr over `warmup` steps, then cosine down to `min_ratio * lr` at `total`."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if total <= warmup:
        return lr
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def set_lr(optimizer: torch.optim.Optimizer, value: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = value


def autocast(device: torch.device, bf16: bool, *, cache: bool = True):
    """bf16 autocast on `device` when bf16, else a no-op context. cache=False turns off autocast's cache of cast
    weights, which must not live across CUDA-graph replays (torch.cuda.make_graphed_callables' rule)."""
    if bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext()
