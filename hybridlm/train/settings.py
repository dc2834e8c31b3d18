"""The flags of `hybridlm train`, their defaults and their checks, and the CPU threads of a run.

Non-standard here: every range check of a flag lives in `check_args`, run once the preset's defaults are filled
in, so each bad value gets one line naming the flag, what it accepts and what it got (a TrainError: exit 2).
"""

from __future__ import annotations

import argparse
import math
import os

import torch

from .errors import TrainError
from .presets import TRAIN_DEFAULTS, TrainDefaults

DEFAULT_OUT = os.path.join("runs", "train")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--preset", default=None,
                   help=f"model preset: {', '.join(TRAIN_DEFAULTS)} or any other `hybridlm info` preset name "
                        "(default: cpu-tiny on CPU, gpu-30m on GPU)")
    g.add_argument("--config", default=None, help="HybridConfig JSON file (overrides --preset)")
    g = p.add_argument_group("data")
    g.add_argument("--data", nargs="+", default=None,
                   help="text files, folders of .txt/.md/.jsonl, or .jsonl files with a \"text\" field "
                        "(default: the bundled Shakespeare)")
    g.add_argument("--tokenizer", default="bytes", help="'bytes' (UTF-8 bytes, vocab 256) or a tokenizer.json path")
    g.add_argument("--val-fraction", type=float, default=0.02, help="held-out tail of each document (default 0.02)")
    g.add_argument("--packing", choices=("auto", "flat"), default=None,
                   help="flat: every micro-batch as one [1, B*T] row with cu_seqlens (one forward call: the kernels "
                        "and varlen attention take the documents); auto: rows without a document boundary as a plain "
                        "[b, T] batch, the others flattened (on the CPU, whole rows then skip the per-document loops "
                        "of the PyTorch paths). Same math either way. Default: flat on CUDA, auto on the CPU")
    g = p.add_argument_group("schedule")
    g.add_argument("--seq-len", type=int, default=None, help="tokens per row (preset default: 256 on CPU)")
    g.add_argument("--batch-size", type=int, default=None, help="rows per micro-batch per rank")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (AdamW)")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as a fraction of --lr")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay of matrices (default 0.1)")
    g.add_argument("--warmup", type=int, default=None, help="linear warmup steps")
    g.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default from the preset)")
    g.add_argument("--max-tokens", type=float, default=None,
                   help="train for this many tokens instead of --max-steps (e.g. 2e6)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="clip the gradient norm to this (0: off)")
    g = p.add_argument_group("evaluation and output")
    g.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps (and at the end)")
    g.add_argument("--log-every", type=int, default=None,
                   help="bring the train loss and gradient norm to the host every N steps (and at eval/save steps "
                        "and the end); metrics.jsonl still gets one record per step (default: 1 on CPU, 10 on GPU, "
                        "where each copy to the host waits for the GPU)")
    g.add_argument("--eval-tokens", type=int, default=None,
                   help="val tokens per evaluation (default: 32768 on CPU, up to 1M on GPU)")
    g.add_argument("--save-every", type=int, default=None, help="checkpoint every N steps (and at the end; 0: end)")
    g.add_argument("--keep", type=int, default=3, help="checkpoints to keep (0: all)")
    g.add_argument("--out", default=DEFAULT_OUT, help=f"run folder (default {DEFAULT_OUT})")
    g.add_argument("--resume", nargs="?", const="", default=None, metavar="PATH",
                   help="continue from a checkpoint folder or a run folder's latest (no PATH: --out's latest; "
                        "a rerun into the same --out continues by itself)")
    g.add_argument("--fresh", action="store_true",
                   help="start over in --out: the earlier run there (checkpoints, metrics, run.json, ...) is moved "
                        "aside to OUT.prev-DATE")
    g.add_argument("--sample-tokens", type=int, default=400, help="tokens of the sample printed at the end")
    g.add_argument("--prompt", default=None, help="prompt of the final sample")
    g.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: greedy)")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bar (log lines only); without a terminal on stderr, plain progress lines instead")
    g = p.add_argument_group("system")
    g.add_argument("--seed", type=int, default=0, help="seed of the init, the data order and the sample")
    g.add_argument("--device", default="auto", help="auto (a GPU if one is visible), cpu, cuda, cuda:N")
    g.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="auto: bf16 autocast on GPU, fp32 on CPU")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block in the backward (less memory, ~30%% more compute)")
    g.add_argument("--recompute-linear", action="store_true",
                   help="the linear layers' recurrences keep only their inputs and rerun their forward in the "
                   "backward (less memory than the default, far less extra compute than --activation-checkpointing)")
    g.add_argument("--fsdp-min-unit-params", type=float, default=5e7, metavar="N",
                   help="FSDP2 (torchrun): shard consecutive blocks together until a unit holds N parameters "
                   "(default 5e7; 0: one unit per block). Each unit costs host time every step, which a small "
                   "model's blocks do not hide; a large model's blocks pass N one by one")
    g.add_argument("--no-reshard-after-forward", action="store_true",
                   help="FSDP2 (torchrun): keep each block's gathered parameters from the forward to the backward "
                   "(one all-gather per block a step instead of two; the whole model's parameters stay in memory "
                   "on every GPU)")
    g.add_argument("--context-parallel", type=int, default=1, metavar="N",
                   help="torchrun: split each sequence over N ranks (N divides the number of ranks and --seq-len); "
                   "a 2-D mesh of ranks / N data x N context ranks, FSDP2 over the data ranks (default 1: off)")
    g.add_argument("--profile-steps", default=None, metavar="FIRST:COUNT",
                   help="profile COUNT optimizer steps from step FIRST with torch.profiler: a Chrome trace and a "
                   "summary (GPU busy / NCCL / idle time a step, top ops) per rank under OUT/profile")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads of each process (default: on CPU the cores this process may run on, "
                   "os.sched_getaffinity; on GPU PyTorch's own, which torchrun sets to 1)")


def cpu_threads() -> int:
    """The cores this process may run on (its affinity mask, which taskset, cgroups' cpusets and container limits
    set). Not the load average: right after a pip install it reads busy on an idle machine, and the main job then
    ran at 1 thread on 2 cores, 1.7x slower."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def set_threads(threads: int | None, device: torch.device) -> None:
    """--threads on any device (a GPU run under torchrun, which sets 1, may ask for more); without it, on CPU the
    cores this process may run on, on GPU PyTorch's setting as it is."""
    if threads is not None and threads < 1:
        raise TrainError(f"--threads: expected >= 1, got {threads}")
    if threads is not None:
        torch.set_num_threads(threads)
    elif device.type == "cpu":
        torch.set_num_threads(cpu_threads())


def fill_defaults(args, defaults: TrainDefaults, device: torch.device) -> None:
    """The preset's run settings and the device's defaults for every flag left unset."""
    if args.packing is None:  # on CUDA one call a step: two calls cost the small presets their host time twice
        args.packing = "flat" if device.type == "cuda" else "auto"
    if args.eval_tokens is None:
        args.eval_tokens = 32768 if device.type == "cpu" else 1 << 20
    for name in ("seq_len", "batch_size", "lr", "warmup", "eval_every", "save_every"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(defaults, name))
    if args.log_every is None:
        args.log_every = 1 if device.type == "cpu" else 10


def _fail(flag: str, expected: str, got) -> TrainError:
    return TrainError(f"{flag}: expected {expected}, got {got:g}" if isinstance(got, float)
                      else f"{flag}: expected {expected}, got {got}")


# flag -> (test of the value, what it accepts); checked when the value is set (None: the preset's default)
_RANGES = {
    "--val-fraction": (lambda v: 0 < v < 1, "a fraction in (0, 1)"),
    "--max-steps": (lambda v: v >= 1, ">= 1"),
    "--max-tokens": (lambda v: 0 < v < math.inf, "a number of tokens > 0"),
    "--lr": (lambda v: 0 < v < math.inf, "a finite learning rate > 0"),
    "--min-lr-ratio": (lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
    "--weight-decay": (lambda v: 0 <= v < math.inf, "a finite value >= 0"),
    "--warmup": (lambda v: v >= 0, ">= 0"),
    "--grad-clip": (lambda v: 0 <= v < math.inf, "a finite norm >= 0 (0: off)"),
    "--seq-len": (lambda v: v >= 2, ">= 2"),
    "--batch-size": (lambda v: v >= 1, ">= 1"),
    "--grad-accum": (lambda v: v >= 1, ">= 1"),
    "--eval-every": (lambda v: v >= 0, ">= 0 (0: only at the end)"),
    "--save-every": (lambda v: v >= 0, ">= 0 (0: only at the end)"),
    "--log-every": (lambda v: v >= 1, ">= 1"),
    "--eval-tokens": (lambda v: v >= 1, ">= 1"),
    "--keep": (lambda v: v >= 0, ">= 0 (0: keep all)"),
    "--sample-tokens": (lambda v: v >= 0, ">= 0"),
    "--temperature": (lambda v: 0 <= v < math.inf, "a finite temperature >= 0 (0: greedy)"),
    "--threads": (lambda v: v >= 1, ">= 1"),
    "--fsdp-min-unit-params": (lambda v: 0 <= v < math.inf, ">= 0"),
}


def check_args(args) -> None:
    """Every flag's range, in one place (after `fill_defaults`); NaN fails every test."""
    for flag, (ok, expected) in _RANGES.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not ok(value):
            raise _fail(flag, expected, value)
    if args.seq_len % args.context_parallel:
        raise TrainError(f"--seq-len: expected a multiple of --context-parallel {args.context_parallel} (each rank "
                         f"runs an equal slice), got {args.seq_len}")
    if args.fresh and args.resume is not None:
        raise TrainError("--fresh: starts over, --resume continues; pass one of them")
