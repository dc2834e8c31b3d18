"""Tokenizers for generation: a checkpoint's `tokenizer.json` (through the `tokenizers` library) or bytes.

Non-standard here: our own small models are byte-level (vocab 256: token id = UTF-8 byte), so no vocabulary file
is needed; decoding replaces incomplete UTF-8 sequences, which is why streaming decodes the whole new text and
prints only what was not printed yet.
"""

from __future__ import annotations

import os


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` loaded with the `tokenizers` library (no transformers)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def load_tokenizer(folder: str | None, vocab_size: int):
    """tokenizer.json in folder if present; else bytes for a vocab-256 model; else a clear error."""
    if folder is not None:
        path = os.path.join(folder, "tokenizer.json")
        if os.path.exists(path):
            return HFTokenizer(path)
    if vocab_size == 256:
        return ByteTokenizer()
    raise FileNotFoundError(f"{folder}: no tokenizer.json, and the model's vocabulary ({vocab_size}) is not bytes")
