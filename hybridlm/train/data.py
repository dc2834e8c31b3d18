"""Corpus reading, train/val split, and packing of documents into rows with document boundaries.

Non-standard here:
- A corpus is a list of documents. The bundled Shakespeare is split back into its works; a text file is one
  document (or its works, if it is a concatenation like the bundled one); a .jsonl line with a "text" field is one.
- Documents are concatenated into one token stream and cut into rows of `seq_len`. A row may hold the end of one
  document and the start of the next: the batch is then flattened to one row `[1, B*T]` and `cu_seqlens` (int32)
  lists every piece (row starts and document starts inside rows), so no token ever attends to another document.
  The target of the last token of a document is -100 (ignored); a row's last token predicts the first token of the
  next row when both are in the same document, so no token of the stream is wasted.
- `short_documents` cuts a text into web-text-sized documents (paragraphs joined until one passes 400 bytes), the
  corpus of short documents that `scripts/short_docs.py` writes for --data and the benchmarks pack.
- A file must be text: a NUL byte, or more than 1% of its bytes invalid UTF-8, refuses it (binary data would
  train on replacement characters); fewer invalid bytes are read as U+FFFD with one warning for the corpus.
- The order of rows is a seeded permutation per epoch, and a batch is a pure function of (seed, micro-batch
  index, rank, world size): the data position of a checkpoint is one integer and resuming is exact.
"""

from __future__ import annotations

import json
import logging
import lzma
import math
import os
import re
from dataclasses import dataclass
from importlib import resources

import torch

from .errors import TrainError

IGNORE = -100
BUNDLED_NAME = "shakespeare.txt.xz"
TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".json")
MAX_INVALID_FRACTION = 0.01  # a file with more invalid UTF-8 bytes than this is not text
log = logging.getLogger(__name__)
# A work of the bundled corpus starts with its title line, a blank line, and "by William Shakespeare".
_WORK_START = re.compile(r"\n+(?=[^\n]+\n\nby William Shakespeare\n)")


def split_works(text: str) -> list[str]:
    """Split a concatenation of works (title / blank / 'by William Shakespeare') into one string per work."""
    return [p for p in _WORK_START.split(text) if p.strip()]


_BLANK_LINES = re.compile(r"\n\n+")


def short_documents(text: str, min_bytes: int = 400) -> list[str]:
    """Documents of a little more than `min_bytes` UTF-8 bytes: each work of `text` (`split_works`) is split at
    blank lines, and its paragraphs (stripped) are joined by a blank line until the document passes min_bytes; a
    work's last document may be shorter, none spans two works. The bundled text gives 8,674 documents of 581 bytes
    on average."""
    if min_bytes < 1:
        raise ValueError(f"min_bytes: expected >= 1, got {min_bytes}")
    docs = []
    for work in split_works(text):
        cur, size = [], -2
        for para in _BLANK_LINES.split(work):
            para = para.strip()
            if not para:
                continue
            cur.append(para)
            size += len(para.encode("utf-8")) + 2
            if size > min_bytes:
                docs.append("\n\n".join(cur))
                cur, size = [], -2
        if cur:
            docs.append("\n\n".join(cur))
    return docs


def short_document_stream(min_bytes: int = 400) -> Stream:
    """The bundled text's `short_documents` as UTF-8 byte tokens, concatenated: rows of it (`make_batch`) are the
    packed short-document batches (cu_seqlens) that benchmarks train on beside the bundled corpus."""
    docs = [d.encode("utf-8") for d in short_documents(bundled_corpus_text(), min_bytes)]
    tokens = [torch.frombuffer(bytearray(d), dtype=torch.uint8).to(torch.int32) for d in docs]
    return Stream.from_docs(tokens, sum(len(d) for d in docs))


def bundled_corpus_text() -> str:
    with resources.files("hybridlm").joinpath("data", BUNDLED_NAME).open("rb") as f:
        return lzma.decompress(f.read()).decode("utf-8")


def decode_text(raw: bytes, path: str) -> tuple[str, int]:
    """`raw` as UTF-8 text (invalid bytes as U+FFFD) and how many of its bytes were invalid. Raises TrainError
    naming `path` when it is not text: a NUL byte, or more than MAX_INVALID_FRACTION of the bytes invalid."""
    nul = raw.find(b"\0")
    if nul >= 0:
        raise TrainError(f"--data: {path} is not text (a NUL byte at offset {nul}); give UTF-8 text files or a "
                         ".jsonl with a \"text\" field")
    bad = len(raw) - len(raw.decode("utf-8", errors="ignore").encode("utf-8"))
    if bad > MAX_INVALID_FRACTION * len(raw):
        raise TrainError(f"--data: {path} is not UTF-8 text ({bad} of its {len(raw)} bytes, {bad / len(raw):.1%}, "
                         f"are invalid UTF-8; at most {MAX_INVALID_FRACTION:.0%} is read, as U+FFFD); convert it "
                         "to UTF-8, e.g. iconv -f latin1 -t utf-8")
    return raw.decode("utf-8", errors="replace"), bad


def _read_bytes(path: str) -> bytes:
    if path.endswith(".xz"):
        with lzma.open(path, "rb") as f:
            return f.read()
    with open(path, "rb") as f:
        return f.read()


def _read_jsonl(path: str, text: str) -> list[str]:
    docs = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TrainError(f"--data: line {n} of {path} is not JSON ({e.msg}); give one JSON object per line") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise TrainError(f"--data: line {n} of {path} has no string field \"text\" (each line must be "
                             "{\"text\": \"...\"})")
        docs.append(obj["text"])
    return docs


def _read_file(path: str) -> tuple[list[str], int]:
    """The documents of one file and how many invalid UTF-8 bytes it had."""
    text, bad = decode_text(_read_bytes(path), path)
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # the newlines a file opened as text gives
    if path.endswith(JSONL_SUFFIXES):
        return _read_jsonl(path, text), bad
    works = split_works(text)
    return (works if len(works) > 1 else ([text] if text.strip() else [])), bad


def _warn_invalid(bad: dict[str, int]) -> None:
    """One warning for the whole corpus: the files with invalid UTF-8 bytes (read as U+FFFD) and how many."""
    if not bad:
        return
    shown = [f"{n} in {p}" for p, n in list(bad.items())[:3]]
    more = f" and {len(bad) - 3} more file(s)" if len(bad) > 3 else ""
    log.warning("--data: invalid UTF-8 bytes read as U+FFFD: %s%s", ", ".join(shown), more)


def read_documents(paths: list[str] | None) -> tuple[list[str], str]:
    """The documents of `--data` (None: the bundled corpus) and a short description of where they came from."""
    if not paths:
        return split_works(bundled_corpus_text()), "bundled Shakespeare (hybridlm/data/shakespeare.txt.xz)"
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(
                os.path.join(root, name)
                for root, _, names in os.walk(p)
                for name in names
                if name.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES)
            )
            if not found:
                raise TrainError(f"--data: folder {p} has no .txt, .md or .jsonl files; point --data at text files, "
                                 "a folder of them, or a .jsonl with a \"text\" field")
            files.extend(found)
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise TrainError(f"--data: no such file or folder: {p} (give text files, a folder of .txt/.jsonl files, "
                             "or a .jsonl with a \"text\" field; leave --data out for the bundled Shakespeare)")
    docs, bad = [], {}
    for f in files:
        file_docs, n_bad = _read_file(f)
        docs.extend(file_docs)
        if n_bad:
            bad[f] = n_bad
    _warn_invalid(bad)
    if not any(d.strip() for d in docs):
        raise TrainError(f"--data: the corpus is empty ({len(files)} file(s) read, no text in them); "
                         "give files that contain text")
    return docs, f"{len(files)} file(s) from {', '.join(paths)}"


@dataclass
class Stream:
    """Documents concatenated: `tokens` [N] int32 and `starts` [D+1] int64 (document d is starts[d]:starts[d+1])."""

    tokens: torch.Tensor
    starts: torch.Tensor
    n_bytes: int  # UTF-8 bytes of the text these tokens encode (for nats/byte)

    @classmethod
    def from_docs(cls, docs: list[torch.Tensor], n_bytes: int) -> Stream:
        docs = [d for d in docs if d.numel() > 0]
        lens = torch.tensor([0] + [d.numel() for d in docs], dtype=torch.int64)
        tokens = torch.cat(docs) if docs else torch.zeros(0, dtype=torch.int32)
        return cls(tokens.to(torch.int32), torch.cumsum(lens, 0), n_bytes)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.numel())

    def n_rows(self, seq_len: int) -> int:
        return self.n_tokens // seq_len

    def targets_valid(self) -> int:
        """How many positions have a target (every token but the last of each document)."""
        return self.n_tokens - (len(self.starts) - 1)


def split_train_val(token_docs: list[torch.Tensor], val_fraction: float) -> tuple[list[torch.Tensor], list]:
    """Hold out the tail `val_fraction` of each long document; of short documents, every k-th one whole."""
    train, val = [], []
    every = max(2, round(1 / val_fraction)) if val_fraction > 0 else 0
    n_short = 0
    for d in token_docs:
        n_val = int(d.numel() * val_fraction)
        if n_val >= 64:
            train.append(d[: d.numel() - n_val])
            val.append(d[d.numel() - n_val :])
        elif every:
            (val if n_short % every == every - 1 else train).append(d)
            n_short += 1
        else:
            train.append(d)
    return train, val


@dataclass
class Batch:
    input_ids: torch.Tensor  # [1, B*T] int64
    targets: torch.Tensor  # [1, B*T] int64, IGNORE where there is no target in the same document
    cu_seqlens: torch.Tensor  # [P+1] int32: every piece (row starts and document starts inside rows)
    rows: int
    seq_len: int

    @property
    def n_targets(self) -> int:
        return int((self.targets != IGNORE).sum())

    def pieces(self, mode: str = "auto") -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """The forward calls for this batch: (input_ids, targets, cu_seqlens or None).

        "flat": one call, all rows flattened to [1, B*T] with cu_seqlens. "auto": rows with no document start
        inside them go as a plain [b, T] batch (the same math; the layers' batched paths, no per-document work),
        the others flattened with their cu_seqlens; at most two calls. A flattened call's attention runs per
        document (hybridlm.layers.attention.Documents), never with a [B*T, B*T] mask."""
        if mode == "flat":
            return [(self.input_ids, self.targets, self.cu_seqlens)]
        T, B = self.seq_len, self.rows
        cuts = self.cu_seqlens.long()
        inner = cuts[(cuts % T) != 0]
        split = torch.zeros(B, dtype=torch.bool)
        split[(inner // T).unique()] = True
        ids, tg = self.input_ids.view(B, T), self.targets.view(B, T)
        out = []
        plain = (~split).nonzero().flatten()
        if plain.numel():
            out.append((ids[plain], tg[plain], None))
        mixed = split.nonzero().flatten()
        if mixed.numel():
            cu = [0]
            for j, r in enumerate(mixed.tolist()):
                inside = inner[(inner // T) == r] - r * T + j * T
                cu.extend(inside.tolist())
                cu.append((j + 1) * T)
            out.append((ids[mixed].reshape(1, -1), tg[mixed].reshape(1, -1), torch.tensor(cu, dtype=torch.int32)))
        return out

    def to(self, device) -> Batch:
        return Batch(self.input_ids.to(device, non_blocking=True), self.targets.to(device, non_blocking=True),
                     self.cu_seqlens.to(device, non_blocking=True), self.rows, self.seq_len)


def make_batch(stream: Stream, rows: list[int], seq_len: int) -> Batch:
    """Rows `rows` (row r is stream tokens r*T .. r*T+T) flattened into one packed row with its cu_seqlens."""
    T = seq_len
    n = stream.n_tokens
    starts = stream.starts
    ids, tgts, cuts = [], [], [0]
    for i, r in enumerate(rows):
        a, b = r * T, r * T + T
        if b > n:
            raise IndexError(f"row {r} of length {T} runs past the stream ({n} tokens)")
        ids.append(stream.tokens[a:b])
        nxt = torch.full((T,), IGNORE, dtype=torch.int64)
        upto = min(b + 1, n)
        nxt[: upto - a - 1] = stream.tokens[a + 1 : upto].to(torch.int64)
        # document starts strictly inside (a, b]: their previous token has no target; inside (a, b) they cut a piece
        lo = int(torch.searchsorted(starts, a, right=True))
        hi = int(torch.searchsorted(starts, b, right=True))
        inner = starts[lo:hi]
        nxt[(inner - a - 1).long()] = IGNORE
        off = i * T
        for s in inner.tolist():
            if s < b:
                cuts.append(off + s - a)
        cuts.append(off + T)
        tgts.append(nxt)
    input_ids = torch.cat(ids).to(torch.int64).unsqueeze(0)
    targets = torch.cat(tgts).unsqueeze(0)
    return Batch(input_ids, targets, torch.tensor(cuts, dtype=torch.int32), len(rows), T)


@dataclass
class RowLayout:
    """What a batch of rows will look like, read from the document starts alone (no batch built, no device, no
    communication): every rank holds the whole stream, so each can work out every other rank's batches.

    targets[r]: the targets of row r (make_batch's `n_targets` of that row); split[r]: a document starts strictly
    inside row r (the row goes to the flattened cu_seqlens call of `Batch.pieces("auto")`)."""

    targets: torch.Tensor  # [R] int64
    split: torch.Tensor  # [R] bool
    seq_len: int

    @classmethod
    def of(cls, stream: Stream, seq_len: int) -> RowLayout:
        T, R = seq_len, stream.n_rows(seq_len)
        s = stream.starts
        a = torch.arange(R, dtype=torch.int64) * T
        # row r covers positions a..a+T-1; position p has no target when p + 1 is a document start or the stream's
        # end (starts[-1] == n_tokens), i.e. one position fewer per start in (a, a + T]
        n_cut = torch.searchsorted(s, a + T, right=True) - torch.searchsorted(s, a, right=True)
        split = torch.zeros(R, dtype=torch.bool)
        inner = s[(s % T) != 0] // T
        split[inner[inner < R]] = True
        return cls(T - n_cut, split, T)

    def n_targets(self, rows: list[int]) -> int:
        return int(self.targets[rows].sum()) if rows else 0

    def n_calls(self, rows: list[int], packing: str) -> int:
        """len(make_batch(stream, rows, T).pieces(packing)) without building the batch."""
        if packing == "flat":
            return 1
        sp = self.split[rows]
        return int(bool(sp.any())) + int(not bool(sp.all()))


class RowSampler:
    """Which rows micro-batch `micro` of rank `rank` gets: a seeded permutation per epoch, sharded by rank."""

    def __init__(self, n_rows: int, batch_rows: int, seed: int, rank: int = 0, world: int = 1):
        self.n_rows, self.batch_rows, self.seed, self.rank, self.world = n_rows, batch_rows, seed, rank, world
        self.per_epoch = n_rows // (batch_rows * world)
        if self.per_epoch < 1:
            raise TrainError(
                f"the training split has {n_rows} rows of this --seq-len, fewer than one global batch "
                f"({batch_rows} rows x {world} rank(s)); lower --batch-size or --seq-len, or give more --data"
            )
        self._epoch, self._perm = -1, None

    def rows(self, micro: int, rank: int | None = None) -> list[int]:
        """The rows of micro-batch `micro` of this sampler's rank, or of `rank` (any rank's rows are known here)."""
        epoch, idx = divmod(micro, self.per_epoch)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n_rows, generator=g)
        start = (idx * self.world + (self.rank if rank is None else rank)) * self.batch_rows
        return self._perm[start : start + self.batch_rows].tolist()

    def epoch_of(self, micro: int) -> float:
        return micro / self.per_epoch


def unigram_nats(train: Stream, val: Stream, vocab_size: int) -> float:
    """Cross-entropy (nats per token) of val targets under the add-one unigram of the train tokens."""
    counts = torch.bincount(train.tokens.long(), minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    # the targets of val: every token that is not the first of its document
    mask = torch.ones(val.n_tokens, dtype=torch.bool)
    mask[val.starts[:-1]] = False
    tg = val.tokens.long()[mask]
    return float(-logp[tg].mean()) if tg.numel() else math.nan


@dataclass
class Corpus:
    train: Stream
    val: Stream
    description: str
    n_docs: int


def load_corpus(paths: list[str] | None, tokenizer, val_fraction: float = 0.02) -> Corpus:
    docs, desc = read_documents(paths)
    token_docs = tokenizer.encode_many(docs)
    if sum(int(d.numel()) for d in token_docs) == 0:
        raise TrainError("--data: the corpus is empty after tokenizing; give files that contain text")
    tr, va = split_train_val(token_docs, val_fraction)
    if tokenizer.vocab_size == 256 and tokenizer.name == "bytes":
        tb = sum(int(d.numel()) for d in tr)
        vb = sum(int(d.numel()) for d in va)
    else:  # bytes of the text the tokens stand for (decoded, so tails split mid-document count right)
        tb = sum(len(tokenizer.decode(d.tolist()).encode("utf-8")) for d in tr)
        vb = sum(len(tokenizer.decode(d.tolist()).encode("utf-8")) for d in va)
    return Corpus(Stream.from_docs(tr, tb), Stream.from_docs(va, vb), desc, len(docs))
