"""`hybridlm memory`: KV-cache vs recurrent-state bytes against context length, as a table and a PNG plot.

Non-standard here: every curve is the same closed-form count as `hybridlm.model.info.cache_bytes` (checked in the
tests against the bytes of a real cache after a prefill), applied to variants of one config that keep its widths
and layer count and change only the layer types: full attention with one KV head per query head (MHA), with the
config's KV heads (GQA), MLA (the config's latent sizes, or Kimi Linear's 512 + 64), all GDN, all KDA (one
key/value head per GDN value head), and the config's own hybrid pattern.
"""

from __future__ import annotations

import argparse
import dataclasses

from hybridlm.files import atomic_write

from .config import HybridConfig
from .info import _DTYPE_BYTES, _fmt_bytes, cache_bytes, load_config


def variants(cfg: HybridConfig) -> dict[str, HybridConfig]:
    n = cfg.num_hidden_layers
    full, lin = ["full_attention"] * n, ["linear_attention"] * n
    rep = lambda **kw: dataclasses.replace(cfg, extra={}, **kw)  # noqa: E731
    return {
        "full attention (MHA)": rep(layer_types=full, attention_kind="gated",
                                    num_key_value_heads=cfg.num_attention_heads),
        "full attention (GQA)": rep(layer_types=full, attention_kind="gated"),
        "MLA": rep(layer_types=full, attention_kind="mla", kv_lora_rank=cfg.kv_lora_rank or 512,
                   qk_rope_head_dim=cfg.qk_rope_head_dim or 64),
        "all GDN": rep(layer_types=lin, linear_kind="gdn"),
        "all KDA": rep(layer_types=lin, linear_kind="kda", linear_num_key_heads=cfg.linear_num_value_heads),
        "hybrid (this config)": cfg,
    }


def table(cfg: HybridConfig, contexts: list[int], dtype_bytes: int, batch: int) -> dict[str, list[int]]:
    return {name: [cache_bytes(v, dtype_bytes).total(c, batch) for c in contexts] for name, v in variants(cfg).items()}


def contexts_up_to(max_context: int) -> list[int]:
    out, c = [], 1024
    while c < max_context:
        out.append(c)
        c *= 2
    return out + [max_context]


def plot(rows: dict[str, list[int]], contexts: list[int], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for name, vals in rows.items():
        ax.plot(contexts, [v / 2**30 for v in vals], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("cache memory (GiB)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(path, fig.savefig)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_mutually_exclusive_group(required=True)
    g.add_argument("--preset", help="preset name")
    g.add_argument("--config", help="config JSON (transformers or HybridConfig), checkpoint or Hugging Face folder, "
                   "training run folder (its latest checkpoint) or Hub id (org/name)")
    parser.add_argument("--max-context", type=int, default=None, help="largest context (default: the model's)")
    parser.add_argument("--batch", type=int, default=1, help="sequences held at once (default 1)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPE_BYTES),
                        help="dtype of the KV cache (recurrent states are float32)")
    parser.add_argument("--plot", default=None, help="write a PNG plot here")


def run(args: argparse.Namespace) -> int:
    from .locate import UsageError

    target = args.preset or args.config
    cfg = load_config(target, "--preset" if args.preset else "--config")
    max_ctx = args.max_context or cfg.max_position_embeddings
    if max_ctx < 1:
        raise UsageError(f"--max-context: expected >= 1, got {max_ctx}")
    if args.batch < 1:
        raise UsageError(f"--batch: expected >= 1, got {args.batch}")
    ctxs = contexts_up_to(max_ctx)
    rows = table(cfg, ctxs, _DTYPE_BYTES[args.dtype], args.batch)
    width = max(len(k) for k in rows)
    print(f"cache bytes for {target} ({cfg.num_hidden_layers} layers, batch {args.batch}, {args.dtype} KV/conv, "
          f"fp32 recurrent state)")
    print(" " * width + "".join(f"{c:>12d}" for c in ctxs))
    for name, vals in rows.items():
        print(f"{name:<{width}}" + "".join(f"{_fmt_bytes(v):>12}" for v in vals))
    if args.plot:
        plot(rows, ctxs, args.plot, f"{target}: cache memory vs context (batch {args.batch}, {args.dtype})")
        print(f"plot written to {args.plot}")
    return 0
