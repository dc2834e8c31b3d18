"""`hybridlm train --profile-steps FIRST:COUNT`: torch.profiler over a few optimizer steps, written per rank.

Non-standard here: besides the Chrome trace (open it in Perfetto) each rank writes a short text summary that answers
the first question about a slow step without a trace viewer: how much of the wall time the GPU was busy at all
(the union of its kernels' intervals), how much of that was collectives (NCCL kernels), how much the host spent,
and the ops that took the most device and host time. Under FSDP a step whose GPU is busy half the time is host- or
communication-bound; one whose GPU is busy all the time is compute-bound, and more GPUs only add collectives.
"""

from __future__ import annotations

import os
import time

import torch

from ..files import atomic_write_text


def parse_profile_steps(spec: str | None) -> tuple[int, int] | None:
    """'FIRST:COUNT' -> (FIRST, COUNT): profile COUNT steps starting at step FIRST (0-based, after FIRST steps ran)."""
    if spec is None:
        return None
    parts = spec.split(":")
    try:
        first, count = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--profile-steps: expected FIRST:COUNT (e.g. 10:3), got {spec!r}") from None
    if first < 0 or count < 1:
        raise ValueError(f"--profile-steps: expected FIRST >= 0 and COUNT >= 1, got {spec!r}")
    return first, count


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (microseconds)."""
    total, end = 0.0, -float("inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


class StepProfiler:
    """Call `before(step)` and `after(step)` around every optimizer step; steps [first, first + count) are
    profiled, then `folder/rank{R}.trace.json.gz` and `folder/rank{R}.txt` are written."""

    def __init__(self, folder: str, first: int, count: int, rank: int, device: torch.device):
        self.folder, self.first, self.count, self.rank, self.device = folder, first, count, rank, device
        self.prof = None
        self.t0 = 0.0
        self.written: str | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before(self, step: int) -> None:
        if step != self.first:
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._sync()
        self.prof = torch.profiler.profile(activities=acts)
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def after(self, step: int) -> None:
        if self.prof is None or step != self.first + self.count - 1:
            return
        self._sync()
        wall_us = (time.perf_counter() - self.t0) * 1e6
        self.prof.__exit__(None, None, None)
        os.makedirs(self.folder, exist_ok=True)
        self.prof.export_chrome_trace(os.path.join(self.folder, f"rank{self.rank}.trace.json.gz"))
        text = self.summary(wall_us)
        path = os.path.join(self.folder, f"rank{self.rank}.txt")
        atomic_write_text(path, text)
        self.written = path
        self.prof = None

    def summary(self, wall_us: float) -> str:
        events = self.prof.events()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        spans = [(e.time_range.start, e.time_range.end) for e in kernels]
        nccl = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()]
        compute = [s for s, e in zip(spans, kernels) if "nccl" not in e.name.lower()]
        n = self.count
        busy, busy_c, busy_n = _busy_us(spans), _busy_us(compute), _busy_us(nccl)
        overlap = busy_c + busy_n - busy  # time compute and collectives ran at once
        per = lambda us: f"{us / n / 1e3:9.2f} ms/step"  # noqa: E731
        lines = [f"rank {self.rank}: steps {self.first}..{self.first + n - 1} ({n} steps)",
                 f"wall                     {per(wall_us)}"]
        ka = self.prof.key_averages()
        if self.device.type == "cuda":
            lines += [
                f"GPU busy (any kernel)    {per(busy)}  ({100 * busy / max(wall_us, 1e-9):.0f}% of wall)",
                f"  compute kernels        {per(busy_c)}",
                f"  NCCL kernels           {per(busy_n)}  (overlapped with compute: {per(overlap).strip()})",
                f"GPU idle                 {per(max(wall_us - busy, 0.0))}",
                "",
                "top ops by device time:", ka.table(sort_by="self_device_time_total", row_limit=20,
                                                           max_name_column_width=70), ""]
        else:
            lines.append("")
        lines += ["top ops by host time:", ka.table(sort_by="self_cpu_time_total", row_limit=20,
                                                     max_name_column_width=70)]
        return "\n".join(lines) + "\n"
