"""Layer benchmark: forward+backward tokens/s and peak memory of whole token mixers, ours against fla's layers.

    python -m hybridlm.bench.layers [--out DIR] [--seq-lens 2048,8192] [--tokens 16384]   (or: hybridlm bench layers)

Rows, all bf16 parameters and activations on one CUDA device, in training mode:
- `gdn`: our `GatedDeltaNet` (split layout, impl="auto", i.e. the Triton kernels where they apply), also with
  recompute=True (the recurrence keeps only its inputs for the backward), against `fla.layers.GatedDeltaNet`
  (mode "chunk", short conv, output gate);
- `kda`: our `KimiDeltaAttention` (impl="auto": the Triton KDA kernels where they apply), also with recompute=True,
  against `fla.layers.KimiDeltaAttention`;
- `hybrid3:1`: one 3:1 hybrid stack of ours (3 GDN blocks + 1 gated-attention block, each with a SwiGLU MLP,
  pre-norm, a 256-token vocabulary so embedding and head cost next to nothing); fla has no such block, so this
  row has no ratio.
Widths: Qwen3-Next (hidden 2048, 16 key heads, 32 value heads, head dim 128) and hidden 1024 (8 / 16 heads,
head dim 128); KDA uses HV = H. `--widths olmo`: OLMo-Hybrid 7B's linear layers (hidden 3840, 30 heads, key head
dim 96, value head dim 192, its "olmo" projection layout), which the Triton kernels run zero-padded to 128 / 256.
`--vs-chunk` adds our layer with impl="chunk" (the PyTorch chunk path) and the kernels' speedup over it, e.g.
    python -m hybridlm.bench.layers --rows gdn --widths olmo --vs-chunk --no-recompute --no-fla
Each sequence length runs with batch = tokens // T. Time: median of
triton.testing.do_bench over forward + backward of sum(output * fixed random grad); peak memory: the
max_memory_allocated rise over one forward + backward, parameters excluded. Writes layers.json and layers.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from hybridlm.bench.cuda_profile import print_kernel_times
from hybridlm.files import atomic_write_text

# d: key head dim; dv: value head dim (d when absent); layout: our GDN layer's projection layout ("split" when absent)
WIDTHS = {"2048": dict(D=2048, H=16, HV=32, d=128), "1024": dict(D=1024, H=8, HV=16, d=128),
          "olmo": dict(D=3840, H=30, HV=30, d=96, dv=192, layout="olmo")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench_out", help="folder for layers.json / layers.md")
    parser.add_argument("--seq-lens", default="2048,8192", help="comma-separated sequence lengths")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per step (batch = tokens // T)")
    parser.add_argument("--widths", default="2048,1024", help=f"comma-separated, from {sorted(WIDTHS)}")
    parser.add_argument("--rows", default="gdn,kda,hybrid3:1", help="comma-separated from gdn, kda, hybrid3:1")
    parser.add_argument("--rep", type=int, default=100, help="do_bench rep (ms of repeats)")
    parser.add_argument("--no-fla", action="store_true", help="skip fla's layers even if installed")
    parser.add_argument("--tune-json", default=None,
                        help="GDN launch settings from scripts/gpu_tune.py --json (its 'best'), or any JSON "
                        "file of the form {\"best\": {...}}; default: built-in")
    parser.add_argument("--vs-chunk", action="store_true",
                        help="also time our layers with impl='chunk' (the PyTorch chunk path) and report the "
                             "kernels' speedup over it")
    parser.add_argument("--no-recompute", action="store_true",
                        help="skip the rows of our layers with recompute=True (one variant less per row)")
    parser.add_argument("--profile", action="store_true",
                        help="also print each variant's CUDA time per kernel over 3 forward+backward steps (where "
                             "ours and fla's layers differ)")


def _fwd_bwd_step(fn, x):
    """One forward+backward of fn at x against a fixed random output gradient."""
    dy = torch.randn_like(fn(x).float()).to(x.dtype)

    def step():
        x.grad = None
        fn(x).backward(dy)

    return step


def _time_fwd_bwd(fn, x, rep):
    import triton.testing

    step = _fwd_bwd_step(fn, x)
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = float(triton.testing.do_bench(step, warmup=10, rep=rep, return_mode="median"))
    return ms, peak


def _ours_gdn(w, recompute=False, impl="auto"):
    from hybridlm.layers.gdn import GatedDeltaNet

    return GatedDeltaNet(w["D"], w["H"], w["HV"], w["d"], w.get("dv", w["d"]), layout=w.get("layout", "split"),
                         impl=impl, recompute=recompute)


def _ours_kda(w, recompute=False, impl="auto"):
    from hybridlm.layers.kda import KimiDeltaAttention

    return KimiDeltaAttention(w["D"], w["HV"], w["d"], impl=impl, recompute=recompute)


def _ours_hybrid(w):
    from hybridlm.model.config import HybridConfig
    from hybridlm.model.hybrid import HybridLM

    cfg = HybridConfig(vocab_size=256, hidden_size=w["D"], num_hidden_layers=4,
                       layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_types=["dense"] * 4,
                       linear_num_key_heads=w["H"], linear_num_value_heads=w["HV"], linear_key_head_dim=w["d"],
                       linear_value_head_dim=w["d"], num_attention_heads=w["D"] // 128,
                       num_key_value_heads=max(1, w["D"] // 512), head_dim=128, intermediate_size=3 * w["D"])
    return HybridLM(cfg, impl="auto")


def _fla_gdn(w):
    from fla.layers import GatedDeltaNet

    return GatedDeltaNet(hidden_size=w["D"], expand_v=w.get("dv", w["d"]) / w["d"], head_dim=w["d"],
                         num_heads=w["H"], num_v_heads=w["HV"],
                         mode="chunk", use_gate=True, use_short_conv=True)


def _fla_kda(w):
    from fla.layers import KimiDeltaAttention

    return KimiDeltaAttention(hidden_size=w["D"], expand_v=1, head_dim=w["d"], num_heads=w["HV"], mode="chunk",
                              use_short_conv=True)


def _run_row(kind, wname, T, args, have_fla):
    w = WIDTHS[wname]
    B = max(1, args.tokens // T)
    dev = torch.device("cuda")
    row = {"layer": kind, "width": wname, "T": T, "B": B}
    makers = {"gdn": (_ours_gdn, _fla_gdn), "kda": (_ours_kda, _fla_kda), "hybrid3:1": (_ours_hybrid, None)}
    ours, theirs = makers[kind]
    variants = [("ours", ours)]
    if kind != "hybrid3:1" and not getattr(args, "no_recompute", False):
        # the same layer with recompute=True: its recurrence keeps only its inputs
        variants.append(("ours_rc", lambda w, ours=ours: ours(w, recompute=True)))
    if kind != "hybrid3:1" and getattr(args, "vs_chunk", False):
        variants.append(("chunk", lambda w, ours=ours: ours(w, impl="chunk")))
    variants += [("fla", theirs)] if (theirs is not None and have_fla) else []
    for name, make in variants:
        try:
            torch.manual_seed(0)
            m = make(w).to(dev, torch.bfloat16).train()
            if kind == "hybrid3:1":
                ids = torch.randint(0, 256, (B, T), device=dev)

                def fn(_x, m=m, ids=ids):
                    return m(ids).logits

                x = torch.zeros(1, device=dev, requires_grad=True)
            else:
                x = torch.randn(B, T, w["D"], device=dev, dtype=torch.bfloat16, requires_grad=True)

                def fn(x, m=m, name=name):
                    y = m(x)
                    return y[0] if isinstance(y, tuple) else y

            ms, peak = _time_fwd_bwd(fn, x, args.rep)
            if getattr(args, "profile", False):
                print_kernel_times(f"{kind} width {wname} B{B} T{T} {name}", _fwd_bwd_step(fn, x))
            row[f"{name}_ms"] = ms
            row[f"{name}_tok_s"] = B * T / (ms * 1e-3)
            row[f"{name}_peak_GiB"] = peak / 2**30
        except Exception as e:  # noqa: BLE001  (one failing variant must not hide the others)
            row[f"{name}_error"] = repr(e)[:300]
        finally:
            torch.cuda.empty_cache()
        # each variant as it ends: fla's KDA layer autotunes for minutes, and a run cut short keeps what it has
        print(json.dumps({"partial": True, **row}), flush=True)
    if "ours_ms" in row and "fla_ms" in row:
        row["speedup_vs_fla"] = row["fla_ms"] / row["ours_ms"]
    if "ours_ms" in row and "chunk_ms" in row:
        row["speedup_vs_chunk"] = row["chunk_ms"] / row["ours_ms"]
    if "ours_rc_ms" in row and "fla_ms" in row:
        row["rc_speedup_vs_fla"] = row["fla_ms"] / row["ours_rc_ms"]
    return row


def _table(info, rows):
    lines = [f"device {info['device']}, torch {info['torch']}, triton {info['triton']}, fla {info['fla']}, "
             f"{info['date_utc']} UTC; bf16, forward+backward, {info['tokens']} tokens per step",
             "", "| layer | width | T x B | ours tok/s | fla tok/s | ours/fla | ours peak GiB | fla peak GiB "
             "| recompute: tok/s | ours/fla | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda r, k, s: "-" if k not in r else format(r[k], s)  # noqa: E731
    for r in rows:
        lines.append(f"| {r['layer']} | {r['width']} | {r['T']} x {r['B']} | {f(r, 'ours_tok_s', ',.0f')} | "
                     f"{f(r, 'fla_tok_s', ',.0f')} | {f(r, 'speedup_vs_fla', '.2f')} | "
                     f"{f(r, 'ours_peak_GiB', '.2f')} | {f(r, 'fla_peak_GiB', '.2f')} | "
                     f"{f(r, 'ours_rc_tok_s', ',.0f')} | {f(r, 'rc_speedup_vs_fla', '.2f')} | "
                     f"{f(r, 'ours_rc_peak_GiB', '.2f')} |")
        if "chunk_tok_s" in r:
            lines.append(f"|   impl='chunk': {r['chunk_tok_s']:,.0f} tok/s, {r['chunk_peak_GiB']:.2f} GiB peak; "
                         f"ours/chunk {f(r, 'speedup_vs_chunk', '.2f')} ||||||||||")
        for k in ("ours_error", "ours_rc_error", "fla_error", "chunk_error"):
            if k in r:
                lines.append(f"|   {k}: {r[k][:150]} ||||||||||")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("hybridlm bench layers: needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    have_fla, fla_version = False, None
    if not args.no_fla:
        try:
            from importlib.metadata import version

            import fla.ops.common.chunk_o as fla_chunk_o

            fla_chunk_o.TRITON_ABOVE_3_7_1 = True  # fla 0.6.0's Hopper guard on its gated backward (#640)
            fla_version = version("fla-core")
            have_fla = True
        except Exception as e:  # noqa: BLE001
            print(f"fla not usable: {e!r}", file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    from hybridlm.ops.triton import gdn

    if args.tune_json:
        with open(args.tune_json) as f:
            gdn.TUNE.update(**json.load(f)["best"])  # names checked
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "fla": fla_version, "python": platform.python_version(), "tokens": args.tokens,
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "gdn_tune": gdn.TUNE.as_dict()}
    rows = []

    def save():  # after every row, atomically: a run cut short keeps its finished rows
        table = _table(info, rows)
        atomic_write_text(os.path.join(args.out, "layers.json"), json.dumps({"info": info, "rows": rows}, indent=1))
        atomic_write_text(os.path.join(args.out, "layers.md"), table + "\n")
        return table

    for kind in args.rows.split(","):
        for wname in args.widths.split(","):
            if wname not in WIDTHS:
                print(f"--widths: expected names from {sorted(WIDTHS)}, got {wname!r}", file=sys.stderr)
                return 2
            for T in (int(t) for t in args.seq_lens.split(",")):
                row = _run_row(kind, wname, T, args, have_fla)
                rows.append(row)
                print(json.dumps(row), flush=True)
                save()
    print(save())
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybridlm.bench.layers", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
