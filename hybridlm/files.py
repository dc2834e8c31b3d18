"""Atomic file writing, for every layer of the package (it imports nothing from hybridlm).

Non-standard here: a file is written under a temporary name in its own folder, flushed to disk (fsync), moved
onto its final name with os.replace, and the folder is fsync'd, so a crash or an interrupt at any point leaves
either the old file or the complete new one under the final name, never a half-written one. The temporary name
ends with the final name, so writers that pick a format from the extension (matplotlib's savefig) still work.
Before the move the file gets the mode a plain `open` would have given it (0666 less the umask): some writers
(safetensors' save_file, tempfile.mkstemp) create 0600 files, which another user of a shared machine cannot read.
An OSError about the temporary file is raised again naming the final path, the one the caller knows.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable


def umask() -> int:
    """The process umask, read without changing it where Linux shows it; else set and put back at once."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def set_default_mode(path: str) -> None:
    """Give `path` the mode `open` (a file: 0666) or `os.mkdir` (a folder: 0777) gives under the umask."""
    base = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, base & ~umask())


def fsync_file(path: str) -> None:
    """Flush a file that was written by someone else (a library writing by path) to disk, and give it the mode a
    plain `open` gives (`set_default_mode`): such writers may create it 0600."""
    set_default_mode(path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    """Flush a folder's entries (a rename into it) to disk; a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[str], object]) -> None:
    """Call `write(tmp)` to create the file at a temporary path next to `path`, then move it onto `path`
    atomically (fsync'd). On any failure, the temporary file is removed and `path` is left as it was."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{os.path.basename(path)}")
    try:
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename == tmp:  # "No such file or directory: .tmp-...-plot.png"
            raise type(e)(e.errno, e.strerror, path) from None
        raise
    fsync_dir(folder)


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)
