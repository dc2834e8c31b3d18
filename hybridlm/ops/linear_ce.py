"""Linear + cross-entropy (the LM head and its loss) without the [N, vocab] logits: chunk by chunk over tokens.

Non-standard here:
- The gradients are computed in the forward, chunk by chunk, while each chunk's logits are at hand (one matmul
  fewer than recomputing them in the backward); the backward only scales them by the incoming gradient. What is
  kept is grad_hidden [N, D] and grad_weight [V, D], the sizes of the inputs, never N x V. Without a gradient to
  compute (eval, no_grad) the forward makes the loss only.
- Dtypes follow an autocast region around the call as the unfused `F.linear` + `.float()` + `F.cross_entropy`
  would: the matmuls run in the autocast dtype (else the inputs'), logits, softmax and loss in float32 (float64
  for float64 inputs); dlogits is rounded to the matmul dtype for the two gradient matmuls; grad_weight is
  accumulated over chunks in that float type and rounded once.
- `impl`: "auto" (as the layer glue, `hybridlm.ops.glue.use_triton`: on CUDA for float16/bfloat16/float32,
  logged once) runs each chunk's cross-entropy on the Triton kernel `hybridlm.ops.triton.ce`: it reads the
  matmul's logits as stored, computes in float32 and writes dlogits over them in the matmul dtype, so a chunk
  makes no float32 copy of its logits and no second [c, V] buffer; the per-token losses go to one float32 [N]
  buffer summed once. "torch" (and a layer's "naive" / "chunk") keeps the PyTorch chain, the reference and the
  path of float64 and the CPU. The kernel's loss adds log(sum exp) to (max - target logit) apart, which keeps
  rows of huge logits exact to float32; the PyTorch path subtracts the float32 logsumexp.
- grad_weight on CUDA with float16/bfloat16 matmuls: each chunk's d^T h goes straight into the float32
  accumulator (`torch.addmm(..., out_dtype=torch.float32)`: cuBLAS accumulates in float32 and adds the
  accumulator in its epilogue), never rounded to the matmul dtype, with no separate add over [V, D]. Closer to
  exact than the unfused reference, whose weight gradient is one low-precision GEMM over all tokens rounded once
  to bf16. Where torch lacks it (older versions, the CPU, under torch.compile) each chunk's product is rounded to
  the matmul dtype and added in float32.
- Chunk size: tokens per chunk so that a chunk's logits hold about 2^25 values (vocab 32k: 1024 tokens, 64 MB in
  bf16); the byte vocabulary fits 131,072 tokens in one chunk.
- A target outside [0, V) that is not ignore_index: PyTorch's gather raises (a device assert on CUDA); the
  kernel gives that token a NaN loss instead, without a host sync.
"""
from __future__ import annotations

import logging

import torch

from .glue import use_triton

log = logging.getLogger("hybridlm.ops")
CHUNK_VALUES = 1 << 25
_MIXED_MM: dict[str, bool] = {}  # device type -> False once torch refused a float32-output GEMM of fp16/bf16


def _chunk_tokens(n: int, vocab: int, chunk_size: int | None) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size: expected >= 1 or None, got {chunk_size}")
        return chunk_size
    return max(1, min(n, CHUNK_VALUES // max(vocab, 1)))


def _add_dw(grad_w: torch.Tensor | None, d: torch.Tensor, h: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """grad_w + d^T h in `acc` (grad_w None: the first chunk). d: [c, V], h: [c, D] in the matmul dtype;
    grad_w: [V, D]. On CUDA a float16/bfloat16 product goes into the float32 accumulator in the GEMM."""
    dev = d.device.type
    if dev == "cuda" and d.dtype != acc and _MIXED_MM.get(dev, True) and not torch.compiler.is_compiling():
        try:
            if grad_w is None:
                return torch.mm(d.t(), h, out_dtype=acc)
            return torch.addmm(grad_w, d.t(), h, out_dtype=acc, out=grad_w)
        except torch.OutOfMemoryError:
            raise
        except (TypeError, RuntimeError) as e:  # torch without the mixed-dtype GEMM: round each chunk's product
            _MIXED_MM[dev] = False
            log.info("hybridlm.ops.linear_cross_entropy: no float32-output GEMM of %s in this torch (%s); "
                     "grad_weight adds rounded chunks", d.dtype, str(e).splitlines()[0])
    part = (d.t() @ h).to(acc)
    return part if grad_w is None else grad_w.add_(part)


def _chunk_torch(h, weight, t, ignore_index: int, acc: torch.dtype, need_grad: bool):
    """The PyTorch chain on one chunk: (loss sum in acc, dlogits [c, V] in the matmul dtype or None)."""
    valid = t != ignore_index
    safe_t = torch.where(valid, t, 0)
    logits = (h @ weight.t()).to(acc)  # [c, V]
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, safe_t[:, None])[:, 0]
    loss = torch.where(valid, lse - picked, 0).sum()
    if not need_grad:
        return loss, None
    dlogits = torch.exp(logits.sub_(lse[:, None]))  # d loss / d logits = softmax - onehot(target), 0 if ignored
    dlogits[torch.arange(t.shape[0], device=t.device), safe_t] -= 1
    dlogits.mul_(valid[:, None])
    return loss, dlogits.to(h.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index: int, chunk: int, need_grad: bool, kernel: bool):
        """hidden [N, D], weight [V, D] (same dtype), targets [N] -> the float sum of token losses; kernel: the
        Triton cross-entropy per chunk."""
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        n = hidden.shape[0]
        if kernel:
            from .triton import ce as _tce
            from .triton.custom import call

            rows = _tce.new_loss(n, hidden.device)
        else:
            loss = torch.zeros((), dtype=acc, device=hidden.device)
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_grad else None
        grad_w = None
        for s in range(0, n, chunk):
            h, t = hidden[s : s + chunk], targets[s : s + chunk]
            if kernel:
                d = h @ weight.t()  # [c, V] logits, turned into dlogits in place when need_grad
                call("ce_rows", d, t, rows[s : s + chunk], ignore_index, need_grad)
            else:
                part, d = _chunk_torch(h, weight, t, ignore_index, acc, need_grad)
                loss += part
            if need_grad:
                torch.mm(d, weight, out=grad_h[s : s + chunk])
                grad_w = _add_dw(grad_w, d, h, acc)
        if kernel:
            loss = rows.sum()
        if need_grad:
            if grad_w is None:  # no tokens
                grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss.to(grad_h.dtype), grad_w * grad_loss.to(grad_w.dtype), *([None] * 5)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         ignore_index: int = -100, reduction: str = "sum",
                         chunk_size: int | None = None, impl: str = "auto") -> torch.Tensor:
    """F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index, reduction) without the logits.

    hidden: [N, D]; weight: [V, D] (the LM head, no bias); targets: int [N], `ignore_index` where there is no
    target. reduction "sum" or "mean" (over the targets that are not ignored; NaN when there are none, as
    F.cross_entropy). Returns a float32 scalar (float64 for float64 inputs). chunk_size: tokens per chunk (None:
    logits of about 2^25 values a chunk); impl: "auto", "triton" or "torch" (see the module docstring; "naive" and
    "chunk", a layer's impls, take PyTorch)."""
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
    kernel = use_triton("linear_cross_entropy", impl, hidden)
    if kernel:
        from .triton import ce as _tce

        _tce.check(hidden, weight)
        targets = targets.contiguous()
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    chunk = _chunk_tokens(hidden.shape[0], weight.shape[0], chunk_size)
    with torch.autocast(dev, enabled=False):
        loss = _LinearCrossEntropy.apply(hidden, weight, targets, ignore_index, chunk, need_grad, kernel)
    if reduction == "mean":
        loss = loss / (targets != ignore_index).sum()
    return loss


__all__ = ["linear_cross_entropy"]
