"""Triton kernel for the cross-entropy of one chunk of LM-head logits: per-token losses and, over the logits in
place, their gradient.

    logits: [c, V] (float16, bfloat16 or float32, contiguous); targets: int [c] -> loss [c] float32, and with
    grad the logits overwritten by dlogits = (softmax(logits) - onehot(target)) * (target != ignore_index)

Non-standard here:
- One program per row, two passes over it: an online max and sum of exponentials in blocks (fp32), then the
  gradient written over the row in the logits' dtype. A bf16 row is read twice and written once (6 bytes a value,
  the second read mostly from L2); PyTorch's chain (float copy, logsumexp, gather, sub, exp, index-subtract, mask
  multiply, cast back) moves about 40.
- Arithmetic in fp32 on the logits as stored (what their `.float()` holds), so loss and softmax are the unfused
  float32 reference's up to fp32 rounding, and dlogits is rounded once to the logits' dtype as the reference's
  cast to the matmul dtype does.
- An ignored token gets loss 0 and a zero gradient row, without reading its logits. A target outside [0, V) that
  is not ignore_index gives a NaN loss (and the softmax as its gradient row): it shows in the loss sum with no
  device assert and no host sync, where PyTorch's gather asserts.
Custom op: `hybridlm::ce_rows` (writes the loss rows, and the logits with grad).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .conv import _check_device, _check_tensor
from .custom import custom_op
from .tune import LaunchTable

POISON = False  # tests set this: outputs start as NaN so an unwritten element shows


@dataclass
class CETune(LaunchTable):
    block: int = 4096  # logits a program loads at a time (a power of two; vocab 32k: 8 blocks a row)
    num_warps: int = 8  # 16 fp32 values a thread per block at the default block


TUNE = CETune()


@triton.jit
def _ce_rows(z, dz, t, loss, V, ignore_index, BLOCK: tl.constexpr, GRAD: tl.constexpr):
    """Grid (c,): row i of z [c, V] -> loss[i] = logsumexp(z_i) - z_i[t_i]; with GRAD, row i of dz (which may be z)
    = softmax(z_i) - onehot(t_i); both zero where t_i == ignore_index."""
    i = tl.program_id(0).to(tl.int64)
    row = i * V
    o = tl.arange(0, BLOCK)
    b_t = tl.load(t + i).to(tl.int64)
    if b_t != ignore_index:
        b_m = tl.full([], float("-inf"), tl.float32)
        b_s = tl.full([], 0.0, tl.float32)
        for v0 in range(0, V, BLOCK):  # online logsumexp: rescale the running sum whenever the max grows
            m = v0 + o < V
            b_z = tl.load(z + row + v0 + o, mask=m, other=float("-inf")).to(tl.float32)
            b_mn = tl.maximum(b_m, tl.max(b_z, 0))
            b_s = b_s * tl.exp(b_m - b_mn) + tl.sum(tl.exp(b_z - b_mn), 0)
            b_m = b_mn
        b_ls = tl.log(b_s)  # logsumexp = max + log(sum), kept apart: differences to the max are exact
        ok = (b_t >= 0) & (b_t < V)
        b_zt = tl.load(z + row + tl.where(ok, b_t, 0)).to(tl.float32)
        b_loss = tl.where(ok, (b_m - b_zt) + b_ls, float("nan"))
        if GRAD:
            for v0 in range(0, V, BLOCK):
                m = v0 + o < V
                b_p = tl.exp((tl.load(z + row + v0 + o, mask=m, other=float("-inf")).to(tl.float32) - b_m) - b_ls)
                b_d = tl.where(v0 + o == b_t, b_p - 1.0, b_p)
                tl.store(dz + row + v0 + o, b_d.to(dz.dtype.element_ty), mask=m)
    else:
        b_loss = tl.full([], 0.0, tl.float32)
        if GRAD:
            for v0 in range(0, V, BLOCK):
                m = v0 + o < V
                tl.store(dz + row + v0 + o, tl.zeros([BLOCK], dtype=tl.float32).to(dz.dtype.element_ty), mask=m)
    tl.store(loss + i, b_loss)


def launch(logits: torch.Tensor, targets: torch.Tensor, out: torch.Tensor | None, loss: torch.Tensor,
           ignore_index: int) -> None:
    """The kernel on logits [c, V] and targets [c]: loss [c] float32 written; out [c, V] (logits itself for the
    in-place gradient, or another tensor of its shape) gets dlogits, or None for the loss only."""
    c, V = logits.shape
    if c > 0 and V > 0:
        grad = out is not None
        _ce_rows[(c,)](logits, out if grad else logits, targets, loss, V, ignore_index, BLOCK=TUNE.block,
                       GRAD=grad, num_warps=TUNE.num_warps)


@custom_op("ce_rows", mutates_args=("logits", "loss"))
def ce_rows(logits: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor, ignore_index: int, grad: bool) -> None:
    """logits: [c, V] contiguous (overwritten by dlogits when grad); targets: int [c]; loss: float32 [c], written."""
    launch(logits, targets, logits if grad else None, loss, ignore_index)


@ce_rows.register_fake
def _(logits, targets, loss, ignore_index, grad):
    return None


def new_loss(n: int, device: torch.device) -> torch.Tensor:
    """A float32 [n] buffer for the loss rows (NaN under POISON)."""
    return torch.full((n,), float("nan"), device=device) if POISON else torch.empty(n, device=device)


def check(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """The Triton path's inputs: floating types below float64, on CUDA (or the CPU under TRITON_INTERPRET=1)."""
    _check_tensor("hidden", hidden)
    _check_tensor("weight", weight)
    _check_device("hidden", hidden)


__all__ = ["ce_rows", "launch", "new_loss", "check", "TUNE"]
