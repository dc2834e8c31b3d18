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
- The tokenizer travels with the weights (`save_tokenizer_files`): a folder gets a tokenizer.json and a
  tokenizer_config.json that transformers' `AutoTokenizer` loads. For bytes, the tokenizer.json is a `tokenizers`
  BPE with no merges over GPT-2's byte-to-character alphabet (ByteLevel pre-tokenizer and decoder, no regex split,
  no prefix space) whose ids are the byte values, so it encodes and decodes as `ByteTokenizer` does;
  `load_tokenizer` recognises that file and gives a `ByteTokenizer` back. A tokenizer.json given with
  `--tokenizer` is copied byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from hybridlm.files import atomic_write, atomic_write_text

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
        self.path = path  # copied into every folder the weights are saved to
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


TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte (what the ByteLevel pre-tokenizer maps byte b to): printable
    Latin-1 bytes stand for themselves, the other 68 bytes, in order, for U+0100 onwards."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    out, extra = [], 0
    for b in range(256):
        if b in kept:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def byte_tokenizer_json() -> str:
    """tokenizer.json of a `tokenizers` Tokenizer that gives the ids and text `ByteTokenizer` gives."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in enumerate(_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str(pretty=True)


def _is_byte_tokenizer_json(path: str) -> bool:
    """Whether `path` is the file `byte_tokenizer_json` writes (its model, splitting and decoding, not its
    formatting or the fields a newer `tokenizers` may add)."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError):
        return False
    model, pre, dec = d.get("model") or {}, d.get("pre_tokenizer") or {}, d.get("decoder") or {}
    return (model.get("type") == "BPE" and not model.get("merges") and not d.get("added_tokens")
            and model.get("vocab") == {c: b for b, c in enumerate(_byte_alphabet())}
            and d.get("normalizer") is None and d.get("post_processor") is None
            and pre.get("type") == "ByteLevel" and pre.get("use_regex") is False
            and pre.get("add_prefix_space") is False and dec.get("type") == "ByteLevel")


def save_tokenizer_files(tokenizer: ByteTokenizer | JsonTokenizer, folder: str) -> list[str]:
    """Write `tokenizer` into `folder` (atomically, file by file) as transformers' `AutoTokenizer` loads it:
    tokenizer.json (bytes: `byte_tokenizer_json`; a JsonTokenizer: its file, copied) and a tokenizer_config.json
    naming the generic fast tokenizer class. Returns the names written.

    Ids equal ours under `add_special_tokens=False`, and by default too unless the tokenizer.json has a
    post-processor that adds special tokens (we never add them: documents are separated by cu_seqlens)."""
    os.makedirs(folder, exist_ok=True)
    dest = os.path.join(folder, TOKENIZER_FILE)
    if isinstance(tokenizer, ByteTokenizer):
        atomic_write_text(dest, byte_tokenizer_json() + "\n")
    elif isinstance(tokenizer, JsonTokenizer):
        if os.path.abspath(tokenizer.path) != os.path.abspath(dest):
            atomic_write(dest, lambda tmp: shutil.copyfile(tokenizer.path, tmp))
    else:
        raise TypeError(f"tokenizer: expected a ByteTokenizer or a JsonTokenizer, got {type(tokenizer).__name__}")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    atomic_write_text(os.path.join(folder, TOKENIZER_CONFIG), json.dumps(config, indent=2) + "\n")
    return [TOKENIZER_FILE, TOKENIZER_CONFIG]


def load_tokenizer(folder: str | None, vocab_size: int) -> ByteTokenizer | JsonTokenizer:
    """A checkpoint's tokenizer: tokenizer.json in folder if present (the byte tokenizer's file gives a
    ByteTokenizer); else bytes for a vocab-256 model; else a clear error."""
    if folder is not None:
        path = os.path.join(folder, TOKENIZER_FILE)
        if os.path.exists(path):
            return ByteTokenizer() if _is_byte_tokenizer_json(path) else JsonTokenizer(path)
    if vocab_size == 256:
        return ByteTokenizer()
    raise FileNotFoundError(f"{folder}: no tokenizer.json, and the model's vocabulary ({vocab_size}) is not bytes")
