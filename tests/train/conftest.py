from __future__ import annotations

import argparse

import pytest

from hybridlm.train.data import read_documents
from hybridlm.train.main import add_arguments


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> str:
    """Three Shakespeare works cut to 12 kB each, as one text file (split back into 3 documents)."""
    docs, _ = read_documents(None)
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    path.write_text("\n\n".join(d[:12000] for d in docs[:3]), encoding="utf-8")
    return str(path)


@pytest.fixture
def micro_args():
    return _micro_args


def _micro_args(data: str, out: str, *extra: str) -> argparse.Namespace:
    """Parsed `hybridlm train` flags for the micro test model (1 thread: bitwise reproducible)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--preset", "test-micro", "--data", data, "--out", out, "--no-progress", "--threads", "1",
                         "--eval-tokens", "512", "--sample-tokens", "0", "--val-fraction", "0.05", *extra])
