"""SwiGLU MLP and the two mixture-of-experts routers of the released hybrids.

Non-standard here:
- Experts are stored fused like transformers keeps them in memory: `experts.gate_up_proj [E, 2I, D]` (gate rows
  first) and `experts.down_proj [E, D, I]`; the on-disk per-expert layout is handled by `hybridlm.model.hf`.
- Qwen router: logits in the model dtype, softmax in float32, top-k, renormalise (optional), cast back; a shared
  expert scaled by sigmoid(shared_expert_gate(x)).
- Kimi router: logits and scores in float32, sigmoid, choice = score + e_score_correction_bias, group-limited
  top-k (group score = sum of its top-2), weights from the unbiased score, renormalised with +1e-20, times
  routed_scaling_factor; shared experts ungated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.ops import glue

from .projection import fused_linear


class SwiGLU(nn.Module):
    """x: [..., D] -> [..., D]: down(silu(gate(x)) * up(x)). impl: "triton" (and "auto" on CUDA) runs
    silu(gate) * up as one fused kernel, else PyTorch; see `hybridlm.ops.glue.silu_mul`."""

    def __init__(self, hidden_size: int, intermediate_size: int, impl: str = "auto"):
        super().__init__()
        self.impl = impl
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = fused_linear(x, self.gate_proj, self.up_proj)
        return self.down_proj(glue.silu_mul(gate, up, impl=self.impl))


class Experts(nn.Module):
    """E SwiGLU experts in two 3-D weights. forward(x [N, D], idx [N, k], w [N, k]) -> [N, D]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class QwenRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, D] -> (weights [N, k] in x's dtype, indices [N, k])."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), idx


class KimiRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float):
        super().__init__()
        if num_experts % n_group:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of n_group ({n_group})")
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        nn.init.normal_(self.weight, std=0.02)
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))  # a bias, not trained

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, D] -> (weights [N, k] float32, indices [N, k])."""
        E = self.weight.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        group_scores = choice.view(-1, self.n_group, E // self.n_group).topk(2, dim=-1)[0].sum(dim=-1)
        keep = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0).bool()
        expert_mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, E // self.n_group).reshape(-1, E)
        idx = torch.topk(choice.masked_fill(~expert_mask, float("-inf")), k=self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.routed_scaling_factor, idx


class MoE(nn.Module):
    """x: [B, T, D] -> [B, T, D]. kind "qwen" (gated shared expert) or "kimi" (ungated shared experts)."""

    def __init__(self, kind: str, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 shared_intermediate_size: int, *, norm_topk_prob: bool = True, n_group: int = 1,
                 topk_group: int = 1, routed_scaling_factor: float = 1.0):
        super().__init__()
        self.kind = kind
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        if kind == "qwen":
            self.gate = QwenRouter(hidden_size, num_experts, top_k, norm_topk_prob)
            self.shared_expert = SwiGLU(hidden_size, shared_intermediate_size) if shared_intermediate_size else None
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_intermediate_size else None
        elif kind == "kimi":
            self.gate = KimiRouter(hidden_size, num_experts, top_k, n_group, topk_group, norm_topk_prob,
                                   routed_scaling_factor)
            self.shared_experts = SwiGLU(hidden_size, shared_intermediate_size) if shared_intermediate_size else None
        else:
            raise ValueError(f"kind: expected 'qwen' or 'kimi', got {kind!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        w, idx = self.gate(flat)
        out = self.experts(flat, idx, w)
        if self.kind == "qwen" and self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        elif self.kind == "kimi" and self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.reshape(shape)
