"""What scripts/export_hf.py checks before it writes anything: the destination (a dangling
symlink, a place such as /proc, a read-only or full device), the checkpoints' meta and the
model state they hold; and how a failed write is reported. Each problem is one UserError line,
and a failed export leaves nothing behind (the script writes into a temporary folder)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from formats.atomic_io import check_output_dir
from formats.errors import UserError

SPECIAL_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))
"""Kernel file systems: nothing written there is a file."""


def check_destination(out: Path, need_bytes: int = 0) -> None:
    """UserError unless `out` can be created as the export's folder with `need_bytes` free."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out}: exists and is not an empty folder; pick another")
    check_output_dir(out, "--out")  # a dangling symlink, a read-only or full device, a file
    resolved = out.resolve()
    if any(resolved == root or root in resolved.parents for root in SPECIAL_ROOTS):
        raise UserError(f"--out {out}: {resolved} is on a kernel file system (/proc, /sys, "
                        "/dev), not a place for files; give a folder on a disk")
    parent = next(a for a in [resolved, *resolved.parents] if a.exists())
    free = shutil.disk_usage(parent).free
    if need_bytes and free < need_bytes:
        raise UserError(f"--out {out}: the export needs {need_bytes} bytes, {parent} has "
                        f"{free} free; free space or give another folder")


def check_metas(metas: dict[int, Any], ckpt: Path) -> None:
    """UserError naming the rank whose checkpoint meta lacks what the export reads."""
    for rank, meta in sorted(metas.items()):
        where = f"{ckpt}: rank {rank}'s checkpoint"
        if not isinstance(meta, dict):
            raise UserError(f"{where}: its meta is not an object (not this project's checkpoint?)")
        stages = meta.get("stages")
        if (not isinstance(stages, list) or not stages
                or not all(isinstance(s, list) and len(s) == 2 for s in stages)):
            raise UserError(f"{where}: its meta has no valid 'stages' (a list of [start, end] "
                            "layer ranges); it was not written by dist_runner.py")
        stage = meta.get("stage")
        if type(stage) is not int or not 0 <= stage < len(stages):
            raise UserError(f"{where}: its meta has no valid 'stage' (got {stage!r} for "
                            f"{len(stages)} stages)")


def check_first_stage(state: Any, ckpt: Path) -> None:
    """UserError unless the first stage's model state holds a 2-D `embed.weight`."""
    import torch

    emb = state.get("embed.weight") if isinstance(state, dict) else None
    if not isinstance(emb, torch.Tensor):
        raise UserError(f"{ckpt}: the first stage's model state has no embed.weight tensor; "
                        "not a checkpoint of this project's model")
    if emb.dim() != 2 or 0 in emb.shape:
        raise UserError(f"{ckpt}: the first stage's embed.weight has shape {list(emb.shape)}, "
                        "not [vocab, d_model]; the checkpoint is damaged")


def write_failed(e: OSError, out: Path) -> UserError:
    """The one line for an export whose write failed (its temporary folder is removed)."""
    return UserError(f"--out {out}: cannot write the export ({e.strerror or e}"
                     f"{'' if e.filename is None else f': {e.filename}'}); nothing was left "
                     "behind")


def tensor_bytes(tensors: dict) -> int:
    """Bytes of the tensors as they will be written."""
    return sum(t.numel() * t.element_size() for t in tensors.values())

