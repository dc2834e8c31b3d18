"""Launch-setting sweep of the Triton GDN and KDA kernels on one CUDA device (one shape, bf16).

    python scripts/gpu_tune.py [--op gdn,kda] [--shape 4,4096,16,128] [--json tune.json] [--max-seconds 240]
                               [--grid '[{"bwd_warps": 8}, ...]'] [--gates bench|init]

When to run it: after changing a kernel or its launch code, after a Triton upgrade, and on a GPU model the tables
(`gdn.TUNE`, `kda.TUNE`) were not measured on; then keep a new default only where it wins on every benchmark shape
(`hybridlm bench kernels --tune-json tune.json` times the others) and the float64 check passes with it
(scripts/gpu_check_gdn.py --gdn-tune / --kda-tune, or tests/ops/test_gpu_check.py).

For each op, the fields of its table in turn (coordinate descent from the current values): each candidate value is
timed with the other fields at the best so far, forward+backward (triton.testing.do_bench, median) under
`tune.tuned()`. Every setting's error is measured against our own fp32 run on the same bf16-rounded inputs (IEEE
dots, ~1e-6 from float64), so a setting that is fast but inexact shows; the best is the fastest whose errors stay
within 0.8x of the check's bf16 bars (o 5e-3, gradients 1e-2). A setting a launch refuses or that does not compile
is reported and skipped. --grid times the given settings instead (one op). Writes {"best": GDN settings,
"kda_best": KDA settings, "rows": [...]} to --json.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton.testing

from hybridlm.bench.kernels import op_inputs
from hybridlm.ops.triton import chunk_gated_delta_rule, chunk_kda, gdn, kda
from hybridlm.ops.triton.tune import tuned

BAR_O, BAR_G = 0.8 * 5e-3, 0.8 * 1e-2
# candidate values per field (the current value is always among those timed)
CANDIDATES = {
    "gdn": dict(kkt_warps=(1, 2, 4), kkt_bk=(16, 32, 64), wu_warps=(4, 8), wu_bk=(32, 64), wu_stages=(1, 2),
                fwd_warps=(4, 8), fwd_bv=(None, 16, 32, 64), fwd_stages=(2, 3), out_bv=(64, 128), out_warps=(4, 8),
                rbwd_warps=(4, 8), rbwd_bv=(None, 16, 32, 64), bwd_warps=(4, 8), bwd_bk=(32, 64, 128),
                bwd_bv=(None, 32, 64), bwd_stages=(1, 2)),
    "kda": dict(bk=(16, 32, 64), prep_warps=(4, 8), bwd_warps=(8, 16), state_warps=(4, 8), out_bv=(32, 64, 128),
                out_warps=(4, 8)),
}
TABLES = {"gdn": gdn.TUNE, "kda": kda.TUNE}


def rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm()).item()


def make(op: str, B: int, T: int, H: int, D: int, gates: str, seed: int = 0) -> list[torch.Tensor]:
    """The bench's inputs (`hybridlm.bench.kernels.op_inputs`)."""
    return op_inputs(op, B, T, H, D, gates, seed)


def run(op: str, xs, dtype, do):
    """o and every gradient of one forward+backward at `dtype` inputs (g fp32)."""
    fn = chunk_gated_delta_rule if op == "gdn" else chunk_kda
    q, k, v, g, beta = xs
    leaf = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)] + [
        g.detach().clone().requires_grad_(), beta.detach().to(dtype).requires_grad_()]
    o, _ = fn(*leaf[:3], g=leaf[3], beta=leaf[4], use_qk_l2norm=True)
    return o, list(torch.autograd.grad(o, leaf, do.to(o.dtype)))


def measure(op: str, setting: dict, xs, do, ref, rep: int) -> dict:
    """One setting of op's table (the others as they are): errors vs ref and the forward+backward time."""
    try:
        with tuned(TABLES[op], **setting):
            gdn._BT_OK.clear()
            o, gr = run(op, xs, torch.bfloat16, do)
            err = {"o": rel(o, ref[0])}
            err.update({n: rel(a, b) for n, a, b in zip(["dq", "dk", "dv", "dg", "dbeta"], gr, ref[1])})
            ms = float(triton.testing.do_bench(lambda: run(op, xs, torch.bfloat16, do), warmup=10, rep=rep,
                                               return_mode="median"))
    except Exception as e:  # noqa: BLE001  (refused or not compiled on this device: report it and go on)
        print(f"{op} {setting}: {type(e).__name__} {str(e)[:160]}", flush=True)
        return {"op": op, "setting": setting, "ms": float("inf"), "error": repr(e)[:200], "ok": False}
    ok = err["o"] <= BAR_O and all(v <= BAR_G for n, v in err.items() if n != "o")
    worst = max(err.items(), key=lambda kv: kv[1])
    print(f"{op} {setting} {ms:8.3f} ms  worst {worst[0]} {worst[1]:.2e} {'ok' if ok else 'INEXACT'}", flush=True)
    return {"op": op, "setting": setting, "ms": ms, "errors": err, "ok": ok}


def sweep(op: str, xs, do, ref, rep: int, deadline: float, rows: list) -> dict:
    """Coordinate descent over op's fields from the table's values; returns the best settings found."""
    best = TABLES[op].as_dict()
    best_ms = measure(op, best, xs, do, ref, rep)
    rows.append(best_ms)
    best_ms = best_ms["ms"] if best_ms["ok"] else float("inf")
    for field, values in CANDIDATES[op].items():
        for value in values:
            if value == best[field] or time.monotonic() > deadline:
                continue
            row = measure(op, dict(best, **{field: value}), xs, do, ref, rep)
            rows.append(row)
            if row["ok"] and row["ms"] < best_ms:
                best, best_ms = row["setting"], row["ms"]
    print(f"{op} best {best_ms:.3f} ms: {best}", flush=True)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", default="gdn,kda", help="comma-separated: gdn, kda")
    ap.add_argument("--shape", default="4,4096,16,128", help="B,T,H,D")
    ap.add_argument("--json", default=None, help="write the rows and the best settings here")
    ap.add_argument("--max-seconds", type=float, default=240.0, help="stop each op's sweep after this long")
    ap.add_argument("--rep", type=int, default=60, help="do_bench rep in ms")
    ap.add_argument("--gates", choices=("bench", "init"), default="bench", help="KDA's gates (kda_bench_gates)")
    ap.add_argument("--grid", default=None, help="JSON list of settings objects to time instead of the sweep "
                    "(with one --op)")
    args = ap.parse_args(argv)
    ops = args.op.split(",")
    if set(ops) - set(TABLES) or (args.grid and len(ops) != 1):
        raise SystemExit(f"--op: expected gdn, kda or both (one with --grid), got {args.op!r}")
    B, T, H, D = (int(x) for x in args.shape.split(","))
    print(f"{torch.cuda.get_device_name()}, B{B} T{T} H{H} D{D} bf16", flush=True)
    rows, best = [], {}
    for op in ops:
        xs = make(op, B, T, H, D, args.gates)
        do = torch.randn(B, T, H, D, device="cuda")
        ref = run(op, xs, torch.float32, do)
        if args.grid:
            grid = json.loads(args.grid)
            rows += [measure(op, dict(TABLES[op].as_dict(), **s), xs, do, ref, args.rep) for s in grid]
            continue
        best[op] = sweep(op, xs, do, ref, args.rep, time.monotonic() + args.max_seconds, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"best": best.get("gdn", {}), "kda_best": best.get("kda", {}), "rows": rows,
                       "device": torch.cuda.get_device_name(), "shape": [B, T, H, D]}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
