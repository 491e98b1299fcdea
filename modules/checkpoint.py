"""Per-rank checkpoints: D/rank{R}/step{S}.pt, written to a temp file and renamed (so a file with
that name is always complete), the newest `keep` kept; loaded with weights_only=True.

`AsyncCheckpointer` takes a CPU snapshot on the training thread (tensors cloned: the only part
that blocks training) and writes it in a background thread; `complete_steps` lists what
`--resume` may pick (temp files never match `step*.pt`).
"""

from __future__ import annotations

import io
import pickle
import queue
import re
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from formats.atomic_io import atomic_write_bytes
from formats.errors import UserError

CKPT_FORMAT = "ckpt/1"
STEP_FILE = re.compile(r"^step(\d+)\.pt$")


def checkpoint_path(ckpt_dir: str | Path, rank: int) -> Path:
    """Single-file checkpoint of rank `rank` (used by save_checkpoint callers and tests)."""
    return Path(ckpt_dir) / f"rank{rank}.pt"


def rank_dir(ckpt_dir: str | Path, rank: int) -> Path:
    """Folder of rank `rank`'s step checkpoints."""
    return Path(ckpt_dir) / f"rank{rank}"


def step_path(ckpt_dir: str | Path, rank: int, step: int) -> Path:
    """Where rank `rank` keeps its checkpoint of step `step`."""
    return rank_dir(ckpt_dir, rank) / f"step{step:08d}.pt"


def complete_steps(ckpt_dir: str | Path, rank: int) -> list[int]:
    """Steps with a complete (renamed) checkpoint of `rank`, ascending; temp files are ignored."""
    d = rank_dir(ckpt_dir, rank)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for f in d.iterdir() if (m := STEP_FILE.match(f.name)))


def snapshot(obj: Any) -> Any:
    """Deep copy of nested dicts/lists/tuples with every tensor cloned to CPU (detached)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(snapshot(v) for v in obj)
    return obj


def save_checkpoint(path: Path, meta: dict[str, Any], state: dict[str, Any]) -> None:
    """Serialise {format, meta, state} in memory, then write it atomically (temp + rename)."""
    buf = io.BytesIO()
    torch.save({"format": CKPT_FORMAT, "meta": meta, "state": state}, buf)
    atomic_write_bytes(path, buf.getvalue())


def prune(ckpt_dir: str | Path, rank: int, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints of `rank`."""
    for step in complete_steps(ckpt_dir, rank)[:-keep] if keep > 0 else []:
        step_path(ckpt_dir, rank, step).unlink(missing_ok=True)


DebugHook = Callable[[int, str], None]
"""Tests only: called by the writer with (step, "half") after half the bytes are written."""


class AsyncCheckpointer:
    """Snapshot on the caller's thread, write + rename + prune in one background thread.

    At most one write is in flight: a new `save` first waits for the previous one (counted in
    `block_s`). Errors of the writer are raised by the next `save` or by `flush`.
    """

    def __init__(self, ckpt_dir: str | Path, rank: int, keep: int = 2,
                 debug_hook: DebugHook | None = None) -> None:
        self.ckpt_dir, self.rank, self.keep = Path(ckpt_dir), rank, keep
        self.debug_hook = debug_hook
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self.block_s: list[float] = []
        """Seconds each save blocked the caller (waiting for the previous write + snapshot)."""
        self.last_step: int | None = None
        """Step of the newest checkpoint written completely."""
        self._thread = threading.Thread(target=self._loop, name=f"ckpt-writer-{rank}",
                                        daemon=True)
        self._thread.start()

    def save(self, step: int, meta: dict[str, Any], state: dict[str, Any]) -> float:
        """Snapshot `state` now and write it in the background; returns the blocking seconds."""
        t0 = time.perf_counter()
        self._idle.wait()
        self._raise()
        snap = snapshot(state)
        self._idle.clear()
        self._queue.put((step, meta, snap, True))
        blocked = time.perf_counter() - t0
        self.block_s.append(blocked)
        return blocked

    def save_snapshot(self, step: int, meta: dict[str, Any], snap: dict[str, Any],
                      prune_old: bool = False) -> None:
        """Write an already-taken snapshot (e.g. an emergency checkpoint) in the background."""
        self._idle.wait()
        self._idle.clear()
        self._queue.put((step, meta, snap, prune_old))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the write in flight is on disk; False if `timeout` passed first."""
        ok = self._idle.wait(timeout)
        self._raise()
        return ok

    def busy(self) -> bool:
        """Whether a write is in flight."""
        return not self._idle.is_set()

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _loop(self) -> None:
        while True:
            step, meta, snap, prune_old = self._queue.get()
            try:
                self._write(step, meta, snap)
                self.last_step = step
                if prune_old:
                    prune(self.ckpt_dir, self.rank, self.keep)
            except BaseException as e:  # reported to the training thread
                self._error = e
            finally:
                self._idle.set()

    def _write(self, step: int, meta: dict[str, Any], snap: dict[str, Any]) -> None:
        path = step_path(self.ckpt_dir, self.rank, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        torch.save({"format": CKPT_FORMAT, "meta": meta, "state": snap}, buf)
        hook = self.debug_hook
        atomic_write_bytes(path, buf.getbuffer(),
                           (lambda: hook(step, "half")) if hook is not None else None)


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
