"""Write the bundled Shakespeare as a corpus of short documents (JSONL, one {"text": ...} per line).

Run it when you need a corpus shaped like web text (many documents of a few hundred bytes) to train or benchmark
packing with document boundaries: `hybridlm train --data <out>` reads the file as one document per line. The
documents come from `hybridlm.train.data.short_documents`: each work split at blank lines, paragraphs joined until
a document passes --min-bytes (400: 8,674 documents of 581 bytes on average). The output is deterministic.

    python scripts/short_docs.py [OUT] [--min-bytes 400]       (OUT default: runs/short_docs.jsonl)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridlm.files import atomic_write_text  # noqa: E402
from hybridlm.train.data import bundled_corpus_text, short_documents  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default=os.path.join("runs", "short_docs.jsonl"), help="output .jsonl path")
    p.add_argument("--min-bytes", type=int, default=400, help="a document ends once it passes this many bytes")
    args = p.parse_args(argv)
    if args.min_bytes < 1:
        p.error(f"--min-bytes: expected >= 1, got {args.min_bytes}")
    docs = short_documents(bundled_corpus_text(), args.min_bytes)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    atomic_write_text(args.out, "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs))
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    print(f"{args.out}: {len(docs):,} documents, {n_bytes:,} bytes ({n_bytes / len(docs):.0f} per document)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
