"""Opening user files for reading: a regular file only, with a size limit; every problem is a
UserError naming the file.

A FIFO where a file is expected blocks `open()` forever (no writer) and a device such as
/dev/zero (or a symlink to it) never ends, so a plain `open(path).read()` hangs or runs out of
memory. Here the file is opened with O_NONBLOCK (a FIFO opens at once) and its type is checked
on the open descriptor (no window between a check and the open), then its size.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path
from typing import BinaryIO

from formats.errors import UserError

NOT_REGULAR = "not a regular file (a FIFO, socket or device?); give a file"


def _kind_problem(mode: int) -> str | None:
    """Why a file of this mode cannot be read as a file, or None."""
    if stat.S_ISDIR(mode):
        return "is a directory; give a file"
    if not stat.S_ISREG(mode):
        return NOT_REGULAR
    return None


def _too_big(size: int, max_bytes: int) -> str:
    return f"{size} bytes, larger than the {max_bytes} bytes such a file may hold"


def open_regular(path: str | os.PathLike, what: str,
                 max_bytes: int | None = None) -> BinaryIO:
    """The regular file `path` opened for binary reading, at most `max_bytes` long (None: any
    size); UserError `WHAT PATH: why` for a folder, FIFO, device, missing or unreadable file."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise UserError(f"cannot read {what} {p}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        why = _kind_problem(st.st_mode)
        if why is None and max_bytes is not None and st.st_size > max_bytes:
            why = _too_big(st.st_size, max_bytes)
        if why is not None:
            raise UserError(f"{what} {p}: {why}")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | os.PathLike, what: str, max_bytes: int) -> bytes:
    """The bytes of the regular file `path` (at most `max_bytes`, also if it grows while
    read); UserError naming it otherwise."""
    with open_regular(path, what, max_bytes) as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise UserError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise UserError(f"{what} {path}: larger than the {max_bytes} bytes such a file may hold")
    return data


def check_regular(path: str | os.PathLike, what: str,
                  max_bytes: int | None = None) -> os.stat_result:
    """stat of `path` after checking it is a regular file of at most `max_bytes`, for readers
    that open by name themselves (np.memmap, pyarrow); UserError naming it otherwise."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise UserError(f"cannot read {what} {p}: {e.strerror or e}") from None
    why = _kind_problem(st.st_mode)
    if why is None and max_bytes is not None and st.st_size > max_bytes:
        why = _too_big(st.st_size, max_bytes)
    if why is not None:
        raise UserError(f"{what} {p}: {why}")
    return st
