"""The training loop: a `Trainer` holding what a run is made of, with one method per part of it (one step, the flush
of the metrics, evaluation, save and restore, the loop that stops on a signal), and `TrainState`, where the run is.

Non-standard here:
- Host synchronisations: none in a step. The loss sums and gradient norms of the steps since the last flush stay
  on the device (`pending`); a flush (every --log-every steps, before an eval or a save, and at the end)
  all-reduces the loss sums in one call and copies them with the norms to the host in one transfer. The step's
  target count (all ranks) and the number of forward calls FSDP needs come from the data layout.
- A stop (SIGINT / SIGTERM, `signals.StopSignals`) is taken between steps. One process stops after the step under
  way. Under torchrun the ranks must stop at the same step and all save, and asking each other every step would add
  a collective and a host wait to each: each rank's flag rides in the flush's all-reduce (one more number in the
  loss sums), so the ranks agree at the next flush, at most --log-every steps later, at no extra cost. (torchrun
  passes a SIGINT or SIGTERM on to its workers and kills them 30 s later: enough for --log-every steps and a save.)
- The loss of a step is the sum over its micro-batches of token losses divided by the step's total target count
  (all ranks), so grad accumulation and sharding give the same gradient as one big batch. With context parallelism
  the rows are those of the data rank (`Dist.dp_rank`), each rank's loss is that of its slice, and the gradients of
  a cp group are summed after the backward (parallel.all_reduce_cp_grads).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass

import torch

from . import checkpoint as ckpt
from .data import RowLayout, make_batch
from .errors import TrainError, TrainInterrupted
from .optim import lr_at, set_lr
from .parallel import Dist, all_reduce_cp_grads, all_reduce_sum, barrier, dcp_load, dcp_save, full_model_state
from .profile import StepProfiler
from .signals import StopSignals
from .step import clip_gradients, cp_slice, evaluate, forward_calls, loss_sum, offsets_to_device, oom_message, to_device


def log(dist: Dist, msg: str, bar=None) -> None:
    """A line on rank 0's stdout (through the progress bar when there is one, so that the bar stays whole)."""
    if not dist.is_main:
        return
    if bar is not None:
        bar.write(msg)
    else:
        print(msg, flush=True)


@dataclass
class TrainState:
    """Where a run is: what a checkpoint's train_state.json restores besides weights, optimizer and RNG."""

    step: int = 0  # optimizer steps done
    micro: int = 0  # micro-batches consumed: the data position (RowSampler)
    tokens_seen: int = 0  # training tokens of every rank so far
    best_val: float = math.inf  # lowest val nats/byte of any evaluation


@dataclass
class RunParts:
    """What the set-up built for the loop (hybridlm.train.main)."""

    args: object  # the parsed flags, defaults filled in
    dist: Dist
    cfg: object  # HybridConfig of the model
    preset_name: str
    tokenizer: object
    corpus: object  # data.Corpus
    sampler: object  # data.RowSampler
    model: torch.nn.Module  # what is saved and clipped (FSDP-wrapped under torchrun)
    fwd_model: torch.nn.Module  # what runs the forward (torch.compile'd with --compile)
    optimizer: torch.optim.Optimizer
    max_steps: int
    bf16: bool
    settings: dict  # the run_folder.SAME_RUN settings of this run, kept in each checkpoint
    t_start: float  # time.time() at the start of the job


class Trainer:
    def __init__(self, parts: RunParts):
        self.p = parts
        self.args, self.dist, self.device = parts.args, parts.dist, parts.dist.device
        self.state = TrainState()
        a = self.args
        self.tokens_per_step = a.batch_size * a.seq_len * a.grad_accum * self.dist.dp_world
        corpus = parts.corpus
        self.bytes_per_token = corpus.val.n_bytes / max(1, corpus.val.n_tokens)
        self.layout = RowLayout.of(corpus.train, a.seq_len)
        self.val_layout = RowLayout.of(corpus.val, a.seq_len)
        self.unigram = math.nan  # nats per byte of the add-one unigram (set by main)
        self.metrics = None  # run_folder.MetricsLog (set by main once the start is known)
        self.pending: list[dict] = []  # steps since the last flush, their loss sums and norms still on the device
        self.t_flush = time.time()  # the host and the device were last in step here
        self.last_loss = math.nan
        self.ema_tps = None
        self.rates: list[float] = []  # tokens/s of each step this process ran
        self.bar = None
        self.progress_every = 0  # plain progress lines every N steps (when no bar can be drawn)
        self.last_progress = 0

    # --- save and restore ---

    def restore(self, path: str, explicit: bool) -> None:
        """Load checkpoint `path` into the model, optimizer, RNG and state. explicit: it came from --resume (whose
        data-position check is this one; a rerun's settings were compared with the run's before)."""
        p, args, dist = self.p, self.args, self.dist
        state = ckpt.load_checkpoint(path)
        ts = state["train_state"]
        if ts.get("seq_len") != args.seq_len or ts.get("batch_size") != args.batch_size \
                or ts.get("world") != dist.world or ts.get("grad_accum") != args.grad_accum \
                or ts.get("context_parallel", 1) != dist.cp:
            raise TrainError(f"--resume: {path} was written with seq_len={ts.get('seq_len')}, batch_size="
                             f"{ts.get('batch_size')}, grad_accum={ts.get('grad_accum')}, world={ts.get('world')}, "
                             f"context_parallel={ts.get('context_parallel', 1)}; resume with the same --seq-len, "
                             "--batch-size, --grad-accum, --context-parallel and number of ranks")
        if dist.enabled:
            dcp_load(os.path.join(path, "dcp"), p.model, p.optimizer)
        else:
            missing, unexpected = p.model.load_state_dict(state["model"], strict=False)
            tied = {"lm_head.weight"} if p.cfg.tie_word_embeddings else set()
            if set(missing) - tied or unexpected:
                raise TrainError(f"--resume: {path} does not match the model (missing {missing}, unexpected "
                                 f"{unexpected}); use the --preset/--config it was trained with")
            p.optimizer.load_state_dict(state["optimizer"])
        self.state = TrainState(ts["step"], ts["micro"], ts["tokens_seen"], ts.get("best_val", math.inf))
        rng = state["rng"]
        if dist.enabled:
            rpath = os.path.join(path, f"rng_rank{dist.rank}.pt")
            if os.path.exists(rpath):
                rng = torch.load(rpath, weights_only=True)
        ckpt.set_rng_state(rng)

    def train_state(self, at_step: int) -> dict:
        p, a, s = self.p, self.args, self.state
        return {"step": at_step, "micro": s.micro, "tokens_seen": s.tokens_seen, "best_val": s.best_val,
                "seq_len": a.seq_len, "batch_size": a.batch_size, "grad_accum": a.grad_accum,
                "world": self.dist.world, "context_parallel": self.dist.cp, "preset": p.preset_name,
                "tokenizer": p.tokenizer.name, "max_steps": p.max_steps, "seed": a.seed, **p.settings}

    def save(self, at_step: int) -> None:
        """Checkpoint `at_step` atomically (every rank takes part under torchrun)."""
        p, args, dist = self.p, self.args, self.dist
        rng = ckpt.rng_state()
        train_state = self.train_state(at_step)
        cfg = p.cfg
        if dist.enabled:
            tag = f"dist{at_step}"
            if dist.is_main:
                ckpt.begin_checkpoint(args.out, at_step, tag)
            barrier(dist)
            tmp = os.path.join(args.out, ckpt.CKPT_DIR, f".tmp-{ckpt.step_name(at_step)}-{tag}")
            dcp_save(os.path.join(tmp, "dcp"), p.model, p.optimizer)
            torch.save(rng, os.path.join(tmp, f"rng_rank{dist.rank}.pt"))
            full = full_model_state(p.model, dist)
            barrier(dist)
            if dist.is_main:
                export = None
                if cfg.hf_model_type:
                    export = lambda folder: _cpu_model(cfg, full).save_pretrained(folder)  # noqa: E731
                ckpt.write_checkpoint_files(tmp, at_step, model_state=full, config_json=cfg.to_json(),
                                            optimizer_state=None, train_state=train_state, rng=rng, export=export,
                                            tokenizer=p.tokenizer)
                ckpt.commit_checkpoint(args.out, at_step, tmp, args.keep)
            barrier(dist)
        else:
            tmp = ckpt.begin_checkpoint(args.out, at_step)
            ckpt.write_checkpoint_files(
                tmp, at_step, model_state=None if cfg.hf_model_type else ckpt.plain_state_dict(p.model),
                config_json=cfg.to_json(), optimizer_state=p.optimizer.state_dict(), train_state=train_state,
                rng=rng, export=p.model.save_pretrained if cfg.hf_model_type else None, tokenizer=p.tokenizer)
            ckpt.commit_checkpoint(args.out, at_step, tmp, args.keep)

    # --- one step, the flush, evaluation ---

    def train_step(self) -> dict:
        """One optimizer step; returns its record for `pending`, the loss sum and the norm still on the device.
        Nothing here waits for the device (tests/train/test_train_gpu.py checks that under CUDA's sync debug mode)."""
        p, args, dist, device, s = self.p, self.args, self.dist, self.device, self.state
        optimizer, sampler = p.optimizer, p.sampler
        set_lr(optimizer, lr_at(s.step, lr=args.lr, warmup=args.warmup, total=p.max_steps,
                                min_ratio=args.min_lr_ratio))
        # every rank's rows are known here: the global target count and FSDP's call counts need no communication
        rows = [[sampler.rows(m, r) for r in range(dist.dp_world)] for m in range(s.micro, s.micro + args.grad_accum)]
        batches = [make_batch(p.corpus.train, rr[dist.dp_rank], args.seq_len) for rr in rows]
        n_tg = sum(self.layout.n_targets(r) for rr in rows for r in rr)
        n_calls = [max(self.layout.n_calls(r, args.packing) for r in rr) for rr in rows]
        # the scale of each micro-batch's loss, filled on the device (torch.tensor(x, device=cuda) would copy from
        # the host and wait); the value of the former float64 count cast to float32
        n_tg_dev = torch.full((), float(n_tg), dtype=torch.float32, device=device)
        total = torch.zeros((), dtype=torch.float64, device=device)
        try:
            for b, nc in zip(batches, n_calls):
                for ids, tg, cu in forward_calls(b, args.packing, nc):
                    ids, tg = cp_slice(ids, tg, dist)
                    ids, tg, cu = to_device(ids, device), to_device(tg, device), offsets_to_device(cu, device)
                    loss = loss_sum(p.fwd_model, ids, tg, cu, device, p.bf16, dist.cp_group)
                    # FSDP averages gradients over the data ranks: scale by their number so that the gradient is
                    # the global token mean, as on one process (the same norm, so the same clipping); a cp group's
                    # gradients are summed below
                    (loss * dist.dp_world / n_tg_dev).backward()
                    total += loss.detach().double()
        except torch.OutOfMemoryError as e:
            raise TrainError(oom_message(args, e)) from e
        except RuntimeError as e:
            if "can't allocate memory" in str(e) or "out of memory" in str(e).lower():
                raise TrainError(oom_message(args, e)) from e
            raise
        all_reduce_cp_grads(list(p.model.parameters()), dist)
        grad_norm = clip_gradients(p.model, args.grad_clip if args.grad_clip > 0 else float("inf"), dist)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        s.step += 1
        s.micro += args.grad_accum
        s.tokens_seen += self.tokens_per_step
        return dict(step=s.step, tokens=s.tokens_seen, loss_sum=total, n_tg=n_tg, grad_norm=grad_norm,
                    lr=optimizer.param_groups[0]["lr"], epoch=sampler.epoch_of(s.micro))

    def flush(self, stop_flag: int = 0) -> bool:
        """Bring the pending steps' losses and norms to the host and record them; returns whether any rank has
        asked to stop (`stop_flag` is this rank's ask; under torchrun it rides in the loss all-reduce)."""
        if not self.pending:
            return False
        dist, pending = self.dist, self.pending
        losses = torch.stack([r.pop("loss_sum") for r in pending])
        if dist.enabled:
            losses = torch.cat([losses, torch.full((1,), float(bool(stop_flag)), dtype=torch.float64,
                                                   device=losses.device)])
        all_reduce_sum(losses, dist)
        norms = torch.stack([r.pop("grad_norm").to(torch.float64) for r in pending])
        if dist.enabled:
            norms = torch.cat([norms, norms.new_zeros(1)])
        host = torch.stack([losses, norms]).cpu().tolist()  # the one wait for the device
        stop = bool(host[0].pop() > 0) if dist.enabled else bool(stop_flag)
        now = time.time()
        span = max(now - self.t_flush, 1e-9)
        tps = len(pending) * self.tokens_per_step / span  # each step of the span gets the span's mean
        for i, (r, loss_total, gn) in enumerate(zip(pending, *host)):
            self.last_loss = loss_total / r.pop("n_tg")
            self.ema_tps = tps if self.ema_tps is None else 0.9 * self.ema_tps + 0.1 * tps
            self.rates.append(tps)
            self.metrics.add(step=r["step"], tokens=r["tokens"], loss=self.last_loss,
                             loss_per_byte=self.last_loss / self.bytes_per_token, lr=r["lr"], grad_norm=gn,
                             tokens_per_s=tps, epoch=r["epoch"],
                             elapsed=self.t_flush + span * (i + 1) / len(pending) - self.p.t_start)
            if not math.isfinite(self.last_loss):
                raise TrainError(f"the loss became {self.last_loss} at step {r['step']}; lower --lr or raise "
                                 "--warmup")
        lr = pending[-1]["lr"]
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{self.last_loss:.3f}", tok_s=f"{self.ema_tps:,.0f}", lr=f"{lr:.2e}")
        step = pending[-1]["step"]
        if self.progress_every and step // self.progress_every > self.last_progress // self.progress_every:
            self.last_progress = step
            log(dist, f"step {step}/{self.p.max_steps} | loss {self.last_loss:.4f} | {self.ema_tps:,.0f} tokens/s | "
                      f"lr {lr:.2e} | {time.time() - self.p.t_start:.0f}s")
        pending.clear()
        return stop

    def evaluate(self, at_step: int) -> float:
        """Evaluate on the val split, record it, log it; returns val nats per byte."""
        p, s, t0 = self.p, self.state, self.p.t_start
        loss, count = evaluate(p.fwd_model, p.corpus.val, self.args, self.dist, self.device, p.bf16, self.val_layout)
        per_byte = loss / self.bytes_per_token
        s.best_val = min(s.best_val, per_byte)
        self.metrics.add(step=at_step, tokens=s.tokens_seen, val_loss=loss, val_nats_per_byte=per_byte,
                         val_ppl=math.exp(loss), unigram_nats_per_byte=self.unigram, val_tokens=count,
                         elapsed=time.time() - t0)
        log(self.dist, f"step {at_step}/{p.max_steps} | val {per_byte:.4f} nats/byte (ppl {math.exp(loss):.2f}/token)"
                       f" | unigram {self.unigram:.3f} | {self.unigram - per_byte:+.3f} below unigram | "
                       f"{time.time() - t0:.0f}s", self.bar)
        return per_byte

    # --- the loop ---

    def train_loop(self, stop: StopSignals, prof_steps: tuple[int, int] | None = None) -> None:
        """Steps until --max-steps, with the evaluations and saves on their steps. A stop asked for by a signal
        ends it after a step: the step is saved and TrainInterrupted raised."""
        from tqdm import tqdm

        args, dist, s, max_steps = self.args, self.dist, self.state, self.p.max_steps
        profiler = None
        if prof_steps is not None:
            profiler = StepProfiler(os.path.join(args.out, "profile"), *prof_steps, dist.rank, self.device)
        # a bar is drawn on a terminal only; elsewhere (a log file, a pipe) it would be one long line of carriage
        # returns, so plain progress lines take its place, about ten a run
        tty = sys.stderr.isatty()
        self.bar = tqdm(total=max_steps, initial=s.step, disable=not dist.is_main or args.no_progress or not tty,
                        unit="step", dynamic_ncols=True, file=sys.stderr)
        if not tty and not args.no_progress:
            self.progress_every, self.last_progress = max(1, max_steps // 10), s.step
        self.p.model.train()
        self.t_flush = time.time()
        try:
            while s.step < max_steps:
                if profiler is not None:
                    profiler.before(s.step)
                self.pending.append(self.train_step())
                if profiler is not None:
                    profiler.after(s.step - 1)
                    if profiler.written:
                        log(dist, f"profile of steps {profiler.first}..{s.step - 1}: {profiler.written}", self.bar)
                        profiler = None
                self.bar.update(1)
                step = s.step
                do_eval = bool(args.eval_every) and step % args.eval_every == 0 and step < max_steps
                do_save = bool(args.save_every) and step % args.save_every == 0 and step < max_steps
                asked = False
                if len(self.pending) >= args.log_every or do_eval or do_save or step == max_steps:
                    asked = self.flush(stop.signum)
                if do_eval:
                    self.evaluate(step)
                if do_save:
                    self.save(step)
                if step < max_steps and (asked if dist.enabled else stop.signum):
                    self.flush()  # one process: the steps since the last flush
                    if not do_save:
                        self.save(step)
                    raise TrainInterrupted(step, stop.signum or 15)
                if not self.pending:
                    self.t_flush = time.time()  # eval and save time stays out of tokens/s
        finally:
            self.bar.close()
            self.bar = None


def _cpu_model(cfg, state: dict[str, torch.Tensor]):
    """A plain CPU HybridLM holding a full state dict (to export what FSDP trained)."""
    from hybridlm.model.hybrid import HybridLM

    m = HybridLM(cfg)
    m.load_state_dict(state, strict=not cfg.tie_word_embeddings)
    return m
