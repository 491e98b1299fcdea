"""Write files so that a reader never sees a half-written one (temp file + rename)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | os.PathLike, data: bytes | memoryview,
                       halfway: Callable[[], None] | None = None) -> None:
    """Write `data` to `path` atomically: a temp file in the same folder, fsync, rename.

    `halfway` (tests) runs when half of the bytes are in the temp file, e.g. to die there.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
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
