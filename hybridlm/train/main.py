"""`hybridlm train`: the training job, from a 2-core CPU (no arguments) to many GPUs (torchrun + FSDP2).

With no arguments: the `cpu-tiny` 3:1 hybrid (or `gpu-30m` on a GPU) on the bundled Shakespeare, byte tokens,
output under runs/train. Every flag has a help line; `hybridlm train --help` lists them.

`train` reads in the order a run happens: set-up (flags, config, tokenizer: `set_up`), the run folder's lock,
data (`load_data`), where to start (`choose_start`: a rerun continues, --fresh keeps the old run aside, --resume),
the model (`build_model`), the loop (trainer.Trainer: one step, flush, eval, save and restore, signals) and the end
(`finish`: last eval and save, sample, plot, summary).

Non-standard here:
- Packing: documents are packed into rows of --seq-len; a row that holds a document boundary is run flattened with
  cu_seqlens (see data.Batch.pieces), so documents never see each other.
- No step waits for the device (see trainer.py): metrics.jsonl keeps one record per step, brought to the host every
  --log-every steps; the tokens/s of a step is the mean over the steps between two flushes.
- Val loss is reported in nats per byte of text (for the byte tokenizer: nats per token) with the add-one unigram
  of the training split beside it, and perplexity per token.
- A rerun of the same command into the same --out continues the run there (run_folder.py); SIGINT / SIGTERM save
  the step and exit 130 / 143 (signals.py); one run at a time holds --out.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from ..files import atomic_write, atomic_write_text
from ..model.tokenizer import tokenizer_from_spec
from . import checkpoint as ckpt
from .data import RowSampler, load_corpus, unigram_nats
from .errors import TrainError, TrainInterrupted
from .optim import build_optimizer
from .parallel import (
    Dist,
    all_reduce_sum,
    apply_activation_checkpointing,
    apply_fsdp,
    barrier,
    init_context_parallel,
    init_distributed,
)
from .presets import TrainDefaults, build_config
from .profile import parse_profile_steps
from .run_folder import MetricsLog, RunLock, absolute_data, find_continuation, keep_aside
from .settings import DEFAULT_OUT, add_arguments, check_args, cpu_threads, fill_defaults, set_threads
from .signals import StopSignals, exit_code
from .step import evaluate, forward_calls, loss_sum, sample
from .trainer import RunParts, Trainer, log

# names that tests and other modules import from here
__all__ = ["DEFAULT_OUT", "add_arguments", "cpu_threads", "set_threads", "train", "run", "evaluate", "sample",
           "median_tokens_per_s", "plot_curve", "MetricsLog", "_forward_calls", "_loss_sum"]
_forward_calls, _loss_sum = forward_calls, loss_sum

TPS_WARMUP_STEPS = 10  # summary.json's tokens_per_s: median over this process's steps after the first ten (compilation)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


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


def median_tokens_per_s(rates: list[float], warmup: int = TPS_WARMUP_STEPS) -> tuple[float | None, int]:
    """(median tokens/s over the steps after `warmup`, how many steps that is); at most half the steps are
    dropped; (None, 0) with no step."""
    kept = rates[min(warmup, len(rates) // 2):]
    return (statistics.median(kept) if kept else None), len(kept)


def _finished(out: str, path: str, step: int, max_steps: int, dist: Dist) -> dict:
    """A resume of a run that already reached its last step: nothing is trained, evaluated or written; the summary
    is the one the run wrote (or, when it never got to write one, the step counts)."""
    summary = {"final_step": step, "max_steps": max_steps}
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
            summary = json.load(f)
    val = summary.get("final_val_nats_per_byte")
    log(dist, f"the run in {out} is finished: {path} is step {step} of {max_steps}"
               f"{f', val {val:.4f} nats/byte' if isinstance(val, float) else ''}; nothing to do (to train "
               "further, rerun with a larger --max-steps or --max-tokens)")
    return summary


@dataclass
class SetUp:
    """What the flags resolve to before any data is read."""

    device: torch.device
    bf16: bool  # bf16 autocast
    cfg: object  # HybridConfig (vocab_size raised to the tokenizer's)
    preset_name: str
    defaults: TrainDefaults
    tokenizer: object
    prof_steps: tuple[int, int] | None  # --profile-steps


def set_up(args, dist: Dist) -> SetUp:
    """Threads, precision, model config, the preset's defaults, every flag's check, the tokenizer."""
    device = dist.device
    set_threads(args.threads, device)
    bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
    cfg, preset_name, defaults = build_config(args.preset, args.config, device.type)
    fill_defaults(args, defaults, device)
    check_args(args)
    try:
        prof_steps = parse_profile_steps(args.profile_steps)
    except ValueError as e:
        raise TrainError(str(e)) from None
    if args.seq_len > cfg.max_position_embeddings:
        raise TrainError(f"--seq-len {args.seq_len} is longer than this model supports "
                         f"(max_position_embeddings = {cfg.max_position_embeddings} in {preset_name}); "
                         f"use --seq-len <= {cfg.max_position_embeddings} or a --config with a larger "
                         "max_position_embeddings")
    if args.no_reshard_after_forward and dist.dp_world == 1:
        raise TrainError("--no-reshard-after-forward: applies to FSDP2 runs under torchrun; this run has one data rank "
                         "(no FSDP)")
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
    if args.recompute_linear:
        cfg.linear_recompute = True
    return SetUp(device, bf16, cfg, preset_name, defaults, tokenizer, prof_steps)


@contextlib.contextmanager
def locked_run_folder(out: str, dist: Dist):
    """Hold --out's lock (rank 0) for the run; under torchrun every rank learns whether rank 0 got it."""
    lock = RunLock(out, dist.is_main)
    error = None
    try:
        lock.__enter__()
    except TrainError as e:
        error = e
    if dist.enabled:  # a collective at set-up: the other ranks must not go on into a folder rank 0 could not take
        failed = torch.full((1,), float(error is not None), device=dist.device)
        all_reduce_sum(failed, dist)
        if failed.item() > 0 and error is None:
            error = TrainError(f"--out {out}: rank 0 could not take the run folder's lock (its message says why)")
    if error is not None:
        raise error
    try:
        yield lock
    finally:
        lock.__exit__()


@dataclass
class Data:
    corpus: object  # data.Corpus
    sampler: RowSampler
    max_steps: int
    bytes_per_token: float  # of the val split
    unigram: float  # nats per byte of the add-one unigram of the training split, on the val split


def load_data(args, dist: Dist, su: SetUp) -> Data:
    """The corpus, its row order, and the number of steps (--max-steps, or --max-tokens over the global batch)."""
    corpus = load_corpus(args.data, su.tokenizer, args.val_fraction)
    if corpus.val.n_rows(args.seq_len) < 1:
        raise TrainError(f"the val split ({corpus.val.n_tokens} tokens) is shorter than one row of --seq-len "
                         f"{args.seq_len}; raise --val-fraction, lower --seq-len, or give more --data")
    sampler = RowSampler(corpus.train.n_rows(args.seq_len), args.batch_size, args.seed, dist.dp_rank, dist.dp_world)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * dist.dp_world
    if args.max_tokens is not None:
        max_steps = max(1, math.ceil(args.max_tokens / tokens_per_step))
    else:
        max_steps = args.max_steps if args.max_steps is not None else su.defaults.max_steps
    bytes_per_token = corpus.val.n_bytes / max(1, corpus.val.n_tokens)
    unigram = unigram_nats(corpus.train, corpus.val, su.cfg.vocab_size) / bytes_per_token
    return Data(corpus, sampler, max_steps, bytes_per_token, unigram)


def run_settings(args, corpus) -> dict:
    """The data settings a checkpoint records beside train_state's others, for a rerun to compare
    (run_folder.SAME_RUN)."""
    return {"data": absolute_data(args.data), "val_fraction": args.val_fraction,
            "train_tokens": corpus.train.n_tokens, "val_tokens": corpus.val.n_tokens}


def choose_start(args, dist: Dist, current: dict, cfg) -> tuple[str | None, bool]:
    """(the checkpoint to start from, None for step 0; whether --resume named it). A rerun continues --out's
    latest checkpoint when the model and data settings are this command's (else a TrainError naming what
    differs); --fresh, or a folder whose earlier run left no checkpoint, keeps the earlier run aside."""
    if args.resume is not None:
        return ckpt.resolve_resume(args.resume or args.out), True
    found = None if args.fresh else find_continuation(args.out, current, json.loads(cfg.to_json()))
    if found is None and dist.is_main:
        kept = keep_aside(args.out)
        if kept is not None:
            why = "--fresh" if args.fresh else "it left no checkpoint to continue from"
            log(dist, f"the earlier run in {args.out} is kept aside in {kept} ({why})")
    barrier(dist)
    return found, False


def build_model(args, su: SetUp, dist: Dist):
    """(model, the module that runs the forward, optimizer, parameter count), the init seeded by --seed."""
    from hybridlm.model.hybrid import HybridLM

    _seed_all(args.seed)
    model = HybridLM(su.cfg).to(su.device)
    n_params = sum(p.numel() for p in model.parameters())
    if args.activation_checkpointing:
        apply_activation_checkpointing(model)
    if dist.dp_world > 1:  # with context parallelism over the "dp" dimension; dp = 1: replicated, no FSDP
        apply_fsdp(model, su.bf16, reshard_after_forward=not args.no_reshard_after_forward,
                   min_unit_params=int(args.fsdp_min_unit_params), mesh=dist.dp_mesh)
    fwd_model = torch.compile(model) if args.compile else model
    optimizer = build_optimizer(model, args.lr, args.weight_decay)
    return model, fwd_model, optimizer, n_params


def train(args) -> dict:
    """The training job; returns a summary dict (also written to OUT/summary.json). Raises TrainError on bad input
    and TrainInterrupted after saving when SIGINT / SIGTERM stopped it."""
    t_start = time.time()
    dist = init_context_parallel(init_distributed(args.device), args.context_parallel)
    su = set_up(args, dist)
    with locked_run_folder(args.out, dist):
        data = load_data(args, dist, su)
        settings = run_settings(args, data.corpus)
        current = {"seq_len": args.seq_len, "batch_size": args.batch_size, "grad_accum": args.grad_accum,
                   "world": dist.world, "seed": args.seed, "tokenizer": su.tokenizer.name, **settings}
        start, explicit = choose_start(args, dist, current, su.cfg)
        model, fwd_model, optimizer, n_params = build_model(args, su, dist)
        trainer = Trainer(RunParts(args, dist, su.cfg, su.preset_name, su.tokenizer, data.corpus, data.sampler, model,
                                   fwd_model, optimizer, data.max_steps, su.bf16, settings, t_start))
        trainer.unigram = data.unigram
        if start is not None:
            trainer.restore(start, explicit)
            step = trainer.state.step
            if step >= data.max_steps:
                return _finished(args.out, start, step, data.max_steps, dist)
            log(dist, f"resumed from {start} at step {step}" if explicit else
                      f"continuing the run in {args.out} from step {step} ({start}); --fresh starts over")
        if dist.is_main:
            os.makedirs(args.out, exist_ok=True)
        barrier(dist)
        trainer.metrics = MetricsLog(os.path.join(args.out, "metrics.jsonl"), dist.is_main,
                                     trainer.state.step if start is not None else None)
        if dist.is_main and start is None:
            run_info = {"args": vars(args), "preset": su.preset_name, "config": su.cfg.to_dict(), "params": n_params,
                        "max_steps": data.max_steps, "device": str(su.device), "world": dist.world}
            atomic_write_text(os.path.join(args.out, "run.json"), json.dumps(run_info, indent=2))
        _log_header(args, dist, su, data, n_params, trainer.tokens_per_step)
        with StopSignals() as stop:
            try:
                trainer.train_loop(stop, su.prof_steps)
            except TrainInterrupted as e:
                log(dist, str(e))
                raise
            return finish(trainer, su, n_params)


def _log_header(args, dist: Dist, su: SetUp, data: Data, n_params: int, tokens_per_step: int) -> None:
    corpus, cfg = data.corpus, su.cfg
    log(dist, f"hybridlm train: {su.preset_name} ({n_params / 1e6:.2f}M params, layers {cfg.layer_types}), "
              f"{corpus.description}: {corpus.n_docs} documents, {corpus.train.n_tokens:,} train / "
              f"{corpus.val.n_tokens:,} val tokens ({su.tokenizer.name} tokenizer)")
    log(dist, f"device {su.device} x{dist.world}, {'bf16 autocast' if su.bf16 else 'fp32'}, threads "
              f"{torch.get_num_threads()}, {data.max_steps} steps of {tokens_per_step:,} tokens "
              f"(batch {args.batch_size} x seq {args.seq_len} x accum {args.grad_accum} x {dist.dp_world} data "
              f"rank(s){f', context parallel {dist.cp}' if dist.cp > 1 else ''}), "
              f"lr {args.lr:g} warmup {args.warmup} cosine, {args.packing} packing, "
              f"unigram baseline {data.unigram:.3f} nats/byte")


def finish(trainer: Trainer, su: SetUp, n_params: int) -> dict:
    """The last evaluation and checkpoint, the sample, the loss curve and summary.json."""
    args, dist, s, p = trainer.args, trainer.dist, trainer.state, trainer.p
    step, unigram, tokenizer, last_loss = s.step, trainer.unigram, su.tokenizer, trainer.last_loss
    # the training steps' peak, before the last evaluation adds its own (rank 0's GPU: ranks differ little)
    peak = torch.cuda.max_memory_allocated(dist.device) / 2**30 if dist.device.type == "cuda" else None
    val = trainer.evaluate(step)
    trainer.save(step)
    best_val = s.best_val
    summary = {"final_step": step, "final_train_loss": last_loss, "final_val_nats_per_byte": val,
               "best_val_nats_per_byte": best_val, "unigram_nats_per_byte": unigram,
               "below_unigram": unigram - val, "params": n_params, "tokens_seen": s.tokens_seen,
               "wall_s": time.time() - p.t_start, "preset": su.preset_name, "peak_gpu_memory_gib": peak}
    summary["tokens_per_s"], summary["tokens_per_s_steps"] = median_tokens_per_s(trainer.rates)
    if args.sample_tokens > 0:
        if args.prompt is not None:
            prompt = args.prompt
        elif not args.data:
            prompt = "ROMEO.\n"
        else:
            prompt = tokenizer.decode(p.corpus.val.tokens[:16].tolist())
        pids = tokenizer.encode(prompt)
        out = sample(p.fwd_model, tokenizer, pids, args.sample_tokens, args.temperature, args.seed,
                     args.seq_len, su.device)
        text = tokenizer.decode(out)
        summary["sample"] = text
        if dist.is_main:
            atomic_write_text(os.path.join(args.out, "sample.txt"), text + "\n")
        log(dist, f"--- sample (temperature {args.temperature}) ---\n{text}\n--- end of sample ---")
    if dist.is_main:
        plot_curve(trainer.metrics.records, unigram, os.path.join(args.out, "loss_curve.png"),
                   f"{su.preset_name} on {p.corpus.description.split(' (')[0]}")
        atomic_write_text(os.path.join(args.out, "summary.json"), json.dumps(summary, indent=2))
    log(dist, f"done in {summary['wall_s']:.0f}s: final train loss {last_loss:.6f}, val {val:.4f} nats/byte "
              f"(best {best_val:.4f}), unigram {unigram:.3f} ({unigram - val:.3f} below); "
              f"outputs in {args.out}/ (metrics.jsonl, loss_curve.png, sample.txt, checkpoints/)")
    return summary


def run(args) -> int:
    """`hybridlm train`: 0 when done, 2 on bad input, 130 / 143 after a SIGINT / SIGTERM (its step saved)."""
    finished = False
    try:
        train(args)
        finished = True
    except TrainError as e:
        print(f"hybridlm train: error: {e}", file=sys.stderr)
        return 2
    except TrainInterrupted as e:
        finished = True  # every rank saved the step
        return exit_code(e.signum)
    except KeyboardInterrupt:  # before the loop's handler was in place: nothing to save yet
        print("hybridlm train: interrupted before the first step; nothing was saved", file=sys.stderr)
        return exit_code(signal.SIGINT)
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if finished:
                # every rank done (rank 0 writes its plot and summary last) before any tears the group down: in one
                # CPU run a rank that left first aborted at exit ("terminate called without an active exception")
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()
    return 0
