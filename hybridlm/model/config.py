"""`HybridConfig`: one typed description for every hybrid this library builds or loads.

Non-standard here: the released models differ in many small ways (norm rounding, projection layouts, beta range,
post-norm attention blocks). Each difference is an explicit field with a comment, never a hidden switch on the
model name, so a new hybrid can mix the parts freely. `layer_types` / `mlp_types` are per-layer lists like
transformers' `layer_types`. JSON round trip: `to_json` / `from_json` (unknown keys are refused by name).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from hybridlm.files import atomic_write_text

LAYER_TYPES = ("linear_attention", "full_attention")
MLP_TYPES = ("dense", "moe")


@dataclass
class HybridConfig:
    # --- trunk ---
    vocab_size: int = 256  # tokens in the embedding and lm head
    hidden_size: int = 256  # model width D
    num_hidden_layers: int = 4  # number of blocks
    layer_types: list[str] = field(default_factory=list)  # per block: "linear_attention" | "full_attention"
    mlp_types: list[str] = field(default_factory=list)  # per block: "dense" (SwiGLU) | "moe"
    norm_kind: str = "zero_centered"  # "zero_centered" (x_hat*(1+w), Qwen) | "llama" (w*x_hat.to(dtype), Kimi)
    #                                   | "fp32_weight" (w*x_hat in fp32, then cast: OLMo-Hybrid)
    rms_norm_eps: float = 1e-6  # eps of the block / final / q-k norms
    block_style: str = "pre"  # "pre" (x += f(norm(x))) | "olmo" (attention blocks post-norm: x += norm(f(x)))
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix
    # --- linear mixer ---
    linear_kind: str = "gdn"  # "gdn" (Gated DeltaNet, scalar decay per head) | "kda" (channel-wise decay)
    #                           | "comba" (Comba: scalar decay, read key p = d k, output correction q - D p)
    #                           | "mesa" (MesaNet: least-squares memory, exact solve; H == HV heads of dk / dv)
    gdn_layout: str = "split"  # "fused" (Qwen3-Next in_proj_qkvz/in_proj_ba) | "split" (Qwen3.5 in_proj_qkv/z/b/a)
    #                            | "olmo" (separate q/k/v/a/b/g projections)
    linear_num_key_heads: int = 2  # H (query/key heads of the linear mixer)
    linear_num_value_heads: int = 4  # HV, a multiple of H (grouped value attention); KDA uses H == HV
    linear_key_head_dim: int = 32  # dk
    linear_value_head_dim: int = 32  # dv
    linear_conv_kernel_dim: int = 4  # width of the causal depthwise short conv
    linear_beta_scale: float = 1.0  # beta = scale * sigmoid(b); 2.0 gives OLMo-Hybrid's beta in (0, 2)
    linear_norm_eps: float = 1e-6  # eps of the gated output norm (OLMo-Hybrid hard-codes 1e-5)
    linear_recompute: bool = False  # training memory: the recurrence keeps only its inputs for the backward and
    #                                 reruns its forward there (GDN kernels: ~1.9 KB less per token and value head)
    # --- softmax attention ---
    attention_kind: str = "gated"  # "gated" (softmax + sigmoid output gate, Qwen) | "plain" (OLMo) | "mla" (Kimi)
    #                                | "path" (PaTH: Householder positions, no RoPE) | "deltaformer" (with RoPE)
    path_forget_gate: bool = False  # attention_kind "path": PaTH-FoX's forget gate on the logits
    attn_gate: str = "elementwise"  # for "gated": "elementwise" (one gate per channel) | "headwise" (one per head)
    qk_norm: str = "head"  # "head" (norm over head_dim) | "full" (over the whole projection, OLMo) | "none"
    num_attention_heads: int = 4  # query heads
    num_key_value_heads: int = 2  # key/value heads (GQA)
    head_dim: int = 64  # per-head width
    rope_theta: float | None = 10000.0  # None: no rotary embedding at all (NoPE)
    partial_rotary_factor: float = 1.0  # RoPE on the first int(head_dim * factor) channels only
    attention_bias: bool = False  # bias on q/k/v/o projections
    # --- MLA (attention_kind == "mla") ---
    kv_lora_rank: int = 0  # width of the compressed kv latent
    qk_nope_head_dim: int = 0  # per-head key width from the latent
    qk_rope_head_dim: int = 0  # shared key part (no rotary in Kimi Linear)
    v_head_dim: int = 0  # per-head value width
    mla_norm_eps: float = 1e-6  # kv_a_layernorm eps (class default in Kimi, not rms_norm_eps)
    # --- MLP / MoE ---
    intermediate_size: int = 512  # dense SwiGLU width
    moe_kind: str = "qwen"  # "qwen" (softmax top-k + gated shared expert) | "kimi" (sigmoid + bias, groups)
    num_experts: int = 0  # routed experts
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # width of one routed expert
    shared_expert_intermediate_size: int = 0  # width of the shared expert(s) (0: none)
    norm_topk_prob: bool = True  # renormalise the top-k weights
    n_group: int = 1  # Kimi: expert groups for the group-limited top-k
    topk_group: int = 1  # Kimi: groups kept
    routed_scaling_factor: float = 1.0  # Kimi: multiplies the routed weights
    # --- bookkeeping ---
    max_position_embeddings: int = 32768  # longest context the model was trained for
    hf_model_type: str | None = None  # transformers model_type to write in save_pretrained (None: not HF)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # model-specific facts kept for a faithful save

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if not self.layer_types:
            self.layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
        if not self.mlp_types:
            self.mlp_types = ["moe" if self.num_experts > 0 else "dense"] * n
        self.validate()

    def validate(self) -> None:
        n = self.num_hidden_layers
        for name in ("layer_types", "mlp_types"):
            vals = getattr(self, name)
            if len(vals) != n:
                raise ValueError(f"{name}: expected {n} entries (num_hidden_layers), got {len(vals)}")
        for t in self.layer_types:
            if t not in LAYER_TYPES:
                raise ValueError(f"layer_types: expected one of {LAYER_TYPES}, got {t!r}")
        for t in self.mlp_types:
            if t not in MLP_TYPES:
                raise ValueError(f"mlp_types: expected one of {MLP_TYPES}, got {t!r}")
        choices = {
            "norm_kind": ("zero_centered", "llama", "fp32_weight"),
            "block_style": ("pre", "olmo"),
            "linear_kind": ("gdn", "kda", "comba", "mesa"),
            "gdn_layout": ("fused", "split", "olmo"),
            "attention_kind": ("gated", "plain", "mla", "path", "deltaformer"),
            "attn_gate": ("elementwise", "headwise"),
            "qk_norm": ("head", "full", "none"),
            "moe_kind": ("qwen", "kimi"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: expected one of {allowed}, got {getattr(self, name)!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if "moe" in self.mlp_types and (self.num_experts <= 0 or self.num_experts_per_tok <= 0):
            raise ValueError("mlp_types has 'moe' layers: num_experts and num_experts_per_tok must be > 0")

    # --- derived sizes ---
    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor) if self.rope_theta is not None else 0

    # --- serialisation ---
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HybridConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"HybridConfig: unknown field(s) {unknown}")
        return cls(**d)

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            atomic_write_text(path, text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: str) -> HybridConfig:
        s = text_or_path.lstrip()
        if not s.startswith("{"):
            with open(text_or_path, encoding="utf-8") as f:
                s = f.read()
        return cls.from_dict(json.loads(s))
