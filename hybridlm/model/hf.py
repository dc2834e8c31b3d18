"""Hugging Face checkpoints <-> HybridLM, for qwen3_next, qwen3_5(_text), qwen3_5_moe(_text), kimi_linear,
olmo_hybrid. transformers is never imported here.

Non-standard here, three explicit steps in each direction:
1. on-disk names <-> transformers' in-memory ("canonical") names: Qwen3.5's `model.language_model.` prefix,
   per-expert tensors <-> fused `experts.gate_up_proj [E, 2I, D]` / `experts.down_proj [E, D, I]`, Kimi's
   `block_sparse_moe` / `w1 w3 w2` and three convs, OLMo-Hybrid's `attention_layer_norm` /
   `feedforward_layer_norm` and three convs. `mtp.*` and vision keys are skipped with a logged note.
2. canonical names <-> our parameter names: `key_map(config)` lists every pair explicitly (one per parameter).
3. every copy is shape-checked; a missing key, wrong shape, missing or truncated file raises `CheckpointError`
   naming the file / key / expected and actual shape before the model is returned (nothing half-loaded).
`save_pretrained` writes the on-disk layout transformers itself writes, so `AutoModelForCausalLM` loads it.
Qwen3.5 models are saved as the text-only types (qwen3_5_text / qwen3_5_moe_text).
The loaders take a `build(config)` that makes the empty model (`HybridLM.from_pretrained` passes its class), so
this module does not import hybrid.py, which imports it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable

import torch
from torch import nn

from hybridlm.files import atomic_write_text

from .config import HybridConfig
from .locate import HYBRID_CONFIG, NATIVE_CONFIG, UsageError, resolve_folder
from .safetensors_folder import CheckpointError, TensorSource, save_sharded
from .tokenizer import ByteTokenizer, save_tokenizer_files

log = logging.getLogger(__name__)

MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "kimi_linear",
               "olmo_hybrid")
ARCHITECTURES = {
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
    "olmo_hybrid": "OlmoHybridForCausalLM",
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------------------------- config
def _get(d: dict, *names, default=None):
    """First present key among names (transformers writes some Kimi fields under their alias names)."""
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    return default


def _rope(d: dict) -> tuple[float | None, float]:
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = rp.get("rope_theta", d.get("rope_theta"))
    factor = rp.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    return theta, float(factor)


def config_from_hf(d: dict) -> HybridConfig:
    """A transformers config.json dict -> HybridConfig. Raises CheckpointError for an unknown model_type."""
    mt = d.get("model_type")
    if mt not in MODEL_TYPES:
        raise CheckpointError(f"config.json: unknown model_type {mt!r}; supported: {', '.join(MODEL_TYPES)}")
    if mt in ("qwen3_5", "qwen3_5_moe"):  # multimodal wrapper: the language model is the text_config
        text = dict(d.get("text_config") or {})
        text.setdefault("tie_word_embeddings", d.get("tie_word_embeddings", False))
        return _with_hf(config_from_hf({**text, "model_type": mt + "_text"}), d)
    n = d["num_hidden_layers"]
    common = dict(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], num_hidden_layers=n,
                  rms_norm_eps=d.get("rms_norm_eps", 1e-6), tie_word_embeddings=d.get("tie_word_embeddings", False),
                  max_position_embeddings=_get(d, "max_position_embeddings", "model_max_length", default=32768),
                  bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
                  pad_token_id=d.get("pad_token_id"), intermediate_size=d.get("intermediate_size") or 0,
                  attention_bias=d.get("attention_bias", False), hf_model_type=mt)
    if mt.startswith("qwen3"):
        cfg = _qwen_config(d, mt, common)
    elif mt == "kimi_linear":
        cfg = _kimi_config(d, common)
    else:
        cfg = _olmo_config(d, common)
    return _with_hf(cfg, d)


def _with_hf(cfg: HybridConfig, d: dict) -> HybridConfig:
    cfg.extra["hf_config"] = d  # kept so a save writes back the fields we do not model
    return cfg


def _qwen_config(d: dict, mt: str, common: dict) -> HybridConfig:
    n = common["num_hidden_layers"]
    layer_types = d.get("layer_types") or [
        "full_attention" if (i + 1) % d.get("full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(n)
    ]
    E = d.get("num_experts", 0) if mt != "qwen3_5_text" else 0
    if mt == "qwen3_next":
        skip, step = set(d.get("mlp_only_layers") or []), d.get("decoder_sparse_step", 1)
        mlp_types = ["moe" if (i not in skip and E > 0 and (i + 1) % step == 0) else "dense" for i in range(n)]
    else:
        mlp_types = ["moe" if E > 0 else "dense"] * n
    theta, factor = _rope(d)
    return HybridConfig(
        **common, layer_types=list(layer_types), mlp_types=mlp_types, norm_kind="zero_centered",
        linear_kind="gdn", gdn_layout="fused" if mt == "qwen3_next" else "split",
        linear_num_key_heads=d["linear_num_key_heads"], linear_num_value_heads=d["linear_num_value_heads"],
        linear_key_head_dim=d["linear_key_head_dim"], linear_value_head_dim=d["linear_value_head_dim"],
        linear_conv_kernel_dim=d.get("linear_conv_kernel_dim", 4), linear_norm_eps=d.get("rms_norm_eps", 1e-6),
        attention_kind="gated", attn_gate="elementwise", qk_norm="head",
        num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
        head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"], rope_theta=theta,
        partial_rotary_factor=factor, moe_kind="qwen", num_experts=E,
        num_experts_per_tok=d.get("num_experts_per_tok", 0) if E else 0,
        moe_intermediate_size=d.get("moe_intermediate_size", 0) if E else 0,
        shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 0) if E else 0,
        norm_topk_prob=d.get("norm_topk_prob", True) if mt == "qwen3_next" else True,
    )


def _kimi_config(d: dict, common: dict) -> HybridConfig:
    n = common["num_hidden_layers"]
    lac = d.get("linear_attn_config") or {}
    layer_types = d.get("layer_types")
    if not layer_types and "full_attn_layers" in lac:
        full = set(lac["full_attn_layers"])  # 1-indexed in the checkpoint
        layer_types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
    if not layer_types:
        layer_types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    mlp_layer_types = d.get("mlp_layer_types")
    if not mlp_layer_types:
        k = d.get("first_k_dense_replace", 1)
        mlp_layer_types = ["dense" if i < k else "sparse" for i in range(n)]
    if d.get("q_lora_rank") is not None:
        raise CheckpointError("config.json: kimi_linear with q_lora_rank is not supported (released models use None)")
    heads = _get(d, "linear_num_heads", default=lac.get("num_heads", 32))
    hdim = _get(d, "linear_head_dim", default=lac.get("head_dim", 128))
    E = _get(d, "num_experts", "num_local_experts", default=0)
    nH = d["num_attention_heads"]
    return HybridConfig(
        **common, layer_types=list(layer_types),
        mlp_types=["moe" if t == "sparse" else "dense" for t in mlp_layer_types],
        norm_kind="llama", linear_kind="kda", linear_num_key_heads=heads, linear_num_value_heads=heads,
        linear_key_head_dim=hdim, linear_value_head_dim=hdim,
        linear_conv_kernel_dim=_get(d, "linear_conv_kernel_dim", default=lac.get("short_conv_kernel_size", 4)),
        linear_norm_eps=d.get("rms_norm_eps", 1e-5), attention_kind="mla", num_attention_heads=nH,
        num_key_value_heads=nH, head_dim=d["qk_nope_head_dim"] + d["qk_rope_head_dim"], rope_theta=None,
        kv_lora_rank=d["kv_lora_rank"], qk_nope_head_dim=d["qk_nope_head_dim"],
        qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"], moe_kind="kimi", num_experts=E,
        num_experts_per_tok=_get(d, "num_experts_per_tok", "num_experts_per_token", default=0),
        moe_intermediate_size=d.get("moe_intermediate_size", 0),
        shared_expert_intermediate_size=d.get("moe_intermediate_size", 0) * _get(d, "n_shared_experts",
                                                                                 "num_shared_experts", default=0),
        norm_topk_prob=_get(d, "norm_topk_prob", "moe_renormalize", default=True),
        n_group=_get(d, "n_group", "num_expert_group", default=1), topk_group=_get(d, "topk_group", default=1),
        routed_scaling_factor=d.get("routed_scaling_factor", 1.0),
    )


def _olmo_config(d: dict, common: dict) -> HybridConfig:
    n, D, nH = common["num_hidden_layers"], d["hidden_size"], d["num_attention_heads"]
    layer_types = d.get("layer_types") or ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    nk = d.get("linear_num_key_heads") or nH
    nv = d.get("linear_num_value_heads") or nH
    dk = d.get("linear_key_head_dim") or int(0.75 * D / nk)
    theta, _ = _rope(d)
    if not d.get("rope_parameters") and not d.get("rope_scaling") and "rope_theta" not in d:
        theta = 10000.0  # transformers' default when a config names no RoPE at all; NoPE is rope_theta null
    return HybridConfig(
        **common, layer_types=list(layer_types), mlp_types=["dense"] * n, norm_kind="fp32_weight", block_style="olmo",
        linear_kind="gdn", gdn_layout="olmo", linear_num_key_heads=nk, linear_num_value_heads=nv,
        linear_key_head_dim=dk, linear_value_head_dim=d.get("linear_value_head_dim") or 2 * dk,
        linear_conv_kernel_dim=d.get("linear_conv_kernel_dim", 4),
        linear_beta_scale=2.0 if d.get("linear_allow_neg_eigval", True) else 1.0, linear_norm_eps=1e-5,
        attention_kind="plain", qk_norm="full", num_attention_heads=nH,
        num_key_value_heads=d.get("num_key_value_heads") or nH, head_dim=d.get("head_dim") or D // nH,
        rope_theta=theta, partial_rotary_factor=1.0,
    )


def config_to_hf(cfg: HybridConfig, model_type: str) -> dict:
    """HybridConfig -> a transformers config.json dict of model_type (text-only types for Qwen3.5)."""
    mt = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}.get(model_type, model_type)
    if mt not in ARCHITECTURES:
        raise ValueError(f"model_type: expected one of {sorted(ARCHITECTURES)}, got {model_type!r}")
    c = cfg
    base = dict(c.extra.get("hf_config") or {})
    if base.get("model_type") in ("qwen3_5", "qwen3_5_moe"):
        base = dict(base.get("text_config") or {})
    for k in ("text_config", "vision_config", "auto_map", "quantization_config", "architectures"):
        base.pop(k, None)
    d = {**base, "model_type": mt, "architectures": [ARCHITECTURES[mt]], "vocab_size": c.vocab_size,
         "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers, "rms_norm_eps": c.rms_norm_eps,
         "tie_word_embeddings": c.tie_word_embeddings, "hidden_act": "silu", "layer_types": list(c.layer_types),
         "max_position_embeddings": c.max_position_embeddings, "bos_token_id": c.bos_token_id,
         "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id, "attention_bias": c.attention_bias,
         "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
         "linear_conv_kernel_dim": c.linear_conv_kernel_dim, "intermediate_size": c.intermediate_size}
    d.pop("model_max_length", None)
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if mt.startswith("qwen3"):
        _check_family(c, mt, norm_kind="zero_centered", linear_kind="gdn",
                      gdn_layout="fused" if mt == "qwen3_next" else "split", attention_kind="gated",
                      attn_gate="elementwise", qk_norm="head", block_style="pre")
        old = dict(base.get("rope_parameters") or {})
        d.update(head_dim=c.head_dim, linear_num_key_heads=c.linear_num_key_heads,
                 linear_num_value_heads=c.linear_num_value_heads, linear_key_head_dim=c.linear_key_head_dim,
                 linear_value_head_dim=c.linear_value_head_dim,
                 rope_parameters={**old, **rope, "partial_rotary_factor": c.partial_rotary_factor})
        if mt != "qwen3_5_text":
            d.update(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                     moe_intermediate_size=c.moe_intermediate_size,
                     shared_expert_intermediate_size=c.shared_expert_intermediate_size)
        if mt == "qwen3_next":
            d.update(norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1,
                     mlp_only_layers=[i for i, t in enumerate(c.mlp_types) if t == "dense"])
        elif (mt == "qwen3_5_moe_text") != all(t == "moe" for t in c.mlp_types):
            raise ValueError(f"{mt}: every layer must be {'moe' if mt == 'qwen3_5_moe_text' else 'dense'}")
    elif mt == "kimi_linear":
        _check_family(c, mt, norm_kind="llama", linear_kind="kda", attention_kind="mla", block_style="pre")
        for k in ("num_local_experts", "num_experts_per_tok", "n_group", "norm_topk_prob", "n_shared_experts",
                  "linear_attn_config", "first_k_dense_replace"):
            d.pop(k, None)
        n_shared = c.shared_expert_intermediate_size // max(c.moe_intermediate_size, 1)
        d.update(linear_num_heads=c.linear_num_value_heads, linear_head_dim=c.linear_key_head_dim,
                 kv_lora_rank=c.kv_lora_rank, q_lora_rank=None, qk_nope_head_dim=c.qk_nope_head_dim,
                 qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                 mlp_layer_types=["sparse" if t == "moe" else "dense" for t in c.mlp_types],
                 num_experts=c.num_experts, num_experts_per_token=c.num_experts_per_tok,
                 moe_intermediate_size=c.moe_intermediate_size, num_shared_experts=n_shared,
                 moe_renormalize=c.norm_topk_prob, num_expert_group=c.n_group, topk_group=c.topk_group,
                 routed_scaling_factor=c.routed_scaling_factor)
    else:
        _check_family(c, mt, norm_kind="fp32_weight", linear_kind="gdn", gdn_layout="olmo", attention_kind="plain",
                      qk_norm="full", block_style="olmo")
        d.update(head_dim=c.head_dim, linear_num_key_heads=c.linear_num_key_heads,
                 linear_num_value_heads=c.linear_num_value_heads, linear_key_head_dim=c.linear_key_head_dim,
                 linear_value_head_dim=c.linear_value_head_dim, linear_allow_neg_eigval=c.linear_beta_scale == 2.0,
                 rope_parameters=rope)  # NoPE is rope_theta null; a null rope_parameters reloads with theta 10000
    return d


def _check_family(c: HybridConfig, mt: str, **expected) -> None:
    bad = {k: getattr(c, k) for k, v in expected.items() if getattr(c, k) != v}
    if bad:
        raise ValueError(f"cannot save as {mt}: these fields differ from what {mt} implies: {bad}")


# ----------------------------------------------------------------------------------------- key maps
def _hf_mixer_prefix(cfg: HybridConfig, i: int) -> str:
    if cfg.layer_types[i] == "full_attention" or cfg.linear_kind == "kda":
        return f"model.layers.{i}.self_attn."
    return f"model.layers.{i}.linear_attn."


def _hf_norm_names(cfg: HybridConfig, i: int) -> tuple[str, str]:
    if cfg.block_style == "olmo" and cfg.layer_types[i] == "full_attention":
        return "post_attention_layernorm", "post_feedforward_layernorm"
    return "input_layernorm", "post_attention_layernorm"


def key_map(model: nn.Module) -> dict[str, str]:
    """Every parameter of `model`: canonical HF name -> our name (tied lm_head omitted)."""
    cfg = model.config
    out: dict[str, str] = {}
    for ours in model.state_dict():
        if ours == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ours.startswith("embed_tokens.") or ours.startswith("norm."):
            out["model." + ours] = ours
        elif ours.startswith("lm_head."):
            out[ours] = ours
        else:
            m = re.match(r"layers\.(\d+)\.(mixer|mlp|norm1|norm2)\.(.+)$", ours)
            if m is None:
                raise AssertionError(f"key_map: no rule for parameter {ours!r}")
            i, part, rest = int(m.group(1)), m.group(2), m.group(3)
            if part == "mixer":
                out[_hf_mixer_prefix(cfg, i) + rest] = ours
            elif part == "mlp":
                out[f"model.layers.{i}.mlp.{rest}"] = ours
            else:
                out[f"model.layers.{i}.{_hf_norm_names(cfg, i)[part == 'norm2']}.{rest}"] = ours
    return out


# ---------------------------------------------------------------------------- disk <-> canonical
_IGNORED = (re.compile(r"^(model\.)?mtp\."), re.compile(r"^(model\.)?visual\."), re.compile(r"^model\.vision"))


def canonical_sources(src: TensorSource, model_type: str) -> dict[str, Callable[[], torch.Tensor]]:
    """On-disk keys -> canonical names, each with a thunk that reads (and merges) the tensors."""
    out: dict[str, Callable[[], torch.Tensor]] = {}
    ignored = []
    experts: dict[tuple[str, str], dict[int, str]] = {}  # (prefix, proj) -> {e: disk key}
    convs: dict[str, dict[str, str]] = {}
    for key in src.keys():
        if any(p.search(key) for p in _IGNORED):
            ignored.append(key)
            continue
        name = key
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        if model_type == "kimi_linear":
            name = name.replace(".block_sparse_moe.", ".mlp.").replace(".forget_gate.", ".")
            name = re.sub(r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj.", name)
            name = re.sub(r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj.", name)
            name = re.sub(r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj.", name)
        if model_type == "olmo_hybrid":
            name = name.replace(".attention_layer_norm.", ".input_layernorm.")
            name = name.replace(".feedforward_layer_norm.", ".post_attention_layernorm.")
        m = re.match(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = key
            continue
        m = re.match(r"(.+)\.([qkv])_conv1d\.weight$", name)
        if m:
            convs.setdefault(m.group(1), {})[m.group(2)] = key
            continue
        out[name] = (lambda k=key: src.get(k))
    if ignored:
        log.info("ignored %d checkpoint tensors not used by the language model (mtp / vision), e.g. %s",
                 len(ignored), ignored[0])
    for prefix, parts in convs.items():
        if set(parts) != {"q", "k", "v"}:
            raise CheckpointError(f"{src.folder}: {prefix}: expected q_conv1d, k_conv1d and v_conv1d, "
                                  f"found {sorted(parts)}")
        out[prefix + ".conv1d.weight"] = (lambda p=parts: torch.cat([src.get(p[c]) for c in "qkv"], dim=0))
    for prefix in sorted({p for p, _ in experts}):
        gate, up, down = (experts.get((prefix, k), {}) for k in ("gate_proj", "up_proj", "down_proj"))
        n = max(len(gate), len(up), len(down))
        for e in range(n):
            for proj, d in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                if e not in d:
                    raise CheckpointError(f"{src.folder}: missing key {prefix}.{e}.{proj}.weight (per-expert layout)")
        out[prefix + ".gate_up_proj"] = (lambda g=gate, u=up, n=n: torch.stack(
            [torch.cat([src.get(g[e]), src.get(u[e])], dim=0) for e in range(n)]))
        out[prefix + ".down_proj"] = (lambda dd=down, n=n: torch.stack([src.get(dd[e]) for e in range(n)]))
    return out


def to_disk(canonical: dict[str, torch.Tensor], cfg: HybridConfig, model_type: str) -> dict[str, torch.Tensor]:
    """Canonical tensors -> the on-disk names and layout transformers writes for model_type."""
    out: dict[str, torch.Tensor] = {}
    for name, t in canonical.items():
        m = re.match(r"(.+\.experts)\.(gate_up_proj|down_proj)$", name)
        kimi = model_type == "kimi_linear"
        if kimi:
            name = name.replace(".mlp.", ".block_sparse_moe.")
            m = re.match(r"(.+\.experts)\.(gate_up_proj|down_proj)$", name)
        if m:
            names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if kimi else None
            for e in range(t.shape[0]):
                parts = t[e].chunk(2, dim=0) if m.group(2) == "gate_up_proj" else (t[e],)
                projs = ("gate_proj", "up_proj") if m.group(2) == "gate_up_proj" else ("down_proj",)
                for proj, part in zip(projs, parts):
                    out[f"{m.group(1)}.{e}.{names[proj] if names else proj}.weight"] = part.clone()
            continue
        m = re.match(r"(.+)\.conv1d\.weight$", name)
        if m and model_type in ("kimi_linear", "olmo_hybrid"):
            if kimi:
                sizes = [t.shape[0] // 3] * 3
            else:
                kd = cfg.linear_key_dim
                sizes = [kd, kd, t.shape[0] - 2 * kd]
            for c, part in zip("qkv", t.split(sizes, dim=0)):
                out[f"{m.group(1)}.{c}_conv1d.weight"] = part.clone()
            continue
        if model_type == "olmo_hybrid":
            name = name.replace(".input_layernorm.", ".attention_layer_norm.")
            name = name.replace(".post_attention_layernorm.", ".feedforward_layer_norm.")
        out[name] = t
    return out


# ------------------------------------------------------------------------------------ load / save
def read_hf_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def _checkpoint_dtype(d: dict) -> torch.dtype:
    name = d.get("dtype") or d.get("torch_dtype") or (d.get("text_config") or {}).get("dtype") or "float32"
    return _DTYPES.get(str(name).replace("torch.", ""), torch.float32)


def _load_native(folder: str, build: Callable[[HybridConfig], nn.Module], dtype: torch.dtype | None) -> nn.Module:
    """Our own format (any HybridConfig, e.g. headwise gates): hybridlm_config.json + safetensors, our key names;
    a training checkpoint of such a config has the same weights beside hybrid_config.json."""
    name = NATIVE_CONFIG if os.path.exists(os.path.join(folder, NATIVE_CONFIG)) else HYBRID_CONFIG
    try:
        cfg = HybridConfig.from_json(os.path.join(folder, name))
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{os.path.join(folder, name)}: not a valid HybridConfig JSON ({e})") from e
    src = TensorSource(folder)
    model = build(cfg)
    expected = model.state_dict()
    wanted = [k for k in expected if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    missing = [k for k in wanted if k not in src.where]
    if missing:
        raise CheckpointError(f"{folder}: missing key(s) {missing[:5]} ({len(missing)} missing)")
    state = {}
    for k in wanted:
        if src.shape(k) != tuple(expected[k].shape):
            raise CheckpointError(f"{folder}: {k}: expected shape {list(expected[k].shape)}, got {list(src.shape(k))}")
        state[k] = src.get(k)
    model.load_state_dict(state, strict=False)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def load_pretrained(folder: str, build: Callable[[HybridConfig], nn.Module], *, dtype: torch.dtype | None = None,
                    strict: bool = True) -> nn.Module:
    """`build(config)` filled from a transformers checkpoint folder (config.json + safetensors), or from our own
    format (hybridlm_config.json + safetensors) when the folder has no config.json. `folder` may also be a training
    run or its checkpoints folder (the latest complete checkpoint) or a Hub id (hybridlm.model.locate)."""
    try:
        folder = resolve_folder(folder)
    except UsageError as e:  # what from_pretrained raises for a folder it cannot load
        raise CheckpointError(str(e)) from e
    native = any(os.path.exists(os.path.join(folder, n)) for n in (NATIVE_CONFIG, HYBRID_CONFIG))
    if not os.path.exists(os.path.join(folder, "config.json")) and native:
        return _load_native(folder, build, dtype)
    d = read_hf_config(folder)
    cfg = config_from_hf(d)
    src = TensorSource(folder)
    sources = canonical_sources(src, d["model_type"])
    with torch.device("meta"):
        model = build(cfg)
    target = _checkpoint_dtype(d) if dtype is None else dtype
    kmap = key_map(model)
    missing = [k for k in kmap if k not in sources]
    if missing:
        raise CheckpointError(f"{folder}: missing key(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                              f"({len(missing)} missing)")
    expected = {k: v for k, v in model.state_dict().items()}
    state = {}
    for hf_key, ours in kmap.items():
        t = sources[hf_key]()
        want = tuple(expected[ours].shape)
        if tuple(t.shape) != want:
            raise CheckpointError(f"{folder}: {hf_key}: expected shape {list(want)}, got {list(t.shape)}")
        state[ours] = t.to(target)
    unused = sorted(set(sources) - set(kmap) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    if unused:
        if strict:
            raise CheckpointError(f"{folder}: unexpected key(s) {unused[:5]} ({len(unused)} unused)")
        log.warning("%s: %d unused checkpoint tensors, e.g. %s", folder, len(unused), unused[0])
    model.to_empty(device="cpu")
    model.to(target)
    missing_ours, _ = model.load_state_dict(state, strict=False, assign=False)
    left = [k for k in missing_ours if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if left:
        raise CheckpointError(f"{folder}: parameters not filled from the checkpoint: {left[:5]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def save_pretrained(model: nn.Module, folder: str, *, max_shard_size: int | str = "5GB",
                    model_type: str | None = None, tokenizer=None) -> None:
    """Write config.json + safetensors in transformers' on-disk layout for model_type (default: the config's);
    with no model type at all, write our own format (hybridlm_config.json + safetensors). The tokenizer files
    (`save_tokenizer_files`) go beside them: `tokenizer`'s, or with None the byte tokenizer's when the
    vocabulary is 256 (what `load_tokenizer` assumes of a folder without them)."""
    cfg = model.config
    mt = model_type or cfg.hf_model_type
    os.makedirs(folder, exist_ok=True)
    if tokenizer is None and cfg.vocab_size == 256:
        tokenizer = ByteTokenizer()
    if tokenizer is not None:
        save_tokenizer_files(tokenizer, folder)
    if mt is None:  # not a transformers architecture: our own format, our own key names
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()
                 if not (k == "lm_head.weight" and cfg.tie_word_embeddings)}
        save_sharded(state, folder, max_shard_size)
        cfg.to_json(os.path.join(folder, NATIVE_CONFIG))
        return
    hf = config_to_hf(cfg, mt)
    mt = hf["model_type"]
    params = next(model.parameters())
    hf["dtype"] = str(params.dtype).replace("torch.", "")
    state = model.state_dict()
    canonical = {hf_key: state[ours].detach().cpu() for hf_key, ours in key_map(model).items()}
    tensors = to_disk(canonical, cfg, mt)
    os.makedirs(folder, exist_ok=True)
    save_sharded(tensors, folder, max_shard_size)
    atomic_write_text(os.path.join(folder, "config.json"), json.dumps(hf, indent=2, sort_keys=True) + "\n")
