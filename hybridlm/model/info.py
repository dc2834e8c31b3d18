"""`hybridlm info PATH_OR_PRESET`: parameters (total and active), layer pattern, cache bytes.

Non-standard here: nothing is loaded or allocated. The model is built on the meta device to count parameters
(so the 80B presets work on a laptop) and the cache sizes come from closed-form formulas:
- softmax attention: 2 * kv_heads * head_dim values per token per layer (K and V, post-RoPE);
- MLA: kv_lora_rank + qk_rope_head_dim values per token per layer (the normed latent and k_rot);
- linear layers (GDN / KDA): a fixed state per sequence: HV * dk * dv float32 values (recurrent state, always
  float32) + conv_dim * kernel values (conv state, model dtype), independent of the context length.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

import torch

from .config import HybridConfig

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class CacheBytes:
    kv_per_token: int  # bytes added per generated / prefilled token, summed over attention layers
    state_per_sequence: int  # bytes of the linear layers' fixed state (conv + recurrent), per sequence

    def total(self, context: int, batch: int = 1) -> int:
        return batch * (self.state_per_sequence + context * self.kv_per_token)


def cache_bytes(cfg: HybridConfig, dtype_bytes: int = 2) -> CacheBytes:
    kv = state = 0
    for t in cfg.layer_types:
        if t == "full_attention":
            if cfg.attention_kind == "mla":
                kv += (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
            elif cfg.attention_kind in ("path", "deltaformer"):  # HistoryState: the layer's per-token inputs
                kv += _history_bytes_per_token(cfg, dtype_bytes)
            else:
                kv += 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
        else:
            HV, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
            conv_dim = {"gdn": 2 * cfg.linear_key_dim + cfg.linear_value_dim,
                        "comba": 2 * cfg.linear_key_dim + cfg.linear_value_dim, "mesa": 2 * HV * dk}.get(
                cfg.linear_kind, 3 * HV * dk)
            key_cov = HV * dk * dk * 4 if cfg.linear_kind == "mesa" else 0  # MesaNet's second state
            state += HV * dk * dv * 4 + key_cov + conv_dim * cfg.linear_conv_kernel_dim * dtype_bytes
    return CacheBytes(kv, state)


def _history_bytes_per_token(cfg: HybridConfig, dtype_bytes: int) -> int:
    """q, k, v (and PaTH's w) in the model dtype; beta (and PaTH-FoX's g) in float32."""
    nH, nKV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if cfg.attention_kind == "deltaformer":
        return (nH + 2 * nKV) * hd * dtype_bytes + nH * 4
    return (nH + 3 * nKV) * hd * dtype_bytes + nKV * 4 + (nH * 4 if cfg.path_forget_gate else 0)


def load_config(target: str, arg: str = "target", check_weights: bool = False) -> HybridConfig:
    """A preset name, a model folder, a training run or its checkpoints folder (the latest complete checkpoint,
    said on stderr), a Hub id (its config.json only), a transformers config.json or a HybridConfig JSON.
    `check_weights`: a folder's safetensors files must be complete too (their headers and lengths are read, no
    tensor). Raises UsageError naming `arg`."""
    from .locate import HF_CONFIG, HYBRID_CONFIG, NATIVE_CONFIG, UsageError, locate
    from .presets import PRESETS, get_preset

    try:
        found = locate(target, PRESETS, hub_files=[HF_CONFIG, NATIVE_CONFIG])
    except UsageError as e:
        raise UsageError(f"{arg} {e}") from e
    if found.preset is not None:
        return get_preset(found.preset)
    if found.note:
        print(f"[reading {found.note}]", file=sys.stderr)
    path = found.file
    if check_weights and found.folder is not None:
        _check_weights(found.folder, arg)
    if path is None:
        names = [n for n in (HF_CONFIG, NATIVE_CONFIG, HYBRID_CONFIG) if os.path.isfile(os.path.join(found.folder, n))]
        if not names:
            raise UsageError(f"{arg} {target}: no {HF_CONFIG} in {found.folder}; give a folder that has one")
        path = os.path.join(found.folder, names[0])
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        if "model_type" in d:
            from .hf import config_from_hf

            return config_from_hf(d)
        return HybridConfig.from_dict(d)
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # bad JSON, unknown model_type, missing fields
        raise UsageError(f"{arg} {target}: {path} is not a transformers or HybridConfig config JSON "
                         f"({type(e).__name__}: {e}); give a model folder, a config JSON or a preset") from e


def _check_weights(folder: str, arg: str) -> None:
    """Raise UsageError when the folder's safetensors files are missing, truncated or unreadable (a folder with
    no weights at all, a config-only Hub snapshot, passes)."""
    from .locate import UsageError
    from .safetensors_folder import INDEX_NAME, SINGLE_NAME, TensorSource

    if not any(os.path.isfile(os.path.join(folder, n)) for n in (INDEX_NAME, SINGLE_NAME)):
        return
    try:
        TensorSource(folder)
    except UsageError as e:
        raise UsageError(f"{arg} {e}") from e


def count_parameters(cfg: HybridConfig) -> tuple[int, int]:
    """(total, active per token) parameters, counted on the meta device."""
    from .hybrid import HybridLM

    with torch.device("meta"):
        model = HybridLM(cfg)
    return model.num_parameters(), model.num_parameters(active=True)


LINEAR_LETTERS = {"gdn": "L", "kda": "K", "comba": "C", "mesa": "S"}
ATTENTION_LETTERS = {"mla": "M", "path": "P", "deltaformer": "D"}  # any other kind: A


def layer_pattern(cfg: HybridConfig) -> str:
    """One letter per layer (`PATTERN_LEGEND`); lower case when the MLP is MoE."""
    out = []
    for t, m in zip(cfg.layer_types, cfg.mlp_types):
        c = LINEAR_LETTERS[cfg.linear_kind] if t == "linear_attention" else ATTENTION_LETTERS.get(
            cfg.attention_kind, "A")
        out.append(c.lower() if m == "moe" else c)
    return "".join(out)


PATTERN_LEGEND = "L=GDN K=KDA C=Comba S=MesaNet A=attention M=MLA P=PaTH D=DeltaFormer; lower case = MoE MLP"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _fmt_count(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.3f} M"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="preset name, training run folder (its latest checkpoint), checkpoint or "
                        "Hugging Face folder, Hub id (org/name), or config JSON (transformers or HybridConfig)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPE_BYTES), help="dtype of KV / conv cache")
    parser.add_argument("--context", type=int, default=None, help="context length for the totals (default: max)")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    from .locate import UsageError

    if args.context is not None and args.context < 1:
        raise UsageError(f"--context: expected >= 1, got {args.context}")
    cfg = load_config(args.target, check_weights=True)
    total, active = count_parameters(cfg)
    cb = cache_bytes(cfg, _DTYPE_BYTES[args.dtype])
    ctx = args.context or cfg.max_position_embeddings
    n_lin = sum(t == "linear_attention" for t in cfg.layer_types)
    info = {
        "target": args.target, "hf_model_type": cfg.hf_model_type, "layers": cfg.num_hidden_layers,
        "linear_layers": n_lin, "attention_layers": cfg.num_hidden_layers - n_lin,
        "pattern": layer_pattern(cfg), "parameters": total, "active_parameters": active,
        "kv_bytes_per_token": cb.kv_per_token, "state_bytes_per_sequence": cb.state_per_sequence,
        "context": ctx, "cache_bytes_at_context": cb.total(ctx),
        "all_attention_kv_bytes_at_context": ctx * cb.kv_per_token * cfg.num_hidden_layers // max(1, (
            cfg.num_hidden_layers - n_lin)) if cfg.num_hidden_layers > n_lin else None,
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{args.target}  (transformers type: {cfg.hf_model_type or '-'})")
    print(f"  parameters        {_fmt_count(total)} total, {_fmt_count(active)} active per token")
    print(f"  layers            {cfg.num_hidden_layers}: {n_lin} linear ({cfg.linear_kind}), "
          f"{cfg.num_hidden_layers - n_lin} attention ({cfg.attention_kind})")
    print(f"  pattern           {info['pattern']}   ({PATTERN_LEGEND})")
    print(f"  KV cache          {_fmt_bytes(cb.kv_per_token)} per token ({args.dtype})")
    print(f"  recurrent state   {_fmt_bytes(cb.state_per_sequence)} per sequence (fp32 state + conv), constant")
    print(f"  cache at {ctx} tokens: {_fmt_bytes(cb.total(ctx))} per sequence")
    if info["all_attention_kv_bytes_at_context"] is not None and n_lin:
        print(f"  (all-attention model of the same attention shape: "
              f"{_fmt_bytes(info['all_attention_kv_bytes_at_context'])})")
    return 0
