"""Per-kernel CUDA times of a step, as the torch profiler tables them (`--profile` of bench kernels and layers)."""

from __future__ import annotations

import torch


def print_kernel_times(label: str, step, steps: int = 3) -> None:
    """Run step() once to warm up (compile, autotune), then print the CUDA time per kernel of `steps` more calls."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    print(f"--- {label}: CUDA time per kernel, {steps} forward+backward steps", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
