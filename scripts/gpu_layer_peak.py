"""What is alive at the peak of one layer's forward+backward, ours against fla's (CUDA only).

Non-standard here: the answer comes from PyTorch's allocator trace (torch.cuda.memory._record_memory_history), replayed
allocation by allocation to find the moment the allocated total is largest; the blocks alive then are listed by
size with the innermost frame of ours or fla's code that allocated them (autograd's saved tensors show up at the
forward op that made them). The layers are built as `hybridlm bench layers` builds them (Qwen3-Next widths, bf16,
B 8 x T 2048 by default), after one warm-up step so autotuning and caches are out of the picture; fla's gated
backward runs with its Hopper guard lifted, as in the bench.

    python scripts/gpu_layer_peak.py [--layer gdn|kda] [--variants ours,fla] [--batch 8] [--seq-len 2048] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridlm.bench import layers as bl  # noqa: E402

OWN = ("hybridlm/", "fla/")


def _site(frames: list[dict]) -> str:
    """The innermost frame in ours or fla's code (file:line function), else the innermost Python frame."""
    py = [f for f in frames if f.get("filename", "").endswith(".py")]
    for f in py:
        name = f["filename"]
        if any(o in name for o in OWN):
            short = name[name.rfind("hybridlm/") if "hybridlm/" in name else name.rfind("fla/"):]
            return f"{short}:{f['line']} {f['name']}"
    return f"{py[0]['filename'].rsplit('/', 1)[-1]}:{py[0]['line']} {py[0]['name']}" if py else "?"


def live_at_peak(snapshot: dict) -> tuple[int, list[tuple[int, str]]]:
    """(peak bytes above the trace's start, [(bytes, site)] alive then), from the device-0 allocator trace."""
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    best_set: list[tuple[int, str]] = []
    for ev in snapshot["device_traces"][0]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], _site(ev.get("frames", [])))
            total += ev["size"]
            if total > best:
                best, best_set = total, list(live.values())
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    return best, best_set


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer", default="gdn", choices=["gdn", "kda"], help="which layer")
    ap.add_argument("--variants", default="ours,fla", help="comma-separated from ours, fla")
    ap.add_argument("--width", default="2048", choices=sorted(bl.WIDTHS), help="layer width (bench layers' WIDTHS)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--top", type=int, default=25, help="sites to print per variant")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_layer_peak.py needs a CUDA device")
    w, dev = bl.WIDTHS[args.width], torch.device("cuda")
    if "fla" in args.variants:
        import fla.ops.common.chunk_o as fla_chunk_o

        fla_chunk_o.TRITON_ABOVE_3_7_1 = True  # fla 0.6.0's Hopper guard on its gated backward (#640), as the bench
    makers = {"gdn": {"ours": bl._ours_gdn, "fla": bl._fla_gdn}, "kda": {"ours": bl._ours_kda, "fla": bl._fla_kda}}
    for name in args.variants.split(","):
        torch.manual_seed(0)
        m = makers[args.layer][name](w).to(dev, torch.bfloat16).train()
        x = torch.randn(args.batch, args.seq_len, w["D"], device=dev, dtype=torch.bfloat16, requires_grad=True)

        def fn(x, m=m):
            y = m(x)
            return y[0] if isinstance(y, tuple) else y

        step = bl._fwd_bwd_step(fn, x)
        step()  # warm-up: autotuning, caches, parameter grads allocated
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=200000)
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak_rise = torch.cuda.max_memory_allocated() - base
        best, alive = live_at_peak(snap)
        by_site: dict[str, list[int]] = collections.defaultdict(list)
        for size, site in alive:
            by_site[site].append(size)
        print(f"\n== {args.layer} {name}: peak rise over the step {peak_rise / 2**30:.3f} GiB (max_memory_allocated); "
              f"allocated in the step and alive at its peak {best / 2**20:.0f} MiB in {len(alive)} blocks")
        for site, sizes in sorted(by_site.items(), key=lambda kv: -sum(kv[1]))[: args.top]:
            print(f"  {sum(sizes) / 2**20:9.1f} MiB  {len(sizes):3d} x  {site}")
        del m, x, step
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
