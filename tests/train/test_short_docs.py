"""The short-document corpus (`short_documents`, scripts/short_docs.py) and the memory of training on it.

The memory test runs two `hybridlm train` steps in child processes, once on the bundled corpus (41 long
documents: rows go as a plain batch) and once on the short documents (every row holds boundaries: one flattened
row with cu_seqlens), and compares their peak RSS. A dense [B*T, B*T] attention mask would make the second grow
with (B*T)^2.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from hybridlm.train.data import (
    bundled_corpus_text,
    make_batch,
    read_documents,
    short_document_stream,
    short_documents,
    split_works,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "short_docs.py")


def test_short_documents_of_the_bundled_text():
    text = bundled_corpus_text()
    docs = short_documents(text)
    assert len(docs) == 8674
    sizes = [len(d.encode("utf-8")) for d in docs]
    assert 570 <= sum(sizes) / len(sizes) <= 590
    assert sum(s <= 400 for s in sizes) <= len(split_works(text))  # only a work's last document may be short
    # the paragraphs, in order, are exactly those of the text
    paras = [p.strip() for p in re.split(r"\n\n+", text) if p.strip()]
    assert [p for d in docs for p in d.split("\n\n")] == paras


def test_short_documents_joins_until_past_min_bytes():
    text = "a\n\nbb\n\n\nccc\n\ndddd\n\ne"
    assert short_documents(text, min_bytes=4) == ["a\n\nbb", "ccc\n\ndddd", "e"]
    assert short_documents(text, min_bytes=5) == ["a\n\nbb\n\nccc", "dddd\n\ne"]
    with pytest.raises(ValueError, match="min_bytes: expected >= 1"):
        short_documents(text, min_bytes=0)


def test_script_writes_jsonl_that_train_reads(tmp_path):
    out = tmp_path / "docs.jsonl"
    r = subprocess.run([sys.executable, SCRIPT, str(out), "--min-bytes", "4000"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    want = short_documents(bundled_corpus_text(), 4000)
    assert f"{len(want):,} documents" in r.stdout
    assert [json.loads(line)["text"] for line in out.read_text(encoding="utf-8").splitlines()] == want
    docs, _ = read_documents([str(out)])
    assert docs == want


_RSS_CHILD = ("import resource, sys; from hybridlm.cli import main; rc = main(sys.argv[1:]); "
              "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)")


def _peak_rss_kb(tmp_path, name: str, data: list[str], preset: str, rows: int, seq_len: int) -> int:
    argv = ["train", "--preset", preset, "--seq-len", str(seq_len), "--batch-size", str(rows), "--max-steps",
            "2", "--eval-tokens", str(seq_len), "--sample-tokens", "0", "--save-every", "0", "--no-progress",
            "--threads", "1", "--out", str(tmp_path / name), *data]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _RSS_CHILD, *argv], capture_output=True, text=True, timeout=900,
                       env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return int(re.search(r"MAXRSS_KB (\d+)", r.stdout).group(1))


@pytest.mark.slow
def test_short_documents_train_in_the_memory_of_the_bundled_corpus(tmp_path):
    """Two steps of 8 x 1024 tokens: the short documents peak at <= 1.15x the bundled corpus's RSS. The test-micro
    model keeps this at ~10 s a run on two cores while the 8k x 8k of a dense mask still shows (with it: 1009 MB
    against 735 MB, 1.37x; cpu-tiny at 16 x 2048 tokens: 9.2 GB against 5.4 GB)."""
    docs = tmp_path / "short.jsonl"
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in short_documents(bundled_corpus_text())),
                    encoding="utf-8")
    bundled = _peak_rss_kb(tmp_path, "bundled", [], "test-micro", rows=8, seq_len=1024)
    short = _peak_rss_kb(tmp_path, "short", ["--data", str(docs)], "test-micro", rows=8, seq_len=1024)
    assert short <= 1.15 * bundled, f"peak RSS: short documents {short / 1024:.0f} MB, bundled {bundled / 1024:.0f} MB"


def test_short_document_stream_packs_into_rows_with_boundaries():
    stream = short_document_stream()
    assert len(stream.starts) - 1 == 8674 and stream.n_tokens == stream.n_bytes
    batch = make_batch(stream, [0, 5], 2048)
    cu = batch.cu_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == 4096 and 2048 in cu and len(cu) > 6  # row starts and document starts
    first = short_documents(bundled_corpus_text())[0].encode("utf-8")
    assert bytes(batch.input_ids[0, : len(first)].tolist()) == first
