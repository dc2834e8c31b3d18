"""The one tokenizer module (training and generation): bytes and tokenizer.json, and what decode does with ids
that are not bytes."""

from __future__ import annotations

import pytest
import torch

from hybridlm.model.tokenizer import ByteTokenizer, JsonTokenizer, load_tokenizer, tokenizer_from_spec


def test_byte_encode_is_utf8():
    t = ByteTokenizer()
    # "hé€": h = 0x68, é = C3 A9, € = E2 82 AC (from the Unicode tables, not from Python's codec)
    assert t.encode("hé€") == [0x68, 0xC3, 0xA9, 0xE2, 0x82, 0xAC]
    many = t.encode_many(["hé€", "", "a"])
    assert [m.dtype for m in many] == [torch.int32] * 3
    assert [m.tolist() for m in many] == [[0x68, 0xC3, 0xA9, 0xE2, 0x82, 0xAC], [], [0x61]]
    assert t.decode(torch.tensor([0x68, 0xC3, 0xA9])) == "hé"


def test_byte_decode_drops_ids_outside_the_byte_range():
    """A model with a padded vocabulary can emit ids >= 256; they stand for no byte and are dropped, never wrapped
    (0x168 & 0xFF would be "h", 0x1C3 & 0xFF would start a two-byte sequence)."""
    t = ByteTokenizer()
    assert t.decode([0x168]) == ""
    assert t.decode([0x68, 0x168, 0xC3, 256, -1, 0xA9, 0x1C3, 0x69]) == "héi"
    # an incomplete UTF-8 sequence is one replacement character (what streaming generation waits on)
    assert t.decode([0x61, 0xE2, 0x82]) == "a\ufffd"


def _word_level(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_json_tokenizer(tmp_path):
    path = _word_level(tmp_path)
    t = tokenizer_from_spec(str(path))
    assert isinstance(t, JsonTokenizer) and t.name == str(path) and t.vocab_size == 3
    assert t.encode("hello world") == [0, 1]
    assert [m.tolist() for m in t.encode_many(["world hello", "hello"])] == [[1, 0], [0]]
    assert t.decode(torch.tensor([0, 1], dtype=torch.int32)) == "hello world"


def test_specs_and_errors(tmp_path):
    for spec in ("bytes", "byte", "utf-8"):
        assert isinstance(tokenizer_from_spec(spec), ByteTokenizer)
    assert ByteTokenizer.name == "bytes"  # what a training run records in train_state.json
    with pytest.raises(FileNotFoundError, match="no such file: .*nope.json"):
        tokenizer_from_spec(str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not a tokenizer.json"):
        tokenizer_from_spec(str(tmp_path / "bad.json"))


def test_load_tokenizer_of_a_checkpoint_folder(tmp_path):
    _word_level(tmp_path)
    assert isinstance(load_tokenizer(str(tmp_path), vocab_size=3), JsonTokenizer)
    assert isinstance(load_tokenizer(None, vocab_size=256), ByteTokenizer)
    assert isinstance(load_tokenizer(str(tmp_path / "empty"), vocab_size=256), ByteTokenizer)
    with pytest.raises(FileNotFoundError, match="not bytes"):
        load_tokenizer(str(tmp_path / "empty"), vocab_size=300)
