"""The one tokenizer module (training and generation): bytes and tokenizer.json, what decode does with ids
that are not bytes, and the tokenizer files saved beside the weights, checked against transformers' AutoTokenizer."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from hybridlm.model.tokenizer import (
    ByteTokenizer,
    JsonTokenizer,
    load_tokenizer,
    save_tokenizer_files,
    tokenizer_from_spec,
)

TEXT = "ROMEO.\nHello, world! \u00e9\u6f22"
# the UTF-8 bytes of TEXT, from the Unicode tables (é = C3 A9, 漢 = U+6F22 = E6 BC A2), not from Python's codec
TEXT_BYTES = [0x52, 0x4F, 0x4D, 0x45, 0x4F, 0x2E, 0x0A, 0x48, 0x65, 0x6C, 0x6C, 0x6F, 0x2C, 0x20, 0x77, 0x6F, 0x72,
              0x6C, 0x64, 0x21, 0x20, 0xC3, 0xA9, 0xE6, 0xBC, 0xA2]


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


def test_byte_tokenizer_files_load_in_transformers(tmp_path, seed):
    """AutoTokenizer on the saved files gives the byte ids and decodes them back, invalid UTF-8 included."""
    transformers = pytest.importorskip("transformers")
    ours = ByteTokenizer()
    assert sorted(save_tokenizer_files(ours, str(tmp_path))) == ["tokenizer.json", "tokenizer_config.json"]
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.encode(TEXT) == TEXT_BYTES
    assert theirs(TEXT)["input_ids"] == TEXT_BYTES  # default call: no special tokens are added
    assert theirs.encode(TEXT, add_special_tokens=False) == TEXT_BYTES
    assert theirs.decode(TEXT_BYTES) == ours.decode(TEXT_BYTES) == TEXT
    g = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (200,), generator=g).tolist()  # mostly invalid UTF-8
    assert theirs.decode(noise) == ours.decode(noise), f"seed {seed}"
    text = bytes(torch.randint(0, 128, (300,), generator=g).tolist()).decode("ascii") + TEXT  # every ASCII byte
    assert theirs.encode(text, add_special_tokens=False) == list(text.encode("utf-8")), f"seed {seed}"
    # our loader reads the file back as the byte tokenizer, for a padded byte vocabulary too
    assert isinstance(load_tokenizer(str(tmp_path), vocab_size=256), ByteTokenizer)
    assert isinstance(load_tokenizer(str(tmp_path), vocab_size=320), ByteTokenizer)


def _trained_bpe(tmp_path):
    """A small byte-level BPE trained on a few lines (merges, so ids are not bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    lines = ["ROMEO. But soft, what light through yonder window breaks?", "Hello, world!", "hello there, world"] * 20
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel
                                                       .alphabet(), show_progress=False))
    path = tmp_path / "src" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return path


def test_json_tokenizer_files_load_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    src = _trained_bpe(tmp_path)
    ours = tokenizer_from_spec(str(src))
    out = tmp_path / "out"
    save_tokenizer_files(ours, str(out))
    assert (out / "tokenizer.json").read_bytes() == src.read_bytes()  # copied as given
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = ours.encode(TEXT)
    assert len(ids) < len(TEXT_BYTES)  # merges were used
    assert theirs(TEXT)["input_ids"] == ids
    assert theirs.decode(ids) == ours.decode(ids) == TEXT
    again = load_tokenizer(str(out), vocab_size=ours.vocab_size)
    assert isinstance(again, JsonTokenizer) and again.encode(TEXT) == ids
    with pytest.raises(TypeError, match="tokenizer: expected a ByteTokenizer or a JsonTokenizer, got str"):
        save_tokenizer_files("bytes", str(out))


def test_save_pretrained_holds_the_tokenizer_and_files_are_readable(tmp_path):
    """save_pretrained writes the tokenizer files (bytes by default for a vocabulary of 256, the given one
    otherwise), every file 0666 & ~umask; a folder without them still loads, with the byte tokenizer."""
    transformers = pytest.importorskip("transformers")
    from hybridlm.model.hybrid import HybridLM
    from hybridlm.model.presets import get_preset

    old = os.umask(0o022)
    try:
        model = HybridLM(get_preset("tiny")).eval()
        model.save_pretrained(str(tmp_path / "bytes"))
        model.save_pretrained(str(tmp_path / "json"), tokenizer=tokenizer_from_spec(str(_trained_bpe(tmp_path))))
    finally:
        os.umask(old)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        mode = stat.S_IMODE(os.stat(tmp_path / "bytes" / name).st_mode)
        assert mode == 0o644, f"{name}: {oct(mode)}"
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "bytes"))
    assert auto(TEXT)["input_ids"] == TEXT_BYTES
    assert (tmp_path / "json" / "tokenizer.json").read_bytes() == (tmp_path / "src" / "tokenizer.json").read_bytes()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(tmp_path / "bytes" / name)
    again = HybridLM.from_pretrained(str(tmp_path / "bytes"))
    assert isinstance(load_tokenizer(str(tmp_path / "bytes"), again.config.vocab_size), ByteTokenizer)
