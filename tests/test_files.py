"""hybridlm.files: atomic writes leave the old file or the new one, never a part, and no temporary file."""

from __future__ import annotations

import os

import pytest

from hybridlm.files import atomic_write, atomic_write_text


def test_atomic_write_text(tmp_path):
    path = tmp_path / "a.json"
    atomic_write_text(str(path), "first\n")
    atomic_write_text(str(path), "héllo\n")
    assert path.read_bytes() == b"h\xc3\xa9llo\n"
    assert os.listdir(tmp_path) == ["a.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "plot.png"
    path.write_text("old")
    seen = []

    def write(tmp: str) -> None:
        seen.append(tmp)
        with open(tmp, "w") as f:
            f.write("partial")
        raise KeyboardInterrupt("interrupted mid-write")

    with pytest.raises(KeyboardInterrupt):
        atomic_write(str(path), write)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["plot.png"]
    # the temporary name is in the same folder (os.replace cannot cross file systems) and keeps the extension
    assert os.path.dirname(seen[0]) == str(tmp_path) and seen[0].endswith(".png")
