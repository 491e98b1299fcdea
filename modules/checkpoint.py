"""Per-rank checkpoints: written to a temp file and renamed; loaded with weights_only=True."""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from scheduler.atomic_io import atomic_write_bytes
from scheduler.errors import UserError

CKPT_FORMAT = "ckpt/1"


def checkpoint_path(ckpt_dir: str | Path, rank: int) -> Path:
    """Where rank `rank` keeps its checkpoint."""
    return Path(ckpt_dir) / f"rank{rank}.pt"


def save_checkpoint(path: Path, meta: dict[str, Any], state: dict[str, Any]) -> None:
    """Serialise {format, meta, state} in memory, then write it atomically (temp + rename)."""
    buf = io.BytesIO()
    torch.save({"format": CKPT_FORMAT, "meta": meta, "state": state}, buf)
    atomic_write_bytes(path, buf.getvalue())


def load_checkpoint(path: Path, expect_meta: dict[str, Any]) -> dict[str, Any]:
    """Load a checkpoint and check that it was written for the same run layout.

    UserError when it is missing, unreadable, corrupt, or its meta differs from `expect_meta`
    (the field that differs is named).
    """
    if not path.exists():
        raise UserError(f"--resume: no checkpoint at {path}; run without --resume to start fresh")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError,
            zipfile.BadZipFile) as e:
        raise UserError(f"checkpoint {path} is corrupt or unreadable ({str(e).splitlines()[0]}"
                        "); delete it or resume from another --ckpt-dir") from None
    if not isinstance(obj, dict) or obj.get("format") != CKPT_FORMAT:
        raise UserError(f"checkpoint {path}: not a {CKPT_FORMAT} checkpoint")
    meta = obj.get("meta", {})
    for key, want in expect_meta.items():
        if meta.get(key) != want:
            raise UserError(f"checkpoint {path}: {key} is {meta.get(key)!r} but this run has "
                            f"{want!r}; it was written for another plan or rank")
    return obj["state"]
