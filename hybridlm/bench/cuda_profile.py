"""Per-kernel CUDA times of a step, as the torch profiler tables them (`--profile` of bench kernels and layers)."""

from __future__ import annotations

import torch


def profile_steps(step, steps: int) -> torch.profiler.profile:
    """Run step() once to warm up (compile, autotune), then `steps` more calls under the CUDA profiler."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof


def print_kernel_times(label: str, step, steps: int = 3) -> None:
    """Print the CUDA time per kernel of `steps` calls of step(), after one warm-up call."""
    prof = profile_steps(step, steps)
    print(f"--- {label}: CUDA time per kernel, {steps} forward+backward steps", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
