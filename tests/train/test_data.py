"""Corpus reading, splitting, packing with cu_seqlens, row sampling, and the data-path errors."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from hybridlm.model.tokenizer import ByteTokenizer
from hybridlm.train.data import (
    IGNORE,
    RowLayout,
    RowSampler,
    Stream,
    load_corpus,
    make_batch,
    read_documents,
    split_train_val,
    split_works,
    unigram_nats,
)
from hybridlm.train.errors import TrainError


def _stream(lengths):
    docs = [torch.randint(0, 256, (n,), dtype=torch.int32) for n in lengths]
    return Stream.from_docs(docs, sum(lengths)), docs


def _doc_of(stream):
    doc = torch.zeros(stream.n_tokens, dtype=torch.long)
    for d in range(len(stream.starts) - 1):
        doc[stream.starts[d] : stream.starts[d + 1]] = d
    return doc


@pytest.mark.parametrize("T", [8, 13, 64])
def test_packing_cu_seqlens_never_straddle(T):
    st, _ = _stream([5, 1, 30, 7, 64, 3, 100, 2, 17])
    doc = _doc_of(st)
    n_rows = st.n_rows(T)
    rows = list(range(n_rows))
    b = make_batch(st, rows, T)
    cu = b.cu_seqlens.long()
    assert b.cu_seqlens.dtype == torch.int32
    assert cu[0] == 0 and cu[-1] == n_rows * T and bool((cu[1:] > cu[:-1]).all())
    # every row start is a cut
    assert set(range(0, n_rows * T + 1, T)) <= set(cu.tolist())
    flat_doc = doc[: n_rows * T]
    assert torch.equal(b.input_ids[0], st.tokens[: n_rows * T].long())
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        assert flat_doc[s:e].unique().numel() == 1, f"piece {s}:{e} straddles documents"
        assert (s // T) == ((e - 1) // T), "piece crosses a row"
    # every document start inside the rows is a cut
    for d_start in st.starts[1:-1].tolist():
        if d_start < n_rows * T:
            assert d_start in set(cu.tolist())
    # targets: next token of the same document, else ignored
    tg = b.targets[0]
    for p in range(n_rows * T):
        if p + 1 < st.n_tokens and doc[p + 1] == doc[p]:
            assert tg[p] == st.tokens[p + 1]
        else:
            assert tg[p] == IGNORE


def test_packing_conserves_tokens_over_an_epoch():
    st, _ = _stream([50, 3, 200, 41, 9, 77, 120])
    T, B = 16, 3
    s = RowSampler(st.n_rows(T), B, seed=5)
    seen = []
    n_targets = 0
    for m in range(s.per_epoch):
        b = make_batch(st, s.rows(m), T)
        seen.extend(s.rows(m))
        n_targets += b.n_targets
    assert len(set(seen)) == len(seen) == s.per_epoch * B  # each row at most once per epoch
    assert all(0 <= r < st.n_rows(T) for r in seen)
    full = make_batch(st, list(range(st.n_rows(T))), T)
    assert full.input_ids.numel() == st.n_rows(T) * T
    # over whole rows: targets = tokens whose successor is in the same document
    n = st.n_rows(T) * T
    doc = _doc_of(st)
    if st.n_tokens > n:
        nxt_same = doc[1 : n + 1] == doc[:n]
    else:
        nxt_same = torch.cat([doc[1:n] == doc[: n - 1], torch.tensor([False])])
    assert full.n_targets == int(nxt_same.sum())


def test_pieces_auto_matches_flat():
    st, _ = _stream([40, 10, 100, 5, 70])
    T = 16
    b = make_batch(st, [3, 0, 7, 1, 9], T)
    flat = b.pieces("flat")
    assert len(flat) == 1
    auto = b.pieces("auto")
    assert 1 <= len(auto) <= 2
    # same tokens and targets overall, and every auto piece respects document bounds
    n = sum(p[0].numel() for p in auto)
    assert n == b.input_ids.numel()
    assert sum(int((p[1] != IGNORE).sum()) for p in auto) == b.n_targets
    for ids, _tg, cu in auto:
        if cu is None:
            assert ids.dim() == 2 and ids.shape[1] == T
        else:
            assert ids.shape[0] == 1 and int(cu[-1]) == ids.shape[1] and cu.dtype == torch.int32


@pytest.mark.parametrize("T", [2, 7, 16, 64])
def test_row_layout_predicts_every_batch(T):
    """RowLayout (what the training loop uses instead of an all-reduce) against built batches: the target count of
    every row and the number of forward calls of random row sets, both packings, on fresh random document lengths
    (1-token documents, documents ending on row boundaries, a stream that ends mid-row and one that ends on one)."""
    lengths = torch.randint(1, 3 * T + 2, (40,)).tolist()
    lengths[3], lengths[4], lengths[5] = 1, T, 2 * T  # short, and boundaries on row starts (after an aligned prefix)
    for end_aligned in (False, True):
        if end_aligned:
            lengths[-1] += (-sum(lengths)) % T
        st, _ = _stream(lengths)
        lay = RowLayout.of(st, T)
        R = st.n_rows(T)
        assert lay.targets.shape == lay.split.shape == (R,)
        for r in range(R):
            b = make_batch(st, [r], T)
            assert lay.n_targets([r]) == b.n_targets, (r, lay.n_targets([r]), b.n_targets)
            assert bool(lay.split[r]) == (len(b.pieces("auto")) == 1 and b.pieces("auto")[0][2] is not None), r
        assert bool(lay.split.any()) and not bool(lay.split.all())  # both kinds of row occur
        for _ in range(30):
            k = int(torch.randint(1, min(R, 6) + 1, ()))
            rows = torch.randperm(R)[:k].tolist()
            b = make_batch(st, rows, T)
            assert lay.n_targets(rows) == b.n_targets
            for packing in ("auto", "flat"):
                assert lay.n_calls(rows, packing) == len(b.pieces(packing)), (rows, packing)


def test_sampler_rows_of_any_rank():
    s = [RowSampler(100, 4, seed=7, rank=r, world=3) for r in range(3)]
    for m in (0, 1, s[0].per_epoch, 2 * s[0].per_epoch + 1):
        for r in range(3):
            assert s[0].rows(m, r) == s[r].rows(m) == s[2].rows(m, r)


def test_sampler_shards_by_rank_and_is_deterministic():
    a0 = RowSampler(100, 4, seed=3, rank=0, world=2)
    a1 = RowSampler(100, 4, seed=3, rank=1, world=2)
    for m in range(a0.per_epoch * 2):
        r0, r1 = a0.rows(m), a1.rows(m)
        assert not set(r0) & set(r1)
        assert r0 == RowSampler(100, 4, seed=3, rank=0, world=2).rows(m)
    assert a0.rows(0) != a0.rows(a0.per_epoch)  # a new permutation each epoch


def test_split_works_of_bundled_corpus():
    docs, desc = read_documents(None)
    assert len(docs) >= 40 and "Shakespeare" in desc
    assert docs[0].startswith("ALL'S WELL THAT ENDS WELL")
    assert all("by William Shakespeare" in d[:300] for d in docs)
    assert sum(len(d) for d in docs) > 5_000_000
    assert split_works("A\n\nby William Shakespeare\nx\n\nB\n\nby William Shakespeare\ny") == [
        "A\n\nby William Shakespeare\nx", "B\n\nby William Shakespeare\ny"]


def test_train_val_split_and_unigram():
    docs = [torch.arange(1000, dtype=torch.int32) % 7, torch.ones(10, dtype=torch.int32)]
    tr, va = split_train_val(docs, 0.1)
    assert sum(d.numel() for d in tr) + sum(d.numel() for d in va) == 1010
    assert any(d.numel() == 100 for d in va)
    u = unigram_nats(Stream.from_docs(tr, 0), Stream.from_docs(va, 0), 256)
    # by hand: train = (0..899) % 7 and ten 1s, so add-one counts over 256 ids are 130, 140, 130, 130, 129, 129,
    # 129 for ids 0-6 and 1 for the rest (total 910 + 256); the val targets are (901..999) % 7, 14 of each id and
    # a 15th 5 (901 % 7 == 5)
    counts = {0: 130, 1: 140, 2: 130, 3: 130, 4: 129, 5: 129, 6: 129}
    targets = {i: 14 for i in range(7)} | {5: 15}
    exact = -sum(n * math.log(counts[i] / 1166) for i, n in targets.items()) / 99
    assert abs(u - exact) < 1e-12, (u, exact)


def test_data_sources_text_folder_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    sub = tmp_path / "d"
    sub.mkdir()
    (sub / "b.md").write_text("second doc\n" * 50)
    (sub / "c.jsonl").write_text("\n".join(json.dumps({"text": f"record {i} " * 20}) for i in range(5)) + "\n")
    docs, _ = read_documents([str(tmp_path / "a.txt"), str(sub)])
    assert len(docs) == 1 + 1 + 5
    c = load_corpus([str(sub)], ByteTokenizer(), 0.1)
    assert c.train.n_tokens + c.val.n_tokens == sum(len(d.encode()) for d in read_documents([str(sub)])[0])


def test_data_errors(tmp_path):
    with pytest.raises(TrainError, match="no such file or folder"):
        read_documents([str(tmp_path / "missing.txt")])
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(TrainError, match="empty"):
        read_documents([str(tmp_path / "empty.txt")])
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(TrainError, match='"text"'):
        read_documents([str(tmp_path / "bad.jsonl")])
    (tmp_path / "e").mkdir()
    with pytest.raises(TrainError, match="no .txt"):
        read_documents([str(tmp_path / "e")])
    with pytest.raises(TrainError, match="fewer than one global batch"):
        RowSampler(3, 4, seed=0)


def test_bad_tokenizer_is_a_train_error(tmp_path, small_corpus, micro_args):
    from hybridlm.train.main import train

    with pytest.raises(TrainError, match="--tokenizer: no such file: .*nope.json"):
        train(micro_args(small_corpus, str(tmp_path), "--tokenizer", str(tmp_path / "nope.json")))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TrainError, match="--tokenizer: .*bad.json is not a tokenizer.json"):
        train(micro_args(small_corpus, str(tmp_path), "--tokenizer", str(tmp_path / "bad.json")))


def test_data_that_is_not_text_is_refused_naming_the_file(tmp_path, seed):
    """A NUL byte, or more than 1% of the bytes invalid UTF-8, refuses the file in one line naming it."""
    g = torch.Generator().manual_seed(seed)
    noise = tmp_path / "random.bin.txt"
    noise.write_bytes(bytes(torch.randint(0, 256, (200_000,), generator=g).tolist()))
    with pytest.raises(TrainError, match=r"--data: .*random.bin.txt is not (UTF-8 )?text") as info:
        read_documents([str(noise)])
    assert "\n" not in str(info.value)
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"plain text\n" * 100 + b"\0" + b"more")
    with pytest.raises(TrainError, match=r"--data: .*nul.txt is not text \(a NUL byte at offset 1100\)"):
        read_documents([str(nul)])
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(("\n".join(json.dumps({"text": "caf\u00e9"}, ensure_ascii=False) for _ in range(3)))
                       .encode("latin-1"))  # 3 invalid bytes (é as E9) in 3 x 16 + 2
    with pytest.raises(TrainError, match=r"latin1.jsonl is not UTF-8 text \(3 of its 50 bytes, 6.0%"):
        read_documents([str(latin1)])


def test_a_few_bad_bytes_give_one_warning(tmp_path, caplog):
    """Up to 1% invalid bytes are read as U+FFFD, with one warning for the corpus that names the files."""
    good = "Hello, world.\n" * 71  # 994 bytes + 6 bad ones below: 0.6%
    (tmp_path / "a.txt").write_bytes(good.encode() + b"\xff\xfe\xc3(\xe2\x82x\x80")  # 6 invalid bytes
    (tmp_path / "b.txt").write_bytes(b"ok " * 400 + b"\xff")
    (tmp_path / "c.txt").write_text("clean\n" * 50)
    with caplog.at_level(logging.WARNING, logger="hybridlm.train.data"):
        docs, _ = read_documents([str(tmp_path / n) for n in ("a.txt", "b.txt", "c.txt")])
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "5 in " not in warnings[0] and f"6 in {tmp_path / 'a.txt'}" in warnings[0], warnings
    assert f"1 in {tmp_path / 'b.txt'}" in warnings[0] and "c.txt" not in warnings[0], warnings
    # \xc3( and \xe2\x82x are cut sequences: one U+FFFD each, the next character kept
    assert docs[0] == good + "\ufffd\ufffd\ufffd(\ufffdx\ufffd"
    caplog.clear()
    (tmp_path / "edge.txt").write_bytes(b"a" * 990 + b"\xff" * 10)  # exactly 1%: read
    read_documents([str(tmp_path / "edge.txt")])
    assert len(caplog.records) == 1
    (tmp_path / "over.txt").write_bytes(b"a" * 989 + b"\xff" * 11)
    with pytest.raises(TrainError, match="over.txt is not UTF-8 text"):
        read_documents([str(tmp_path / "over.txt")])


def test_text_files_keep_their_newlines_as_text_mode_reads_them(tmp_path):
    (tmp_path / "crlf.txt").write_bytes(b"one\r\ntwo\rthree\n")
    (tmp_path / "crlf.jsonl").write_bytes(b'{"text": "x"}\r\n{"text": "y\\r\\n"}\r\n')
    docs, _ = read_documents([str(tmp_path / "crlf.txt"), str(tmp_path / "crlf.jsonl")])
    assert docs == ["one\ntwo\nthree\n", "x", "y\r\n"]
