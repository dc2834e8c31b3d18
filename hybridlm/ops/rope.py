"""Rotary position embedding (rotate_half RoPE, partial) and attention's sigmoid output gate, in PyTorch: the
reference paths of the fused kernels in `hybridlm.ops.triton.rope` (chosen per call by `hybridlm.ops.glue`).

Non-standard here:
- The angle is float32, position * inv_freq with inv_freq = 1 / theta^(2i / rd) recomputed in float32 at each
  call (`inv_freq`), never kept in a buffer a model cast could round. cos/sin are float32 and `apply_rotary` rounds
  them to the activations' dtype before it multiplies (each op rounds: the layers have always computed this).
- Partial RoPE: pairs (i, i + rd/2) of the first rd channels rotate, the rest pass through.
"""

from __future__ import annotations

import torch


def inv_freq(rotary_dim: int, theta: float, device) -> torch.Tensor:
    """float32 [rd / 2]: 1 / theta^(2i / rd), i = 0 .. rd/2 - 1."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
    return 1.0 / (float(theta) ** exponent)


def rotary_cos_sin(position_ids: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [B, T] -> cos, sin [B, T, rd] float32 (angles position * inv_freq in float32, each repeated for
    the pair (i, i + rd/2))."""
    freqs = position_ids[..., None].float() * inv_freq(rotary_dim, theta, position_ids.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, h, T, hd]; cos/sin: [B, T, rd]. Rotates pairs (i, i + rd/2) of the first rd channels."""
    rd = cos.shape[-1]
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def rope_ref(q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor, *, rotary_dim: int,
             theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, nH, hd], k [B, T, nKV, hd], position_ids [B|1, T] -> q, k rotated (`apply_rotary` on the heads-first
    views; the results are transposed views [B, T, h, hd] of [B, h, T, hd] tensors)."""
    cos, sin = rotary_cos_sin(position_ids, rotary_dim, theta)
    return (apply_rotary(q.transpose(1, 2), cos, sin).transpose(1, 2),
            apply_rotary(k.transpose(1, 2), cos, sin).transpose(1, 2))


def sigmoid_gate_ref(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o [B, T, h, d] * sigmoid(gate [B, T, h, d or 1]) (a headwise gate broadcasts over d)."""
    return o * torch.sigmoid(gate)
