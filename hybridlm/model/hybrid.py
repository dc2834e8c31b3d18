"""`HybridLM`: embedding, a stack of hybrid blocks, final norm, lm head.

Non-standard here:
- A block's token mixer is chosen per layer from `config.layer_types` (linear: GDN, KDA, Comba or MesaNet; full:
  gated / plain softmax attention, MLA, PaTH or DeltaFormer) and its MLP from `config.mlp_types` (SwiGLU or MoE).
- block_style "olmo": attention blocks are post-norm (x += norm(attn(x)); x += norm(mlp(x))) as in OLMo-Hybrid;
  linear blocks stay pre-norm.
- Residual adds: a pre-norm block adds each branch inside the next norm (`RMSNorm(x, branch)`, one fused kernel
  each way instead of an add and a norm). A block returns `BlockOutput(residual, branch)`, its MLP output not yet
  added; the next block's first norm (or the final norm) adds it. An OLMo attention block adds what it gets with a
  plain add (its attention reads the residual stream itself) and passes its post-normed MLP output on the same way.
  The values are those of the plain adds: the same add, the same gradient sums.
- `cu_seqlens` (documents packed into one row, B == 1) reaches every mixer: the linear ops restart their state,
  the short conv restarts, attention gets a `Documents` (attention inside each document, no dense mask), and
  default positions restart.
- Default positions are 0..T-1 even with left padding (transformers' forward does the same).
- `impl` ("auto" | "naive" | "chunk" | "triton") is passed explicitly to the linear ops. "auto" runs GDN's Gluon
  forward (sm_90, bf16/fp16, head dims 128) wherever no gradient is needed, e.g. prefill under torch.no_grad (a
  cached one-token step keeps the Triton decode kernel); "gluon" is an op-level impl only (the layers' conv, norm
  and gate glue have no Gluon kernel).
- `targets` (next-token ids, -100 where none) turn the head into the chunked linear + cross-entropy
  (`hybridlm.ops.linear_ce`): the output has the loss sum and no logits, so training never holds [B, T, vocab].
- Attention gets an explicit mask only when something needs one (padding, a cache, packed documents with
  padding); otherwise None, i.e. SDPA with is_causal, so that SDPA may use its FlashAttention backend.
- `cp_group` (context parallelism): each rank of the process group passes its contiguous slice [B, T] of a
  sequence of R*T positions, in rank order; cu_seqlens are the global offsets (documents may cross ranks) and
  position_ids the global ones (default: those of the whole sequence, restarting per document, at rank*T + i).
  The linear layers' conv and recurrence exchange states, attention all-gathers K / V (hybridlm.layers.attention).
  Logits, hidden states and the loss are the rank's slice's: the loss of the whole sequence is the sum over the
  ranks (an all-reduce the caller does), and every rank must backpropagate, since the exchanges' backwards are
  collectives. GDN, KDA, gated / plain attention and MLA take it; other mixers, padding masks and a cache are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from hybridlm.layers import (
    MLA,
    Comba,
    DeltaFormerAttention,
    GatedAttention,
    GatedDeltaNet,
    KimiDeltaAttention,
    MesaNet,
    MoE,
    PaTHAttention,
    RMSNorm,
    SwiGLU,
    build_attention_mask,
    positions_for,
)
from hybridlm.layers.attention import ContextSlice, Documents
from hybridlm.ops.context_parallel import check_group
from hybridlm.ops.linear_ce import linear_cross_entropy
from hybridlm.ops.offsets import host_offsets

from . import hf
from .config import HybridConfig


@dataclass
class HybridOutput:
    logits: torch.Tensor | None  # [B, T, vocab]; None when the forward got targets
    hidden_states: torch.Tensor | None = None  # [B, T, D] after the final norm
    cache: object | None = None  # the HybridCache passed in, after this call
    loss: torch.Tensor | None = None  # with targets: the float32 sum of token losses (float64 for float64 weights)


def build_mixer(config: HybridConfig, layer: int, impl: str = "auto") -> nn.Module:
    c = config
    if c.layer_types[layer] == "linear_attention":
        if c.linear_kind == "mesa":
            return MesaNet(c.hidden_size, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                           conv_kernel=c.linear_conv_kernel_dim, norm_eps=c.linear_norm_eps, impl=impl,
                           recompute=c.linear_recompute)
        if c.linear_kind == "kda":
            return KimiDeltaAttention(c.hidden_size, c.linear_num_value_heads, c.linear_key_head_dim,
                                      conv_kernel=c.linear_conv_kernel_dim, norm_eps=c.linear_norm_eps, impl=impl,
                                      recompute=c.linear_recompute)
        if c.linear_kind == "comba":
            return Comba(c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                         c.linear_value_head_dim, conv_kernel=c.linear_conv_kernel_dim, beta_scale=c.linear_beta_scale,
                         norm_eps=c.linear_norm_eps, impl=impl, recompute=c.linear_recompute)
        return GatedDeltaNet(c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                             c.linear_value_head_dim, conv_kernel=c.linear_conv_kernel_dim, layout=c.gdn_layout,
                             beta_scale=c.linear_beta_scale, norm_eps=c.linear_norm_eps, impl=impl,
                             recompute=c.linear_recompute)
    if c.attention_kind == "path":
        return PaTHAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                             forget_gate=c.path_forget_gate, qk_norm=c.qk_norm, norm_kind=c.norm_kind,
                             norm_eps=c.rms_norm_eps, impl=impl)
    if c.attention_kind == "deltaformer":
        return DeltaFormerAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                    qk_norm=c.qk_norm, norm_kind=c.norm_kind, norm_eps=c.rms_norm_eps,
                                    rotary_dim=c.rotary_dim, rope_theta=c.rope_theta, impl=impl)
    if c.attention_kind == "mla":
        return MLA(c.hidden_size, c.num_attention_heads, kv_lora_rank=c.kv_lora_rank,
                   qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                   latent_norm_eps=c.mla_norm_eps, bias=c.attention_bias, impl=impl)
    return GatedAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                          gate=c.attn_gate if c.attention_kind == "gated" else "none", qk_norm=c.qk_norm,
                          norm_kind=c.norm_kind, norm_eps=c.rms_norm_eps, rotary_dim=c.rotary_dim,
                          rope_theta=c.rope_theta, bias=c.attention_bias, impl=impl)


def build_mlp(config: HybridConfig, layer: int, impl: str = "auto") -> nn.Module:
    c = config
    if c.mlp_types[layer] == "dense":
        return SwiGLU(c.hidden_size, c.intermediate_size, impl=impl)
    return MoE(c.moe_kind, c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
               c.shared_expert_intermediate_size, norm_topk_prob=c.norm_topk_prob, n_group=c.n_group,
               topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor)


class BlockOutput(NamedTuple):
    """A block's output: the residual stream and the block's last branch (the MLP's output, post-normed in an OLMo
    attention block) not yet added to it. The next block's first norm, or the final norm, adds it in the same
    kernel (`RMSNorm(x, branch)`)."""

    residual: torch.Tensor  # [B, T, D]
    branch: torch.Tensor  # [B, T, D]

    @property
    def hidden_state(self) -> torch.Tensor:
        """residual + branch: the block's output hidden state, as a block adding its own output returns it."""
        return self.residual + self.branch


class HybridBlock(nn.Module):
    def __init__(self, config: HybridConfig, layer: int, impl: str = "auto"):
        super().__init__()
        self.layer_type = config.layer_types[layer]
        self.linear = self.layer_type == "linear_attention"
        self.post_norm = config.block_style == "olmo" and not self.linear
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_kind, impl=impl)  # noqa: E731
        self.mixer = build_mixer(config, layer, impl)
        self.mlp = build_mlp(config, layer, impl)
        self.norm1, self.norm2 = norm(), norm()  # pre-norms, or post-norms of an OLMo attention block

    def forward(self, x: torch.Tensor, branch: torch.Tensor | None = None, *, attention_mask, cu_seqlens,
                attn_mask, position_ids, cache=None, cp_group=None) -> BlockOutput:
        """x: [B, T, D] the residual stream; branch: [B, T, D] the previous block's last output, not yet added to x
        (None for the first block). Returns BlockOutput(residual, branch): this block's, the same way."""
        cp = {} if cp_group is None else {"cp_group": cp_group}  # only mixers with supports_cp take it
        if self.linear:
            mix = lambda h: self.mixer(h, attention_mask=attention_mask, cu_seqlens=cu_seqlens, cache=cache,  # noqa
                                       **cp)
        else:
            mix = lambda h: self.mixer(h, attn_mask, position_ids, cache=cache, **cp)  # noqa: E731
        if self.post_norm:  # the mixer reads the residual stream itself: the adds stay plain adds
            if branch is not None:
                x = x + branch
            x = x + self.norm1(mix(x))
            return BlockOutput(x, self.norm2(self.mlp(x)))
        h, x = (self.norm1(x), x) if branch is None else self.norm1(x, branch)
        h, x = self.norm2(x, mix(h))
        return BlockOutput(x, self.mlp(h))


class HybridLM(nn.Module):
    """model(input_ids [B, T], attention_mask [B, T] = None, cu_seqlens [N+1] = None) -> HybridOutput."""

    def __init__(self, config: HybridConfig, impl: str = "auto"):
        super().__init__()
        config.validate()
        self.config = config
        self.impl = impl  # the head's loss takes it (the layers hold their own)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridBlock(config, i, impl) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_kind, impl=impl)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) for linear / embedding weights; norms, A_log, dt_bias and convs keep their inits."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=std)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                cache=None, targets: torch.Tensor | None = None, cp_group=None) -> HybridOutput:
        """input_ids: [B, T] int; attention_mask: [B, T] (1 token / 0 pad, left padding), or [B, past + T] (the whole
        history) with a cache; cu_seqlens: int32 [N+1] offsets of documents packed in one row (B must be 1);
        position_ids: [B, T]; cache: a HybridCache (hybridlm.model.cache), updated in place; targets: int [B, T]
        next-token ids, -100 where there is none: the output gets `loss` (sum over targets) and no logits.
        cp_group: a torch.distributed ProcessGroup over which the sequence is split (module docstring): input_ids,
        position_ids and targets are this rank's slice, cu_seqlens global."""
        B, T = input_ids.shape
        if cp_group is not None:
            return self._forward_cp(input_ids, cu_seqlens, position_ids, targets, cp_group,
                                    attention_mask=attention_mask, cache=cache)
        past = cache.seen_tokens if cache is not None else 0
        if cu_seqlens is not None and B != 1:
            raise ValueError(f"cu_seqlens: packed documents need batch size 1, got input_ids of shape {(B, T)}")
        if attention_mask is not None and tuple(attention_mask.shape) != (B, past + T):
            raise ValueError(f"attention_mask: expected shape {(B, past + T)} (batch, past + new tokens), "
                             f"got {tuple(attention_mask.shape)}")
        x = self.embed_tokens(input_ids)
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # nothing padded: skip the masking work
        mask2d = None if attention_mask is None else attention_mask[:, past:].to(x.dtype)
        attn_mask = None  # None: plain causal (SDPA's is_causal, FlashAttention-eligible)
        has_attention = any(not blk.linear for blk in self.layers)
        if has_attention and cu_seqlens is not None and attention_mask is None and cache is None:
            attn_mask = Documents(cu_seqlens)
        elif has_attention and (attention_mask is not None or cu_seqlens is not None or cache is not None):
            attn_mask = build_attention_mask(T, attention_mask=attention_mask, cu_seqlens=cu_seqlens, past=past,
                                             device=x.device)
        if position_ids is None:
            position_ids = positions_for(T, cu_seqlens, x.device) + past
        branch = None
        for i, blk in enumerate(self.layers):
            x, branch = blk(x, branch, attention_mask=mask2d, cu_seqlens=cu_seqlens, attn_mask=attn_mask,
                            position_ids=position_ids, cache=None if cache is None else cache[i])
        if cache is not None:
            cache.seen_tokens += T
        return self._head(x, branch, targets, cache)

    def _forward_cp(self, input_ids, cu_seqlens, position_ids, targets, group, *, attention_mask,
                    cache) -> HybridOutput:
        """forward with cp_group: this rank's slice of a sequence split over group (module docstring)."""
        rank, R = check_group(group)
        B, T = input_ids.shape
        if cache is not None:
            raise ValueError("cache: expected None with cp_group (context parallelism is for training), got a cache")
        if attention_mask is not None:
            raise ValueError("attention_mask: expected None with cp_group (no padding; pack documents with "
                             "cu_seqlens), got a mask")
        refused = sorted({type(b.mixer).__name__ for b in self.layers if not getattr(b.mixer, "supports_cp", False)})
        if refused:
            raise ValueError("cp_group: context parallelism covers GatedDeltaNet, KimiDeltaAttention, GatedAttention "
                             f"and MLA layers, got {', '.join(refused)}")
        if cu_seqlens is not None:
            if B != 1:
                raise ValueError(f"cu_seqlens: packed documents need batch size 1, got input_ids of shape {(B, T)}")
            bounds = host_offsets(cu_seqlens)
            if bounds[0] != 0 or bounds[-1] != R * T:
                raise ValueError(f"cu_seqlens: expected global offsets from 0 to {R * T} (T={T} positions on each "
                                 f"of {R} ranks), got {bounds[0]}..{bounds[-1]}")
        x = self.embed_tokens(input_ids)
        attn_mask = ContextSlice(rank, R, T, cu_seqlens)
        if position_ids is None:
            position_ids = positions_for(R * T, cu_seqlens, x.device)[:, rank * T : (rank + 1) * T]
        branch = None
        for blk in self.layers:
            x, branch = blk(x, branch, attention_mask=None, cu_seqlens=cu_seqlens, attn_mask=attn_mask,
                            position_ids=position_ids, cp_group=group)
        return self._head(x, branch, targets, None)

    def _head(self, x: torch.Tensor, branch: torch.Tensor | None, targets: torch.Tensor | None,
              cache) -> HybridOutput:
        """The last block's branch added in the final norm, then the lm head (logits), or with targets the fused
        linear + cross-entropy (loss sum)."""
        B, T = x.shape[:2]
        h = self.norm(x) if branch is None else self.norm(x, branch)[0]
        if targets is not None:
            if tuple(targets.shape) != (B, T):
                raise ValueError(f"targets: expected shape {(B, T)}, got {tuple(targets.shape)}")
            loss = linear_cross_entropy(h.flatten(0, 1), self.lm_head.weight, targets.flatten(), ignore_index=-100,
                                        reduction="sum", impl=self.impl)
            return HybridOutput(logits=None, hidden_states=h, cache=cache, loss=loss)
        return HybridOutput(logits=self.lm_head(h), hidden_states=h, cache=cache)

    def new_cache(self):
        """An empty HybridCache for this model's layer types (filled by the first forward that gets it)."""
        from .cache import HybridCache

        return HybridCache.for_config(self.config)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """See hybridlm.model.generate.generate."""
        from .generate import generate

        return generate(self, input_ids, attention_mask, **kwargs)

    # --- parameters ---
    def num_parameters(self, active: bool = False) -> int:
        """All parameters (tied weights once); active=True counts only top-k routed experts per MoE layer."""
        seen, total = set(), 0
        for name, p in self.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = p.numel()
            if active and ".experts." in name:
                c = self.config
                n = n * c.num_experts_per_tok // c.num_experts
            total += n
        return total

    # --- Hugging Face checkpoints ---
    @classmethod
    def from_pretrained(cls, folder: str, *, dtype: torch.dtype | None = None, impl: str = "auto",
                        strict: bool = True) -> HybridLM:
        """A transformers checkpoint folder (config.json + safetensors) or our own format (see hybridlm.model.hf)."""
        return hf.load_pretrained(folder, lambda cfg: cls(cfg, impl=impl), dtype=dtype, strict=strict)

    def save_pretrained(self, folder: str, *, max_shard_size: int | str = "5GB",
                        model_type: str | None = None, tokenizer=None) -> None:
        """transformers' on-disk layout for model_type (default: the config's), else our own format; with the
        tokenizer files of `tokenizer` (a ByteTokenizer or JsonTokenizer of hybridlm.model.tokenizer; None:
        bytes for a vocabulary of 256, else none), which `AutoTokenizer.from_pretrained(folder)` loads."""
        hf.save_pretrained(self, folder, max_shard_size=max_shard_size, model_type=model_type,
                           tokenizer=tokenizer)
