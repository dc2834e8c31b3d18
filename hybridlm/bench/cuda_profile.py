"""Per-kernel CUDA times of a step, as the torch profiler tables them (`--profile` of bench kernels and layers), and
a call captured as a CUDA graph (the benches' graph-replay times)."""

from __future__ import annotations

import torch


def capture_graph(fn, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """fn() captured as a CUDA graph, after `warmup` calls on a side stream (capture needs the allocator and any
    lazy initialisation done off the default stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def profile_steps(step, steps: int) -> torch.profiler.profile:
    """Run step() once to warm up (compile, autotune), then `steps` more calls under the CUDA profiler."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof


def busy_ms(step, steps: int = 5) -> float:
    """GPU time of one call of step() (ms): how long at least one of its kernels runs, the union of their intervals
    over `steps` profiled calls (after a warm-up call), divided by `steps`. Kernels one after another add up, as in
    the summed kernel time; kernels that run side by side on two streams count once. The host's launch gaps are
    left out."""
    prof = profile_steps(step, steps)
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    return union_length(spans) / steps / 1e3


def union_length(spans: list[tuple[float, float]]) -> float:
    """Length of the union of the intervals (start, end): overlaps count once."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return busy


def kernel_rows(prof: torch.profiler.profile, steps: int) -> list[tuple[str, float, float]]:
    """(kernel name, us per step, launches per step) of every CUDA kernel the profile saw, largest first."""
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = e.cuda_time_total
        if t > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            rows.append((e.key, t / steps, e.count / steps))
    return sorted(rows, key=lambda r: -r[1])


def kernel_table(step, steps: int = 5) -> list[tuple[str, float, float]]:
    """kernel_rows of `steps` calls of step(), after one warm-up call."""
    return kernel_rows(profile_steps(step, steps), steps)


def print_kernel_times(label: str, step, steps: int = 3) -> list[tuple[str, float, float]]:
    """Print every kernel's CUDA time per step (us) and launches per step of `steps` calls of step(), after one
    warm-up call, with the total; returns the rows. All rows, not the profiler's top few: comparing two layers
    needs the small kernels too (they add up)."""
    rows = kernel_table(step, steps)
    print(f"--- {label}: CUDA time per kernel and step ({steps} steps), total {sum(r[1] for r in rows):.1f} us",
          flush=True)
    for name, us, n in rows:
        print(f"{us:10.1f} us {n:6.1f}x  {name[:110]}", flush=True)
    return rows
