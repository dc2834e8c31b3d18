"""Launch-setting sweep of the Triton gated delta rule on one CUDA device (one shape, bf16).

    python scripts/gpu_tune_gdn.py [--shape 4,4096,16,128] [--json tune.json] [--max-seconds 240] [--bwd-only]

For each forward setting (V block: None = the built-in choice, or 64; warps; 16-bit or fp32 dot operands) it
times the forward, then for the backward settings (V block, warps, operands) forward+backward with the best
forward. Every setting's error is measured against our own fp32 run on the same bf16-rounded inputs (IEEE
dots, ~1e-6 from float64 on these inputs), so a setting that is fast but inexact shows. The best setting is the
fastest whose errors stay within 0.8x of the bf16 bars of scripts/gpu_check_gdn.py (o 5e-3, gradients 1e-2).
Writes {"best": TUNE, "rows": [...]} to --json; pass it to `python -m hybridlm.bench.kernels --tune-json`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton.testing

from hybridlm.ops.triton import chunk_gated_delta_rule, gdn

BAR_O, BAR_G = 0.8 * 5e-3, 0.8 * 1e-2


def rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm()).item()


def tune_settings(tune: dict, extra, flag: str) -> dict:
    """`extra` (parsed from the JSON value of command-line flag `flag`) as settings of the launch-plan dict `tune`
    (gdn.TUNE or kda.TUNE); anything but an object of keys `tune` has is an error naming the flag, not a setting
    the kernels would silently ignore."""
    if not isinstance(extra, dict):
        raise SystemExit(f"{flag}: expected a JSON object of settings, got {extra!r}")
    try:
        gdn.check_tune_keys(tune, extra, flag, "TUNE")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return extra


def grid_settings(tune: dict, text: str, flag: str = "--grid") -> list[dict]:
    """The JSON list of `flag` as a list of `tune_settings` objects, in order."""
    entries = json.loads(text)
    if not isinstance(entries, list):
        raise SystemExit(f"{flag}: expected a JSON list of objects, got {text!r}")
    return [tune_settings(tune, e, flag) for e in entries]


def make(B, T, H, D, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q, k, v = r(B, T, H, D), r(B, T, H, D), r(B, T, H, D)
    g = torch.nn.functional.logsigmoid(r(B, T, H) + 3.0)
    beta = torch.rand(B, T, H, device="cuda", generator=gen)
    return q, k, v, g, beta


def run(xs, dtype, grad, do=None):
    q, k, v, g, beta = xs
    # detach: a float32 .to() returns the tensor itself, which an earlier call may have made a grad leaf
    leaf = [x.detach().to(dtype).requires_grad_(grad) for x in (q, k, v)] + [
        g.detach().clone().requires_grad_(grad), beta.detach().to(dtype).requires_grad_(grad)]
    o, _ = chunk_gated_delta_rule(*leaf[:3], g=leaf[3], beta=leaf[4], use_qk_l2norm=True)
    if not grad:
        return o, []
    return o, list(torch.autograd.grad(o, leaf, do.to(o.dtype)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4,4096,16,128", help="B,T,H,D")
    ap.add_argument("--json", default=None, help="write the rows and the best setting here")
    ap.add_argument("--max-seconds", type=float, default=240.0, help="stop sweeping after this long")
    ap.add_argument("--rep", type=int, default=60, help="do_bench rep in ms")
    ap.add_argument("--bwd-only", action="store_true", help="time only the built-in forward, then every backward plan")
    ap.add_argument("--warps", action="store_true", help="forward only: num_warps of each forward launch on its own "
                    "(prep stages 1 and 3, the state pass, the output), then forward+backward with the backward's "
                    "two chunk launches' warps; with fla's forward for the ratio")
    ap.add_argument("--lean", action="store_true", help="forward only: the inference-forward plans (gdn.TUNE "
                    "fwd_variant 'lean' and its settings) against the training forward's kernels, and fla's forward "
                    "when installed; no backward")
    ap.add_argument("--grid", default=None,
                    help="JSON list of gdn.TUNE settings, each merged over the built-in ones and timed forward and "
                    "forward+backward in the listed order (list one twice to see the run's drift); replaces the "
                    "built-in sweeps")
    ap.add_argument("--grid-fwd-only", action="store_true", help="with --grid: time each setting's forward only")
    args = ap.parse_args(argv)
    grid = None if args.grid is None else grid_settings(gdn.TUNE, args.grid)
    B, T, H, D = (int(x) for x in args.shape.split(","))
    t_start = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    # bf16-representable inputs, so the fp32 reference and the bf16 runs compute the same function (the error
    # then measures the kernels' rounding, not the inputs')
    xs = [x.to(torch.bfloat16).float() if i != 3 else x for i, x in enumerate(make(B, T, H, D))]
    do = torch.randn(B, T, H, D, device="cuda")
    base = dict(gdn.TUNE)
    gdn.TUNE.update(store_fp32=True, fwd_lowp=False, bwd_lowp=False)
    o_ref, g_ref = run(xs, torch.float32, True, do)
    gdn.TUNE.clear()
    gdn.TUNE.update(base)
    rows = []

    def measure(setting, grad):
        gdn.TUNE.clear()
        gdn.TUNE.update(base, **setting)
        gdn._BT_OK.clear()
        try:
            o, gr = run(xs, torch.bfloat16, grad, do)
            err = {"o": rel(o, o_ref)}
            for n, a, b in zip(["dq", "dk", "dv", "dg", "dbeta"], gr, g_ref):
                err[n] = rel(a, b)
            fn = (lambda: run(xs, torch.bfloat16, True, do)) if grad else (lambda: run(xs, torch.bfloat16, False))
            ms = float(triton.testing.do_bench(fn, warmup=10, rep=args.rep, return_mode="median"))
        except Exception as e:  # an illegal setting on this device: report it and go on
            return {"setting": setting, "grad": grad, "ms": float("inf"), "error": repr(e)[:200]}
        ok = err["o"] <= BAR_O and all(v <= BAR_G for n, v in err.items() if n != "o")
        row = {"setting": setting, "grad": grad, "ms": ms, "errors": err, "ok": ok,
               "bt": {str(k): v for k, v in gdn._BT_OK.items()}}
        worst = max(err.items(), key=lambda kv: kv[1])
        print(f"{'fwd+bwd' if grad else 'fwd':8} {setting} {ms:8.3f} ms  worst {worst[0]} {worst[1]:.2e} "
              f"{'ok' if ok else 'INEXACT'} bt {row['bt']}", flush=True)
        return row

    # fwd_split_o: the output in its own parallel kernel; prep_split: the prep as three launches; solve_interleave:
    # the four diagonal inversions in one loop; prep_lowp: 16-bit operands for the prep's dots; prep_variant: the
    # whole-K prep (the default measured on 2026-11-23, first) or the K-blocked one (prep_bk key channels a block)
    default = dict(fwd_split_o=True, prep_split=True, solve_interleave=True, prep_lowp=False, fwd_bv=None,
                   prep_variant="whole", prep_kkt=False, fwd_raw_out=False, state_raw_k=False)
    kb = dict(default, prep_variant="kblock", prep_bk=64)
    fwd_grid = [default, kb, dict(kb, prep_bk=32), dict(kb, prep_split=False), dict(kb, prep_lowp=True),
                dict(kb, prep_stages=2), dict(kb, prep_warps=4), dict(default, solve_interleave=False),
                dict(default, prep_split=False), dict(default, prep_lowp=True), dict(kb, fwd_split_o=False),
                dict(kb, fwd_bv=64), dict(kb, solve_warps=8)]
    if grid is not None:
        return _grid_sweep(args, grid, measure, rows, (B, T, H, D), base)
    if args.lean or args.warps:
        return _lean_sweep(args, measure, rows, xs, (B, T, H, D), base)
    t_fwd = time.time()  # the reference run above compiled the fp32 kernels: the sweep's own budget starts now
    best_f = None
    for s in [{}] if args.bwd_only else fwd_grid:  # {}: the built-in forward settings
        if time.time() - t_fwd > 0.7 * (args.max_seconds - (t_fwd - t_start)):
            break
        row = measure(s, False)
        rows.append(row)
        if row.get("ok") and (best_f is None or row["ms"] < best_f["ms"]):
            best_f = row
    fset = best_f["setting"] if best_f else {}
    # chunk-backward plans, the runner-up and the default first (a time cut still leaves the A/B): statefirst (state
    # launch then output launch, whole K) with the UT dots in the state launch (bwd_bv None: 32), then the K-blocked
    # state-first plan (kblock, the default: key blocks of 64, BV 64, ptxas capped at 128 registers), its variants
    # (uncapped; key blocks of 32 at BV 32: 32 at BV 64 gave a wrong dk on an H100 and is refused; 4 warps
    # uncapped), then twophase (two phases, two launches) and the statefirst variants (UT dots parked for the
    # output launch, BV, warps of the output launch)
    two = dict(fset, bwd_warps=8, bwd_lowp=True, bwd_variant="twophase", bwd_split=True)
    sf = dict(fset, bwd_warps=8, bwd_lowp=True, bwd_variant="statefirst", bwd_ut_dots=True, bwd_bv=None,
              bwd_out_warps=None)
    kb = dict(fset, bwd_warps=8, bwd_lowp=True, bwd_variant="kblock", bwd_bk=64, bwd_bv=None, bwd_maxnreg=128,
              bwd_out_warps=None)
    bwd_grid = [sf, kb, dict(kb, bwd_maxnreg=None), dict(kb, bwd_bk=32, bwd_bv=32),
                dict(kb, bwd_bk=32, bwd_bv=32, bwd_maxnreg=None), dict(kb, bwd_warps=4, bwd_maxnreg=None),
                dict(two, bwd_bv=64), dict(sf, bwd_ut_dots=False), dict(sf, bwd_ut_dots=False, bwd_bv=32),
                dict(sf, bwd_bv=64), dict(sf, bwd_out_warps=16), dict(two, bwd_bv=32)]
    best_b = None
    for s in bwd_grid:
        if time.time() - t_start > args.max_seconds:
            break
        row = measure(s, True)
        rows.append(row)
        if row.get("ok") and (best_b is None or row["ms"] < best_b["ms"]):
            best_b = row
    best = dict(base, **(best_b["setting"] if best_b else fset))
    print("best:", json.dumps(best), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": [B, T, H, D], "device": torch.cuda.get_device_name(), "best": best, "rows": rows,
                       "best_fwd_ms": best_f and best_f["ms"], "best_fwdbwd_ms": best_b and best_b["ms"]}, f,
                      indent=1, default=str)
    gdn.TUNE.clear()
    gdn.TUNE.update(best)
    return 0


def _grid_sweep(args, grid, measure, rows, shape, base) -> int:
    """--grid: each setting's forward, then its forward+backward, in the listed order, until --max-seconds."""
    t0 = time.time()
    for s in grid:
        if time.time() - t0 > args.max_seconds:
            print(f"stopped at --max-seconds before {s}", flush=True)
            break
        rows.append(measure(s, False))
        if not args.grid_fwd_only:
            rows.append(measure(s, True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": list(shape), "device": torch.cuda.get_device_name(), "base": base, "rows": rows}, f,
                      indent=1, default=str)
    return 0


def _lean_sweep(args, measure, rows, xs, shape, base) -> int:
    """Forward-only sweep of the inference plans (no_grad: the kernels keep nothing for a backward), the training
    forward's kernels first, with fla's forward on the same bf16 inputs for the ratio. With --warps instead: each
    forward launch's warps alone, then the backward launches' (forward+backward)."""
    t0 = time.time()
    # 2026-11-23 22:25 (H100, B4 T4096 H16): saved 1.066 ms, lean 1.568, and each change alone: lean_warps 4 1.268,
    # out_warps 4 1.402, out_bv 128 1.459, lean_split 1.482, prep_lowp 1.507, inline output 1.687 (fwd_stages 1:
    # wrong output, an illegal memory access at B1 T32768: now refused). 22:36: together (lean_warps 4, out_warps 4,
    # out_bv 128) 1.059 vs saved 1.066. 22:40 (prep launches timed one by one): the solve alone ~196 us of the
    # forward's ~840, solve_warps 2 152 us. Now: the doubling solves, fewer solve warps, 16-bit W/U operands
    # these rows compare the split prep's solve settings
    saved = dict(fwd_variant="saved", prep_kkt=False, fwd_raw_out=False, state_raw_k=False)
    lean = dict(fwd_variant="lean", lean_warps=4, out_warps=4, out_bv=128)
    grid = [saved, dict(saved, solve_warps=2), dict(saved, solve_warps=1), dict(saved, solve="doubling16"),
            dict(saved, solve="doubling16", solve_warps=2), dict(saved, solve="doubling"),
            dict(saved, solve_warps=2, prep_lowp=True), dict(saved, solve="doubling16", solve_warps=2, prep_lowp=True),
            dict(saved, solve="doubling16", solve_prec="ieee"), lean, dict(lean, solve="doubling"),
            dict(lean, solve="doubling16")]
    grad = False
    if args.warps:  # one launch's warps at a time, built-in settings otherwise (prep defaults 8, solve 1, out 8)
        grid = [{}, dict(prep1_warps=4), dict(prep1_warps=2), dict(prep3_warps=4), dict(prep3_warps=2),
                dict(fwd_warps=4), dict(out_warps=4), dict(prep1_warps=4, prep3_warps=4, out_warps=4)]
    for s in grid:
        if time.time() - t0 > args.max_seconds:
            break
        rows.append(measure(s, grad))
    if args.warps:  # the backward's two chunk launches (bwd_warps; the output launch alone: bwd_out_warps)
        for s in [{}, dict(bwd_warps=4), dict(bwd_out_warps=4), dict(bwd_warps=4, bwd_maxnreg=None)]:
            if time.time() - t0 > args.max_seconds:
                break
            rows.append(measure(s, True))
    fla_ms = None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn

        q, k, v, g, beta = (x.to(torch.bfloat16) if i != 3 else x for i, x in enumerate(xs))
        with torch.no_grad():
            fla_ms = float(triton.testing.do_bench(
                lambda: fla_gdn(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True), warmup=10, rep=args.rep,
                return_mode="median"))
        print(f"fla fwd {fla_ms:8.3f} ms", flush=True)
    except ImportError:
        print("fla not installed: no ratio", flush=True)
    ok = [r for r in rows if r.get("ok")]
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    if best:
        print(f"best lean-sweep row: {best['setting']} {best['ms']:.3f} ms"
              + (f", fla/ours {fla_ms / best['ms']:.2f}" if fla_ms else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": list(shape), "device": torch.cuda.get_device_name(), "rows": rows, "fla_fwd_ms": fla_ms,
                       "best": dict(base, **best["setting"]) if best else None}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
