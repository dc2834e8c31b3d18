"""MQAR (multi-query associative recall, Zoology, Arora et al. 2023): can a token mixer look up what it was told?

Non-standard here:
- The data follow Zoology's recipe (`mqar_data`): key-value pairs, then the keys again at power-law gaps among
  random tokens; only the recalled values are scored.
- The paper preset gives each mixer its published form (qk_norm "recipe"): linear attention with elu + 1
  features, the scalar-decay mixer as Mamba2 (raw q/k, the write scaled by the same dt as the decay), the delta-rule
  mixers with l2-normalised q/k; qk_norm "l2" l2-normalises every mixer's q/k instead.
- The mixers are the layers of `hybridlm.layers`: GDN, KDA, Comba and MesaNet, linear attention, the scalar-decay
  mixer and DeltaNet as the GDN layer with its recurrence swapped (`RecurrentMixer`; the library has no layer of
  their own), softmax attention as the plain library attention behind the same short conv the recurrent mixers
  have, and so PaTH attention (no forget gate) and DeltaFormer. They keep the bench's own initialisation, on which
  its results rest: decay rate softplus(a + dt_bias) with A fixed at 1 and slow initial decays (`slow_decay_init`),
  a biased beta projection for DeltaNet, GDN and Comba (`beta_bias`), short convs from N(0, 1/4) (`conv_init`).
  Training uses `hybridlm train`'s optimizer (with weight decay on every matrix, the embedding too), learning-rate
  schedule (decayed to 0) and autocast (`hybridlm.train.optim`).
- A grid of cells (mixer x width x setting x learning rate) is run cell by cell into a JSON file; a rerun skips
  cells already done, so the paper grid can be spread over several GPU calls.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..files import atomic_write_text
from ..layers import (
    Comba,
    DeltaFormerAttention,
    GatedAttention,
    GatedDeltaNet,
    KimiDeltaAttention,
    MesaNet,
    PaTHAttention,
    RMSNorm,
    ShortConv,
    SwiGLU,
)
from ..ops import delta_rule, gated_linear_attention, linear_attention
from ..train.optim import autocast, build_optimizer, lr_at, set_lr
from .mqar_data import IGNORE, check_mqar_setting, mqar_batch
from .mqar_results import atomic_savefig, estimate_seconds, load_results, merged_results, parse_shard

MIXERS = ("attention", "linear_attention", "gla", "deltanet", "gdn", "kda", "comba", "mesanet", "gdn_attention",
          "path", "deltaformer")
# the paper grid's mixers; the rest of the family runs PyTorch forms only (MesaNet's exact solve: a K x K matrix a
# token, ~17 GB a layer at width 256), so they join a GPU grid by --mixers
PAPER_MIXERS = ("attention", "linear_attention", "gla", "deltanet", "gdn", "kda", "gdn_attention")


# ----------------------------------------------------------------------------------------------------------------
# models: embedding + blocks of `hybridlm.layers`


class RecurrentMixer(GatedDeltaNet):
    """The library's GatedDeltaNet layer (split layout: in_proj_qkv -> short conv + SiLU -> recurrence -> gated
    RMSNorm -> out_proj) with its recurrence swapped (the library has no layer of their own): "linear_attention",
    "gla" (scalar decay g = -exp(A_log) * softplus(a + dt_bias)) or "deltanet" (beta = sigmoid(b)). Parameters a rule
    does not read are removed (a CUDA graph's backward needs a gradient for every parameter).
    qk_norm "l2": l2-normalised q and k; "recipe": linear attention with elu + 1 features (Katharopoulos et al.
    2020), the scalar-decay mixer with raw q/k and Mamba2's write h_t = exp(-A dt_t) h_t-1 + dt_t k_t v_t^T (it can
    skip a token as well as forget); the delta rule always l2-normalises (its update needs it). x: [B, T, D]."""

    def __init__(self, rule: str, width: int, num_heads: int, key_dim: int, value_dim: int, *, impl: str = "auto",
                 qk_norm: str = "l2"):
        super().__init__(width, num_heads, num_heads, key_dim, value_dim, layout="split", impl=impl)
        check_qk_norm(qk_norm)
        self.rule = rule
        self.l2 = qk_norm == "l2" or rule == "deltanet"
        self.elu_features = not self.l2 and rule == "linear_attention"
        self.dt_write = not self.l2 and rule == "gla"
        if rule != "gla":
            del self.in_proj_a, self.A_log, self.dt_bias
        if rule != "deltanet":
            del self.in_proj_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.conv1d(self.in_proj_qkv(x), impl=self.impl, split=(self.key_dim, self.key_dim, self.value_dim))
        q, k, v = q.view(B, T, self.H, self.dk), k.view(B, T, self.H, self.dk), v.view(B, T, self.HV, self.dv)
        if self.elu_features:
            q, k = F.elu(q) + 1, F.elu(k) + 1
        kw = dict(use_qk_l2norm=self.l2, impl=self.impl)
        if self.rule == "linear_attention":
            o, _ = linear_attention(q, k, v, **kw)
        elif self.rule == "gla":
            dt = F.softplus(_gate_float(self.in_proj_a(x)) + self.dt_bias)  # [B, T, H]
            o, _ = gated_linear_attention(q, k, v, g=-_gate_float(self.A_log).exp() * dt,
                                          beta=dt if self.dt_write else None, **kw)
        else:
            o, _ = delta_rule(q, k, v, beta=torch.sigmoid(_gate_float(self.in_proj_b(x))), **kw)
        z = self.in_proj_z(x).view(B, T, self.HV, self.dv)
        return self.out_proj(self.norm(o, z, impl=self.impl).reshape(B, T, self.value_dim))


def _gate_float(t: torch.Tensor) -> torch.Tensor:
    """Gates in float32 (bf16 under autocast would round the decay), float64 kept for the exact reference."""
    return t if t.dtype == torch.float64 else t.float()


class ConvAttention(nn.Module):
    """The library's plain softmax attention (no output gate, no q/k norm, full rotary) with the recurrent mixers'
    short conv + SiLU after each q/k/v projection (the key at a value's position can be the key before it; a conv over
    the block input mixes the two tokens' embeddings: tiny preset recall 0.67, not 0.99). kind "path" / "deltaformer":
    PaTH attention (its own positions, no rotary) / DeltaFormer (full rotary) behind the same convs. x: [B, T, D]."""

    def __init__(self, width: int, num_heads: int, *, impl: str = "auto", kind: str = "attention"):
        super().__init__()
        hd = width // num_heads
        if kind == "path":
            self.attn = PaTHAttention(width, num_heads, num_heads, hd, impl=impl)
        elif kind == "deltaformer":
            self.attn = DeltaFormerAttention(width, num_heads, num_heads, hd, rotary_dim=hd, impl=impl)
        else:
            self.attn = GatedAttention(width, num_heads, num_heads, hd, gate="none", qk_norm="none", rotary_dim=hd)
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self.attn, name, nn.Sequential(getattr(self.attn, name), ShortConv(width, 4, "silu", impl=impl)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, None, torch.arange(x.shape[1], device=x.device)[None])  # positions [1, T]


def slow_decay_init(mixer: nn.Module) -> None:
    """A fixed at 1 (A_log a zero buffer: the decay rate is softplus(a + dt_bias) alone, as the bench's mixers always
    had it; a learned A at lr 1e-2 moves the decay faster than the gate can) and decay rates softplus(dt_bias)
    log-uniform in [1e-3, 1e-1] (memories of 10 to 1000 tokens): the library's init (A up to 16; KDA's dt_bias 0)
    forgets within a few tokens, and one head would first have to learn to keep."""
    shape = mixer.A_log.shape
    del mixer.A_log
    mixer.register_buffer("A_log", torch.zeros(shape))
    with torch.no_grad():
        dt = torch.empty_like(mixer.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp()
        mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)


def forget_gate_init(mixer: MesaNet) -> None:
    """MesaNet's forget gate e^g = sigmoid(a_proj(x)) with decay rates -g = softplus(-bias) log-uniform in
    [1e-3, 1e-1], as `slow_decay_init` gives the other mixers (a zero or default bias forgets half the memory at
    every token)."""
    with torch.no_grad():
        rate = torch.empty_like(mixer.a_proj.bias).uniform_(math.log(1e-3), math.log(1e-1)).exp()
        mixer.a_proj.bias.copy_(-(rate + torch.log(-torch.expm1(-rate))))  # -softplus^-1(rate)


def beta_bias(mixer: nn.Module) -> None:
    """The beta projection with a bias (beta = sigmoid(W x + b)), as the bench's delta-rule mixers had it: rms-normed
    inputs have no constant direction, so without it every token's write strength depends on its content alone."""
    name = "b_proj" if isinstance(mixer, Comba) else "in_proj_b"
    old = getattr(mixer, name)
    setattr(mixer, name, nn.Linear(old.in_features, old.out_features, bias=True))


def conv_init(model: nn.Module) -> None:
    """Every short conv's weight from N(0, 1 / kernel size) (the bench's init: std 0.5 at kernel 4; the library's
    Conv1d default is uniform with std 0.29, with which DeltaNet and GDN recalled 0.09 and 0.13 of the tiny preset,
    not 0.96 and 0.99)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ShortConv):
                m.weight.normal_(0.0, m.weight.shape[-1] ** -0.5)


def build_mixer(kind: str, width: int, num_heads: int, *, key_dim: int | None = None, value_dim: int | None = None,
                impl: str = "auto", qk_norm: str = "l2") -> nn.Module:
    """A token mixer of hybridlm.layers for one MQAR block (kind: one of MIXERS except gdn_attention)."""
    check_qk_norm(qk_norm)
    dk, dv = key_dim or width // num_heads, value_dim or width // num_heads
    if kind in ("attention", "path", "deltaformer"):
        return ConvAttention(width, num_heads, impl=impl, kind=kind)
    if kind == "gdn":
        mixer = GatedDeltaNet(width, num_heads, num_heads, dk, dv, layout="split", impl=impl)
    elif kind == "kda":
        if dk != dv:
            raise ValueError(f"value_dim: expected the key dim {dk} for kda (one head size), got {dv}")
        mixer = KimiDeltaAttention(width, num_heads, dk, impl=impl)
    elif kind == "comba":
        mixer = Comba(width, num_heads, num_heads, dk, dv, impl=impl)
    elif kind == "mesanet":
        mixer = MesaNet(width, num_heads, dk, dv, impl=impl)
        forget_gate_init(mixer)
        return mixer
    else:
        mixer = RecurrentMixer(kind, width, num_heads, dk, dv, impl=impl, qk_norm=qk_norm)
    if hasattr(mixer, "A_log"):
        slow_decay_init(mixer)
    if kind in ("gdn", "deltanet", "comba"):
        beta_bias(mixer)
    return mixer


class Block(nn.Module):
    """Pre-norm residual block: mixer, then (mlp=True) a SwiGLU MLP. Zoology's MQAR models have no MLP."""

    def __init__(self, mixer: nn.Module, width: int, mlp: bool = False, impl: str = "auto"):
        super().__init__()
        self.mixer, self.mixer_norm = mixer, RMSNorm(width, 1e-6, impl=impl)
        self.mlp = SwiGLU(width, 2 * width, impl=impl) if mlp else None
        self.mlp_norm = RMSNorm(width, 1e-6, impl=impl) if mlp else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x))
        return x if self.mlp is None else x + self.mlp(self.mlp_norm(x))


class MQARModel(nn.Module):
    """Two blocks (Zoology's setting). mixer "gdn_attention" is the hybrid: GDN first, attention second."""

    def __init__(self, mixer: str, *, width: int, num_heads: int, vocab_size: int, key_dim: int | None = None,
                 value_dim: int | None = None, mlp: bool = False, impl: str = "auto", qk_norm: str = "l2"):
        super().__init__()
        check_model_setting(mixer=mixer, width=width, num_heads=num_heads, key_dim=key_dim, value_dim=value_dim)
        kinds = {"gdn_attention": ["gdn", "attention"]}.get(mixer, [mixer, mixer])
        self.embed = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(
            Block(build_mixer(k, width, num_heads, key_dim=key_dim, value_dim=value_dim, impl=impl, qk_norm=qk_norm),
                  width, mlp=mlp, impl=impl)
            for k in kinds
        )
        self.norm = RMSNorm(width, 1e-6, impl=impl)
        self.head = nn.Linear(width, vocab_size, bias=False)
        conv_init(self)

    def forward(self, ids: torch.Tensor, scored: torch.Tensor | None = None) -> torch.Tensor:
        """ids: [B, T] -> logits [B, T, vocab]; with scored (bool [B, T]) only the scored positions' logits
        [n_scored, vocab]: MQAR scores one position in eight or fewer, and the vocabulary head is most of the step."""
        x = self.features(ids)
        return self.logits(x[scored] if scored is not None else x)

    def features(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [B, T] -> the last block's output [B, T, width] (before the final norm and the head)."""
        return _embed_and_blocks(self.embed, self.blocks, ids)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., width] features -> [..., vocab]."""
        return self.head(self.norm(x))


class _Trunk(nn.Module):
    """The embedding and the blocks of an MQARModel (shared parameters): the part a CUDA graph can hold, since the
    scored positions it is read at vary from batch to batch."""

    def __init__(self, model: MQARModel):
        super().__init__()
        self.embed, self.blocks = model.embed, model.blocks

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _embed_and_blocks(self.embed, self.blocks, ids)


def _embed_and_blocks(embed: nn.Module, blocks: nn.ModuleList, ids: torch.Tensor) -> torch.Tensor:
    x = embed(ids)
    for blk in blocks:
        x = blk(x)
    return x


QK_NORMS = ("l2", "recipe")
# the mixers whose model differs between qk_norm "l2" and "recipe", and the suffix that keeps their recipe cells
# apart: linear attention's q/k features; the scalar-decay mixer's raw q/k and dt-scaled write ("dtw": cells run
# before the write was scaled kept the plain "|qkrecipe" and are not reused)
RECIPE_CHANGES = {"linear_attention": "|qkrecipe", "gla": "|qkrecipe|dtw"}
# ends every cell key of the models built from hybridlm.layers: cells of the bench's earlier mixers of its own
# (results/mqar-paper/) still load and tabulate, but a rerun does not count them as done
MODEL_TAG = "|layers"


def check_qk_norm(qk_norm: str) -> None:
    if qk_norm not in QK_NORMS:
        raise ValueError(f"qk_norm: expected one of {', '.join(QK_NORMS)}, got {qk_norm!r}")


def check_model_setting(*, mixer: str, width: int, num_heads: int, key_dim: int | None = None,
                        value_dim: int | None = None) -> None:
    if mixer not in MIXERS:
        raise ValueError(f"mixer: expected one of {', '.join(MIXERS)}, got {mixer!r}")
    if num_heads < 1:
        raise ValueError(f"num_heads: expected >= 1, got {num_heads}")
    if width % num_heads != 0 or (width // num_heads) % 2 != 0:
        raise ValueError(f"width: expected a multiple of num_heads={num_heads} with an even head size, got "
                         f"width={width}")
    for name, val in (("key_dim", key_dim), ("value_dim", value_dim)):
        if val is not None and val < 1:
            raise ValueError(f"{name}: expected >= 1 (or None for width / num_heads), got {val}")


# ----------------------------------------------------------------------------------------------------------------
# one cell


@dataclass
class Setting:
    seq_len: int  # tokens per example
    num_pairs: int  # key-value pairs to recall
    vocab_size: int  # keys from [1, V/2), values from [V/2, V)


@dataclass
class TrainConfig:
    num_heads: int = 1
    key_dim: int | None = None  # q/k size per head of the recurrent mixers; None: width / num_heads
    value_dim: int | None = None  # v size per head of the recurrent mixers; None: width / num_heads
    mlp: bool = False  # SwiGLU MLP after each mixer (Zoology's MQAR models have none)
    steps: int = 1000  # optimizer steps, each on a fresh batch (no example is seen twice)
    batch_size: int = 64
    warmup: float = 0.1  # fraction of steps of linear warmup, then cosine decay to 0
    weight_decay: float = 0.1
    test_examples: int = 1000
    # train each batch on P/4, P/2 and P pairs in equal parts (Zoology trains on several pair counts at once: the
    # easy examples teach the lookup sooner); tested on P pairs only
    mixed_pairs: bool = False
    qk_norm: str = "l2"  # "l2": every recurrent mixer l2-normalises q, k; "recipe": each as published (RecurrentMixer)
    impl: str = "auto"  # recurrence implementation (hybridlm.ops impl); not part of the cell key
    # capture the embedding and blocks (forward and backward) in CUDA graphs: one launch each instead of hundreds
    # of small kernels a step; same arithmetic; not part of the cell key
    cuda_graphs: bool = False
    amp: bool = True  # bf16 autocast on CUDA; not part of the cell key

    def tag(self) -> str:
        return (f"h{self.num_heads}|dk{self.key_dim or '-'}|dv{self.value_dim or '-'}|mlp{int(self.mlp)}"
                f"|s{self.steps}|b{self.batch_size}|wu{self.warmup:g}|wd{self.weight_decay:g}"
                + ("|mix" if self.mixed_pairs else ""))


@dataclass
class Cell:
    mixer: str
    width: int
    setting: Setting
    lr: float

    def key(self, cfg: TrainConfig) -> str:
        s = self.setting
        # qk_norm "recipe" changes only the mixers in RECIPE_CHANGES; the others are the same model either way and
        # share their results
        qk = RECIPE_CHANGES.get(self.mixer, "") if cfg.qk_norm == "recipe" else ""
        return (f"{self.mixer}|d{self.width}|T{s.seq_len}|P{s.num_pairs}|V{s.vocab_size}|lr{self.lr:g}|{cfg.tag()}"
                f"{qk}{MODEL_TAG}")


def train_cell(cell: Cell, cfg: TrainConfig, *, seed: int, device: torch.device) -> dict:
    """Train from scratch on fresh examples every step; score recall accuracy on held-out examples. `hybridlm
    train`'s AdamW groups, warmup + cosine schedule (to 0 here) and autocast: bf16 on CUDA unless cfg.amp is off."""
    s = cell.setting
    torch.manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed)  # training data are sampled where the model runs
    data = dict(seq_len=s.seq_len, num_pairs=s.num_pairs, vocab_size=s.vocab_size)
    x_te, y_te = mqar_batch(cfg.test_examples, **data, generator=torch.Generator().manual_seed(seed + 1_000_003))
    groups = train_groups(cfg.batch_size, s.num_pairs, cfg.mixed_pairs)
    n_scored = sum(n * pairs for n, pairs in groups)
    model = MQARModel(cell.mixer, width=cell.width, num_heads=cfg.num_heads, vocab_size=s.vocab_size,
                      key_dim=cfg.key_dim, value_dim=cfg.value_dim, mlp=cfg.mlp, impl=cfg.impl,
                      qk_norm=cfg.qk_norm).to(device)
    # every matrix decays, the embedding too (no_decay=()): the bench's rule, kept so its results stay comparable
    opt = build_optimizer(model, cell.lr, cfg.weight_decay, betas=(0.9, 0.98), no_decay=())
    warmup = max(1, int(cfg.warmup * cfg.steps))
    bf16 = cfg.amp and device.type == "cuda"
    t_start = time.perf_counter()
    trunk: nn.Module = _Trunk(model)
    if cfg.cuda_graphs:
        if device.type != "cuda":
            raise ValueError(f"cuda_graphs: expected a CUDA device, got {device}")
        # autocast's weight-cast cache cannot live across graph replays (make_graphed_callables' rule)
        amp = autocast(device, bf16, cache=False)
        with amp:
            trunk = torch.cuda.make_graphed_callables(
                trunk, (torch.zeros(cfg.batch_size, s.seq_len, dtype=torch.int64, device=device),))
    else:
        amp = autocast(device, bf16)
    t0 = time.perf_counter()
    losses = []
    for step in range(cfg.steps):
        parts = [mqar_batch(n, **{**data, "num_pairs": P}, generator=gen) for n, P in groups]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        # every example scores exactly its number of pairs, so the count is known and finding the scored positions
        # needs no device-to-host sync (a boolean index would wait for the GPU every step)
        idx = torch.nonzero_static((y != IGNORE).flatten(), size=n_scored).squeeze(1)
        with amp:
            # logits at the scored positions only [n_scored, vocab]: the same mean loss as over all positions
            logits = model.logits(trunk(x).flatten(0, 1)[idx])
        loss = F.cross_entropy(logits.float(), y.flatten()[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        set_lr(opt, lr_at(step, lr=cell.lr, warmup=warmup, total=cfg.steps, min_ratio=0.0))
        opt.step()
        if step % 50 == 0 or step == cfg.steps - 1:
            losses.append(round(loss.item(), 4))
    train_s = time.perf_counter() - t0
    acc = evaluate(model, x_te, y_te, batch_size=cfg.batch_size, device=device, bf16=bf16)
    return {"key": cell.key(cfg), "mixer": cell.mixer, "width": cell.width, **asdict(s), "lr": cell.lr,
            **asdict(cfg), "accuracy": acc, "final_train_loss": losses[-1], "loss_every_50": losses,
            "ms_per_step": round(1000 * train_s / cfg.steps, 2), "seconds": round(time.perf_counter() - t_start, 2),
            "setup_seconds": round(t0 - t_start, 2), "seed": seed, "device": device_name(device),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def train_groups(batch_size: int, num_pairs: int, mixed: bool) -> list[tuple[int, int]]:
    """(examples, pairs) making up one training batch: all at num_pairs, or (mixed) split as evenly as possible over
    num_pairs // 4, num_pairs // 2 and num_pairs (duplicates and zeros dropped)."""
    if not mixed:
        return [(batch_size, num_pairs)]
    counts = sorted({max(1, num_pairs // 4), max(1, num_pairs // 2), num_pairs})
    if batch_size < len(counts):
        raise ValueError(f"batch_size: expected >= {len(counts)} with mixed pairs {counts}, got {batch_size}")
    sizes = [batch_size // len(counts) + (i < batch_size % len(counts)) for i in range(len(counts))]
    return list(zip(sizes, counts))


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, batch_size: int, device: torch.device,
             bf16: bool = False) -> float:
    """Recall accuracy: the share of scored positions (labels not IGNORE) whose argmax is the value."""
    model.eval()
    right = total = 0
    for i in range(0, x.shape[0], batch_size):
        yb = y[i : i + batch_size].to(device)
        with autocast(device, bf16):
            pred = model(x[i : i + batch_size].to(device)).argmax(-1)
        mask = yb != IGNORE
        right += (pred[mask] == yb[mask]).sum().item()
        total += mask.sum().item()
    model.train()
    return right / total


# ----------------------------------------------------------------------------------------------------------------
# grids and the command


PRESETS = {
    # CPU, minutes. Random tokens fill the query region (Zoology's data), so a state that cannot forget or overwrite
    # (plain linear attention) fills up with noise; 8 pairs at width 64 (one 64 x 64 state per layer).
    "tiny": dict(mixers=list(MIXERS), widths=[64], seq_lens=[64], pairs=[8], vocab_size=512, lrs=[1e-2],
                 num_heads=1, key_dim=None, value_dim=None, mlp=False, steps=600, batch_size=64, warmup=0.1,
                 weight_decay=0.1, test_examples=500, mixed_pairs=False, qk_norm="l2"),
    # one GPU, resumable: 64 pairs in 512 tokens (the hardest setting of Zoology's and DeltaNet's MQAR plots); one
    # head, so a recurrent mixer's state is width x width and 64 pairs fill it at width 64; training mixes 16, 32
    # and 64 pairs (Zoology trains on several pair counts: at 1000 steps of 32 pairs alone no recurrent mixer left
    # chance level); each mixer in its published form (qk_norm "recipe": with l2-normalised q/k for every mixer,
    # linear attention recalled 0.977 of 64 pairs at width 64); lr 1e-2 left every recurrent mixer at chance and
    # 6e-3 most of them (H100 runs), hence 1e-3 and 3e-3; 42 cells of 4000 steps x 128 examples
    "paper": dict(mixers=list(PAPER_MIXERS), widths=[64, 128, 256], seq_lens=[512], pairs=[64], vocab_size=4096,
                  lrs=[1e-3, 3e-3], num_heads=1, key_dim=None, value_dim=None, mlp=False, steps=4000,
                  batch_size=128, warmup=0.1, weight_decay=0.1, test_examples=1000, mixed_pairs=True,
                  qk_norm="recipe"),
}


def build_cells(cfg: dict) -> list[Cell]:
    # learning rate outermost: a grid cut short by a time limit still has every cell at the first rate
    cells = []
    for lr in cfg["lrs"]:
        for T in cfg["seq_lens"]:
            for P in cfg["pairs"]:
                if 4 * P > T + 1:
                    continue  # this many pairs do not fit in this sequence
                for d in cfg["widths"]:
                    for m in cfg["mixers"]:
                        cells.append(Cell(m, d, Setting(T, P, cfg["vocab_size"]), lr))
    return cells


def best_per_cell(results: list[dict]) -> list[dict]:
    """Keep the best learning rate of each (mixer, width, setting), as the paper reports."""
    best: dict[tuple, dict] = {}
    for r in results:
        k = (r["mixer"], r["width"], r["seq_len"], r["num_pairs"], r["vocab_size"])
        if k not in best or r["accuracy"] > best[k]["accuracy"]:
            best[k] = r
    return sorted(best.values(), key=lambda r: (r["seq_len"], r["num_pairs"], r["mixer"], r["width"]))


def format_table(rows: list[dict]) -> str:
    widths = sorted({r["width"] for r in rows})
    settings = sorted({(r["seq_len"], r["num_pairs"]) for r in rows})
    lines = []
    for T, P in settings:
        lines.append(f"seq_len={T} pairs={P}")
        lines.append(f"  {'mixer':<18}" + "".join(f"{'d=' + str(w):>9}" for w in widths))
        for m in MIXERS:
            accs = {r["width"]: r["accuracy"] for r in rows if (r["seq_len"], r["num_pairs"], r["mixer"]) == (T, P, m)}
            if accs:
                lines.append(f"  {m:<18}" + "".join(f"{accs[w]:>9.3f}" if w in accs else f"{'-':>9}" for w in widths))
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({(r["seq_len"], r["num_pairs"]) for r in rows})
    fig, axes = plt.subplots(1, len(settings), figsize=(4.5 * len(settings), 3.8), squeeze=False)
    for ax, (T, P) in zip(axes[0], settings):
        for m in MIXERS:
            pts = sorted((r["width"], r["accuracy"]) for r in rows
                         if (r["seq_len"], r["num_pairs"], r["mixer"]) == (T, P, m))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_title(f"MQAR: seq_len {T}, {P} pairs")
        ax.set_xlabel("model width")
        ax.set_ylabel("recall accuracy")
        ax.set_ylim(0, 1.02)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, path)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="grid to run: tiny (CPU, minutes) or paper (one GPU, resumable); flags below override it")
    parser.add_argument("--mixers", nargs="+", choices=MIXERS, help="token mixers (default: the preset's)")
    parser.add_argument("--widths", nargs="+", type=int, help="model widths (default: the preset's)")
    parser.add_argument("--seq-lens", nargs="+", type=int, help="sequence lengths (default: the preset's)")
    parser.add_argument("--pairs", nargs="+", type=int, help="numbers of key-value pairs (default: the preset's)")
    parser.add_argument("--vocab-size", type=int, help="vocabulary size (default: the preset's)")
    parser.add_argument("--lrs", nargs="+", type=float, help="learning rates swept per cell (default: the preset's)")
    parser.add_argument("--num-heads", type=int, help="heads per mixer (default: the preset's)")
    parser.add_argument("--key-dim", type=int, help="q/k size per head of the recurrent mixers (default: the preset's;"
                        " 0 means width / num_heads)")
    parser.add_argument("--value-dim", type=int, help="v size per head of the recurrent mixers (default: the preset's;"
                        " 0 means width / num_heads)")
    parser.add_argument("--mlp", action=argparse.BooleanOptionalAction, default=None,
                        help="a SwiGLU MLP after each mixer (default: the preset's; Zoology uses none)")
    parser.add_argument("--mixed-pairs", action=argparse.BooleanOptionalAction, default=None,
                        help="train on P/4, P/2 and P pairs in equal parts of each batch, test on P (default: the "
                        "preset's; Zoology trains on several pair counts together)")
    parser.add_argument("--qk-norm", choices=QK_NORMS, default=None,
                        help="l2: every recurrent mixer l2-normalises q and k (isolates the update rule); recipe: "
                        "each as published (linear attention elu+1 features, the scalar-decay mixer raw q/k and "
                        "Mamba2's dt-scaled write, the delta-rule mixers l2) (default: the preset's)")
    parser.add_argument("--steps", type=int, help="optimizer steps per cell, each on a fresh batch")
    parser.add_argument("--batch-size", type=int, help="examples per step")
    parser.add_argument("--warmup", type=float, help="fraction of steps of linear warmup before the cosine decay")
    parser.add_argument("--weight-decay", type=float, help="AdamW weight decay of the matrices")
    parser.add_argument("--test-examples", type=int, help="held-out examples scored per cell")
    parser.add_argument("--seed", type=int, default=0, help="seed of data and initialisation")
    parser.add_argument("--out", default="runs/mqar", help="folder for results.json, table.txt and mqar.png")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--max-cells", type=int, default=None, help="stop after this many new cells (resume later)")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="stop before a cell that would end past this many minutes (estimated from the cells "
                        "run so far); rerun the same command to resume")
    parser.add_argument("--shard", default=None,
                        help="I/N: of the cells missing from results.json, run those whose index is I modulo N, "
                        "into results.shardIofN.json (N processes share one GPU; a plain run afterwards merges them "
                        "and writes the table)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    parser.add_argument("--impl", choices=("auto", "chunk", "naive", "triton"), default="auto",
                        help="recurrence implementation of hybridlm.ops (auto: Triton kernels on CUDA where they exist,"
                        " else the PyTorch chunk form); chunk is the fallback if a kernel fails")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="capture each cell's embedding and blocks (forward and backward) in CUDA graphs: the "
                        "small models are launch-bound, the arithmetic is the same")
    parser.add_argument("--no-amp", dest="amp", action="store_false",
                        help="run in float32 on CUDA instead of bf16 autocast")


_OVERRIDES = ("mixers", "widths", "seq_lens", "pairs", "vocab_size", "lrs", "num_heads", "key_dim", "value_dim",
              "mlp", "mixed_pairs", "qk_norm", "steps",
              "batch_size", "warmup", "weight_decay", "test_examples")


def resolve_config(args: argparse.Namespace) -> dict:
    """The preset with the given flags applied, checked (errors name the flag, what it expects and what it got)."""
    cfg = dict(PRESETS[args.preset])
    for name in _OVERRIDES:
        if getattr(args, name, None) is not None:
            cfg[name] = getattr(args, name)
    for name in ("key_dim", "value_dim"):
        if cfg[name] == 0:
            cfg[name] = None
    for w in cfg["widths"]:
        if w % cfg["num_heads"] != 0 or (w // cfg["num_heads"]) % 2 != 0:
            raise ValueError(f"widths: expected multiples of num_heads={cfg['num_heads']} with an even head size, "
                             f"got {w}")
    for m in cfg["mixers"]:
        check_model_setting(mixer=m, width=cfg["widths"][0], num_heads=cfg["num_heads"], key_dim=cfg["key_dim"],
                            value_dim=cfg["value_dim"])
    for name in ("steps", "batch_size", "test_examples"):
        if cfg[name] < 1:
            raise ValueError(f"{name}: expected >= 1, got {cfg[name]}")
    fits = [(T, P) for T in cfg["seq_lens"] for P in cfg["pairs"] if 4 * P <= T + 1]
    if not fits:  # the grid skips (T, P) pairs that do not fit; all of them not fitting is an error
        check_mqar_setting(seq_len=max(cfg["seq_lens"]), num_pairs=min(cfg["pairs"]), vocab_size=cfg["vocab_size"])
    for T, P in fits:
        check_mqar_setting(seq_len=T, num_pairs=P, vocab_size=cfg["vocab_size"])
    return cfg


def train_config(cfg: dict) -> TrainConfig:
    return TrainConfig(**{f: cfg[f] for f in TrainConfig.__dataclass_fields__ if f in cfg})


def run(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    cfg["impl"], cfg["amp"] = getattr(args, "impl", "auto"), getattr(args, "amp", True)
    cfg["cuda_graphs"] = getattr(args, "cuda_graphs", False)
    tcfg = train_config(cfg)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dev = device_name(device)
    os.makedirs(args.out, exist_ok=True)
    shard = parse_shard(getattr(args, "shard", None))
    path = os.path.join(args.out, "results.json" if shard is None else f"results.shard{shard[0]}of{shard[1]}.json")
    # a shard writes only its own file (several run at once on one GPU); a plain run gathers every shard's cells
    data = load_results(path) if shard is not None else merged_results(args.out)
    data["runs"].append({"command": shlex.join(["hybridlm", "bench", "mqar", *sys.argv[3:]])
                         if sys.argv[1:3] == ["bench", "mqar"] else shlex.join(sys.argv),
                         "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                         "config": cfg, "device": dev, "torch": torch.__version__,
                         "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    # a plain run's data are already the merged files; a shard also skips cells other shards or runs finished
    done = {r["key"] for r in (data if shard is None else merged_results(args.out))["cells"]}
    cells = build_cells(cfg)
    missing = [c for c in cells if c.key(tcfg) not in done]
    todo = missing
    if shard is not None:
        # shards split the cells that the merged results.json lacks (only a plain run writes it, so every shard of
        # one launch sees the same list, whenever it starts): a resumed grid stays balanced
        base = {r["key"] for r in load_results(os.path.join(args.out, "results.json"))["cells"]}
        share = [c for c in cells if c.key(tcfg) not in base][shard[0] :: shard[1]]
        todo = [c for c in share if c.key(tcfg) not in done]
    part = "" if shard is None else f" (shard {shard[0]}/{shard[1]})"
    print(f"MQAR preset={args.preset}{part}: {len(cells) - len(missing)} of {len(cells)} cells done, {len(todo)} to "
          f"run here on {dev} ({tcfg.steps} steps x batch {tcfg.batch_size} each)", flush=True)
    t_start = time.perf_counter()
    ran = 0
    for cell in todo:
        if args.max_cells is not None and ran >= args.max_cells:
            print("stopping at --max-cells; rerun the same command to continue")
            break
        est = estimate_seconds(cell, tcfg, data["cells"], dev)
        elapsed = time.perf_counter() - t_start
        if args.max_minutes is not None and ran > 0:
            guess = est if est is not None else elapsed / ran
            if elapsed + guess > 60 * args.max_minutes:
                print(f"stopping before {cell.key(tcfg)}: {elapsed / 60:.1f} min used, next cell ~{guess:.0f}s, "
                      f"budget {args.max_minutes:g} min; rerun the same command to continue")
                break
        r = train_cell(cell, tcfg, seed=args.seed, device=device)
        data["cells"].append(r)
        ran += 1
        atomic_write_text(path, json.dumps(data, indent=1))  # after every cell: a killed run loses one cell
        left = todo[ran:]
        ests = [estimate_seconds(c, tcfg, data["cells"], dev) for c in left]
        mean = (time.perf_counter() - t_start) / ran
        remaining = sum(e if e is not None else mean for e in ests)
        print(f"  {cell.mixer:<16} d={cell.width:<4} T={cell.setting.seq_len:<4} P={cell.setting.num_pairs:<3} "
              f"lr={cell.lr:<7g} acc {r['accuracy']:.3f}  loss {r['final_train_loss']:.3f}  "
              f"{r['seconds']:.0f}s ({r['ms_per_step']:.0f} ms/step); ~{remaining / 60:.1f} min left for "
              f"{len(left)} cells", flush=True)
    atomic_write_text(path, json.dumps(data, indent=1))
    if shard is not None:  # the table and plot come from a plain run after every shard has ended
        return 0
    grid = {c.key(tcfg) for c in cells}
    mine = [r for r in data["cells"] if r["key"] in grid]
    rows = best_per_cell(mine)
    if not rows:
        print("no cells done yet")
        return 0
    table = format_table(rows)
    # where and when the cells ran (a merge may run elsewhere, later)
    devices = sorted({r.get("device", "?") for r in rows})
    torches = sorted({r.get("torch", "?") for r in rows})
    dates = sorted(r.get("date", "?")[:10] for r in rows)
    meta = (f"MQAR, best lr per cell ({', '.join(f'{lr:g}' for lr in cfg['lrs'])}); {tcfg.steps} steps x batch "
            f"{tcfg.batch_size}, heads {tcfg.num_heads}, key dim {tcfg.key_dim or 'width/heads'}, vocab "
            f"{cfg['vocab_size']}; device {', '.join(devices)}, torch {', '.join(torches)}, run "
            f"{dates[0]}{'' if dates[0] == dates[-1] else ' to ' + dates[-1]}; {len(mine)} of {len(cells)} cells; "
            f"command: {data['runs'][-1]['command']}")
    atomic_write_text(os.path.join(args.out, "table.txt"), meta + "\n" + table + "\n")
    if not args.no_plot:
        plot(rows, os.path.join(args.out, "mqar.png"))
    print(meta)
    print(table)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="MQAR recall benchmark")
    add_arguments(p)
    raise SystemExit(run(p.parse_args()))
