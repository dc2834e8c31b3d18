"""hybridlm.files: atomic writes leave the old file or the new one, never a part, and no temporary file."""

from __future__ import annotations

import os
import stat

import pytest

from hybridlm.files import atomic_write, atomic_write_text, fsync_file, set_default_mode, umask


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


@pytest.fixture
def umask_027():
    """The umask set to 027 for the test (0640 files, 0750 folders), put back after it."""
    old = os.umask(0o027)
    try:
        yield 0o027
    finally:
        os.umask(old)


def test_files_get_the_mode_open_gives_under_the_umask(tmp_path, umask_027):
    """A writer that creates its file 0600 (as safetensors and mkstemp do) still leaves a 0666 & ~umask file."""
    assert umask() == 0o027  # read without being changed
    path = tmp_path / "model.safetensors"

    def write_private(tmp: str) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"weights")
        os.close(fd)

    atomic_write(str(path), write_private)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    atomic_write_text(str(tmp_path / "a.json"), "{}")
    assert stat.S_IMODE(os.stat(tmp_path / "a.json").st_mode) == 0o640
    os.umask(0o002)
    atomic_write(str(path), write_private)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o664
    # what a checkpoint's writer calls on each file a library wrote by path (safetensors' save_file: 0600)
    lib = tmp_path / "lib.safetensors"
    write_private(str(lib))
    fsync_file(str(lib))
    assert stat.S_IMODE(os.stat(lib).st_mode) == 0o664
    folder = tmp_path / "d"
    folder.mkdir(mode=0o700)
    set_default_mode(str(folder))
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o775


def test_an_error_names_the_final_file_not_the_temporary_one(tmp_path):
    path = tmp_path / "missing" / "plot.png"

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(b"x")

    with pytest.raises(FileNotFoundError) as info:
        atomic_write(str(path), write)
    assert info.value.filename == str(path) and ".tmp-" not in str(info.value), str(info.value)
