"""Training throughput of a ~350M 3:1 hybrid: ours against the same shape built from fla's model classes.

    python -m hybridlm.bench.train [--data bundled,short-docs] [--seq-len 4096] [--batch-size 4] [--steps 10]
                                   [--out DIR]                                        (= hybridlm bench train)
    python -m hybridlm.bench.train --tiny                                             (CPU smoke run)

--data (comma-separated, one table row per model and data kind):
- bundled (default): the bundled Shakespeare as `hybridlm train` reads it (its train split, 41 works, byte tokens);
- short-docs: the same text as 8,674 documents of ~580 bytes (`train.data.short_document_stream`);
- random: uniform random token ids over the whole vocabulary, a plain [B, T] batch (no documents).
With documents, each step's B rows of T tokens are cut from the stream as `hybridlm train` cuts them
(`train.data.make_batch`, rows drawn by `RowSampler`), and both models get them as one packed [1, B*T] call with
cu_seqlens (row starts and document starts), so no token attends across a document boundary. Byte ids (< 256) are
valid ids of the 32000-token vocabulary.

One step is what a training job does: forward under bf16 autocast (fp32 on a CPU) with each model's own training
loss, backward, gradient clipping to 1.0, AdamW (`hybridlm.train.optim`, fused on CUDA, the same parameter groups
for both) and zero_grad. After --warmup steps (Triton compilation and autotuning happen there), --steps steps are
timed one by one between torch.cuda.synchronize calls; tokens/s = batch * T / median step time. Every step has its
own batch; the host batches are built before the model, and each step copies its batch to the device (pinned,
non-blocking) as the training loop does. Peak memory: torch.cuda.max_memory_allocated from before the model is
built, per (model, data) row, so parameters, gradients, optimizer state and activations all count. A model that
fails (out of memory or anything else) gets its error in its row; the others still run. Writes train.json (device,
versions, date, command, both configs, every step time) and train.md (the table).

Non-standard here:
- The shape (`SHAPE_350M`): hidden 1024, 24 blocks, every 4th softmax attention (blocks 3, 7, ..., 23), SwiGLU
  MLP 2816, Gated DeltaNet with 8 key and 8 value heads of width 128, short conv 4, attention 8 query / 2 kv heads
  of width 128, full RoPE (theta 1e4), vocab 32000, tied embeddings. Ours is the Qwen3.5 layout
  (`gdn_layout="split"`, gated attention with q/k RMSNorm, zero-centred norms); fla's is
  `GatedDeltaNetForCausalLM` with `attn` placing its `Attention` layers, which has no output gate and no q/k norm,
  so ours has 6 x (1024 x 1024 + 256) more parameters. Both counts are printed.
- The loss is each model's own training path: ours `model(ids, cu_seqlens=, targets=)` (the chunked linear +
  cross-entropy of `hybridlm.ops.linear_ce`, no [tokens, vocab] logits; its sum over targets divided by their
  count, known on the host), fla's `labels=` with its config's defaults (fuse_cross_entropy: bf16 logits, then
  its fused cross-entropy kernel). fla shifts `labels` itself and has no target for the last position of a row, so
  it gets the batch's targets shifted right by one, and that position (of each [B, T] row, or of the one packed
  row) has no target for either model.
- The cu_seqlens handed to our model have their host values registered (`hybridlm.ops.offsets.remember_offsets`),
  as in `hybridlm train`, so our varlen layers never wait for the device to read them.
- fla's model, its loss and the stand-ins for flash_attn are in `hybridlm.bench.fla_model` (imported only when
  asked for); what they changed in fla is said in the table.
- Ours runs with impl="auto": the Triton GDN kernels and fused glue on CUDA, SDPA with is_causal for plain batches
  and variable-length FlashAttention (`varlen_attn`) for packed documents. Which paths "auto" picked is recorded in
  train.json.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import json
import logging
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from hybridlm.files import atomic_write_text
from hybridlm.train.data import IGNORE

from .fla_model import (  # noqa: F401  (fla's side, re-exported for the tests and callers of this module)
    build_fla,
    fla_config_kwargs,
    fla_labels,
    fla_loss,
    fla_packed_skip,
    load_fla,
    loss_name,
    patch_fla,
    sdpa_flash_attn_func,
    varlen_available,
    varlen_flash_attn_func,
)

DEFAULT_OUT = os.path.join("runs", "bench-train")
DATA_KINDS = ("bundled", "short-docs", "random")
DEFAULT_DATA = "bundled"


@dataclass(frozen=True)
class Shape:
    """The model shape both implementations are built to."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    linear_heads: int  # Gated DeltaNet key heads
    linear_value_heads: int
    linear_head_dim: int  # key and value head width
    attn_heads: int
    attn_kv_heads: int
    attn_head_dim: int  # fla ties it to hidden_size // attn_heads
    conv_size: int = 4
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    attn_every: int = 4  # block i is softmax attention when (i + 1) % attn_every == 0

    @property
    def attention_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if (i + 1) % self.attn_every == 0]


SHAPE_350M = Shape(vocab_size=32000, hidden_size=1024, num_layers=24, intermediate_size=2816, linear_heads=8,
                   linear_value_heads=8, linear_head_dim=128, attn_heads=8, attn_kv_heads=2, attn_head_dim=128)
SHAPE_TINY = Shape(vocab_size=256, hidden_size=64, num_layers=4, intermediate_size=192, linear_heads=2,
                   linear_value_heads=2, linear_head_dim=32, attn_heads=2, attn_kv_heads=1, attn_head_dim=32)
# bf16 dense tensor-core peak (no sparsity) by device name, the denominator of MFU; other devices: --peak-tflops
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "H20": 148.0, "A100": 312.0, "B200": 2250.0}


def matmul_params(shape: Shape) -> int:
    """Weights that take part in a matrix product per token (the LM head included, the embedding lookup not): the
    Qwen3.5 layout of `ours_config` (q|k|v, z, a, b and out projections; gated attention's q with its output gate, k,
    v, o; SwiGLU's three)."""
    h, d = shape.hidden_size, shape.linear_head_dim
    gdn = h * (2 * shape.linear_heads * d + shape.linear_value_heads * d)  # in_proj_qkv
    gdn += h * shape.linear_value_heads * (d + 2) + shape.linear_value_heads * d * h  # z, a, b, out
    ad = shape.attn_head_dim
    attn = h * (2 * shape.attn_heads * ad + 2 * shape.attn_kv_heads * ad) + shape.attn_heads * ad * h
    n_attn = len(shape.attention_layers)
    mlp = 3 * h * shape.intermediate_size
    return (shape.num_layers - n_attn) * gdn + n_attn * attn + shape.num_layers * mlp + h * shape.vocab_size


def train_flops_per_token(shape: Shape, mean_context: float) -> float:
    """Model FLOPs of one token's forward and backward: 6 x the matmul weights, causal attention's two products
    (6 x heads x head dim x the keys a token sees on average, `mean_context`: half its document's length, averaged
    over tokens), and the chunked GDN recurrence's products (its forward's, x 3 for forward and backward). The same
    count for both models (the paper convention: recomputation and padding do not count)."""
    from hybridlm.ops.triton.gdn import flops_chunk_fwd

    n_attn = len(shape.attention_layers)
    attn = n_attn * 2 * 6 * shape.attn_heads * shape.attn_head_dim * mean_context
    d = shape.linear_head_dim
    gdn = (shape.num_layers - n_attn) * 3 * flops_chunk_fwd(1, 4096, shape.linear_value_heads, d, d) / 4096
    return 6 * matmul_params(shape) + attn + gdn


def mean_context(batches: list, seq_len: int) -> float:
    """The keys a query sees under causal attention, averaged over the tokens of `batches`: (L + 1) / 2 for a
    document of L tokens, weighted by L (rows without cu_seqlens are one document each)."""
    num = den = 0.0
    for b in batches:
        cu = b.cu_seqlens
        lens = [seq_len] * b.input_ids.shape[0] if cu is None else (cu[1:] - cu[:-1]).tolist()
        num += sum(n * (n + 1) / 2 for n in lens)
        den += sum(lens)
    return num / max(den, 1.0)


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    """The MFU denominator: --peak-tflops, else the bf16 dense peak of a known CUDA device, else None."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


# (seq_len, batch_size, steps, warmup) when the flags are not given
RUN_DEFAULTS = {"350m": (4096, 4, 10, 3), "tiny": (64, 2, 2, 1)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default=DEFAULT_DATA, metavar="KIND[,KIND]",
                        help="what the steps train on, comma-separated, one row per model and kind: bundled (the "
                        "bundled corpus packed as `hybridlm train` packs it, the default), short-docs (the same text "
                        "as 8,674 short documents, packed with cu_seqlens), random (random token ids, no documents)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 4096; --tiny: 64)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="rows per step (default 4: 16k tokens; --tiny: 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --tiny: 2)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps first, where Triton compiles and autotunes (default 3; --tiny: 1)")
    parser.add_argument("--grad-ckpt", action="store_true",
                        help="activation checkpointing in both models (each block recomputed in the backward)")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models")
    parser.add_argument("--recompute-linear", action="store_true",
                        help="our model's linear recurrences keep only their inputs for the backward "
                        "(HybridConfig.linear_recompute)")
    parser.add_argument("--no-fla", action="store_true", help="only our model, even if fla is installed")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the timed steps, N more under the CUDA profiler: CUDA ms per step by kernel "
                        "group and the top kernels of each model (printed, and in train.json / profile.md)")
    parser.add_argument("--tiny", action="store_true",
                        help="hidden 64, 4 blocks, vocab 256 and the --tiny defaults above: a smoke run that works "
                             "on a CPU (fla is skipped there: its kernels need CUDA)")
    parser.add_argument("--device", default="auto", help="auto (CUDA if visible), cuda, cuda:N or cpu")
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default 3e-4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the random tokens")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's peak TFLOP/s for MFU (default: the bf16 dense peak of a known GPU, "
                        f"{', '.join(PEAK_BF16_TFLOPS)}; none on a CPU)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"folder for train.json / train.md (default {DEFAULT_OUT})")


# --- the two models ---------------------------------------------------------------------------------------------


def ours_config(shape: Shape, seq_len: int):
    """HybridConfig of our model for `shape` (Qwen3.5 layout)."""
    from hybridlm.model.config import HybridConfig

    n = shape.num_layers
    attn = set(shape.attention_layers)
    return HybridConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, num_hidden_layers=n,
        layer_types=["full_attention" if i in attn else "linear_attention" for i in range(n)],
        mlp_types=["dense"] * n, norm_kind="zero_centered", gdn_layout="split",
        linear_num_key_heads=shape.linear_heads, linear_num_value_heads=shape.linear_value_heads,
        linear_key_head_dim=shape.linear_head_dim, linear_value_head_dim=shape.linear_head_dim,
        linear_conv_kernel_dim=shape.conv_size, attention_kind="gated", attn_gate="elementwise", qk_norm="head",
        num_attention_heads=shape.attn_heads, num_key_value_heads=shape.attn_kv_heads, head_dim=shape.attn_head_dim,
        rope_theta=shape.rope_theta, partial_rotary_factor=1.0, intermediate_size=shape.intermediate_size,
        tie_word_embeddings=shape.tie_embeddings, max_position_embeddings=max(seq_len, 4096),
    )


def build_ours(shape: Shape, seq_len: int, device: torch.device, recompute_linear: bool = False):
    from hybridlm.model.hybrid import HybridLM

    cfg = ours_config(shape, seq_len)
    cfg.linear_recompute = recompute_linear
    with torch.device(device):
        model = HybridLM(cfg, impl="auto")
    return model, cfg.to_dict(), ours_loss


def ours_loss(model, ids: torch.Tensor, targets: torch.Tensor, cu_seqlens: torch.Tensor | None,
              n_targets: int) -> torch.Tensor:
    """Mean token loss of our model through its training path: ids / targets [B, T] (B == 1 with cu_seqlens)."""
    return model(ids, cu_seqlens=cu_seqlens, targets=targets).loss / n_targets


def enable_grad_ckpt(model) -> None:
    if hasattr(model, "gradient_checkpointing_enable"):  # transformers models (fla)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        from hybridlm.train.parallel import apply_activation_checkpointing

        apply_activation_checkpointing(model)


# --- data -------------------------------------------------------------------------------------------------------


@dataclass
class StepBatch:
    """One step's batch on the host: input_ids / targets [B, T] int64 (or [1, B*T] packed), cu_seqlens [P+1] int32
    (packed documents) or None, and the number of targets (not IGNORE)."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor | None
    n_targets: int

    def to(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(ids, targets, cu_seqlens) on `device`, copied without waiting (pinned memory on CUDA); the host values
        of cu_seqlens are registered so that the varlen ops need not read them back."""
        from hybridlm.ops.offsets import remember_offsets

        ids, tg = (t.to(device, non_blocking=True) for t in (self.input_ids, self.targets))
        cu = self.cu_seqlens
        if cu is not None:
            cu = remember_offsets(cu.to(device, non_blocking=True), cu)
        return ids, tg, cu


def _no_last_target(targets: torch.Tensor) -> torch.Tensor:
    """targets with the last position of every row ignored (fla's labels cannot reach it; see `fla_labels`)."""
    targets = targets.clone()
    targets[:, -1] = IGNORE
    return targets


def document_stream(kind: str):
    """The byte-token stream of data kind `kind` ("bundled" or "short-docs") -> (Stream, description)."""
    from hybridlm.train import data

    if kind == "bundled":
        from hybridlm.model.tokenizer import tokenizer_from_spec

        corpus = data.load_corpus(None, tokenizer_from_spec("bytes"))
        return corpus.train, f"{corpus.description}, train split, {corpus.n_docs} documents, byte tokens"
    if kind == "short-docs":
        stream = data.short_document_stream()
        return stream, (f"the bundled text as {len(stream.starts) - 1:,} short documents "
                        "(train.data.short_document_stream), byte tokens")
    raise ValueError(f"--data: expected one of {', '.join(DATA_KINDS)}, got {kind!r}")


def make_batches(kind: str, shape: Shape, spec: RunSpec, n: int) -> tuple[list[StepBatch], str]:
    """`n` steps' batches of data kind `kind` (host tensors, pinned on CUDA) and a description of the data.
    Documents: rows of the stream drawn as `hybridlm train` draws them (RowSampler, --seed), packed into one
    [1, B*T] row with cu_seqlens (`make_batch`); random: [B, T] uniform ids, a fresh batch per step."""
    B, T = spec.batch_size, spec.seq_len
    out = []
    if kind == "random":
        g = torch.Generator().manual_seed(spec.seed)
        for _ in range(n):
            ids = torch.randint(0, shape.vocab_size, (B, T + 1), generator=g)
            tg = _no_last_target(ids[:, 1:])
            out.append(StepBatch(ids[:, :-1].contiguous(), tg, None, int((tg != IGNORE).sum())))
        desc = f"random token ids in [0, {shape.vocab_size}), [B, T] rows, no documents"
    else:
        from hybridlm.train.data import RowSampler, make_batch

        stream, desc = document_stream(kind)
        if stream.tokens.max() >= shape.vocab_size:
            raise ValueError(f"--data {kind}: byte tokens need vocab >= 256, the shape has {shape.vocab_size}")
        sampler = RowSampler(stream.n_rows(T), B, spec.seed)
        for i in range(n):
            b = make_batch(stream, sampler.rows(i), T)
            tg = _no_last_target(b.targets)
            out.append(StepBatch(b.input_ids, tg, b.cu_seqlens, int((tg != IGNORE).sum())))
        pieces = statistics.mean(len(b.cu_seqlens) - 1 for b in out)
        desc += f"; {B} rows x {T} packed as [1, {B * T}] with cu_seqlens, {pieces:.1f} pieces a step on average"
    if spec.device.type == "cuda":
        out = [StepBatch(b.input_ids.pin_memory(), b.targets.pin_memory(),
                         None if b.cu_seqlens is None else b.cu_seqlens.pin_memory(), b.n_targets) for b in out]
    return out, desc


def parse_data(arg: str) -> list[str]:
    """--data's comma-separated kinds, in order, each once."""
    kinds = [k.strip() for k in arg.split(",") if k.strip()]
    bad = [k for k in kinds if k not in DATA_KINDS]
    if not kinds or bad or len(set(kinds)) != len(kinds):
        raise ValueError(f"--data: expected distinct kinds from {', '.join(DATA_KINDS)}, comma-separated, got {arg!r}")
    return kinds


# --- timing -----------------------------------------------------------------------------------------------------


@dataclass
class RunSpec:
    seq_len: int
    batch_size: int
    steps: int
    warmup: int
    lr: float
    seed: int
    grad_ckpt: bool
    compile: bool
    device: torch.device
    bf16: bool
    recompute_linear: bool = False  # our model's linear recurrences keep only their inputs (linear_recompute)
    profile: int = 0  # steps run under the CUDA profiler after the timed ones (0: none)


class _LogCollector(logging.Handler):
    """Keeps the messages of the `hybridlm` loggers (which paths impl="auto" picked) while a model runs."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _collect_logs(name: str = "hybridlm"):
    """The `hybridlm` log records while the block runs. The impl="auto" choices are logged once per process; they are
    forgotten first, so this run logs its own even after other models ran in the process (pytest, say)."""
    from hybridlm.ops import dispatch

    dispatch.forget_logged()
    logger, handler = logging.getLogger(name), _LogCollector()
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_step(loss_fn: Callable, model, optimizer, batch: StepBatch, spec: RunSpec) -> float:
    ids, tg, cu = batch.to(spec.device)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if spec.bf16 else contextlib.nullcontext()
    with ctx:
        loss = loss_fn(model, ids, tg, cu, batch.n_targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())  # also a device sync


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(name: str, build: Callable, shape: Shape, spec: RunSpec, batches: list[StepBatch] | None = None,
            data: str = "random") -> tuple[dict, dict | None]:
    """One model's row on one data kind (params, step times, tokens/s, peak memory; or its error) and its config
    dict. batches: one per step, warm-up, timed and profiled steps in that order, reused cyclically if fewer
    (None: random tokens, `make_batches`)."""
    from hybridlm.train.optim import build_optimizer

    if batches is None:
        batches, _ = make_batches("random", shape, spec, spec.warmup + spec.steps + spec.profile)
    row: dict = {"model": name, "data": data}
    config = None
    dev = spec.device
    _free(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    try:
        torch.manual_seed(spec.seed)
        model, config, loss_fn = build(shape, spec.seq_len, dev)
        row["params"] = sum(p.numel() for p in model.parameters())
        model.train()
        if spec.grad_ckpt:
            enable_grad_ckpt(model)
        optimizer = build_optimizer(model, spec.lr, 0.1)
        run_model = torch.compile(model) if spec.compile else model
        batch = (batches[i % len(batches)] for i in itertools.count())
        losses = [_train_step(loss_fn, run_model, optimizer, next(batch), spec) for _ in range(spec.warmup)]
        times = []
        for _ in range(spec.steps):
            _sync(dev)
            t0 = time.perf_counter()
            losses.append(_train_step(loss_fn, run_model, optimizer, next(batch), spec))
            _sync(dev)
            times.append(time.perf_counter() - t0)
        step_s = statistics.median(times)
        row.update(step_ms=step_s * 1e3, tokens_per_s=spec.batch_size * spec.seq_len / step_s,
                   step_ms_all=[t * 1e3 for t in times], loss_first=losses[0], loss_last=losses[-1])
        if spec.profile:
            row["profile"] = profile_step(lambda: _train_step(loss_fn, run_model, optimizer, next(batch), spec),
                                          spec.profile)
    except torch.OutOfMemoryError as e:
        row["error"] = f"out of memory: {str(e).splitlines()[0][:300]}"
    except Exception as e:  # noqa: BLE001  (one failing model must not hide the other's row)
        row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        traceback.print_exc(file=sys.stderr)
    finally:
        if dev.type == "cuda":
            row["peak_GiB"] = torch.cuda.max_memory_allocated(dev) / 2**30
        model = optimizer = run_model = None  # noqa: F841  (drop the references before freeing)
        _free(dev)
    return row, config


# --- profile ----------------------------------------------------------------------------------------------------

# kernel groups, first match wins (lower-case kernel names); Triton kernels have bare names, so what no torch or
# CUDA library pattern claims is counted as Triton
KERNEL_GROUPS = (
    ("attention (SDPA)", ("sdpa", "flash_fwd", "flash_bwd", "fmha", "efficient_attention", "attention_kernel")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "splitk", "sm90_", "sm80_")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("loss", ("softmax", "nll_loss", "cross_entropy")),
    ("torch other", ("at::", "void ", "memcpy", "memset", "cudnn", "::")),
)


def kernel_group(name: str) -> str:
    low = name.lower()
    for group, keys in KERNEL_GROUPS:
        if any(k in low for k in keys):
            return group
    return "Triton"


def profile_step(step: Callable, steps: int) -> dict:
    """CUDA time per step of `steps` calls of step() under the profiler: by group and by kernel (ms), and the
    kernels launched per step (memsets and copies included)."""
    _sync(torch.device("cuda"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    launches = 0
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        us = e.cuda_time_total if us is None else us
        if us > 0:
            kernels[e.key] = kernels.get(e.key, 0.0) + us / 1e3 / steps
            launches += e.count
    groups: dict[str, float] = {}
    for name, ms in kernels.items():
        groups[kernel_group(name)] = groups.get(kernel_group(name), 0.0) + ms
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:30])
    return {"steps": steps, "total_ms": sum(kernels.values()), "launches": launches / steps, "groups_ms": groups,
            "top_kernels_ms": top}


def profile_table(rows: list[dict]) -> str:
    """Markdown: CUDA ms per step by kernel group, one column per row (model and data), then each row's top
    kernels."""
    prof = [(f"{r['model']} {r['data']}" if "data" in r else r["model"], r["profile"]) for r in rows if "profile" in r]
    if not prof:
        return ""
    groups = sorted({g for _, p in prof for g in p["groups_ms"]}, key=lambda g: -max(p["groups_ms"].get(g, 0.0)
                                                                                   for _, p in prof))
    lines = ["| kernel group | " + " | ".join(f"{m} ms/step" for m, _ in prof) + " |",
             "|---|" + "---|" * len(prof)]
    for g in groups + ["all kernels"]:
        vals = [p["total_ms"] if g == "all kernels" else p["groups_ms"].get(g, 0.0) for _, p in prof]
        lines.append(f"| {g} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")
    # a host-bound step shows here: many launches, each paying the host's cost of issuing it
    lines.append("| kernels launched per step | " + " | ".join(f"{p.get('launches', 0):.0f}" for _, p in prof) + " |")
    for m, p in prof:
        lines += ["", f"{m}: top kernels (CUDA ms per step, {p['steps']} profiled steps)", "",
                  "| kernel | group | ms |", "|---|---|---|"]
        lines += [f"| `{k[:90]}` | {kernel_group(k)} | {v:.2f} |" for k, v in p["top_kernels_ms"].items()]
    return "\n".join(lines)


# --- output -----------------------------------------------------------------------------------------------------


def _fmt(row: dict, key: str, spec: str) -> str:
    return format(row[key], spec) if key in row else "-"


def markdown_table(info: dict, rows: list[dict]) -> str:
    lines = [f"device {info['device']}, torch {info['torch']}, triton {info['triton']}, fla {info['fla']}, "
             f"{info['date_utc']} UTC",
             f"{info['precision']}, AdamW + grad clip, batch {info['batch_size']} x T {info['seq_len']}, "
             f"{info['warmup']} warm-up + {info['steps']} timed steps (median), grad ckpt "
             f"{'on' if info['grad_ckpt'] else 'off'}, torch.compile {'on' if info['compile'] else 'off'}",
             "", "| model | data | loss | params | tokens/s | ours/fla | x bundled | model TFLOP/s | MFU | step ms "
             "| peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r.get('data', '-')} | {r.get('loss_fn', '-')} | {_fmt(r, 'params', ',')} | "
                     f"{_fmt(r, 'tokens_per_s', ',.0f')} | {_fmt(r, 'ratio_ours_over_fla', '.2f')} | "
                     f"{_fmt(r, 'ratio_over_bundled', '.2f')} | {_fmt(r, 'model_tflops', '.1f')} | "
                     f"{_fmt(r, 'mfu', '.1%')} | "
                     f"{_fmt(r, 'step_ms', '.1f')} | "
                     f"{_fmt(r, 'peak_GiB', '.1f')} |")
    for r in rows:
        for key in ("error", "skipped"):
            if key in r:
                lines.append(f"\n{r['model']} on {r.get('data', '-')} {key}: {r[key]}")
    lines += ["", "Data:"] + [f"- {k}: {d}" for k, d in info.get("data", {}).items()]
    lines += ["", "Notes:"] + [f"- {n}" for n in info["notes"]]
    return "\n".join(lines)


def _versions() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "python": platform.python_version()}


def _shape_notes(shape: Shape, impl_log: list[str]) -> list[str]:
    """impl_log: our run's `hybridlm` log lines, where silu_mul(impl="auto") says which silu(gate) * up ran."""
    fused = any("ops.silu_mul:" in m and "picked 'triton'" in m for m in impl_log)
    swiglu = "as one fused Triton kernel" if fused else "in PyTorch"
    extra = len(shape.attention_layers) * (shape.hidden_size * shape.attn_heads * shape.attn_head_dim
                                           + 2 * shape.attn_head_dim)
    return [
        f"shape: hidden {shape.hidden_size}, {shape.num_layers} blocks, softmax attention at blocks "
        f"{shape.attention_layers}, SwiGLU {shape.intermediate_size}, GDN {shape.linear_heads} key / "
        f"{shape.linear_value_heads} value heads x {shape.linear_head_dim}, conv {shape.conv_size}, attention "
        f"{shape.attn_heads} / {shape.attn_kv_heads} kv heads x {shape.attn_head_dim}, vocab {shape.vocab_size}, "
        f"tied embeddings {shape.tie_embeddings}",
        "ours: Qwen3.5 layout (one in_proj_qkv and one short conv over q|k|v, gated attention with an output "
        f"gate and q/k RMSNorm, zero-centred RMSNorm, SwiGLU {swiglu}); fla: GatedDeltaNetForCausalLM with its "
        "Attention at the same blocks (no output gate, no q/k norm; fused RMSNorm and SwiGLU kernels): ours has "
        f"{extra:,} more parameters from the gate and q/k norms",
        "loss: each model's own training path, the token mean over the same targets: ours model(ids, "
        "cu_seqlens=, targets=) (linear + cross-entropy in chunks of tokens, the [tokens, vocab] logits never "
        "held), fla model(input_ids, cu_seqlens=, labels=) with its config's loss (fuse_cross_entropy: the logits, "
        "then its fused cross-entropy kernel); the last position of each row has no target for either",
        "x bundled: the row's tokens/s over the same model's on the bundled corpus in this run",
    ]


def _resolve_device(arg: str) -> torch.device:
    if arg == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(arg)
    except RuntimeError as e:
        raise ValueError(f"--device: expected auto, cpu, cuda or cuda:N, got {arg!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {arg}: no CUDA device is visible; use --device cpu with --tiny")
    return dev


def _spec(args: argparse.Namespace) -> tuple[Shape, RunSpec]:
    """Validated shape and run settings from the flags."""
    dev = _resolve_device(args.device)
    if dev.type == "cpu" and args.device == "auto" and not args.tiny:
        raise ValueError("no CUDA device: the 350M run needs one; pass --tiny for the CPU smoke run "
                         "(or --device cpu to insist)")
    shape = SHAPE_TINY if args.tiny else SHAPE_350M
    defaults = RUN_DEFAULTS["tiny" if args.tiny else "350m"]
    vals = [v if v is not None else d for v, d in zip((args.seq_len, args.batch_size, args.steps, args.warmup),
                                                        defaults)]
    for flag, v, low in zip(("--seq-len", "--batch-size", "--steps", "--warmup"), vals, (2, 1, 1, 0)):
        if v < low:
            raise ValueError(f"{flag}: must be >= {low}, got {v}")
    if args.lr <= 0:
        raise ValueError(f"--lr: must be > 0, got {args.lr}")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise ValueError(f"--peak-tflops: expected > 0, got {args.peak_tflops}")
    if args.profile < 0 or (args.profile and dev.type != "cuda"):
        raise ValueError(f"--profile: expected 0, or a number of steps >= 1 on a CUDA device, got {args.profile} "
                         f"on {dev}")
    seq_len, batch, steps, warmup = vals
    parse_data(args.data)
    return shape, RunSpec(seq_len, batch, steps, warmup, args.lr, args.seed, args.grad_ckpt, args.compile, dev,
                          bf16=dev.type == "cuda", recompute_linear=args.recompute_linear,
                          profile=args.profile)


def _label_rows(ours: dict, theirs: dict, configs: dict, spec: RunSpec, fla_version: str | None) -> None:
    """Label, loss name and ours/fla ratio of one data kind's two rows."""
    ours["label"] = "ours (hybridlm, impl=auto" + (", linear_recompute)" if spec.recompute_linear else ")")
    theirs["label"] = "fla GatedDeltaNetForCausalLM" + (f" ({fla_version})" if fla_version else "")
    ours["loss_fn"] = loss_name("ours", configs["ours"])
    if "skipped" not in theirs:
        theirs["loss_fn"] = loss_name("fla", configs["fla"])
    if "tokens_per_s" in ours and "tokens_per_s" in theirs:
        ours["ratio_ours_over_fla"] = ours["tokens_per_s"] / theirs["tokens_per_s"]


def _add_mfu(row: dict, flops_per_token: float, peak: float | None) -> None:
    """The row's model TFLOP/s (`train_flops_per_token` x tokens/s) and, with a peak, its MFU."""
    if "tokens_per_s" not in row:
        return
    row["model_tflops"] = flops_per_token * row["tokens_per_s"] / 1e12
    if peak:
        row["mfu"] = row["model_tflops"] / peak


def _ratio_over_bundled(rows: list[dict]) -> None:
    """Each row's tokens/s over the same model's bundled-corpus row (when both ran)."""
    base = {r["model"]: r["tokens_per_s"] for r in rows if r.get("data") == "bundled" and "tokens_per_s" in r}
    for r in rows:
        if r.get("data") != "bundled" and "tokens_per_s" in r and r["model"] in base:
            r["ratio_over_bundled"] = r["tokens_per_s"] / base[r["model"]]


def run(args: argparse.Namespace) -> int:
    try:
        shape, spec = _spec(args)
    except ValueError as e:
        print(f"hybridlm bench train: error: {e}", file=sys.stderr)
        return 2
    dev = spec.device
    fla_version, fla_notes, fla_skip = load_fla(dev, args.no_fla)
    info = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
            **_versions(), "fla": fla_version, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "command": getattr(args, "command", None) or shlex.join(sys.argv),
            "precision": "bf16 autocast" if spec.bf16 else "fp32", "seq_len": spec.seq_len,
            "batch_size": spec.batch_size, "steps": spec.steps, "warmup": spec.warmup, "grad_ckpt": spec.grad_ckpt,
            "recompute_linear": spec.recompute_linear,
            "compile": spec.compile, "shape": asdict(shape)}
    kinds = parse_data(args.data)
    peak = peak_tflops(dev, args.peak_tflops)
    info["peak_tflops"] = peak
    print(f"hybridlm bench train: {info['device']}, batch {spec.batch_size} x T {spec.seq_len}, "
          f"{spec.warmup} + {spec.steps} steps, data {', '.join(kinds)}", flush=True)
    fla_packed = None if fla_skip is not None else fla_packed_skip()
    build = functools.partial(build_ours, recompute_linear=spec.recompute_linear)
    rows, configs, info["data"] = [], {"ours": None, "fla": None}, {}
    with _collect_logs() as impl_log:
        for kind in kinds:
            try:
                batches, info["data"][kind] = make_batches(kind, shape, spec,
                                                           spec.warmup + spec.steps + spec.profile)
            except Exception as e:  # noqa: BLE001  (data that cannot be read fails its rows, not the others)
                info["data"][kind] = f"{type(e).__name__}: {e}"
                rows += [{"model": m, "data": kind, "label": m, "error": info["data"][kind]} for m in ("ours", "fla")]
                continue
            ours, cfg = measure("ours", build, shape, spec, batches, kind)
            configs["ours"] = configs["ours"] or cfg
            theirs = {"model": "fla", "data": kind}
            skip = fla_skip or (fla_packed if kind != "random" else None)
            if skip is None:
                theirs, cfg = measure("fla", build_fla, shape, spec, batches, kind)
                configs["fla"] = configs["fla"] or cfg
            else:
                theirs["skipped"] = skip
            fpt = train_flops_per_token(shape, mean_context(batches[: spec.warmup + spec.steps], spec.seq_len))
            for r in (ours, theirs):
                _add_mfu(r, fpt, peak)
                print(json.dumps({k: v for k, v in r.items() if k != "step_ms_all"}), flush=True)
            _label_rows(ours, theirs, configs, spec, fla_version)
            rows += [ours, theirs]
    info["notes"] = _shape_notes(shape, impl_log) + fla_notes + [
        f"model TFLOP/s: tokens/s x the model FLOPs of a token (`train_flops_per_token`: 6 x "
        f"{matmul_params(shape):,} matmul weights, causal attention over each document, the chunked GDN products), "
        "the same count for both models; MFU: that over "
        + (f"{peak:g} TFLOP/s (bf16 dense peak)" if peak else "the device's peak (unknown here: --peak-tflops)")]
    _ratio_over_bundled(rows)
    table = markdown_table(info, rows)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    atomic_write_text(os.path.join(args.out, "train.json"),
                      json.dumps({"info": info, "configs": configs, "rows": rows, "ours_impl_log": impl_log},
                                 indent=1, default=str))
    atomic_write_text(os.path.join(args.out, "train.md"), table + "\n")
    prof = profile_table(rows)
    if prof:
        print(prof)
        atomic_write_text(os.path.join(args.out, "profile.md"), prof + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybridlm.bench.train", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    args.command = shlex.join(["python", "-m", "hybridlm.bench.train", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
