"""Tokenizers for training: raw UTF-8 bytes (vocab 256, the default) or a `tokenizers` tokenizer.json."""

from __future__ import annotations

import os

import torch

from .errors import TrainError


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; no special tokens (documents are separated by cu_seqlens, not by a token)."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int32)

    def encode_many(self, texts: list[str]) -> list[torch.Tensor]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")


class JsonTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json (BPE, unigram, ...), special tokens left out of the encoding."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        if not os.path.isfile(path):
            raise TrainError(f"--tokenizer: no such file: {path} (give 'bytes' or the path of a tokenizer.json)")
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - the library raises plain Exception subclasses
            raise TrainError(f"--tokenizer: {path} is not a tokenizer.json the `tokenizers` library reads: {e}") from e
        self.name = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self._tok.encode(text, add_special_tokens=False).ids, dtype=torch.int32)

    def encode_many(self, texts: list[str]) -> list[torch.Tensor]:
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [torch.tensor(e.ids, dtype=torch.int32) for e in encs]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(spec: str):
    """'bytes' -> ByteTokenizer; anything else is a path to a tokenizer.json."""
    if spec in ("bytes", "byte", "utf-8"):
        return ByteTokenizer()
    return JsonTokenizer(spec)
