"""Atomic file writing, for every layer of the package (it imports nothing from hybridlm).

Non-standard here: a file is written under a temporary name in its own folder, flushed to disk (fsync), moved
onto its final name with os.replace, and the folder is fsync'd, so a crash or an interrupt at any point leaves
either the old file or the complete new one under the final name, never a half-written one. The temporary name
ends with the final name, so writers that pick a format from the extension (matplotlib's savefig) still work.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable


def fsync_file(path: str) -> None:
    """Flush a file that was written by someone else (a library writing by path) to disk."""
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
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)
