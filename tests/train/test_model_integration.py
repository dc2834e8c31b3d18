"""The trainer with the real HybridLM: packed documents never see each other, checkpoints load with
from_pretrained and carry a tokenizer that transformers loads with our ids, a tokenizer.json corpus trains."""

from __future__ import annotations

import os

import pytest
import torch

from hybridlm.model.hybrid import HybridLM
from hybridlm.model.tokenizer import tokenizer_from_spec
from hybridlm.train import checkpoint as ckpt
from hybridlm.train.data import Stream, make_batch
from hybridlm.train.main import _loss_sum, train
from hybridlm.train.presets import build_config


def _model():
    return HybridLM(build_config("test-micro", None, "cpu")[0]).eval()


def test_packed_documents_do_not_see_each_other():
    docs = [torch.randint(0, 256, (n,), dtype=torch.int32) for n in (20, 30, 14)]
    st = Stream.from_docs(docs, 64)
    T = 32
    b = make_batch(st, [0, 1], T)  # row 0: doc0 + 12 of doc1; row 1: 18 of doc1 + doc2
    m = _model()
    with torch.no_grad():
        ref = m(b.input_ids, cu_seqlens=b.cu_seqlens).logits
        # change document 0 only: nothing of documents 1 and 2 may move
        docs2 = [docs[0].flip(0), docs[1], docs[2]]
        b2 = make_batch(Stream.from_docs(docs2, 64), [0, 1], T)
        out = m(b2.input_ids, cu_seqlens=b2.cu_seqlens).logits
    assert not torch.allclose(ref[0, :20], out[0, :20])
    torch.testing.assert_close(ref[0, 20:], out[0, 20:], rtol=0, atol=1e-6)
    # a document piece in its own row with the same start gives the same logits as when packed
    with torch.no_grad():
        alone = m(docs[2].long()[None]).logits
    torch.testing.assert_close(ref[0, 50:64], alone[0], rtol=1e-5, atol=1e-5)


def test_auto_packing_equals_flat():
    docs = [torch.randint(0, 256, (n,), dtype=torch.int32) for n in (100, 7, 60, 90)]
    st = Stream.from_docs(docs, 257)
    b = make_batch(st, [4, 0, 2, 6, 1], 32)
    m = _model()
    with torch.no_grad():
        losses = {}
        for mode in ("flat", "auto"):
            losses[mode] = sum(float(_loss_sum(m, ids, tg, cu, torch.device("cpu"), False))
                               for ids, tg, cu in b.pieces(mode))
    assert abs(losses["flat"] - losses["auto"]) <= 1e-4 * abs(losses["flat"])


def test_checkpoint_is_a_from_pretrained_folder(tmp_path, small_corpus, micro_args):
    s = train(micro_args(small_corpus, str(tmp_path / "r"), "--max-steps", "2", "--eval-every", "0"))
    path = ckpt.resolve_resume(str(tmp_path / "r"))
    m = HybridLM.from_pretrained(path)
    st = ckpt.load_checkpoint(path)
    for k, v in m.state_dict().items():
        assert torch.equal(v, st["model"][k]), k
    assert s["final_step"] == 2
    _assert_tokenizer_travels(path, tokenizer_from_spec("bytes"))


def _assert_tokenizer_travels(folder: str, ours) -> None:
    """transformers' AutoTokenizer loads the checkpoint's tokenizer files and gives our tokenizer's ids."""
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    for text in ("ROMEO.\nWhat light through yonder window breaks?", "caf\u00e9 \u6f22 \u2014 ok"):
        assert theirs.encode(text, add_special_tokens=False) == ours.encode(text), text


def test_tokenizer_json_corpus(tmp_path, small_corpus, micro_args):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train([small_corpus], trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    s = train(micro_args(small_corpus, str(tmp_path / "r"), "--max-steps", "2", "--eval-every", "0",
                         "--tokenizer", path, "--sample-tokens", "5"))
    assert s["final_step"] == 2 and s["unigram_nats_per_byte"] > 0
    assert os.path.exists(tmp_path / "r" / "sample.txt")
    _assert_tokenizer_travels(ckpt.resolve_resume(str(tmp_path / "r")), tokenizer_from_spec(path))


def test_training_presets_have_the_sizes_their_names_say():
    """Each GPU preset builds (on the meta device: no memory) with about the parameter count in its name, as a
    3:1 hybrid with the byte vocabulary."""
    for name, millions in (("gpu-30m", 30), ("gpu-325m", 325)):
        cfg = build_config(name, None, "cuda")[0]
        with torch.device("meta"):
            n = sum(p.numel() for p in HybridLM(cfg).parameters())
        assert abs(n / 1e6 - millions) / millions < 0.1, (name, n)
        assert cfg.vocab_size == 256 and cfg.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
