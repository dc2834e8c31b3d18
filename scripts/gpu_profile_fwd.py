"""Per-kernel CUDA time of one GDN forward (and forward+backward), ours against fla-core, at the benchmark shapes.

    python scripts/gpu_profile_fwd.py [--shapes 4,4096,16,128 8,2048,32,128] [--tune KEY=VALUE ...] [--bwd]

For each shape: ours with the built-in launch settings, ours with --tune applied (if given), and fla's
chunk_gated_delta_rule (q/k l2norm in kernel; its gated backward guard lifted for --bwd), each run once to warm up
and then 5 times under the torch profiler. Prints, per kernel, microseconds per call of the op and launches per
call, so each of our kernels can be set beside the fla kernel doing the same part of the work.
"""

from __future__ import annotations

import argparse
import ast

import torch
import torch.nn.functional as F

from hybridlm.bench.cuda_profile import kernel_table
from hybridlm.ops.triton import chunk_gated_delta_rule, gdn


class _Timed:
    """Stands in for a Triton kernel and times each launch with CUDA events, keyed by the value of one constexpr
    (the prep's STAGE): the profiler names every launch of a kernel alike."""

    def __init__(self, fn, key: str):
        self.fn, self.key, self.events = fn, key, []

    def __getitem__(self, grid):
        def launch(*a, **kw):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            out = self.fn[grid](*a, **kw)
            e1.record()
            self.events.append((kw.get(self.key), e0, e1))
            return out
        return launch


def stage_times(step, name: str, key: str = "STAGE", steps: int = 5) -> dict:
    """Microseconds per call of each value of `key` over the launches of kernel `name` in step()."""
    from hybridlm.ops.triton import gdn_kernels as kern

    orig = getattr(kern, name)
    timed = _Timed(orig, key)
    setattr(kern, name, timed)
    try:
        step()
        torch.cuda.synchronize()
        timed.events.clear()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    finally:
        setattr(kern, name, orig)
    out: dict = {}
    for k, e0, e1 in timed.events:
        out[k] = out.get(k, 0.0) + e0.elapsed_time(e1) * 1000 / steps
    return out


def show(label: str, rows) -> None:
    total = sum(r[1] for r in rows)
    print(f"--- {label}: {total:8.1f} us per call", flush=True)
    for name, us, n in rows[:12]:
        print(f"   {us:8.1f} us  x{n:4.1f}  {name[:70]}", flush=True)


def _profile_shape(B, T, H, D, gen, fla_gdn, tune: dict, args) -> None:
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = (r(B, T, H, D).to(torch.bfloat16) for _ in range(3))
    g = F.logsigmoid(r(B, T, H) + 3.0)
    beta = torch.sigmoid(r(B, T, H)).to(torch.bfloat16)
    do = r(B, T, H, D).to(torch.bfloat16)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    shape = f"B{B} T{T} H{H}"
    fns = {"ours": lambda *a, **kw: chunk_gated_delta_rule(*a, use_qk_l2norm=True, **kw)}
    if fla_gdn is not None:
        fns["fla"] = lambda *a, **kw: fla_gdn(*a, use_qk_l2norm_in_kernel=True, **kw)
    base = dict(gdn.TUNE)
    runs = [("ours", "ours", {})] + ([("ours", "ours " + " ".join(args.tune), tune)] if tune else [])
    runs += [("fla", "fla", {})] if "fla" in fns else []
    for which, label, setting in runs:
        fn = fns[which]
        gdn.TUNE.clear()
        gdn.TUNE.update(base, **setting)
        with torch.no_grad():
            show(f"{shape} fwd {label}", kernel_table(lambda fn=fn: fn(q, k, v, g=g, beta=beta)))
            if which == "ours":
                for kname in ("_prep_fwd_blk", "_prep_lean"):
                    st = stage_times(lambda fn=fn: fn(q, k, v, g=g, beta=beta), kname)
                    if st:
                        print(f"   {kname} by STAGE (us per call, events): "
                              + ", ".join(f"{s}: {t:.1f}" for s, t in sorted(st.items())), flush=True)
        if args.bwd:
            def fb(fn=fn):
                o = fn(*leaves[:3], g=leaves[3], beta=leaves[4])[0]
                return torch.autograd.grad(o, leaves, do)
            show(f"{shape} fwd+bwd {label}", kernel_table(fb))
    gdn.TUNE.clear()
    gdn.TUNE.update(base)


def _value(text: str):
    """A --tune value: a Python literal (4, None, True), else the text itself (lean)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["4,4096,16,128", "8,2048,32,128"], help="B,T,H,D each")
    ap.add_argument("--tune", nargs="*", default=[], help="KEY=VALUE gdn.TUNE settings of the second 'ours' row")
    ap.add_argument("--bwd", action="store_true", help="also forward+backward")
    ap.add_argument("--no-fla", action="store_true", help="ours only")
    args = ap.parse_args(argv)
    tune = {k: _value(v) for k, v in (x.split("=", 1) for x in args.tune)}
    try:
        if args.no_fla:
            raise ImportError
        import fla.ops.common.chunk_o as fla_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn

        fla_o.TRITON_ABOVE_3_7_1 = True  # fla 0.6.0 refuses its gated backward on Hopper with Triton < 3.7.1
    except ImportError:
        fla_gdn = None
    gen = torch.Generator(device="cuda").manual_seed(0)
    for spec in args.shapes:
        _profile_shape(*(int(x) for x in spec.split(",")), gen, fla_gdn, tune, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
