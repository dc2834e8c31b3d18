"""MLA as Kimi Linear uses it: multi-head latent attention with no rotary anywhere and no output gate.

Non-standard here: `kv_a_proj_with_mqa` gives a latent (kv_lora_rank) and a shared key part k_rot
(qk_rope_head_dim) that gets NO rotary embedding; the latent goes through `kv_a_layernorm` (Llama-style RMSNorm,
eps 1e-6 by default, not the model's rms_norm_eps) and `kv_b_proj` expands it per head to `[k_nope | v]`.
k = cat(k_nope, k_rot broadcast over heads); scale = (nope + rope) ** -0.5. The generation cache
stores the normed latent and k_rot.
With `cp_group` (context parallelism) the normed latent and k_rot are all-gathered in one differentiable
collective (fewer values than the expanded K and V) and expanded for the whole sequence on each rank.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.ops.context_parallel import gather

from .attention import sdpa
from .norm import RMSNorm
from .projection import fused_linear


class MLA(nn.Module):
    supports_cp = True  # forward takes cp_group (context parallelism)

    def __init__(self, hidden_size: int, num_heads: int, *, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, latent_norm_eps: float = 1e-6, bias: bool = False,
                 impl: str = "auto"):
        super().__init__()
        self.nH, self.r, self.nope, self.rope, self.vd = (num_heads, kv_lora_rank, qk_nope_head_dim,
                                                          qk_rope_head_dim, v_head_dim)
        D = hidden_size
        self.q_proj = nn.Linear(D, num_heads * (qk_nope_head_dim + qk_rope_head_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, latent_norm_eps, "llama", impl=impl)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, D, bias=bias)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor | None = None,
                cache=None, cp_group=None) -> torch.Tensor:
        """x: [B, T, D]; mask bool [B|1, 1, T, S], or None (causal, no cache); position_ids unused (no rotary).
        cache: a LatentState (hybridlm.model.cache) that receives the normed latent and k_rot.
        cp_group: a ProcessGroup over which the sequence is split: x is this rank's slice, mask this
        rank's `ContextSlice`."""
        B, T, _ = x.shape
        q, kv_a = fused_linear(x, self.q_proj, self.kv_a_proj_with_mqa)
        q = q.view(B, T, self.nH, self.nope + self.rope).transpose(1, 2)
        latent, k_rot = kv_a.split([self.r, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        if cache is not None:
            if cp_group is not None:
                raise ValueError("cp_group: expected no generation cache with context parallelism, got one")
            latent, k_rot = cache.append(latent, k_rot)
        if cp_group is not None:  # [R, B, T, r + rope] -> the whole sequence [B, R*T, r + rope]
            whole = gather(torch.cat([latent, k_rot], dim=-1), cp_group)
            latent, k_rot = whole.transpose(0, 1).flatten(1, 2).split([self.r, self.rope], dim=-1)
        S = latent.shape[1]
        kv = self.kv_b_proj(latent).view(B, S, self.nH, self.nope + self.vd).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.vd], dim=-1)
        k = torch.cat([k_nope, k_rot[:, None].expand(B, self.nH, S, self.rope)], dim=-1)
        o = sdpa(q, k, v, mask, (self.nope + self.rope) ** -0.5)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nH * self.vd))
