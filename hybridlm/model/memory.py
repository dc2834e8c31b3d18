"""`hybridlm memory`: KV-cache vs recurrent-state bytes against context length, as a table and a PNG plot.

Non-standard here: every curve is the same closed-form count as `hybridlm.model.info.cache_bytes` (checked in the
tests against the bytes of a real cache after a prefill), applied to variants of one config that keep its widths
and layer count and change only the layer types: full attention with one KV head per query head (MHA), with the
config's KV heads (GQA), MLA (the config's latent sizes, or Kimi Linear's 512 + 64), all GDN, all KDA (one
key/value head per GDN value head), and the config's own hybrid pattern. Curves that coincide (all GDN and all
KDA, often) are drawn in distinct styles, each thinner and above the one before, so that both show.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

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


# One marker and line style per curve. Curves may coincide (all GDN and all KDA hold the same state when KDA has
# one key head per GDN value head): each is drawn thinner and above the ones before it, so all stay visible.
STYLES = [("o", "-"), ("s", "--"), ("^", "-."), ("D", "-"), ("x", "--"), ("*", ":")]


def figure(rows: dict[str, list[int]], contexts: list[int], title: str):
    """The plot of `rows` (GiB against context length, log-log) as a matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    n = len(rows)
    for i, (name, vals) in enumerate(rows.items()):
        marker, style = STYLES[i % len(STYLES)]
        ax.plot(contexts, [v / 2**30 for v in vals], marker=marker, linestyle=style, label=name, zorder=2 + i,
                linewidth=1.2 + 0.5 * (n - 1 - i), markersize=4 + 1.2 * (n - 1 - i))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("cache memory (GiB)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot(rows: dict[str, list[int]], contexts: list[int], path: str, title: str) -> None:
    import matplotlib.pyplot as plt

    fig = figure(rows, contexts, title)
    try:
        atomic_write(path, fig.savefig)
    finally:
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

    if args.max_context is not None and args.max_context < 1:  # 0 is not "the model's default"
        raise UsageError(f"--max-context: expected >= 1, got {args.max_context}")
    if args.batch < 1:
        raise UsageError(f"--batch: expected >= 1, got {args.batch}")
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        raise UsageError(f"--plot {args.plot}: no such folder {os.path.dirname(os.path.abspath(args.plot))}; "
                         "create it or give another path")
    target = args.preset or args.config
    cfg = load_config(target, "--preset" if args.preset else "--config")
    max_ctx = args.max_context if args.max_context is not None else cfg.max_position_embeddings
    ctxs = contexts_up_to(max_ctx)
    rows = table(cfg, ctxs, _DTYPE_BYTES[args.dtype], args.batch)
    width = max(len(k) for k in rows)
    print(f"cache bytes for {target} ({cfg.num_hidden_layers} layers, batch {args.batch}, {args.dtype} KV/conv, "
          f"fp32 recurrent state)")
    print(" " * width + "".join(f"{c:>12d}" for c in ctxs))
    for name, vals in rows.items():
        print(f"{name:<{width}}" + "".join(f"{_fmt_bytes(v):>12}" for v in vals))
    if args.plot:
        try:
            plot(rows, ctxs, args.plot, f"{target}: cache memory vs context (batch {args.batch}, {args.dtype})")
        except (OSError, ValueError) as e:  # a folder not writable, a format matplotlib does not know
            raise UsageError(f"--plot {args.plot}: {e}") from e
        print(f"plot written to {args.plot}")
    return 0
