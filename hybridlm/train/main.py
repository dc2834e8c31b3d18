"""`hybridlm train`: the training job, from a 2-core CPU (no arguments) to many GPUs (torchrun + FSDP2).

With no arguments: the `cpu-tiny` 3:1 hybrid (or `gpu-30m` on a GPU) on the bundled Shakespeare, byte tokens,
output under runs/train. Every flag has a help line; `hybridlm train --help` lists them.

Non-standard here:
- Packing: documents are packed into rows of --seq-len; a row that holds a document boundary is run flattened with
  cu_seqlens (see data.Batch.pieces), so documents never see each other.
- The loss of a step is the sum over its micro-batches of token losses divided by the step's total target count
  (all ranks), so grad accumulation and sharding give the same gradient as one big batch.
- No step waits for the device: the global target count and the number of forward calls FSDP needs on every rank
  come from the data layout (every rank holds the whole corpus and knows every rank's rows: `data.RowLayout`),
  and the loss sums and gradient norms stay on the device until a flush (every --log-every steps, before an eval
  or a save, and at the end: one all-reduce of the loss sums, one copy to the host). metrics.jsonl keeps one record
  per step; the tokens/s of a step is the mean over the steps between two flushes.
- Val loss is reported in nats per byte of text (for the byte tokenizer: nats per token) with the add-one unigram
  of the training split beside it, and perplexity per token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import statistics
import sys
import time

import torch

from ..files import atomic_write, atomic_write_text
from ..model.tokenizer import tokenizer_from_spec
from ..ops.offsets import remember_offsets
from . import checkpoint as ckpt
from .data import IGNORE, RowLayout, RowSampler, load_corpus, make_batch, unigram_nats
from .errors import TrainError
from .optim import autocast, build_optimizer, lr_at, set_lr
from .parallel import (
    Dist,
    all_reduce_sum,
    apply_activation_checkpointing,
    apply_fsdp,
    barrier,
    clip_grad_norm,
    dcp_load,
    dcp_save,
    full_model_state,
    init_distributed,
)
from .presets import TRAIN_DEFAULTS, build_config
from .profile import StepProfiler, parse_profile_steps

DEFAULT_OUT = os.path.join("runs", "train")
TPS_WARMUP_STEPS = 10  # summary.json's tokens_per_s: median over this process's steps after the first ten (compilation)


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
                   help="continue from a checkpoint folder or a run folder's latest (no PATH: --out's latest)")
    g.add_argument("--sample-tokens", type=int, default=400, help="tokens of the sample printed at the end")
    g.add_argument("--prompt", default=None, help="prompt of the final sample")
    g.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: greedy)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
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


def _log(dist: Dist, msg: str, bar=None) -> None:
    if not dist.is_main:
        return
    if bar is not None:
        bar.write(msg)
    else:
        print(msg, flush=True)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


class MetricsLog:
    """metrics.jsonl: one JSON object per line; on resume, records past the resumed step are dropped."""

    def __init__(self, path: str, enabled: bool, resume_step: int | None):
        self.path, self.enabled = path, enabled
        self.records: list[dict] = []
        if enabled and resume_step is not None and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    with contextlib.suppress(json.JSONDecodeError):
                        r = json.loads(line)
                        if r.get("step", 0) <= resume_step:
                            self.records.append(r)
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in self.records))
        elif enabled:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            open(path, "w").close()

    def add(self, **rec) -> None:
        if not self.enabled:
            return
        self.records.append(rec)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")


def plot_curve(records: list[dict], unigram: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [(r["step"], r["loss_per_byte"]) for r in records if "loss" in r]
    va = [(r["step"], r["val_nats_per_byte"]) for r in records if "val_nats_per_byte" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if tr:
        ax.plot(*zip(*tr), lw=0.8, alpha=0.8, label="train")
    if va:
        ax.plot(*zip(*va), "o-", label="val")
    ax.axhline(unigram, color="gray", ls="--", lw=1, label=f"unigram {unigram:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110))
    plt.close(fig)


def _forward_calls(batch, packing: str, n_calls: int):
    """The (input_ids, targets, cu_seqlens) calls of a micro-batch, padded to `n_calls`. Under FSDP every rank must
    make the same number of forward/backward calls (each one all-gathers and reduce-scatters every block), and with
    "auto" packing a batch takes one or two: `n_calls` is the largest count of any rank's batch, which every rank
    works out from the data layout (`RowLayout.n_calls` of each rank's rows: no communication). A rank with fewer
    adds a dummy call (one row, every target ignored: zero loss and zero gradient, but the same collectives), so most
    steps stay at one call per rank."""
    calls = batch.pieces(packing)
    if len(calls) > n_calls:
        raise RuntimeError(f"internal: this batch takes {len(calls)} forward calls but the data layout said at most "
                           f"{n_calls} (RowLayout.n_calls disagrees with Batch.pieces)")
    while len(calls) < n_calls:
        ids = batch.input_ids.view(-1)[: batch.seq_len].view(1, -1)
        calls.append((ids, torch.full_like(ids, IGNORE), None))
    return calls


def _to_device(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """A host tensor onto `device` without blocking the host: pinned first on CUDA (an asynchronous copy from
    pageable memory may wait for the device)."""
    if t is None or t.device == device:
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _offsets_to_device(cu: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """cu_seqlens onto `device`, with its host values recorded (hybridlm.ops.offsets), so that the varlen ops of
    every layer read them from the host copy instead of waiting for the device."""
    if cu is None:
        return None
    return remember_offsets(_to_device(cu, device), cu)


def _loss_sum(model, ids, tg, cu, device, bf16) -> torch.Tensor:
    """The sum of token losses of one forward call: the model's head and loss fused (hybridlm.ops.linear_ce), so
    the [tokens, vocab] logits are never held; inside the forward, so FSDP has the head's weight gathered."""
    with autocast(device, bf16):
        return model(ids, cu_seqlens=cu, targets=tg).loss


@torch.no_grad()
def evaluate(model, stream, args, dist: Dist, device, bf16, layout: RowLayout | None = None) -> tuple[float, int]:
    """Sum of val token losses / count over the first --eval-tokens of the val split (rows split over ranks).
    The sums stay on the device until the end (one all-reduce and one host copy per evaluation)."""
    was_training = model.training
    model.eval()
    T = args.seq_len
    layout = layout or RowLayout.of(stream, T)
    n_rows = min(stream.n_rows(T), max(1, args.eval_tokens // T))
    n_rows = max(dist.world, n_rows - n_rows % dist.world)  # the same number of batches on every rank
    all_rows = [r % stream.n_rows(T) for r in range(n_rows)]
    per_rank = [all_rows[k :: dist.world] for k in range(dist.world)]
    tot = torch.zeros(2, dtype=torch.float64, device=device)
    eb = args.batch_size * 4  # no activations kept: bigger batches
    for i in range(0, len(per_rank[dist.rank]), eb):
        b = make_batch(stream, per_rank[dist.rank][i : i + eb], T)
        n_calls = max(layout.n_calls(rows[i : i + eb], args.packing) for rows in per_rank)
        for ids, tg, cu in _forward_calls(b, args.packing, n_calls):
            ids, tg, cu = _to_device(ids, device), _to_device(tg, device), _offsets_to_device(cu, device)
            tot[0] += _loss_sum(model, ids, tg, cu, device, bf16).double()
            tot[1] += (tg != IGNORE).sum()
    all_reduce_sum(tot, dist)
    model.train(was_training)
    return float(tot[0] / tot[1].clamp(min=1)), int(tot[1])


@torch.no_grad()
def sample(model, tokenizer, prompt_ids: list[int], n: int, temperature: float, seed: int, max_len: int,
           device) -> list[int]:
    """Re-run the model on the growing sequence (no cache), temperature sampling with a fixed generator."""
    was_training = model.training
    model.eval()
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt_ids)
    for _ in range(n):
        x = torch.tensor([ids[-max_len:]], dtype=torch.long, device=device)
        logits = model(x).logits[0, -1].float().cpu()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=g))
        ids.append(nxt)
    model.train(was_training)
    return ids


def median_tokens_per_s(rates: list[float], warmup: int = TPS_WARMUP_STEPS) -> tuple[float | None, int]:
    """(median tokens/s over the steps after `warmup`, how many steps that is); at most half the steps are
    dropped; (None, 0) with no step."""
    kept = rates[min(warmup, len(rates) // 2):]
    return (statistics.median(kept) if kept else None), len(kept)


def _clip_grad_norm(model, max_norm: float, dist: Dist) -> torch.Tensor:
    """Clip the gradients to `max_norm` and return their total norm as a tensor on the device: under FSDP2 the
    norm of the sharded gradients is reduced over ranks once here (clipping needs it), and logging it later needs no
    second reduction and no wait for the device now."""
    return clip_grad_norm([p for p in model.parameters() if p.grad is not None], max_norm, dist)


def _oom_message(args, err) -> str:
    return (f"a micro-batch of {args.batch_size} x {args.seq_len} tokens does not fit in memory ({err}); "
            "lower --batch-size (raise --grad-accum to keep the same global batch), use --activation-checkpointing, "
            "or shorten --seq-len")


def _cpu_model(cfg, state: dict[str, torch.Tensor]):
    """A plain CPU HybridLM holding a full state dict (to export what FSDP trained)."""
    from hybridlm.model.hybrid import HybridLM

    m = HybridLM(cfg)
    m.load_state_dict(state, strict=not cfg.tie_word_embeddings)
    return m


def _finished(out: str, path: str, step: int, max_steps: int, dist: Dist) -> dict:
    """A resume of a run that already reached its last step: nothing is trained, evaluated or written; the summary
    is the one the run wrote (or, when it never got to write one, the step counts)."""
    summary = {"final_step": step, "max_steps": max_steps}
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
            summary = json.load(f)
    val = summary.get("final_val_nats_per_byte")
    _log(dist, f"the run in {out} is finished: {path} is step {step} of {max_steps}"
               f"{f', val {val:.4f} nats/byte' if isinstance(val, float) else ''}; nothing to do (to train "
               "further, resume with a larger --max-steps or --max-tokens)")
    return summary


def train(args) -> dict:
    """The training job; returns a summary dict (also written to OUT/summary.json)."""
    t_start = time.time()
    dist = init_distributed(args.device)
    device = dist.device
    set_threads(args.threads, device)
    bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
    if args.packing is None:  # on CUDA one call a step: two calls cost the small presets their host time twice
        args.packing = "flat" if device.type == "cuda" else "auto"

    cfg, preset_name, defaults = build_config(args.preset, args.config, device.type)
    if args.eval_tokens is None:
        args.eval_tokens = 32768 if device.type == "cpu" else 1 << 20
    for name in ("seq_len", "batch_size", "lr", "warmup", "eval_every", "save_every"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(defaults, name))
    if args.log_every is None:
        args.log_every = 1 if device.type == "cpu" else 10
    if args.fsdp_min_unit_params < 0:
        raise TrainError(f"--fsdp-min-unit-params: expected >= 0, got {args.fsdp_min_unit_params:g}")
    try:
        prof_steps = parse_profile_steps(args.profile_steps)
    except ValueError as e:
        raise TrainError(str(e)) from None
    if args.log_every < 1:
        raise TrainError(f"--log-every: must be >= 1, got {args.log_every}")
    if args.seq_len < 2:
        raise TrainError(f"--seq-len: must be >= 2, got {args.seq_len}")
    if args.batch_size < 1 or args.grad_accum < 1:
        raise TrainError("--batch-size and --grad-accum must be >= 1")
    if args.seq_len > cfg.max_position_embeddings:
        raise TrainError(f"--seq-len {args.seq_len} is longer than this model supports "
                         f"(max_position_embeddings = {cfg.max_position_embeddings} in {preset_name}); "
                         f"use --seq-len <= {cfg.max_position_embeddings} or a --config with a larger "
                         "max_position_embeddings")

    if cfg.hf_model_type:  # checkpoints are exported in that format: refuse now, not at the first save
        from ..model.hf import config_to_hf

        try:
            config_to_hf(cfg, cfg.hf_model_type)
        except ValueError as e:
            raise TrainError(f"{'--config' if args.config else '--preset'}: {e}; set \"hf_model_type\": null in the "
                             "config to save checkpoints in hybridlm's own format") from None
    try:
        tokenizer = tokenizer_from_spec(args.tokenizer)
    except (FileNotFoundError, ValueError) as e:
        raise TrainError(f"--tokenizer: {e}") from e
    if tokenizer.vocab_size > cfg.vocab_size:
        if args.config:
            raise TrainError(f"--tokenizer has {tokenizer.vocab_size} tokens but --config's vocab_size is "
                             f"{cfg.vocab_size}; raise vocab_size in the config")
        cfg.vocab_size = tokenizer.vocab_size
        cfg.validate()

    corpus = load_corpus(args.data, tokenizer, args.val_fraction)
    if corpus.val.n_rows(args.seq_len) < 1:
        raise TrainError(f"the val split ({corpus.val.n_tokens} tokens) is shorter than one row of --seq-len "
                         f"{args.seq_len}; raise --val-fraction, lower --seq-len, or give more --data")
    sampler = RowSampler(corpus.train.n_rows(args.seq_len), args.batch_size, args.seed, dist.rank, dist.world)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * dist.world
    if args.max_tokens is not None:
        max_steps = max(1, math.ceil(args.max_tokens / tokens_per_step))
    else:
        max_steps = args.max_steps if args.max_steps is not None else defaults.max_steps
    bytes_per_token = corpus.val.n_bytes / max(1, corpus.val.n_tokens)
    unigram = unigram_nats(corpus.train, corpus.val, cfg.vocab_size) / bytes_per_token

    # --- model ---
    from hybridlm.model.hybrid import HybridLM

    if args.recompute_linear:
        cfg.linear_recompute = True
    _seed_all(args.seed)
    model = HybridLM(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    if args.activation_checkpointing:
        apply_activation_checkpointing(model)
    if dist.enabled:
        apply_fsdp(model, bf16, reshard_after_forward=not args.no_reshard_after_forward,
                   min_unit_params=int(args.fsdp_min_unit_params))
    elif args.no_reshard_after_forward:
        raise TrainError("--no-reshard-after-forward: applies to FSDP2 runs under torchrun; this run has one process")
    fwd_model = torch.compile(model) if args.compile else model
    optimizer = build_optimizer(model, args.lr, args.weight_decay)

    # --- resume ---
    step, micro, tokens_seen, best_val = 0, 0, 0, math.inf
    resume_step = None
    if args.resume is not None:
        path = ckpt.resolve_resume(args.resume or args.out)
        state = ckpt.load_checkpoint(path)
        ts = state["train_state"]
        if ts.get("seq_len") != args.seq_len or ts.get("batch_size") != args.batch_size \
                or ts.get("world") != dist.world or ts.get("grad_accum") != args.grad_accum:
            raise TrainError(f"--resume: {path} was written with seq_len={ts.get('seq_len')}, batch_size="
                             f"{ts.get('batch_size')}, grad_accum={ts.get('grad_accum')}, world={ts.get('world')}; "
                             "resume with the same --seq-len, --batch-size, --grad-accum and number of ranks")
        if dist.enabled:
            dcp_load(os.path.join(path, "dcp"), model, optimizer)
        else:
            missing, unexpected = model.load_state_dict(state["model"], strict=False)
            tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
            if set(missing) - tied or unexpected:
                raise TrainError(f"--resume: {path} does not match the model (missing {missing}, unexpected "
                                 f"{unexpected}); use the --preset/--config it was trained with")
            optimizer.load_state_dict(state["optimizer"])
        step, micro, tokens_seen = ts["step"], ts["micro"], ts["tokens_seen"]
        best_val = ts.get("best_val", math.inf)
        rng = state["rng"]
        if dist.enabled:
            rpath = os.path.join(path, f"rng_rank{dist.rank}.pt")
            if os.path.exists(rpath):
                rng = torch.load(rpath, weights_only=True)
        ckpt.set_rng_state(rng)
        resume_step = step
        if step >= max_steps:
            return _finished(args.out, path, step, max_steps, dist)
        _log(dist, f"resumed from {path} at step {step}")

    if dist.is_main:
        os.makedirs(args.out, exist_ok=True)
        old_ckpts = os.path.join(args.out, ckpt.CKPT_DIR)
        if resume_step is None and os.path.isdir(old_ckpts) and os.listdir(old_ckpts):
            # a fresh run into a used folder: keep the earlier run's checkpoints, out of the way
            kept = f"{old_ckpts}.prev-{time.strftime('%Y%m%d-%H%M%S')}"
            os.rename(old_ckpts, kept)
            _log(dist, f"note: {args.out} held checkpoints of an earlier run; moved them to {kept} "
                       "(pass --resume to continue a run instead)")
    barrier(dist)
    metrics = MetricsLog(os.path.join(args.out, "metrics.jsonl"), dist.is_main, resume_step)
    if dist.is_main and resume_step is None:
        run_info = {"args": vars(args), "preset": preset_name, "config": cfg.to_dict(), "params": n_params,
                    "max_steps": max_steps, "device": str(device), "world": dist.world}
        atomic_write_text(os.path.join(args.out, "run.json"), json.dumps(run_info, indent=2))

    _log(dist, f"hybridlm train: {preset_name} ({n_params / 1e6:.2f}M params, layers {cfg.layer_types}), "
               f"{corpus.description}: {corpus.n_docs} documents, {corpus.train.n_tokens:,} train / "
               f"{corpus.val.n_tokens:,} val tokens ({tokenizer.name} tokenizer)")
    _log(dist, f"device {device} x{dist.world}, {'bf16 autocast' if bf16 else 'fp32'}, threads "
               f"{torch.get_num_threads()}, {max_steps} steps of {tokens_per_step:,} tokens "
               f"(batch {args.batch_size} x seq {args.seq_len} x accum {args.grad_accum} x {dist.world} rank(s)), "
               f"lr {args.lr:g} warmup {args.warmup} cosine, {args.packing} packing, "
               f"unigram baseline {unigram:.3f} nats/byte")

    def save(at_step: int) -> None:
        rng = ckpt.rng_state()
        train_state = {"step": at_step, "micro": micro, "tokens_seen": tokens_seen, "best_val": best_val,
                       "seq_len": args.seq_len, "batch_size": args.batch_size, "grad_accum": args.grad_accum,
                       "world": dist.world, "preset": preset_name, "tokenizer": tokenizer.name,
                       "max_steps": max_steps, "seed": args.seed}
        if dist.enabled:
            tag = f"dist{at_step}"
            if dist.is_main:
                ckpt.begin_checkpoint(args.out, at_step, tag)
            barrier(dist)
            tmp = os.path.join(args.out, ckpt.CKPT_DIR, f".tmp-{ckpt.step_name(at_step)}-{tag}")
            dcp_save(os.path.join(tmp, "dcp"), model, optimizer)
            torch.save(rng, os.path.join(tmp, f"rng_rank{dist.rank}.pt"))
            full = full_model_state(model, dist)
            barrier(dist)
            if dist.is_main:
                export = None
                if cfg.hf_model_type:
                    export = lambda folder: _cpu_model(cfg, full).save_pretrained(folder)  # noqa: E731
                ckpt.write_checkpoint_files(tmp, at_step, model_state=full, config_json=cfg.to_json(),
                                            optimizer_state=None, train_state=train_state, rng=rng, export=export)
                ckpt.commit_checkpoint(args.out, at_step, tmp, args.keep)
            barrier(dist)
        else:
            tmp = ckpt.begin_checkpoint(args.out, at_step)
            ckpt.write_checkpoint_files(
                tmp, at_step, model_state=None if cfg.hf_model_type else ckpt.plain_state_dict(model),
                config_json=cfg.to_json(), optimizer_state=optimizer.state_dict(), train_state=train_state, rng=rng,
                export=model.save_pretrained if cfg.hf_model_type else None)
            ckpt.commit_checkpoint(args.out, at_step, tmp, args.keep)

    val_layout = RowLayout.of(corpus.val, args.seq_len)

    def run_eval(at_step: int, bar=None) -> float:
        nonlocal best_val
        loss, count = evaluate(fwd_model, corpus.val, args, dist, device, bf16, val_layout)
        per_byte = loss / bytes_per_token
        best_val = min(best_val, per_byte)
        metrics.add(step=at_step, tokens=tokens_seen, val_loss=loss, val_nats_per_byte=per_byte,
                    val_ppl=math.exp(loss), unigram_nats_per_byte=unigram, val_tokens=count,
                    elapsed=time.time() - t_start)
        _log(dist, f"step {at_step}/{max_steps} | val {per_byte:.4f} nats/byte (ppl {math.exp(loss):.2f}/token) | "
                   f"unigram {unigram:.3f} | {unigram - per_byte:+.3f} below unigram | "
                   f"{time.time() - t_start:.0f}s", bar)
        return per_byte

    # --- loop ---
    profiler = None
    if prof_steps is not None:
        profiler = StepProfiler(os.path.join(args.out, "profile"), *prof_steps, dist.rank, device)
    from tqdm import tqdm

    bar = tqdm(total=max_steps, initial=step, disable=not dist.is_main or args.no_progress, unit="step",
               dynamic_ncols=True, file=sys.stderr)
    model.train()
    last_loss = math.nan
    ema_tps = None
    rates: list[float] = []  # tokens/s of each step this process ran
    val = math.nan
    layout = RowLayout.of(corpus.train, args.seq_len)
    # Host synchronisations: none in a step. The loss sums and gradient norms of the steps since the last flush
    # stay on the device (`pending`); a flush (every --log-every steps, before an eval or a save, and at the end)
    # all-reduces the loss sums in one call and copies them with the norms to the host in one transfer. The
    # step's target count (all ranks) and the number of forward calls FSDP needs come from the data layout.
    pending: list[dict] = []
    t_flush = time.time()  # the host and the device were last in step here

    def flush() -> None:
        nonlocal last_loss, ema_tps
        if not pending:
            return
        losses = torch.stack([p.pop("loss_sum") for p in pending])
        all_reduce_sum(losses, dist)
        norms = torch.stack([p.pop("grad_norm").to(torch.float64) for p in pending])
        host = torch.stack([losses, norms]).cpu().tolist()  # the one wait for the device
        now = time.time()
        span = max(now - t_flush, 1e-9)
        tps = len(pending) * tokens_per_step / span  # each step of the span gets the span's mean
        for i, (p, loss_sum, gn) in enumerate(zip(pending, *host)):
            last_loss = loss_sum / p.pop("n_tg")
            ema_tps = tps if ema_tps is None else 0.9 * ema_tps + 0.1 * tps
            rates.append(tps)
            metrics.add(step=p["step"], tokens=p["tokens"], loss=last_loss, loss_per_byte=last_loss / bytes_per_token,
                        lr=p["lr"], grad_norm=gn, tokens_per_s=tps, epoch=p["epoch"],
                        elapsed=t_flush + span * (i + 1) / len(pending) - t_start)
            if not math.isfinite(last_loss):
                raise TrainError(f"the loss became {last_loss} at step {p['step']}; lower --lr or raise --warmup")
        bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{ema_tps:,.0f}", lr=f"{pending[-1]['lr']:.2e}")
        pending.clear()

    def one_step() -> dict:
        """One optimizer step; returns its record for `pending`, the loss sum and the norm still on the device.
        Nothing here waits for the device (tests/train/test_train_gpu.py checks that under CUDA's sync debug mode)."""
        nonlocal step, micro, tokens_seen
        set_lr(optimizer, lr_at(step, lr=args.lr, warmup=args.warmup, total=max_steps, min_ratio=args.min_lr_ratio))
        # every rank's rows are known here: the global target count and FSDP's call counts need no communication
        rows = [[sampler.rows(m, r) for r in range(dist.world)] for m in range(micro, micro + args.grad_accum)]
        batches = [make_batch(corpus.train, rr[dist.rank], args.seq_len) for rr in rows]
        n_tg = sum(layout.n_targets(r) for rr in rows for r in rr)
        n_calls = [max(layout.n_calls(r, args.packing) for r in rr) for rr in rows]
        # the scale of each micro-batch's loss, filled on the device (torch.tensor(x, device=cuda) would copy from
        # the host and wait); the value of the former float64 count cast to float32
        n_tg_dev = torch.full((), float(n_tg), dtype=torch.float32, device=device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        try:
            for b, nc in zip(batches, n_calls):
                for ids, tg, cu in _forward_calls(b, args.packing, nc):
                    ids, tg, cu = _to_device(ids, device), _to_device(tg, device), _offsets_to_device(cu, device)
                    loss = _loss_sum(fwd_model, ids, tg, cu, device, bf16)
                    # FSDP averages gradients over ranks: scale by the world size so that the gradient is the
                    # global token mean, as on one process (the same norm, so the same clipping)
                    (loss * dist.world / n_tg_dev).backward()
                    loss_sum += loss.detach().double()
        except torch.OutOfMemoryError as e:
            raise TrainError(_oom_message(args, e)) from e
        except RuntimeError as e:
            if "can't allocate memory" in str(e) or "out of memory" in str(e).lower():
                raise TrainError(_oom_message(args, e)) from e
            raise
        grad_norm = _clip_grad_norm(model, args.grad_clip if args.grad_clip > 0 else float("inf"), dist)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        micro += args.grad_accum
        tokens_seen += tokens_per_step
        return dict(step=step, tokens=tokens_seen, loss_sum=loss_sum, n_tg=n_tg, grad_norm=grad_norm,
                    lr=optimizer.param_groups[0]["lr"], epoch=sampler.epoch_of(micro))

    while step < max_steps:
        if profiler is not None:
            profiler.before(step)
        pending.append(one_step())
        if profiler is not None:
            profiler.after(step - 1)
            if profiler.written:
                _log(dist, f"profile of steps {profiler.first}..{step - 1}: {profiler.written}", bar)
                profiler = None
        bar.update(1)
        do_eval = bool(args.eval_every) and step % args.eval_every == 0 and step < max_steps
        do_save = bool(args.save_every) and step % args.save_every == 0 and step < max_steps
        if len(pending) >= args.log_every or do_eval or do_save or step == max_steps:
            flush()
        if do_eval:
            val = run_eval(step, bar)
        if do_save:
            save(step)
        if not pending:
            t_flush = time.time()  # eval and save time stays out of tokens/s
    bar.close()

    val = run_eval(step)
    save(step)
    summary = {"final_step": step, "final_train_loss": last_loss, "final_val_nats_per_byte": val,
               "best_val_nats_per_byte": best_val, "unigram_nats_per_byte": unigram,
               "below_unigram": unigram - val, "params": n_params, "tokens_seen": tokens_seen,
               "wall_s": time.time() - t_start, "preset": preset_name}
    summary["tokens_per_s"], summary["tokens_per_s_steps"] = median_tokens_per_s(rates)

    # --- sample, plot ---
    if args.sample_tokens > 0:
        if args.prompt is not None:
            prompt = args.prompt
        elif not args.data:
            prompt = "ROMEO.\n"
        else:
            prompt = tokenizer.decode(corpus.val.tokens[:16].tolist())
        pids = tokenizer.encode(prompt)
        out = sample(fwd_model, tokenizer, pids, args.sample_tokens, args.temperature, args.seed,
                     args.seq_len, device)
        text = tokenizer.decode(out)
        summary["sample"] = text
        if dist.is_main:
            atomic_write_text(os.path.join(args.out, "sample.txt"), text + "\n")
        _log(dist, f"--- sample (temperature {args.temperature}) ---\n{text}\n--- end of sample ---")
    if dist.is_main:
        plot_curve(metrics.records, unigram, os.path.join(args.out, "loss_curve.png"),
                   f"{preset_name} on {corpus.description.split(' (')[0]}")
        atomic_write_text(os.path.join(args.out, "summary.json"), json.dumps(summary, indent=2))
    _log(dist, f"done in {summary['wall_s']:.0f}s: final train loss {last_loss:.6f}, val {val:.4f} nats/byte "
               f"(best {best_val:.4f}), unigram {unigram:.3f} ({unigram - val:.3f} below); "
               f"outputs in {args.out}/ (metrics.jsonl, loss_curve.png, sample.txt, checkpoints/)")
    return summary


def run(args) -> int:
    finished = False
    try:
        train(args)
        finished = True
    except TrainError as e:
        print(f"hybridlm train: error: {e}", file=sys.stderr)
        return 2
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if finished:
                # every rank done (rank 0 writes its plot and summary last) before any tears the group down: in one
                # CPU run a rank that left first aborted at exit ("terminate called without an active exception")
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()
    return 0
