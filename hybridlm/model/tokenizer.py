"""Tokenizers, one set for training and generation: UTF-8 bytes (vocab 256) or a `tokenizer.json` read with the
`tokenizers` library (no transformers).

Non-standard here:
- Our own small models are byte-level (token id = UTF-8 byte), so no vocabulary file is needed. A byte model's
  vocabulary may be larger than 256 (a --config with a padded vocab_size); ids outside 0..255 stand for no byte,
  so `ByteTokenizer.decode` drops them (it never wraps them onto bytes).
- Decoding replaces incomplete UTF-8 sequences with U+FFFD, which is why streaming decodes the whole new text and
  prints only what was not printed yet.
- `encode` gives a list of ids (a prompt); `encode_many` gives int32 tensors (a corpus, without a Python int per
  byte).
"""

from __future__ import annotations

import os

import torch

BYTE_SPECS = ("bytes", "byte", "utf-8")


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; no special tokens (documents are separated by cu_seqlens, not by a token)."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_many(self, texts: list[str]) -> list[torch.Tensor]:
        return [self._tensor(t.encode("utf-8")) for t in texts]

    @staticmethod
    def _tensor(data: bytes) -> torch.Tensor:
        if not data:  # torch.frombuffer refuses an empty buffer
            return torch.zeros(0, dtype=torch.int32)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int32)

    def decode(self, ids) -> str:
        """ids outside 0..255 are dropped (they stand for no byte)."""
        return bytes(b for b in map(int, ids) if 0 <= b < 256).decode("utf-8", errors="replace")


class JsonTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json (BPE, unigram, ...), special tokens left out of the encoding."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        if not os.path.isfile(path):
            raise FileNotFoundError(f"no such file: {path} (give 'bytes' or the path of a tokenizer.json)")
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - the library raises plain Exception subclasses
            raise ValueError(f"{path} is not a tokenizer.json the `tokenizers` library reads: {e}") from e
        self.name = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_many(self, texts: list[str]) -> list[torch.Tensor]:
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [torch.tensor(e.ids, dtype=torch.int32) for e in encs]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def tokenizer_from_spec(spec: str) -> ByteTokenizer | JsonTokenizer:
    """'bytes' (or 'byte', 'utf-8') -> ByteTokenizer; anything else is the path of a tokenizer.json."""
    if spec in BYTE_SPECS:
        return ByteTokenizer()
    return JsonTokenizer(spec)


def load_tokenizer(folder: str | None, vocab_size: int) -> ByteTokenizer | JsonTokenizer:
    """A checkpoint's tokenizer: tokenizer.json in folder if present; else bytes for a vocab-256 model; else a
    clear error."""
    if folder is not None:
        path = os.path.join(folder, "tokenizer.json")
        if os.path.exists(path):
            return JsonTokenizer(path)
    if vocab_size == 256:
        return ByteTokenizer()
    raise FileNotFoundError(f"{folder}: no tokenizer.json, and the model's vocabulary ({vocab_size}) is not bytes")
