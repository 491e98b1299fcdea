"""Write files so that a reader never sees a half-written one (temp file + rename).

The temp file has a unique, unpredictable name in the target's folder (`tempfile.mkstemp`:
O_CREAT | O_EXCL, so a symlink planted at that name is never followed), and the rename
replaces a symlink at the target itself instead of writing through it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from formats.errors import UserError

# mkstemp creates 0600 files; a plan or cluster file is meant to be shared like any other file.
_UMASK = os.umask(0)
os.umask(_UMASK)

Chunk = bytes | bytearray | memoryview


def atomic_write_with(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Call `write(f)` on a fresh temp file beside `path`, fsync it, rename it onto `path`.

    For writers that want a file object, e.g. `lambda f: fig.savefig(f, format="png")`.
    On any error the temp file is removed and `path` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # replaces a symlink at `path`, never its target
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    # makes the rename itself durable; some file systems cannot open or fsync a folder
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: Chunk | Sequence[Chunk],
                       halfway: Callable[[], None] | None = None) -> None:
    """Write `data` (bytes, or a sequence of byte chunks written in order) to `path` atomically.

    `halfway` (tests) runs when half of the bytes are in the temp file, e.g. to die there.
    """
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)

    def write(f: BinaryIO) -> None:
        todo = sum(len(memoryview(c).cast("B")) for c in chunks) // 2 if halfway else -1
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            if 0 <= todo < len(view):  # the half-way point lies in this chunk
                f.write(view[:todo])
                f.flush()
                assert halfway is not None
                halfway()
                view, todo = view[todo:], -1
            elif todo >= 0:
                todo -= len(view)
            f.write(view)

    atomic_write_with(path, write)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` as indented JSON to `path` atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode())


def check_output_path(path: str | os.PathLike, flag: str, suffix: str = "") -> None:
    """UserError now (before long work) if `path` cannot be written as a file later."""
    p = Path(path)
    if suffix and p.suffix.lower() != suffix:
        raise UserError(f"{flag} {path}: expected a {suffix} file name")
    if p.is_dir():
        raise UserError(f"{flag} {path}: is a directory; give a file name")
    parent = next((a for a in p.absolute().parents if a.exists()), None)
    if parent is None or not parent.is_dir():
        raise UserError(f"{flag} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK):
        raise UserError(f"{flag} {path}: cannot write in {parent}")


def check_output_dir(path: str | os.PathLike, flag: str) -> None:
    """UserError now (before long work) if `path` cannot be used or created as a folder later."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} {path}: exists and is not a directory")
    parent = next((a for a in [p.absolute(), *p.absolute().parents] if a.exists()), None)
    if parent is None or not parent.is_dir():
        raise UserError(f"{flag} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK):
        raise UserError(f"{flag} {path}: cannot write in {parent}")
