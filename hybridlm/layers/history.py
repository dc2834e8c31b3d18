"""Running a whole-history attention op (PaTH attention, DeltaFormer) under the model's masks and cache.

Non-standard here: these ops have no fixed-size state, and an old key's contribution changes with every new token
(PaTH's Householder products, DeltaFormer's u), so a generation step reruns the op over the cached history: the
cache keeps the layer's per-token inputs (O(S) memory, O(S^2) work per step, exact). A dense mask (padding, a
cache) is reduced to which keys are real tokens, and the real tokens of each row are packed into one varlen row,
so padding never enters a Householder product, a short conv or a delta-rule write. Dense masks that are not
causal with key padding (packed documents with padding) are refused with a one-line error.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import Documents, qk_norm_modules


class HistoryHeads(nn.Module):
    """What the whole-history attention layers share: grouped heads (num_heads a multiple of num_kv_heads), the q, k,
    v and o projections without bias, the optional q/k norms (`qk_norm_modules`) and `impl` ("naive" or "chunk",
    else "auto": these ops have no Triton kernel, so "triton" means the default)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, qk_norm: str,
                 norm_kind: str, norm_eps: float, impl: str):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.nH, self.nKV, self.hd, self.qk_norm = num_heads, num_kv_heads, head_dim, qk_norm
        self.impl = impl if impl in ("naive", "chunk") else "auto"
        kv = num_kv_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, kv, bias=False)
        self.v_proj = nn.Linear(hidden_size, kv, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm, self.k_norm = qk_norm_modules(qk_norm, num_heads, num_kv_heads, head_dim, eps=norm_eps,
                                                   kind=norm_kind, impl=impl)


def gate_dtype(x: torch.Tensor) -> torch.Tensor:
    """Gates and Householder directions in float32 at least (float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def key_padding(mask: torch.Tensor, B: int, T: int, S: int) -> torch.Tensor:
    """mask: bool [B|1, 1, T, S] (build_attention_mask) -> keep [B, S]: True for the real tokens of each row."""
    m = mask.expand(B, 1, T, S)[:, 0]
    keep = m[:, -1, :]  # the last query may see every real key of its row (and itself)
    qi = torch.arange(S - T, S, device=mask.device)
    ki = torch.arange(S, device=mask.device)
    expected = (keep[:, None, :] & (ki[None, :] <= qi[:, None])) | (ki[None, :] == qi[:, None])
    if not torch.equal(m, expected):
        raise ValueError("mask: PaTH / DeltaFormer layers take causal masks with key padding only (packed "
                         "documents with padding are not supported: pass cu_seqlens without an attention_mask)")
    return keep


class Packed:
    """The kept tokens of each row of [B, S, ...] packed into one row [1, n, ...] with offsets `cu_seqlens`."""

    def __init__(self, keep: torch.Tensor):
        self.B, self.S = keep.shape
        self.index = keep.flatten().nonzero().squeeze(1)
        counts = keep.sum(1).cumsum(0)
        self.cu_seqlens = torch.cat([counts.new_zeros(1), counts]).to(torch.int32)

    def pack(self, x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.flatten(0, 1)[self.index][None]

    def unpack(self, y: torch.Tensor, T: int) -> torch.Tensor:
        """y: [1, n, ...] -> [B, T, ...]: the last T positions of each row, zeros at padding."""
        full = y.new_zeros(self.B * self.S, *y.shape[2:]).index_copy(0, self.index, y[0])
        return full.view(self.B, self.S, *y.shape[2:])[:, -T:]


def run_over_history(attend, parts: dict[str, torch.Tensor | None], mask, T: int, cache=None) -> torch.Tensor:
    """attend(parts, cu_seqlens) -> [B, S, ...] over per-token parts [B, T, ...]; returns this call's [B, T, ...].

    mask: None (causal, no cache), a `Documents` (packed, B == 1) or a dense bool mask [B|1, 1, T, S]; cache: a
    HistoryState (hybridlm.model.cache) that keeps the parts of earlier calls."""
    if cache is not None:
        parts = cache.append(**parts)
    if mask is None and cache is None:
        return attend(parts, None)
    if isinstance(mask, Documents):
        if cache is not None:
            raise ValueError("cu_seqlens: packed documents cannot be combined with a generation cache")
        return attend(parts, mask.cu_seqlens)
    ref = next(t for t in parts.values() if t is not None)
    B, S = ref.shape[:2]
    keep = (torch.ones(B, S, dtype=torch.bool, device=ref.device) if mask is None
            else key_padding(mask, B, T, S))
    packed = Packed(keep)
    out = attend({n: packed.pack(t) for n, t in parts.items()}, packed.cu_seqlens)
    return packed.unpack(out, T)
