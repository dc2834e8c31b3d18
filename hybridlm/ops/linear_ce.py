"""Linear + cross-entropy (the LM head and its loss) without the [N, vocab] logits: chunk by chunk over tokens.

Non-standard here:
- The gradients are computed in the forward, chunk by chunk, while each chunk's logits are at hand (one matmul
  fewer than recomputing them in the backward); the backward only scales them by the incoming gradient. What is
  kept is grad_hidden [N, D] and grad_weight [V, D], the sizes of the inputs, never N x V. Without a gradient to
  compute (eval, no_grad) the forward makes the loss only.
- Dtypes follow an autocast region around the call as the unfused `F.linear` + `.float()` + `F.cross_entropy`
  would: the matmuls run in the autocast dtype (else the inputs'), logits, softmax and loss in float32 (float64
  for float64 inputs); grad_weight is accumulated over chunks in that float type and rounded once.
- Chunk size: tokens per chunk so that a chunk's logits hold about 2^25 values (vocab 32k: 1024 tokens, 128 MB in
  float32); the byte vocabulary fits 131,072 tokens in one chunk.
"""

from __future__ import annotations

import torch

CHUNK_VALUES = 1 << 25


def _chunk_tokens(n: int, vocab: int, chunk_size: int | None) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size: expected >= 1 or None, got {chunk_size}")
        return chunk_size
    return max(1, min(n, CHUNK_VALUES // max(vocab, 1)))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index: int, chunk: int, need_grad: bool):
        """hidden [N, D], weight [V, D] (same dtype), targets [N] -> the float sum of token losses."""
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        n = hidden.shape[0]
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_grad else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_grad else None
        for s in range(0, n, chunk):
            h, t = hidden[s : s + chunk], targets[s : s + chunk]
            valid = t != ignore_index
            safe_t = torch.where(valid, t, 0)
            logits = (h @ weight.t()).to(acc)  # [c, V]
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe_t[:, None])[:, 0]
            loss += torch.where(valid, lse - picked, 0).sum()
            if need_grad:  # d loss / d logits = softmax - onehot(target), zero for ignored tokens
                dlogits = torch.exp(logits.sub_(lse[:, None]))
                dlogits[torch.arange(t.shape[0], device=t.device), safe_t] -= 1
                dlogits.mul_(valid[:, None])
                d = dlogits.to(hidden.dtype)
                grad_h[s : s + chunk] = d @ weight
                grad_w += (d.t() @ h).to(acc)
        if need_grad:
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss.to(grad_h.dtype), grad_w * grad_loss.to(grad_w.dtype), None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         ignore_index: int = -100, reduction: str = "sum",
                         chunk_size: int | None = None) -> torch.Tensor:
    """F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index, reduction) without the logits.

    hidden: [N, D]; weight: [V, D] (the LM head, no bias); targets: int [N], `ignore_index` where there is no
    target. reduction "sum" or "mean" (over the targets that are not ignored; NaN when there are none, as
    F.cross_entropy). Returns a float32 scalar (float64 for float64 inputs). chunk_size: tokens per chunk (None:
    logits of about 2^25 values a chunk)."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction: expected 'sum' or 'mean', got {reduction!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden, weight: expected [N, D] and [V, D], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets: expected shape {tuple(hidden.shape[:1])}, got {tuple(targets.shape)}")
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        cd = torch.get_autocast_dtype(dev)
        hidden, weight = hidden.to(cd), weight.to(cd)
    elif weight.dtype != hidden.dtype:
        raise TypeError(f"weight: expected dtype {hidden.dtype} (hidden's) outside autocast, got {weight.dtype}")
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    chunk = _chunk_tokens(hidden.shape[0], weight.shape[0], chunk_size)
    with torch.autocast(dev, enabled=False):
        loss = _LinearCrossEntropy.apply(hidden, weight, targets, ignore_index, chunk, need_grad)
    if reduction == "mean":
        loss = loss / (targets != ignore_index).sum()
    return loss


__all__ = ["linear_cross_entropy"]
