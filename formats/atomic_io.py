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


NAME_MAX = 255
"""Longest file name (one path component, in bytes) Linux file systems take (ENAMETOOLONG)."""
PATH_MAX = 4096
MIN_FREE_BYTES = 1 << 20
"""Free space below which an output folder counts as full (a metrics line, a small JSON)."""


def _name_problem(p: Path) -> str | None:
    """Why the file system would refuse the name `p` itself (ENAMETOOLONG), or None."""
    for part in p.parts:
        size = len(os.fsencode(part))
        if size > NAME_MAX:
            return (f"the name {part[:24]!r}... is {size} bytes, more than the {NAME_MAX} a "
                    "file name may have; give a shorter one")
    if len(os.fsencode(str(p.absolute()))) >= PATH_MAX:
        return f"the path is longer than the {PATH_MAX} bytes a path may have"
    return None


def _folder_problem(folder: Path) -> str | None:
    """Why nothing can be written in the existing `folder` (not a folder, no permission, its
    device full), or None."""
    if not folder.is_dir():
        return f"{folder} is not a directory"
    if not os.access(folder, os.W_OK):
        return f"cannot write in {folder}"
    st = os.statvfs(folder)
    free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize
    if st.f_blocks and free < MIN_FREE_BYTES:
        return f"no space left on the device of {folder} ({free} bytes free)"
    return None


def _nearest_existing(p: Path) -> Path | None:
    """`p` or its nearest ancestor that exists."""
    return next((a for a in [p, *p.parents] if a.exists()), None)


def _output_problem(p: Path, is_dir: bool) -> str | None:
    """Why `p` cannot be written as a file (is_dir False) or used as a folder, or None."""
    why = _name_problem(p)
    if why is not None:
        return why
    if p.is_symlink() and not p.exists():
        return (f"is a symlink to {os.readlink(p)}, which does not exist; create that or "
                "give another path")
    if p.exists():
        if is_dir and not p.is_dir():
            return "exists and is not a directory"
        if not is_dir and p.is_dir():
            return "is a directory; give a file name"
        if not is_dir and not p.is_file():
            return "exists and is not a regular file (a device, FIFO or socket); give a file name"
    parent = _nearest_existing(p if is_dir else p.parent)
    return "no existing parent folder" if parent is None else _folder_problem(parent)


def check_output_path(path: str | os.PathLike, flag: str, suffix: str = "") -> None:
    """UserError now (before long work) if `path` cannot be written as a file later."""
    p = Path(path).absolute()
    if suffix and p.suffix.lower() != suffix:
        raise UserError(f"{flag} {path}: expected a {suffix} file name")
    try:
        why = _output_problem(p, is_dir=False)
    except OSError as e:  # e.g. a folder on the way that cannot be listed
        why = e.strerror or str(e)
    if why is not None:
        raise UserError(f"{flag} {path}: {why}")


def check_output_dir(path: str | os.PathLike, flag: str) -> None:
    """UserError now (before long work) if `path` cannot be used or created as a folder later."""
    try:
        why = _output_problem(Path(path).absolute(), is_dir=True)
    except OSError as e:
        why = e.strerror or str(e)
    if why is not None:
        raise UserError(f"{flag} {path}: {why}")
