"""Softmax attention with the variations of the released hybrids, on PyTorch SDPA.

Non-standard here:
- Output gate (Qwen3-Next / Qwen3.5): `q_proj` emits per head `[query (hd) | gate (hd)]` ("elementwise") or
  `[query (hd) | gate (1)]` ("headwise"); the attention output is multiplied by sigmoid(gate) before `o_proj`.
  gate "none" is plain attention (OLMo-Hybrid).
- QK-norm: "head" normalises each head over hd before RoPE (Qwen, zero-centred); "full" normalises the whole
  q / k projection before the head split (OLMo-Hybrid); "none".
- Partial RoPE: rotate_half RoPE on the first `rotary_dim` channels, the rest pass through; rotary_dim 0 is NoPE.
  cos/sin are float32 and cast to the activations' dtype on the PyTorch path (`hybridlm.ops.rope`); the fused
  kernel (`hybridlm.ops.glue.rotary`) computes them from the position ids in float32 and rounds once.
- The mask is an explicit boolean [B, 1, T, T] built by `build_attention_mask` (causal, key padding, a cache).
  Each query may always see itself, so fully padded rows stay finite (their outputs are unused).
  mask None means plain causal with queries and keys aligned (no cache, nothing padded or packed): SDPA's
  is_causal, which lets it pick its FlashAttention backend (no mask takes it), with GQA by enable_gqa (no copies).
- Packed documents (one row [1, N] with cu_seqlens, no padding, no cache) get a `Documents` instead of a mask and
  never a dense [N, N] one. On CUDA in fp16/bf16: variable-length FlashAttention (`varlen_attn`, unequal q/v head
  dims padded with zeros), or where torch has none (< 2.10) a compiled `flex_attention` with a document block
  mask; otherwise (CPU, float32/64) causal SDPA per document, O(sum of document length^2) at most. The choice is
  logged once per (device type, dtype, path).
- Context parallelism (`cp_group`: the sequence split over a process group, each rank holding a contiguous
  slice): K and V are all-gathered in one differentiable collective (post-norm, post-RoPE; the backward sums the
  gradients over the ranks). The rank's queries get a `ContextSlice` instead of a mask: each (row, document) that
  meets the slice is one query block attending to the keys from its document's start to the block's end, causal
  aligned at the bottom right (query i of a block of n against m keys sees keys j <= i + m - n). On CUDA in
  fp16/bf16 that is one `varlen_attn` call (FlashAttention aligns causal masks that way); elsewhere SDPA per
  block with that mask as a lazy causal bias (kv heads repeated, so float32 on CUDA takes the memory-efficient
  kernel). No [T, R*T] tensor is made; rank r reads at most (r + 1) T keys, so the last rank does
  the most attention work (contiguous slices, no load balancing).
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from hybridlm.ops import glue
from hybridlm.ops.context_parallel import gather
from hybridlm.ops.offsets import host_offsets
from hybridlm.ops.rope import apply_rotary, rotary_cos_sin  # noqa: F401  (apply_rotary: public here too)

from .norm import RMSNorm, autocast_dtype
from .projection import fused_linear

log = logging.getLogger("hybridlm.layers")
_DOC_LOGGED: set[tuple] = set()
DOC_IMPLS = ("auto", "varlen", "flex", "loop")


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


@dataclass(frozen=True)
class ContextSlice:
    """This rank's T queries of a sequence split into `ranks` slices of T (rank r holds global positions
    [r T, (r + 1) T)), against the all-gathered keys of the whole sequence: causal on global positions, and inside
    the documents of the global offsets cu_seqlens [N+1] if given (then batch size 1)."""

    rank: int  # this rank's place in the group
    ranks: int  # the group's size R
    T: int  # positions a rank holds
    cu_seqlens: torch.Tensor | None = None  # global document offsets, 0 .. R*T, or None (one sequence a row)

    @functools.cached_property
    def blocks(self) -> tuple[int, list[int], list[int]]:
        """(lo, query offsets, key offsets) of one row: query block i is [q[i], q[i+1]) of the slice, its keys
        [lo + k[i], lo + k[i+1]) of the gathered sequence, lo the start of the document the slice begins in. Worked
        out once: every attention layer of a forward shares the slice."""
        a, z = self.rank * self.T, (self.rank + 1) * self.T
        if self.cu_seqlens is None:
            return 0, [0, self.T], [0, z]
        docs = [(s, e) for s, e in _pairs(host_offsets(self.cu_seqlens)) if s < z and e > a]
        lo = docs[0][0]
        return lo, [0] + [min(e, z) - a for _, e in docs], [0] + [min(e, z) - lo for _, e in docs]


def _pairs(bounds: list[int]) -> list[tuple[int, int]]:
    return [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]


def cp_gather_kv(k: torch.Tensor, v: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """k [B, h, T, dk], v [B, h, T, dv] of this rank's slice -> those of the whole sequence [B, h, R*T, d], in one
    collective (two could run their backwards in different orders on different ranks)."""
    dk = k.shape[-1]
    kv = gather(torch.cat([k, v], dim=-1), group)  # [R, B, h, T, dk + dv]
    k, v = kv.permute(1, 2, 0, 3, 4).flatten(2, 3).split([dk, v.shape[-1]], dim=-1)
    return k, v


def positions_for(T: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """Default position ids [1, T]: 0..T-1, restarting at each packed document."""
    pos = torch.arange(T, device=device)
    if cu_seqlens is not None:
        starts = cu_seqlens.to(device=device, dtype=torch.long)
        doc = torch.bucketize(pos, starts[1:], right=True)
        pos = pos - starts[doc]
    return pos[None]


class Rotary(nn.Module):
    """cos/sin [B, T, rotary_dim] (float32) for position ids [B, T] (`hybridlm.ops.rope.rotary_cos_sin`).

    The inverse frequencies are recomputed in float32 at each call instead of kept in a buffer, so casting the
    model to bf16 (or building it on the meta device) never rounds them."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim, self.theta = rotary_dim, float(theta)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin(position_ids, self.rotary_dim, self.theta)


class Documents:
    """Documents packed in one row of N tokens: causal attention inside each, none across. cu_seqlens: int [D+1]
    offsets (0 first, N last). One per forward, shared by its attention layers, so the host offsets are read and
    the flex block mask is built once."""

    def __init__(self, cu_seqlens: torch.Tensor):
        self.cu_seqlens = cu_seqlens
        self._block_mask = None

    @property
    def bounds(self) -> list[int]:
        return host_offsets(self.cu_seqlens)

    @property
    def max_len(self) -> int:
        b = self.bounds
        return max((e - s for s, e in zip(b[:-1], b[1:])), default=0)

    def block_mask(self, n: int, device: torch.device):
        """The flex_attention BlockMask of these documents (causal inside each), built once on `device`."""
        if self._block_mask is None:
            cu = self.cu_seqlens.to(device=device, dtype=torch.long)
            doc = torch.bucketize(torch.arange(n, device=device), cu[1:], right=True)

            def same_doc_causal(b, h, q_idx, kv_idx):
                return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

            self._block_mask = _compiled("create_block_mask")(same_doc_causal, None, None, n, n, device=device)
        return self._block_mask


_COMPILED: dict[str, object] = {}


def _compiled(name: str):
    """torch.compile'd flex_attention / create_block_mask: uncompiled, both fall back to dense [N, N] math."""
    if name not in _COMPILED:
        from torch.nn.attention import flex_attention as fa

        _COMPILED[name] = torch.compile(getattr(fa, name))
    return _COMPILED[name]


def varlen_available() -> bool:
    """Whether this torch has `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  (torch >= 2.10)
    except ImportError:
        return False
    return True


def _flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_document_impl(q: torch.Tensor, v: torch.Tensor, impl: str = "auto") -> str:
    """The path of `document_attention` for q [1, h, N, dk] and v [1, hkv, N, dv] (after autocast): on CUDA for
    fp16/bf16 with dk, dv <= 256 "varlen" (torch >= 2.10), else "flex"; "loop" for everything else. "auto" logs
    its choice once per (device type, dtype, path)."""
    if impl not in DOC_IMPLS:
        raise ValueError(f"impl: expected one of {DOC_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    why = None
    if q.device.type != "cuda":
        impl, why = "loop", f"on {q.device.type}"
    elif q.dtype not in (torch.float16, torch.bfloat16) or max(q.shape[-1], v.shape[-1]) > 256:
        impl, why = "loop", f"{q.dtype} inputs, head dims {q.shape[-1]}/{v.shape[-1]}"
    elif varlen_available():
        impl = "varlen"
    elif _flex_available() and min(q.shape[-1], v.shape[-1]) >= 16:  # flex_attention's smallest head dim
        impl, why = "flex", "no torch.nn.attention.varlen (torch < 2.10)"
    else:
        impl, why = "loop", "no varlen_attn in this torch, and flex_attention needs head dims >= 16"
    key = (q.device.type, q.dtype, impl)
    if key not in _DOC_LOGGED and not torch.compiler.is_compiling():
        _DOC_LOGGED.add(key)
        log.info("hybridlm.layers.attention: packed documents on %s %s go to %s%s", q.device.type, q.dtype,
                 {"varlen": "varlen_attn (FlashAttention)", "flex": "flex_attention with a document block mask",
                  "loop": "causal SDPA per document"}[impl], f" ({why})" if why else "")
    return impl


def _autocast_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k, v in the dtype autocast would give them (SDPA casts itself; varlen_attn / flex do not)."""
    half = autocast_dtype(q)
    return (q, k, v) if half is None else (q.to(half), k.to(half), v.to(half))


def varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                  max_q: int, max_k: int, *, scale: float | None, causal: bool = True) -> torch.Tensor:
    """torch's `varlen_attn` on q [N, h, d], k / v [N, hkv, d] -> [N, h, d], query head i reading kv head
    i // (h / hkv). Its keywords moved between releases: causal is `window_size=(-1, 0)` where it has a window
    (else `is_causal`), and GQA is `enable_gqa` where it has one (else the kv heads are repeated)."""
    from torch.nn.attention.varlen import varlen_attn

    params = _params(varlen_attn)
    kw = {"scale": scale}
    if "window_size" in params:
        kw["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kw["is_causal"] = causal
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


@functools.cache
def _params(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _varlen_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                 max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """`varlen_causal` on q [B, h, n, dk], k [B, hkv, m, dk], v [B, hkv, m, dv] whose rows are flattened into one
    packed sequence (offsets cu_q / cu_k over B*n / B*m) -> [B, h, n, dv]."""
    # FlashAttention takes one head dim, a multiple of 8, for q, k and v: zero channels appended to q and k leave
    # the scores as they are (scale is explicit), appended to v give zero outputs that are cut off (MLA: dk 192,
    # dv 128)
    B, n, dv = q.shape[0], q.shape[2], v.shape[-1]
    d = -(-max(q.shape[-1], dv) // 8) * 8
    q3, k3, v3 = (F.pad(t.transpose(1, 2).flatten(0, 1), (0, d - t.shape[-1])).contiguous() for t in (q, k, v))
    o = varlen_causal(q3, k3, v3, cu_q, cu_k, max_q, max_k, scale=scale)
    return o[..., :dv].unflatten(0, (B, n)).transpose(1, 2)  # [B*n, h, d] -> [B, h, n, dv]


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sl: ContextSlice, scale: float,
                 impl: str = "auto") -> torch.Tensor:
    """This rank's queries q [B, h, T, dk] against the whole sequence's keys k [B, hkv, R*T, dk] and values
    v [B, hkv, R*T, dv] -> [B, h, T, dv] (module docstring: one bottom-right causal block a document)."""
    R, T = sl.ranks, sl.T
    if q.shape[2] != T or k.shape[2] != R * T:
        raise ValueError(f"q, k: expected {T} queries and {R * T} keys (a slice of {T} on each of {R} ranks), got "
                         f"{q.shape[2]} and {k.shape[2]}")
    if sl.cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"q: packed documents need batch size 1, got shape {tuple(q.shape)}")
    q, k, v = _autocast_dtype(q, k, v)
    lo, cq, ck = sl.blocks
    k, v = k[:, :, lo : lo + ck[-1]], v[:, :, lo : lo + ck[-1]]
    if resolve_document_impl(q, v, impl) == "varlen":
        B, n, m = q.shape[0], cq[-1], ck[-1]
        rows = [(b * n + x, b * m + y) for b in range(B) for x, y in zip(cq[int(b > 0):], ck[int(b > 0):])]
        cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=q.device) for c in zip(*rows))
        lens = [(x1 - x0, y1 - y0) for (x0, y0), (x1, y1) in zip(rows[:-1], rows[1:])]
        return _varlen_rows(q, k, v, cu_q, cu_k, max(a for a, _ in lens), max(b for _, b in lens), scale)
    k, v = _expand_kv(q, k, v)
    outs = [_causal_block(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], scale)
            for (q0, q1), (k0, k1) in zip(zip(cq[:-1], cq[1:]), zip(ck[:-1], ck[1:]))]
    return torch.cat(outs, dim=2)


def _expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [B, hkv, m, d] with each kv head repeated for its query heads: SDPA's memory-efficient kernel (the one
    that takes float32 on CUDA) has no enable_gqa, and without it a long float32 document falls to the math path's
    [m, m] score matrix."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def _causal_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, h, n, dk] against k, v [B, h, m, d], causal aligned at the bottom right (query i sees keys
    j <= i + m - n) as SDPA's lazy causal bias, which the fused kernels take without a dense [n, m] mask."""
    n, m = q.shape[2], k.shape[2]
    if n == m:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, m), scale=scale)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, scale: float,
                       impl: str = "auto") -> torch.Tensor:
    """Causal attention inside each packed document, none across. q: [1, h, N, dk]; k: [1, hkv, N, dk];
    v: [1, hkv, N, dv] -> [1, h, N, dv]; query head i reads kv head i // (h / hkv). No [N, N] tensor is made."""
    if q.shape[0] != 1:
        raise ValueError(f"q: packed documents need batch size 1, got shape {tuple(q.shape)}")
    bounds, n = docs.bounds, q.shape[2]
    if bounds[0] != 0 or bounds[-1] != n:
        raise ValueError(f"cu_seqlens: expected offsets from 0 to {n} (the packed row's length), got "
                         f"{bounds[0]}..{bounds[-1]}")
    q, k, v = _autocast_dtype(q, k, v)
    impl = resolve_document_impl(q, v, impl)
    if impl == "varlen":
        cu = docs.cu_seqlens.to(device=q.device, dtype=torch.int32)
        m = docs.max_len
        return _varlen_rows(q, k, v, cu, cu, m, m, scale)
    if impl == "flex":
        bm = docs.block_mask(n, q.device)
        return _compiled("flex_attention")(q, k, v, block_mask=bm, scale=scale, enable_gqa=q.shape[1] > k.shape[1])
    k, v = _expand_kv(q, k, v)
    outs = [_causal_block(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], scale) for s, e in zip(bounds[:-1], bounds[1:])
            if e > s]
    return torch.cat(outs, dim=2)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | Documents | ContextSlice | None,
         scale: float) -> torch.Tensor:
    """q: [B, h, T, d]; k, v: [B, hkv, S, d]; query head i reads kv head i // groups. mask: bool [B|1, 1, T, S];
    a `Documents` (B == 1, packed documents: `document_attention`); a `ContextSlice` (this rank's queries against
    the gathered keys: `cp_attention`); or None for plain causal attention with S == T
    (is_causal; GQA by enable_gqa, else by repeat_interleave)."""
    if isinstance(mask, Documents):
        return document_attention(q, k, v, mask, scale)
    if isinstance(mask, ContextSlice):
        return cp_attention(q, k, v, mask, scale)
    groups = q.shape[1] // k.shape[1]
    if mask is None:
        if k.shape[2] != q.shape[2]:
            raise ValueError(f"mask None means causal with as many keys as queries; got {q.shape[2]} queries and "
                             f"{k.shape[2]} keys (pass the mask of build_attention_mask)")
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=groups > 1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def qk_norm_modules(qk_norm: str, num_heads: int, num_kv_heads: int, head_dim: int, *, eps: float, kind: str,
                    impl: str) -> tuple[RMSNorm | None, RMSNorm | None]:
    """The q and k RMSNorms of an attention layer: "head" over each head's channels, "full" over the whole
    projection (OLMo), "none" neither."""
    if qk_norm not in ("head", "full", "none"):
        raise ValueError(f"qk_norm: expected 'head', 'full' or 'none', got {qk_norm!r}")
    if qk_norm == "none":
        return None, None
    full = qk_norm == "full"
    return (RMSNorm(num_heads * head_dim if full else head_dim, eps, kind, impl=impl),
            RMSNorm(num_kv_heads * head_dim if full else head_dim, eps, kind, impl=impl))


def normed_heads(q: torch.Tensor, k: torch.Tensor, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, nH * hd], k [B, T, nKV * hd] (or already split into heads) -> q [B, T, nH, hd], k [B, T, nKV, hd]
    through the layer's q/k norms (`qk_norm_modules`; the layer has qk_norm, q_norm, k_norm, nH, nKV, hd)."""
    B, T = q.shape[:2]
    if layer.qk_norm == "full":
        q, k = layer.q_norm(q.reshape(B, T, -1)), layer.k_norm(k.reshape(B, T, -1))
    q, k = q.reshape(B, T, layer.nH, layer.hd), k.reshape(B, T, layer.nKV, layer.hd)
    if layer.qk_norm == "head":
        q, k = layer.q_norm(q), layer.k_norm(k)
    return q, k


class GatedAttention(nn.Module):
    """x: [B, T, D] -> [B, T, D]. impl: the model's, for the glue (`hybridlm.ops.glue`): the q/k RMSNorms, RoPE and
    the output gate take their fused Triton kernels when it resolves so."""

    supports_cp = True  # forward takes cp_group (context parallelism)

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 gate: str = "elementwise", qk_norm: str = "head", norm_kind: str = "zero_centered",
                 norm_eps: float = 1e-6, rotary_dim: int = 0, rope_theta: float | None = 10000.0,
                 bias: bool = False, impl: str = "auto"):
        super().__init__()
        if gate not in ("elementwise", "headwise", "none"):
            raise ValueError(f"gate: expected 'elementwise', 'headwise' or 'none', got {gate!r}")
        self.nH, self.nKV, self.hd, self.gate, self.qk_norm = num_heads, num_kv_heads, head_dim, gate, qk_norm
        self.impl = impl
        gate_width = {"elementwise": head_dim, "headwise": 1, "none": 0}[gate]
        self.gate_width = gate_width
        D = hidden_size
        self.q_proj = nn.Linear(D, num_heads * (head_dim + gate_width), bias=bias)
        self.k_proj = nn.Linear(D, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(D, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, D, bias=bias)
        self.q_norm, self.k_norm = qk_norm_modules(qk_norm, num_heads, num_kv_heads, head_dim, eps=norm_eps,
                                                   kind=norm_kind, impl=impl)
        self.rotary = Rotary(rotary_dim, rope_theta) if rotary_dim and rope_theta is not None else None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | Documents | None, position_ids: torch.Tensor,
                cache=None, cp_group=None) -> torch.Tensor:
        """x: [B, T, D]; mask: bool [B|1, 1, T, S] from build_attention_mask, a `Documents` (packed, B == 1), or
        None (causal, no cache);
        position_ids: [B|1, T]. cache: a KVState (hybridlm.model.cache) that receives this call's post-RoPE K / V.
        cp_group: a ProcessGroup over which the sequence is split: x is this rank's slice, position_ids global,
        mask this rank's `ContextSlice`."""
        B, T, _ = x.shape
        q, k, v = fused_linear(x, self.q_proj, self.k_proj, self.v_proj)
        gate = None
        if self.gate_width:
            q, gate = q.view(B, T, self.nH, self.hd + self.gate_width).split([self.hd, self.gate_width], dim=-1)
        q, k = normed_heads(q, k, self)
        if self.rotary is not None:
            q, k = glue.rotary(q, k, position_ids, rotary_dim=self.rotary.rotary_dim, theta=self.rotary.theta,
                               impl=self.impl)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(B, T, self.nKV, self.hd).transpose(1, 2)
        if cache is not None:
            if cp_group is not None:
                raise ValueError("cp_group: expected no generation cache with context parallelism, got one")
            k, v = cache.append(k, v)
        if cp_group is not None:
            k, v = cp_gather_kv(k, v, cp_group)
        o = sdpa(q, k, v, mask, self.hd**-0.5).transpose(1, 2)  # [B, T, nH, hd]
        if gate is not None:
            o = glue.sigmoid_gate(o, gate, impl=self.impl)  # headwise gate [.., 1] broadcasts over hd
        return self.o_proj(o.reshape(B, T, self.nH * self.hd))
