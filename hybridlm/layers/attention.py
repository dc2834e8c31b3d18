"""Softmax attention with the variations of the released hybrids, on PyTorch SDPA.

Non-standard here:
- Output gate (Qwen3-Next / Qwen3.5): `q_proj` emits per head `[query (hd) | gate (hd)]` ("elementwise") or
  `[query (hd) | gate (1)]` ("headwise"); the attention output is multiplied by sigmoid(gate) before `o_proj`.
  gate "none" is plain attention (OLMo-Hybrid).
- QK-norm: "head" normalises each head over hd before RoPE (Qwen, zero-centred); "full" normalises the whole
  q / k projection before the head split (OLMo-Hybrid); "none".
- Partial RoPE: rotate_half RoPE on the first `rotary_dim` channels, the rest pass through; rotary_dim 0 is NoPE.
  cos/sin are float32 and cast to the activations' dtype.
- The mask is an explicit boolean [B, 1, T, T] built by `build_attention_mask` (causal, key padding, packed
  documents). Each query may always see itself, so fully padded rows stay finite (their outputs are unused).
  mask None means plain causal with queries and keys aligned (no cache, nothing padded or packed): SDPA's
  is_causal, which lets it pick its FlashAttention backend (no mask takes it), with GQA by enable_gqa (no copies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .norm import RMSNorm


def build_attention_mask(T: int, *, attention_mask: torch.Tensor | None = None,
                         cu_seqlens: torch.Tensor | None = None, past: int = 0, device=None) -> torch.Tensor:
    """-> bool [B or 1, 1, T, past + T], True = may attend. Queries sit at positions past..past+T-1.

    attention_mask: [B, past + T] (1 token / 0 pad) over the whole history; cu_seqlens: [N+1] (no past)."""
    S = past + T
    qi = torch.arange(past, S, device=device)
    ki = torch.arange(S, device=device)
    allowed = (ki[None, :] <= qi[:, None])[None, None]  # causal
    if cu_seqlens is not None:  # block-diagonal: documents packed in one row never see each other
        if past:
            raise ValueError("cu_seqlens: packed documents cannot be combined with a generation cache")
        doc = torch.bucketize(ki, cu_seqlens.to(device=device, dtype=torch.long)[1:], right=True)
        allowed = allowed & (doc[None, :] == doc[:, None])[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, None, :]
    return allowed | (ki[None, :] == qi[:, None])[None, None]


def positions_for(T: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """Default position ids [1, T]: 0..T-1, restarting at each packed document."""
    pos = torch.arange(T, device=device)
    if cu_seqlens is not None:
        starts = cu_seqlens.to(device=device, dtype=torch.long)
        doc = torch.bucketize(pos, starts[1:], right=True)
        pos = pos - starts[doc]
    return pos[None]


class Rotary(nn.Module):
    """cos/sin [B, T, rotary_dim] (float32) for position ids [B, T].

    The inverse frequencies are recomputed in float32 at each call instead of kept in a buffer, so casting the
    model to bf16 (or building it on the meta device) never rounds them."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim, self.theta = rotary_dim, float(theta)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rd = self.rotary_dim
        exponent = torch.arange(0, rd, 2, dtype=torch.float32, device=position_ids.device) / rd
        inv_freq = 1.0 / (self.theta**exponent)
        freqs = position_ids[..., None].float() * inv_freq
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


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q: [B, h, T, d]; k, v: [B, hkv, S, d]; query head i reads kv head i // groups. mask: bool [B|1, 1, T, S], or
    None for plain causal attention with S == T (is_causal; GQA by enable_gqa, else by repeat_interleave)."""
    groups = q.shape[1] // k.shape[1]
    if mask is None:
        if k.shape[2] != q.shape[2]:
            raise ValueError(f"mask None means causal with as many keys as queries; got {q.shape[2]} queries and "
                             f"{k.shape[2]} keys (pass the mask of build_attention_mask)")
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=groups > 1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class GatedAttention(nn.Module):
    """x: [B, T, D] -> [B, T, D]. impl: the model's, for the q/k RMSNorms (fused Triton norm when it resolves so)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 gate: str = "elementwise", qk_norm: str = "head", norm_kind: str = "zero_centered",
                 norm_eps: float = 1e-6, rotary_dim: int = 0, rope_theta: float | None = 10000.0,
                 bias: bool = False, impl: str = "auto"):
        super().__init__()
        if gate not in ("elementwise", "headwise", "none"):
            raise ValueError(f"gate: expected 'elementwise', 'headwise' or 'none', got {gate!r}")
        if qk_norm not in ("head", "full", "none"):
            raise ValueError(f"qk_norm: expected 'head', 'full' or 'none', got {qk_norm!r}")
        self.nH, self.nKV, self.hd, self.gate, self.qk_norm = num_heads, num_kv_heads, head_dim, gate, qk_norm
        gate_width = {"elementwise": head_dim, "headwise": 1, "none": 0}[gate]
        self.gate_width = gate_width
        D = hidden_size
        self.q_proj = nn.Linear(D, num_heads * (head_dim + gate_width), bias=bias)
        self.k_proj = nn.Linear(D, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(D, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, D, bias=bias)
        if qk_norm == "head":
            self.q_norm = RMSNorm(head_dim, norm_eps, norm_kind, impl=impl)
            self.k_norm = RMSNorm(head_dim, norm_eps, norm_kind, impl=impl)
        elif qk_norm == "full":
            self.q_norm = RMSNorm(num_heads * head_dim, norm_eps, norm_kind, impl=impl)
            self.k_norm = RMSNorm(num_kv_heads * head_dim, norm_eps, norm_kind, impl=impl)
        self.rotary = Rotary(rotary_dim, rope_theta) if rotary_dim and rope_theta is not None else None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor,
                cache=None) -> torch.Tensor:
        """x: [B, T, D]; mask: bool [B|1, 1, T, S] from build_attention_mask, or None (causal, no cache);
        position_ids: [B|1, T]. cache: a KVState (hybridlm.model.cache) that receives this call's post-RoPE K / V."""
        B, T, _ = x.shape
        q = self.q_proj(x)
        gate = None
        if self.gate_width:
            q, gate = q.view(B, T, self.nH, self.hd + self.gate_width).split([self.hd, self.gate_width], dim=-1)
        k, v = self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q.reshape(B, T, -1)), self.k_norm(k)
        q = q.reshape(B, T, self.nH, self.hd)
        k = k.view(B, T, self.nKV, self.hd)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(B, T, self.nKV, self.hd).transpose(1, 2)
        if self.rotary is not None:
            cos, sin = self.rotary(position_ids)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)
        o = sdpa(q, k, v, mask, self.hd**-0.5).transpose(1, 2)  # [B, T, nH, hd]
        if gate is not None:
            o = o * torch.sigmoid(gate)  # headwise gate [.., 1] broadcasts over hd
        return self.o_proj(o.reshape(B, T, self.nH * self.hd))
