"""Write files so that a reader never sees a half-written one (temp file + rename)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from formats.errors import UserError

# mkstemp creates 0600 files; a plan or cluster file is meant to be shared like any other file.
_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write_bytes(path: str | os.PathLike, data: bytes | memoryview,
                       halfway: Callable[[], None] | None = None) -> None:
    """Write `data` to `path` atomically: a temp file in the same folder, fsync, rename.

    `halfway` (tests) runs when half of the bytes are in the temp file, e.g. to die there.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            if halfway is not None:
                f.write(data[: len(data) // 2])
                f.flush()
                halfway()
                data = data[len(data) // 2:]
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
