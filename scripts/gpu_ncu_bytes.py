"""DRAM bytes and GPU time of every kernel of one training step of our GDN or KDA op, per kernel name, and the
step's floor at the copy bandwidth: how far each launch is from what its bytes allow.

Run it after changing a kernel's launch plan (what each launch reads and writes), to see where a step's time goes
and how far it is from its bytes. Needs Nsight Compute (`ncu`) on the GPU machine.

    python3 scripts/gpu_ncu_bytes.py --op kda [--gates init] [--shape 4,4096,16,128] [--out DIR]

runs ncu twice on this same script (`--step`): one window around the second step's forward (with grad, the
training forward) and one around its forward and backward (bf16 inputs, the inputs of `hybridlm bench kernels`;
the first step compiles). Every kernel in the window is measured (`dram__bytes_read.sum`, `dram__bytes_write.sum`,
`gpu__time_duration.sum`, clocks left alone), PyTorch's own kernels too; the backward is the second window less the
first. Prints a table per pass and writes both CSVs to --out. ncu serialises the kernels it measures: the sums are
of kernel durations, not of a step's wall time.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys
from collections import defaultdict

METRICS = "dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum"


def inputs(op: str, B: int, T: int, H: int, D: int, gates: str) -> list:
    """q, k, v [B, T, H, D], g ([B, T, H] for GDN, [B, T, H, D] for KDA, fp32), beta [B, T, H]: bf16-representable
    (`hybridlm.bench.kernels.op_inputs`, seed 0)."""
    from hybridlm.bench.kernels import op_inputs

    return op_inputs(op, B, T, H, D, gates)


def step(op: str, shape: str, gates: str, backward: bool) -> None:
    """Inside ncu: one unprofiled step, then the profiled window (forward only, or forward and backward)."""
    import torch

    if op == "gdn":
        from hybridlm.ops.triton import chunk_gated_delta_rule as fn
    else:
        from hybridlm.ops.triton import chunk_kda as fn
    B, T, H, D = (int(x) for x in shape.split(","))
    q, k, v, g, beta = inputs(op, B, T, H, D, gates)
    do = torch.randn(B, T, H, D, device="cuda").bfloat16()

    def one_step(window: bool) -> None:
        leaf = [x.detach().bfloat16().requires_grad_() for x in (q, k, v)] + [
            g.detach().clone().requires_grad_(), beta.detach().bfloat16().requires_grad_()]
        torch.cuda.synchronize()
        if window:
            torch.cuda.cudart().cudaProfilerStart()
        o, _ = fn(*leaf[:3], g=leaf[3], beta=leaf[4], use_qk_l2norm=True)
        if backward or not window:
            torch.autograd.grad(o, leaf, do)
        torch.cuda.synchronize()
        if window:
            torch.cuda.cudart().cudaProfilerStop()

    one_step(False)
    one_step(True)


def ncu_csv(ncu: str, args: argparse.Namespace, backward: bool) -> str:
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw", "--print-units",
           "base", "--metrics", METRICS, sys.executable, os.path.abspath(__file__), "--step", "--op", args.op,
           "--shape", args.shape, "--gates", args.gates] + (["--backward"] if backward else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"ncu exit {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def per_kernel(text: str) -> dict[str, list[float]]:
    """{kernel name: [launches, bytes read, bytes written, ns]} from ncu's raw CSV (the lines from its header on)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    head = rows[0]
    col = {name: head.index(name) for name in ("Kernel Name", *METRICS.split(","))}
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for row in rows[2:]:  # rows[1]: units
        if len(row) < len(head):
            continue
        acc = out[row[col["Kernel Name"]].split("(")[0].strip()]
        acc[0] += 1
        for i, m in enumerate(METRICS.split(",")):
            acc[1 + i] += float(row[col[m]].replace(",", ""))
    return dict(out)


def table(title: str, kernels: dict[str, list[float]], copy_gbs: float) -> float:
    """Prints one pass's table; returns its bytes in MB."""
    print(f"\n{title}")
    print("| kernel | launches | MB read | MB written | us | GB/s | of copy |")
    print("|---|---|---|---|---|---|---|")
    tot = [0, 0.0, 0.0, 0.0]
    for name, (n, r, w, ns) in sorted(kernels.items(), key=lambda kv: -kv[1][3]):
        tot = [a + b for a, b in zip(tot, (n, r, w, ns))]
        gbs = (r + w) / ns if ns else 0.0
        print(f"| `{name}` | {n:.0f} | {r / 1e6:.0f} | {w / 1e6:.0f} | {ns / 1e3:.0f} | {gbs:.0f} | "
              f"{100 * gbs / copy_gbs:.0f}% |")
    n, r, w, ns = tot
    print(f"| all | {n:.0f} | {r / 1e6:.0f} | {w / 1e6:.0f} | {ns / 1e3:.0f} | {(r + w) / ns:.0f} | "
          f"{100 * (r + w) / ns / copy_gbs:.0f}% |")
    print(f"floor at {copy_gbs:.0f} GB/s: {(r + w) / copy_gbs / 1e3:.0f} us")
    return (r + w) / 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", choices=("gdn", "kda"), default="gdn", help="which op's step to measure")
    ap.add_argument("--shape", default="4,4096,16,128", help="B,T,H,D")
    ap.add_argument("--gates", choices=("bench", "init"), default="init",
                    help="KDA's log-decays: the bench's mild ones or a freshly initialised layer's")
    ap.add_argument("--copy-gbs", type=float, default=3016.0, help="copy bandwidth for the floor (GB/s)")
    ap.add_argument("--out", default=None, help="folder for the two raw CSVs")
    ap.add_argument("--step", action="store_true", help="(internal) the profiled process")
    ap.add_argument("--backward", action="store_true", help="(internal) with --step: the window holds the backward")
    args = ap.parse_args(argv)
    if args.step:
        step(args.op, args.shape, args.gates, args.backward)
        return 0
    ncu = subprocess.run(["bash", "-c", "command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1"],
                         capture_output=True, text=True).stdout.strip()
    if not ncu:
        raise SystemExit("no ncu on this machine")
    fwd_csv, all_csv = ncu_csv(ncu, args, False), ncu_csv(ncu, args, True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        for name, text in (("fwd", fwd_csv), ("fwdbwd", all_csv)):
            with open(os.path.join(args.out, f"ncu_{args.op}_{name}.csv"), "w") as f:
                f.write(text)
    fwd, both = per_kernel(fwd_csv), per_kernel(all_csv)
    bwd = {}
    for name, acc in both.items():
        rest = [a - b for a, b in zip(acc, fwd.get(name, [0, 0.0, 0.0, 0.0]))]
        if rest[0] > 0:
            bwd[name] = rest
    extra = f", gates {args.gates}" if args.op == "kda" else ""
    print(f"{args.op} B,T,H,D {args.shape} bf16{extra}")
    mb_f = table("forward (training, with grad)", fwd, args.copy_gbs)
    mb_b = table("backward (the second window less the first)", bwd, args.copy_gbs)
    print(f"\nforward+backward: {mb_f + mb_b:.0f} MB, floor {(mb_f + mb_b) / args.copy_gbs * 1e3:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
