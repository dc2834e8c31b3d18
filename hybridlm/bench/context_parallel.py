"""Context-parallel ops on several GPUs: the GDN and KDA ops with the sequence split over every rank (cp_group)
against one GPU running the whole sequence, for agreement and fwd+bwd time.

    torchrun --nproc_per_node 4 -m hybridlm.bench.context_parallel [--seq-len 32768] [--heads 16] [--dim 128]
             [--out DIR]

Non-standard here: every rank draws the same whole-sequence inputs from one seed and runs the whole sequence on its
own GPU too (the "CP 1" run: R independent copies, so its time is one GPU's), then its slice with cp_group. The
agreement is the float64 check's measure (`scripts/gpu_check_gdn.py`), on the timed inputs and on inputs whose
state survives a slice (`_inputs` carried): the relative Frobenius error of CP R against CP 1 for the output, the
final state and every gradient (slices gathered by summing squared norms over the ranks; the initial state's
gradient summed over the ranks), held to that check's bf16 bars (5e-3 for outputs and states, 1e-2 for
gradients). Time: the median over --rep of one fwd+bwd between two barriers (wall, synchronised), and its
CUDA-event time on each rank (the slowest rank's); then the same fwd+bwd captured as one CUDA graph (the
collectives inside it) and replayed, its GPU time without the host's launches (a call at 8K tokens a rank issues
its ~50 launches for longer than they run). Writes cp.json and cp.md under --out on rank 0. --profile adds
profile.md: each rank's kernels in one CP fwd+bwd by name (torch profiler, a barrier before each profiled call, so
a collective's time is its wait for the slowest rank within the call plus the transfer) beside the whole sequence's
on one GPU divided by R, what a rank would take with nothing added.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridlm.bench.cuda_profile import capture_graph, kernel_table
from hybridlm.files import atomic_write_text
from hybridlm.ops import gated_delta_rule, kda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU (gloo) only to try the script out
BARS = {"o": 5e-3, "final_state": 5e-3}  # every other tensor: a gradient, 1e-2
GRAD_BAR = 1e-2


def _inputs(op: str, T: int, H: int, D: int, seed: int, device, carried: bool = False) -> dict[str, torch.Tensor]:
    """The whole sequence's inputs. carried: a state that survives a slice (log-decays ~2e-5 and beta ~0.01 a
    token: the transition M of 8192 tokens stays near the identity's scale), so the agreement goes through the
    chain of M; with the timed inputs (log-decays ~-0.05, beta ~0.5) M underflows to 0 within a slice."""
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    gk = (1, T, H, D) if op == "kda" else (1, T, H)
    g, beta = F.logsigmoid(r(*gk) + 3.0), torch.sigmoid(r(1, T, H))
    if carried:
        g, beta = g * 4e-4, beta * 0.02
    x = dict(q=r(1, T, H, D), k=r(1, T, H, D), v=r(1, T, H, D), g=g, beta=beta)
    x = {n: t if n == "g" and op == "kda" else t.bfloat16() for n, t in x.items()}  # KDA takes fp32 log-decays
    x["h0"] = r(1, H, D, D) * 0.1
    return x


def _run(op: str, x: dict[str, torch.Tensor], group) -> tuple[torch.Tensor, torch.Tensor]:
    fn = kda if op == "kda" else gated_delta_rule
    return fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["h0"], output_final_state=True,
              use_qk_l2norm=True, cp_group=group)


def _fwd_bwd(op, x, s, group, cot_o, cot_f, last: bool):
    """o, final state and the gradients of sum(o * cot_o) (+ sum(final * cot_f) on the last rank)."""
    leaves = {n: (t if n == "h0" else t[:, s]).detach().requires_grad_() for n, t in x.items()}
    o, f = _run(op, leaves, group)
    loss = (o.float() * cot_o).sum()
    if last:
        loss = loss + (f * cot_f).sum()
    loss.backward()
    grads = {f"d{n}": t.grad for n, t in leaves.items()}
    return {"o": o.detach(), "final_state": f.detach(), **grads}


def _rel(got: dict, want: dict, s: slice, group) -> dict[str, float]:
    """Relative Frobenius errors of this rank's results against the whole-sequence ones, over all ranks: sliced
    tensors by their squared norms summed over the ranks; the final state (the same on every rank) counted once;
    the initial state's gradient summed over the ranks first."""
    sliced = [n for n in got if n not in ("final_state", "dh0")]
    sums = torch.zeros(2 * len(sliced), dtype=torch.float64, device=got["o"].device)
    for i, n in enumerate(sliced):
        w = want[n][:, s].double()
        sums[2 * i], sums[2 * i + 1] = (got[n].double() - w).norm() ** 2, w.norm() ** 2
    dist.all_reduce(sums, group=group)
    dh0 = got["dh0"].clone()
    dist.all_reduce(dh0, group=group)
    out = {n: (sums[2 * i] / sums[2 * i + 1].clamp_min(1e-300)).sqrt().item() for i, n in enumerate(sliced)}
    for n, t in (("final_state", got["final_state"]), ("dh0", dh0)):
        w = want[n].double()
        out[n] = ((t.double() - w).norm() / w.norm().clamp_min(1e-300)).item()
    return out


def _time(fn, rep: int, group) -> tuple[float, float]:
    """(median wall ms between barriers, median CUDA-event ms of the slowest rank) of fn()."""
    walls, gpus = [], []
    cuda = DEVICE == "cuda"
    for _ in range(rep):
        dist.barrier(group)
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        fn()
        if cuda:
            b.record()
            torch.cuda.synchronize()
        dist.barrier(group)
        walls.append((time.perf_counter() - t0) * 1e3)
        gpus.append(a.elapsed_time(b) if cuda else walls[-1])
    gpu = torch.tensor([statistics.median(gpus)], device=DEVICE)
    dist.all_reduce(gpu, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(walls), gpu.item()


def _time_graph(fn, rep: int, group) -> tuple[float | None, str | None]:
    """(median ms of one replay of fn() captured as one CUDA graph, forward, backward and collectives together, the
    slowest rank's; None and why where it cannot be captured). Replays are timed between barriers by CUDA events:
    the GPU time of the call without its host, as the kernel benches' graph-replay columns."""
    if DEVICE != "cuda":
        return None, "not on CUDA"
    try:
        graph = capture_graph(fn)
    except RuntimeError as e:  # a backend or collective that cannot be captured
        torch.cuda.synchronize()
        return None, str(e).splitlines()[0][:200]
    times = []
    for _ in range(rep):
        dist.barrier(group)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    dist.barrier(group)
    t = torch.tensor([statistics.median(times)], device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    del graph
    return t.item(), None


def _calls(op: str, a, group, carried: bool = False):
    """(the whole sequence's fwd+bwd, this rank's CP fwd+bwd, this rank's slice) on fresh inputs from the seed, the
    same on every call (carried: `_inputs`)."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    T = a.seq_len // R
    s, last = slice(rank * T, (rank + 1) * T), rank == R - 1
    x = _inputs(op, a.seq_len, a.heads, a.dim, a.seed, DEVICE, carried)
    gen = torch.Generator(device=DEVICE).manual_seed(a.seed + 1)
    cot_o = torch.randn(1, a.seq_len, a.heads, a.dim, device=DEVICE, generator=gen)
    cot_f = torch.randn(1, a.heads, a.dim, a.dim, device=DEVICE, generator=gen)
    run_one = lambda: _fwd_bwd(op, x, slice(None), None, cot_o, cot_f, True)  # noqa: E731
    run_cp = lambda: _fwd_bwd(op, x, s, group, cot_o[:, s], cot_f, last)  # noqa: E731
    return run_one, run_cp, s


def _op_row(op: str, a, group) -> dict:
    """One op: CP R against the whole sequence on one GPU, agreement and eager time."""
    R = dist.get_world_size(group)
    run_one, run_cp, s = _calls(op, a, group, carried=True)
    carried = _rel(run_cp(), run_one(), s, group)
    run_one, run_cp, s = _calls(op, a, group)
    err = _rel(run_cp(), run_one(), s, group)
    one, cp = _time(run_one, a.rep, group), _time(run_cp, a.rep, group)
    ok = all(v <= BARS.get(n, GRAD_BAR) for e in (err, carried) for n, v in e.items())
    return dict(op=op, ranks=R, seq_len=a.seq_len, heads=a.heads, dim=a.dim, errors=err, errors_carried=carried,
                pass_=ok, one_gpu_ms=one[0], one_gpu_event_ms=one[1], cp_ms=cp[0], cp_event_ms=cp[1],
                ratio=cp[0] / one[0],
                one_gpu_graph_ms=None, cp_graph_ms=None, graph_ratio=None, graph_note="--no-graph")


def _add_graph_times(row: dict, a, group) -> None:
    """The row's CUDA-graph replay times, after every op's eager row (a capture that fails cannot spoil those)."""
    run_one, run_cp, _ = _calls(row["op"], a, group)
    one, why_one = _time_graph(run_one, a.rep, group)
    cp, why_cp = _time_graph(run_cp, a.rep, group)
    row.update(one_gpu_graph_ms=one, cp_graph_ms=cp, graph_ratio=cp / one if one and cp else None,
               graph_note=why_one or why_cp)


def _profile(op: str, a, group, steps: int = 5) -> str:
    """Markdown lines (rank 0; '' elsewhere) of every rank's kernel ms in one CP fwd+bwd against the whole
    sequence's on one GPU divided by the ranks."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    run_one, run_cp, _ = _calls(op, a, group)

    def rows(fn) -> dict[str, float]:
        return {name[:60]: us / 1e3 for name, us, _ in kernel_table(fn, steps)}

    def synced_cp():  # each profiled call starts with every rank at a barrier, the GPU idle
        dist.barrier(group)
        torch.cuda.synchronize()
        run_cp()

    mine = rows(synced_cp)
    one = rows(run_one) if rank == 0 else {}
    every = [None] * R
    dist.all_gather_object(every, mine, group=group)
    if rank != 0:
        return ""
    names = sorted(set(one) | {n for r in every for n in r}, key=lambda n: -max([one.get(n, 0) / R] +
                                                                                 [r.get(n, 0) for r in every]))
    comm = lambda r: sum(ms for n, ms in r.items() if n.startswith("nccl"))  # noqa: E731
    lines = [f"{op}: kernel ms a call (profiler, {steps} calls), one GPU on the whole sequence / {R} against each "
             "CP rank", "", "| kernel | one GPU / R | " + " | ".join(f"rank {r}" for r in range(R)) + " |",
             "|---|---|" + "---|" * R,
             "| **all but collectives** | " + f"{(sum(one.values()) - comm(one)) / R:.3f} | " +
             " | ".join(f"{sum(r.values()) - comm(r):.3f}" for r in every) + " |",
             "| **collectives (waits included)** | - | " + " | ".join(f"{comm(r):.3f}" for r in every) + " |"]
    for n in names:
        lines.append(f"| {n} | {one.get(n, 0) / R:.3f} | " + " | ".join(f"{r.get(n, 0):.3f}" for r in every) + " |")
    return "\n".join(lines + [""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=32768, help="tokens of the whole sequence (default 32768)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128, help="key = value head dim")
    p.add_argument("--rep", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ops", default="gdn,kda")
    p.add_argument("--no-graph", dest="graph", action="store_false",
                   help="skip the CUDA-graph replay timing (eager wall and CUDA-event times only)")
    p.add_argument("--profile", action="store_true", help="also profile.md: each rank's kernels by name against "
                   "the whole sequence's on one GPU (CUDA only)")
    p.add_argument("--out", default="out/cp")
    a = p.parse_args(argv)
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    rank, R = dist.get_rank(), dist.get_world_size()
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    group = dist.group.WORLD
    if a.seq_len % R:
        raise SystemExit(f"--seq-len: expected a multiple of the {R} ranks, got {a.seq_len}")
    rows = [_op_row(op, a, group) for op in a.ops.split(",")]
    if a.graph:
        for row in rows:
            _add_graph_times(row, a, group)
    prof = [_profile(op, a, group) for op in a.ops.split(",")] if a.profile and DEVICE == "cuda" else []
    if rank == 0:
        name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
        lines = [f"{name} x {R}, torch {torch.__version__}, bf16, B1 T{a.seq_len} "
                 f"H{a.heads} D{a.dim}, l2norm, initial state", "",
                 "| op | worst rel. error vs CP 1 (tensor) | the same, state carried | pass | "
                 "1 GPU fwd+bwd ms (event) | "
                 f"CP {R} fwd+bwd ms (event) | CP {R} / 1 GPU | 1 GPU graph ms | CP {R} graph ms | "
                 f"CP {R} / 1 GPU (graph) |", "|---|---|---|---|---|---|---|---|---|---|"]
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        for r in rows:
            worst = [max(e, key=lambda n: e[n] / BARS.get(n, GRAD_BAR)) for e in (r["errors"], r["errors_carried"])]
            lines.append(f"| {r['op']} | {r['errors'][worst[0]]:.2e} ({worst[0]}) | "
                         f"{r['errors_carried'][worst[1]]:.2e} ({worst[1]}) | {'PASS' if r['pass_'] else 'FAIL'} | "
                         f"{r['one_gpu_ms']:.2f} ({r['one_gpu_event_ms']:.2f}) | {r['cp_ms']:.2f} "
                         f"({r['cp_event_ms']:.2f}) | {r['ratio']:.2f} | {fmt(r['one_gpu_graph_ms'], '.2f')} | "
                         f"{fmt(r['cp_graph_ms'], '.2f')} | {fmt(r['graph_ratio'], '.2f')} |")
        lines += [f"{r['op']}: no graph replay ({r['graph_note']})" for r in rows if r["graph_note"]]
        table = "\n".join(lines)
        print(table, flush=True)
        os.makedirs(a.out, exist_ok=True)
        atomic_write_text(os.path.join(a.out, "cp.md"), table + "\n")
        atomic_write_text(os.path.join(a.out, "cp.json"), json.dumps(rows, indent=1))
        if prof:
            atomic_write_text(os.path.join(a.out, "profile.md"), "\n".join(prof))
    ok = all(r["pass_"] for r in rows)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
