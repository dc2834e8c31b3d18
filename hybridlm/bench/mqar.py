"""MQAR (multi-query associative recall, Zoology, Arora et al. 2023): can a token mixer look up what it was told?

Non-standard here:
- The data follow Zoology's recipe: P key-value pairs (keys from the lower half of the vocabulary, values from the
  upper half, drawn fresh for every example so nothing can be memorised across examples), then the keys again at
  gaps drawn from a power law (most queries soon after the context, a long tail far away), each followed by its
  value. Only the value positions are scored. Other positions hold token 0.
- Every mixer is the same small block (projections, short conv, recurrence, gated output norm) built directly on
  `hybridlm.ops`, so the table compares the recurrences and nothing else; softmax attention uses SDPA.
- A grid of cells (mixer x width x setting x learning rate) is run cell by cell into a JSON file; a rerun skips
  cells already done, so the paper grid can be spread over several GPU calls.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import (
    causal_conv1d,
    delta_rule,
    gated_delta_rule,
    gated_linear_attention,
    gated_rms_norm,
    kda,
    linear_attention,
    rms_norm,
)

MIXERS = ("attention", "linear_attention", "gla", "deltanet", "gdn", "kda", "gdn_attention")
IGNORE = -100


# ----------------------------------------------------------------------------------------------------------------
# data


def mqar_batch(
    n: int, *, seq_len: int, num_pairs: int, vocab_size: int, power_a: float = 0.01, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """n examples: inputs [n, seq_len] int64 and labels [n, seq_len] (IGNORE except where a value must be recalled).

    Layout before the one-token shift: [k1 v1 ... kP vP | query region of seq_len + 1 - 2P tokens], where key ki
    reappears at an even offset 2*gap_i of the query region, followed by vi; gaps are drawn without replacement with
    probability proportional to a * x^(a-1) (Zoology's power law).
    """
    check_mqar_setting(seq_len=seq_len, num_pairs=num_pairs, vocab_size=vocab_size)
    total = seq_len + 1
    half = vocab_size // 2
    # keys: distinct per example, from [1, half); values: from [half, vocab)
    keys = torch.argsort(torch.rand(n, half - 1, generator=generator), dim=1)[:, :num_pairs] + 1
    values = torch.randint(half, vocab_size, (n, num_pairs), generator=generator)
    context = torch.stack([keys, values], dim=2).reshape(n, 2 * num_pairs)

    space = (total - 2 * num_pairs) // 2  # query slots (pairs of positions)
    x = torch.arange(1, space + 1, dtype=torch.float64)
    p = power_a * x ** (power_a - 1)
    p = (p / p.sum()).expand(n, space)
    gaps = torch.multinomial(p, num_pairs, replacement=False, generator=generator)  # [n, P]
    queries = torch.zeros(n, total - 2 * num_pairs, dtype=torch.int64)
    queries.scatter_(1, 2 * gaps, keys)
    queries.scatter_(1, 2 * gaps + 1, values)
    seq = torch.cat([context, queries], dim=1)  # [n, total]

    inputs, targets = seq[:, :-1], seq[:, 1:]
    labels = torch.full_like(targets, IGNORE)
    value_pos = 2 * num_pairs + 2 * gaps  # positions (in inputs) holding a query key; the next token is its value
    labels.scatter_(1, value_pos, targets.gather(1, value_pos))
    return inputs.contiguous(), labels


def check_mqar_setting(*, seq_len: int, num_pairs: int, vocab_size: int) -> None:
    if num_pairs < 1:
        raise ValueError(f"num_pairs: expected >= 1, got {num_pairs}")
    if 4 * num_pairs > seq_len + 1:
        raise ValueError(
            f"num_pairs: {num_pairs} pairs need 4 * num_pairs <= seq_len + 1 (context + queries), "
            f"got seq_len={seq_len}; use at most {(seq_len + 1) // 4} pairs or a longer sequence"
        )
    if vocab_size // 2 - 1 < num_pairs:
        raise ValueError(f"vocab_size: {vocab_size} has only {vocab_size // 2 - 1} keys, fewer than num_pairs={num_pairs}")


# ----------------------------------------------------------------------------------------------------------------
# models


class LinearMixer(nn.Module):
    """q/k/v projections -> causal short conv + SiLU -> recurrence -> gated RMSNorm -> output projection.

    kind: "linear_attention" (no decay, Hebbian), "gla" (scalar decay per head, Hebbian; Mamba2-like), "deltanet"
    (delta rule), "gdn" (scalar decay + delta rule), "kda" (per-channel decay + delta rule). x: [B, T, D].
    """

    def __init__(self, kind: str, width: int, num_heads: int, conv_size: int = 4):
        super().__init__()
        self.kind, self.H, self.dh = kind, num_heads, width // num_heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.conv_w = nn.Parameter(torch.randn(3 * width, conv_size) / conv_size**0.5)
        n_gate = {"linear_attention": 0, "gla": num_heads, "deltanet": num_heads, "gdn": 2 * num_heads,
                  "kda": num_heads + width}[kind]
        self.gates = nn.Linear(width, n_gate, bias=True) if n_gate else None
        self.z = nn.Linear(width, width, bias=False)
        self.norm_w = nn.Parameter(torch.ones(self.dh))
        self.out = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        qkv, _ = causal_conv1d(self.qkv(x), self.conv_w, activation="silu")
        q, k, v = (t.reshape(B, T, self.H, self.dh) for t in qkv.chunk(3, dim=-1))
        H = self.H
        kw = dict(use_qk_l2norm=True)
        if self.kind == "linear_attention":
            o, _ = linear_attention(q, k, v, **kw)
        elif self.kind == "gla":
            a = self.gates(x)
            o, _ = gated_linear_attention(q, k, v, g=-F.softplus(a), **kw)
        elif self.kind == "deltanet":
            o, _ = delta_rule(q, k, v, beta=torch.sigmoid(self.gates(x)), **kw)
        elif self.kind == "gdn":
            a, b = self.gates(x).split([H, H], dim=-1)
            o, _ = gated_delta_rule(q, k, v, g=-F.softplus(a), beta=torch.sigmoid(b), **kw)
        else:  # kda
            b, a = self.gates(x).split([H, D], dim=-1)
            o, _ = kda(q, k, v, g=-F.softplus(a).reshape(B, T, H, self.dh), beta=torch.sigmoid(b), **kw)
        z = self.z(x).reshape(B, T, H, self.dh)
        return self.out(gated_rms_norm(o, z, self.norm_w, 1e-6).reshape(B, T, D))


class AttentionMixer(nn.Module):
    """Causal softmax attention (SDPA) with rotary positions. x: [B, T, D]."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.H, self.dh = num_heads, width // num_heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = (t.reshape(B, T, self.H, self.dh).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        q, k = rotary(q), rotary(k)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(B, T, D))


def rotary(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """x: [B, H, T, d] with d even; rotate pairs (i, i + d/2) by position-dependent angles."""
    T, d = x.shape[-2], x.shape[-1]
    inv = base ** (-torch.arange(0, d // 2, dtype=torch.float32, device=x.device) / (d // 2))
    ang = torch.arange(T, dtype=torch.float32, device=x.device)[:, None] * inv[None]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(nn.Module):
    """Pre-norm residual block: mixer, then a SwiGLU MLP."""

    def __init__(self, mixer: nn.Module, width: int):
        super().__init__()
        self.mixer = mixer
        self.n1, self.n2 = nn.Parameter(torch.ones(width)), nn.Parameter(torch.ones(width))
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(rms_norm(x, self.n1, 1e-6))
        a, b = self.up(rms_norm(x, self.n2, 1e-6)).chunk(2, dim=-1)
        return x + self.down(F.silu(a) * b)


class MQARModel(nn.Module):
    """Two blocks (Zoology's setting). mixer "gdn_attention" is the hybrid: GDN first, attention second."""

    def __init__(self, mixer: str, *, width: int, num_heads: int, vocab_size: int):
        super().__init__()
        if mixer not in MIXERS:
            raise ValueError(f"mixer: expected one of {MIXERS}, got {mixer!r}")
        if width % num_heads != 0 or (width // num_heads) % 2 != 0:
            raise ValueError(
                f"width: expected a multiple of num_heads={num_heads} with an even head size, got width={width}"
            )
        kinds = {"gdn_attention": ["gdn", "attention"]}.get(mixer, [mixer, mixer])
        self.embed = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(
            Block(AttentionMixer(width, num_heads) if k == "attention" else LinearMixer(k, width, num_heads), width)
            for k in kinds
        )
        self.norm = nn.Parameter(torch.ones(width))
        self.head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(rms_norm(x, self.norm, 1e-6))


# ----------------------------------------------------------------------------------------------------------------
# one cell


@dataclass
class Setting:
    seq_len: int  # tokens per example
    num_pairs: int  # key-value pairs to recall
    vocab_size: int  # keys from [1, V/2), values from [V/2, V)


@dataclass
class Cell:
    mixer: str
    width: int
    setting: Setting
    lr: float

    def key(self) -> str:
        s = self.setting
        return f"{self.mixer}|d{self.width}|T{s.seq_len}|P{s.num_pairs}|V{s.vocab_size}|lr{self.lr:g}"


def train_cell(cell: Cell, *, num_heads: int, train_examples: int, epochs: int, batch_size: int, test_examples: int,
               seed: int, device: torch.device) -> dict:
    """Train from scratch on fixed training examples and score recall accuracy on fresh held-out examples."""
    s = cell.setting
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    x_tr, y_tr = mqar_batch(train_examples, seq_len=s.seq_len, num_pairs=s.num_pairs, vocab_size=s.vocab_size,
                            generator=gen)
    x_te, y_te = mqar_batch(test_examples, seq_len=s.seq_len, num_pairs=s.num_pairs, vocab_size=s.vocab_size,
                            generator=torch.Generator().manual_seed(seed + 1_000_003))
    model = MQARModel(cell.mixer, width=cell.width, num_heads=num_heads, vocab_size=s.vocab_size).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cell.lr, weight_decay=0.1, betas=(0.9, 0.98))
    steps = epochs * math.ceil(train_examples / batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cell.lr, total_steps=steps, pct_start=0.1)
    t0, step = time.perf_counter(), 0
    for _ in range(epochs):
        perm = torch.randperm(train_examples, generator=gen)
        for i in range(0, train_examples, batch_size):
            idx = perm[i : i + batch_size]
            logits = model(x_tr[idx].to(device))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y_tr[idx].to(device).flatten(), ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
    acc = evaluate(model, x_te, y_te, batch_size=batch_size, device=device)
    return {"key": cell.key(), "mixer": cell.mixer, "width": cell.width, **asdict(s), "lr": cell.lr,
            "accuracy": acc, "final_train_loss": loss.item(), "steps": step,
            "seconds": round(time.perf_counter() - t0, 2)}


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, batch_size: int, device: torch.device) -> float:
    model.eval()
    right = total = 0
    for i in range(0, x.shape[0], batch_size):
        yb = y[i : i + batch_size].to(device)
        pred = model(x[i : i + batch_size].to(device)).argmax(-1)
        mask = yb != IGNORE
        right += (pred[mask] == yb[mask]).sum().item()
        total += mask.sum().item()
    model.train()
    return right / total


# ----------------------------------------------------------------------------------------------------------------
# grids and the command


PRESETS = {
    # CPU, minutes: one setting where capacity matters, width 64, two learning rates
    "tiny": dict(mixers=list(MIXERS), widths=[64], seq_lens=[64], pairs=[8], vocab_size=256, lrs=[3e-3, 1e-2],
                 train_examples=4000, epochs=8, batch_size=64, test_examples=500, num_heads=1),
    # one GPU: Zoology's grid (vocab 8192, widths 64-256, sequence 64-256 with 4-64 pairs, lr sweep)
    "paper": dict(mixers=list(MIXERS), widths=[64, 128, 256], seq_lens=[64, 128, 256], pairs=[4, 16, 64],
                  vocab_size=8192, lrs=[1e-3, 3e-3, 1e-2], train_examples=100_000, epochs=16, batch_size=256,
                  test_examples=3000, num_heads=1),
}


def build_cells(cfg: dict) -> list[Cell]:
    cells = []
    for T in cfg["seq_lens"]:
        for P in cfg["pairs"]:
            if 4 * P > T + 1:
                continue  # this many pairs do not fit in this sequence
            for d in cfg["widths"]:
                for m in cfg["mixers"]:
                    for lr in cfg["lrs"]:
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
            pts = sorted((r["width"], r["accuracy"]) for r in rows if (r["seq_len"], r["num_pairs"], r["mixer"]) == (T, P, m))
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


def atomic_write_text(path: str, text: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def atomic_savefig(fig, path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".png")
    os.close(fd)
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="grid to run (tiny: CPU minutes)")
    parser.add_argument("--mixers", nargs="+", choices=MIXERS, help="token mixers (default: the preset's)")
    parser.add_argument("--widths", nargs="+", type=int, help="model widths (default: the preset's)")
    parser.add_argument("--seq-lens", nargs="+", type=int, help="sequence lengths (default: the preset's)")
    parser.add_argument("--pairs", nargs="+", type=int, help="numbers of key-value pairs (default: the preset's)")
    parser.add_argument("--vocab-size", type=int, help="vocabulary size (default: the preset's)")
    parser.add_argument("--lrs", nargs="+", type=float, help="learning rates swept per cell (default: the preset's)")
    parser.add_argument("--num-heads", type=int, help="heads per mixer (default: the preset's)")
    parser.add_argument("--train-examples", type=int, help="training examples per cell")
    parser.add_argument("--epochs", type=int, help="passes over the training examples")
    parser.add_argument("--batch-size", type=int, help="examples per step")
    parser.add_argument("--test-examples", type=int, help="held-out examples scored per cell")
    parser.add_argument("--seed", type=int, default=0, help="seed of data and initialisation")
    parser.add_argument("--out", default="runs/mqar", help="folder for results.json, table.txt and mqar.png")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--max-cells", type=int, default=None, help="stop after this many new cells (resume later)")


def run(args: argparse.Namespace) -> int:
    cfg = dict(PRESETS[args.preset])
    for name in ("mixers", "widths", "seq_lens", "pairs", "vocab_size", "lrs", "num_heads", "train_examples",
                 "epochs", "batch_size", "test_examples"):
        if getattr(args, name) is not None:
            cfg[name] = getattr(args, name)
    for w in cfg["widths"]:
        if w % cfg["num_heads"] != 0:
            raise ValueError(f"widths: {w} is not divisible by num_heads={cfg['num_heads']}")
    for T in cfg["seq_lens"]:
        for P in cfg["pairs"]:
            check_mqar_setting(seq_len=T, num_pairs=P, vocab_size=cfg["vocab_size"])
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "results.json")
    results = json.load(open(path)) if os.path.exists(path) else []
    done = {r["key"] for r in results}
    todo = [c for c in build_cells(cfg) if c.key() not in done]
    print(f"MQAR preset={args.preset}: {len(done)} cells done, {len(todo)} to run on {device}")
    for i, cell in enumerate(todo):
        if args.max_cells is not None and i >= args.max_cells:
            print("stopping at --max-cells; rerun the same command to continue")
            break
        r = train_cell(cell, num_heads=cfg["num_heads"], train_examples=cfg["train_examples"], epochs=cfg["epochs"],
                       batch_size=cfg["batch_size"], test_examples=cfg["test_examples"], seed=args.seed,
                       device=device)
        results.append(r)
        atomic_write_text(path, json.dumps(results, indent=1))  # after every cell: a killed run loses one cell
        print(f"  {r['key']:<45} acc {r['accuracy']:.3f}  ({r['seconds']:.0f}s)", flush=True)
    rows = best_per_cell(results)
    table = format_table(rows)
    meta = (f"MQAR, best lr per cell; device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
            f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    atomic_write_text(os.path.join(args.out, "table.txt"), meta + "\n" + table + "\n")
    plot(rows, os.path.join(args.out, "mqar.png"))
    print(meta)
    print(table)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="MQAR recall benchmark")
    add_arguments(p)
    raise SystemExit(run(p.parse_args()))
