"""Per-rank checkpoints: D/rank{R}/step{S}.pt, written to a temp file and renamed (so a file with
that name is always complete), the newest `keep` kept; loaded with weights_only=True.

A file is a 48-byte header (magic, sha256 of the payload, payload length) and the payload
(`torch.save` of {format, meta, state}); the checksum is verified before anything is unpickled,
so a flipped byte anywhere is an error naming the file and rank, never a silent load.

`AsyncCheckpointer` takes a CPU snapshot on the training thread (tensors cloned: the only part
that blocks training) and writes it in a background thread; `complete_steps` lists what
`--resume` may pick: renamed files whose checksum verifies (temp files never match `step*.pt`).
`check_finite_state` tells the training loop when the loss or a parameter stopped being finite.
"""

from __future__ import annotations

import hashlib
import io
import math
import pickle
import queue
import re
import shutil
import struct
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from formats.atomic_io import atomic_write_bytes
from formats.errors import UserError
from formats.safe_open import open_regular

CKPT_FORMAT = "ckpt/2"
"""ckpt/1 had no checksum; its files are refused (they cannot be verified)."""
MAGIC = b"STCKPT2\n"
HEADER = struct.Struct("<8s32sQ")
"""magic, sha256 of the payload, payload length in bytes (little-endian)."""
STEP_FILE = re.compile(r"^step(\d+)\.pt$")
TEMP_FILE = re.compile(r"^\.step\d+\.pt\..+\.tmp$")
"""A write's temporary file (formats.atomic_io's name): left over only by a killed write."""
_RANK_NAME = re.compile(r"^rank(\d+)")
_READ_CHUNK_BYTES = 1 << 20
META_HINTS = {"tokenizer": "it was trained with another vocabulary: resume with the "
              "--tokenizer it was written with (vocab_size and sha256 of the file must match)"}
"""What to do when a meta field differs (default: another plan or rank)."""


def checkpoint_path(ckpt_dir: str | Path, rank: int) -> Path:
    """Single-file checkpoint of rank `rank` (used by save_checkpoint callers and tests)."""
    return Path(ckpt_dir) / f"rank{rank}.pt"


def rank_dir(ckpt_dir: str | Path, rank: int) -> Path:
    """Folder of rank `rank`'s step checkpoints."""
    return Path(ckpt_dir) / f"rank{rank}"


def step_path(ckpt_dir: str | Path, rank: int, step: int) -> Path:
    """Where rank `rank` keeps its checkpoint of step `step`."""
    return rank_dir(ckpt_dir, rank) / f"step{step:08d}.pt"


def step_files(ckpt_dir: str | Path, rank: int) -> list[int]:
    """Steps with a renamed checkpoint file of `rank`, ascending, unverified (names only)."""
    d = rank_dir(ckpt_dir, rank)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for f in d.iterdir() if (m := STEP_FILE.match(f.name)))


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def complete_steps(ckpt_dir: str | Path, rank: int,
                   log: Callable[[str], None] | None = None) -> list[int]:
    """Steps of `rank` whose checkpoint is complete and intact (checksum verified), ascending.

    Each file that fails verification is skipped with an `error: checkpoint PATH is corrupt or
    unreadable (...)` line naming it and the rank (to `log`, default stderr), so `--resume`'s
    agreement on the newest step every rank has falls back to an older intact one.
    """
    log = log or _stderr
    intact = []
    for step in step_files(ckpt_dir, rank):
        path = step_path(ckpt_dir, rank, step)
        why = verify_checkpoint(path)
        if why is None:
            intact.append(step)
        else:
            log(f"error: checkpoint {path} is corrupt or unreadable (rank {rank}: {why}); "
                f"rank {rank} skips step {step}, so --resume falls back to an older step if "
                "every rank has one intact")
    return intact


def fallback_note(ckpt_dir: str | Path, rank: int, step: int) -> str | None:
    """What to say when --resume picked `step` although `rank` has a newer checkpoint file."""
    newer = [s for s in step_files(ckpt_dir, rank) if s > step]
    if not newer:
        return None
    return (f"resuming from step {step}, not step {newer[-1]}: the newer checkpoints are not "
            "intact on every rank (see the error lines)")


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


def encode_checkpoint(meta: dict[str, Any], state: dict[str, Any]) -> list[bytes | memoryview]:
    """The bytes of a checkpoint file as [header, payload] (written in that order)."""
    buf = io.BytesIO()
    torch.save({"format": CKPT_FORMAT, "meta": meta, "state": state}, buf)
    payload = buf.getbuffer()
    return [HEADER.pack(MAGIC, hashlib.sha256(payload).digest(), len(payload)), payload]


def save_checkpoint(path: Path, meta: dict[str, Any], state: dict[str, Any]) -> None:
    """Serialise {format, meta, state} in memory, then write it atomically (temp + rename)."""
    atomic_write_bytes(path, encode_checkpoint(meta, state))


def _check_header(head: bytes, size: int) -> tuple[str | None, bytes, int]:
    """(why the file is bad or None, sha256, payload length) from its first HEADER.size bytes."""
    if len(head) < HEADER.size:
        return f"truncated: {size} bytes, shorter than the {HEADER.size}-byte header", b"", 0
    magic, digest, length = HEADER.unpack(head)
    if magic != MAGIC:
        old = " (an older ckpt/1 file without a checksum?)" if head[:2] == b"PK" else ""
        return f"not a {CKPT_FORMAT} checkpoint: bad magic bytes{old}", b"", 0
    if size != HEADER.size + length:
        return (f"{size} bytes on disk but the header says {HEADER.size + length} (truncated "
                "or extended)"), b"", 0
    return None, digest, length


def verify_checkpoint(path: Path) -> str | None:
    """None if `path` is a complete checkpoint whose checksum verifies, else why not."""
    try:
        with open_regular(path, "checkpoint") as f:  # a FIFO here would block the resume
            size = f.seek(0, io.SEEK_END)
            f.seek(0)
            why, digest, _ = _check_header(f.read(HEADER.size), size)
            if why is not None:
                return why
            h = hashlib.sha256()
            while chunk := f.read(_READ_CHUNK_BYTES):
                h.update(chunk)
    except OSError as e:
        return f"cannot read it: {e.strerror or e}"
    except UserError as e:
        return str(e).split(": ", 1)[-1]
    if h.digest() != digest:
        return "sha256 of its bytes does not match the one written with it (changed on disk)"
    return None


def prune(ckpt_dir: str | Path, rank: int, keep: int, floor: int | None = None) -> None:
    """Delete all but the newest `keep` checkpoint files of `rank`, never one of step
    `floor` or newer (the newest step every rank has: --resume needs it on every rank)."""
    for step in step_files(ckpt_dir, rank)[:-keep] if keep > 0 else []:
        if floor is None or step < floor:
            step_path(ckpt_dir, rank, step).unlink(missing_ok=True)


def remove_stale_temps(ckpt_dir: str | Path, rank: int) -> list[Path]:
    """Delete the temporary files a killed write left in `rank`'s folder (call before any
    writer of this rank runs); returns them."""
    d = rank_dir(ckpt_dir, rank)
    try:
        stale = [f for f in d.iterdir() if TEMP_FILE.match(f.name) and f.is_file()]
    except OSError:
        return []
    for f in stale:
        f.unlink(missing_ok=True)
    return stale


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem of `path` (its nearest existing folder)."""
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def write_step(ckpt_dir: str | Path, rank: int, step: int, meta: dict[str, Any],
               state: dict[str, Any], hook: Callable[[], None] | None = None) -> str | None:
    """Write `rank`'s checkpoint of `step` (temp + rename); None when it is on disk, else why
    not: the path, the error, the bytes it needed and the free bytes there. A failed write
    leaves no temporary file and the previous checkpoints as they were."""
    path = step_path(ckpt_dir, rank, step)
    chunks = encode_checkpoint(meta, state)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, chunks, hook)
    except OSError as e:
        need = sum(memoryview(c).nbytes for c in chunks)
        free = _free_bytes(path.parent)
        where = f", {free} free there" if free is not None else ""
        return (f"cannot write {path} ({e.strerror or e}; it needs {need} bytes{where}; "
                f"--ckpt-dir {ckpt_dir})")
    return None


def shared_floor(store: Any, rank: int, ranks: Iterable[int], last: int | None,
                 publish: bool = True) -> int | None:
    """Publish `last` (this rank's newest complete step; unless not `publish`) and return the
    oldest such step over `ranks` (-1 while one has none): `prune` keeps it, so --resume finds
    a step every rank has even when some rank's saves failed. None when the store does not
    answer."""
    from modules.control.protocol import checkpoint_key

    try:
        if publish:
            store.put(checkpoint_key(rank), str(-1 if last is None else last))
        return min(store.read_int(checkpoint_key(r), -1) for r in ranks)
    except (RuntimeError, OSError):
        return None


RETRY_PAUSE_S = 1.0
"""Pause before the one retry of a failed checkpoint write."""
DebugHook = Callable[[int, str], None]
"""Tests only: called by the writer with (step, "half") after half the bytes are written."""


class AsyncCheckpointer:
    """Snapshot on the caller's thread, write + rename + prune in one background thread.

    At most one write is in flight: a new `save` first waits for the previous one (counted in
    `block_s`). Errors of the writer are raised by the next `save` or by `flush`.
    """

    def __init__(self, ckpt_dir: str | Path, rank: int, keep: int = 2,
                 debug_hook: DebugHook | None = None,
                 log: Callable[[str], None] | None = None,
                 on_failure: Callable[[int, str], None] | None = None) -> None:
        self.ckpt_dir, self.rank, self.keep = Path(ckpt_dir), rank, keep
        self.debug_hook = debug_hook
        self.on_failure = on_failure
        """Called with (step, why) when a write failed twice (None: warn and train on)."""
        self.fail_from = 0
        """Tests (--debug-ckpt-fail): writes of this step and later fail (0: never)."""
        self.log = log or _stderr
        for f in remove_stale_temps(ckpt_dir, rank):
            self.log(f"checkpoint: removed {f}, left over by a write that was killed")
        self.floor: int | None = None
        """The newest step every rank has completely (`shared_floor`): never pruned."""
        self.failures: list[str] = []
        """Why each failed write failed (the run goes on without that checkpoint)."""
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
                why = self.write_retried(step, meta, snap)
                if why is not None:
                    self.report_failure(step, why)
                    continue
                self.last_step = step
                if prune_old:
                    prune(self.ckpt_dir, self.rank, self.keep, self.floor)
            except BaseException as e:  # reported to the training thread
                self._error = e
            finally:
                self._idle.set()

    def write_retried(self, step: int, meta: dict[str, Any], snap: dict[str, Any]) -> str | None:
        """Write a step, and once more after RETRY_PAUSE_S if that failed (a transient I/O
        error, space freed meanwhile); None when it is on disk, else why not."""
        hook = self.debug_hook
        for attempt in (1, 2):
            why = (f"cannot write {step_path(self.ckpt_dir, self.rank, step)} (Input/output "
                   "error injected by --debug-ckpt-fail)" if self.fail_from and
                   step >= self.fail_from else
                   write_step(self.ckpt_dir, self.rank, step, meta, snap,
                              (lambda: hook(step, "half")) if hook is not None else None))
            if why is None or attempt == 2:
                return why
            self.log(f"checkpoint of step {step} failed: {why}; retrying once in "
                     f"{RETRY_PAUSE_S:g} s")
            time.sleep(RETRY_PAUSE_S)
        return why

    def report_failure(self, step: int, why: str) -> None:
        """A save that failed twice: the handler decides (stop the run); without one, say so,
        keep the older steps (no pruning) and train on."""
        self.failures.append(why)
        if self.on_failure is not None:
            self.on_failure(step, why)
            return
        kept = (f"step {self.last_step} stays the newest complete one" if self.last_step
                is not None else "no complete checkpoint of this run yet")
        self.log(f"warning: checkpoint of step {step} failed: {why}; {kept} (nothing pruned); "
                 "training goes on and the next checkpoint tries again")


def _rank_of(path: Path, expect_meta: dict[str, Any]) -> str:
    """The rank a checkpoint belongs to, for messages: from the run's meta or the path."""
    if "rank" in expect_meta:
        return str(expect_meta["rank"])
    m = _RANK_NAME.match(path.parent.name) or _RANK_NAME.match(path.name)
    return m.group(1) if m else "?"


def _read_verified(path: Path, rank: str) -> io.BytesIO:
    """The payload of `path` after its checksum verified; UserError naming file and rank."""
    def corrupt(why: str) -> UserError:
        return UserError(f"checkpoint {path} is corrupt or unreadable (rank {rank}: {why}); "
                         "delete it or resume from another --ckpt-dir")

    try:
        with open_regular(path, "checkpoint") as f:  # a FIFO here would block the resume
            data = f.read()
    except OSError as e:
        raise corrupt(f"cannot read it: {e.strerror or e}") from None
    except UserError as e:
        raise corrupt(str(e).split(": ", 1)[-1]) from None
    why, digest, _ = _check_header(data[:HEADER.size], len(data))
    if why is not None:
        raise corrupt(why)
    with memoryview(data) as view:
        if hashlib.sha256(view[HEADER.size:]).digest() != digest:
            raise corrupt("sha256 of its bytes does not match the one written with it "
                          "(changed on disk)")
        return io.BytesIO(view[HEADER.size:])  # one copy; `data` is freed on return


def load_checkpoint(path: Path, expect_meta: dict[str, Any]) -> dict[str, Any]:
    """Load a checkpoint after verifying its checksum, and check it was written for this run.

    UserError (naming the file and rank) when it is missing, unreadable, corrupt, not a
    mapping of the expected shape, holds non-finite values, or its meta differs from
    `expect_meta` (the field that differs is named).
    """
    return load_checkpoint_meta(path, expect_meta)[1]


def load_checkpoint_meta(path: Path, expect_meta: dict[str, Any],
                         any_shard_degree: bool = False) -> tuple[dict, dict]:
    """(meta, state) of a checkpoint, checked like load_checkpoint (scripts/export_hf.py;
    `any_shard_degree`: a reader that gathers the shards itself takes any D)."""
    if not path.exists():
        raise UserError(f"--resume: no checkpoint at {path}; run without --resume to start fresh")
    rank = _rank_of(path, expect_meta)
    payload = _read_verified(path, rank)
    try:
        obj = torch.load(payload, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError,
            zipfile.BadZipFile) as e:  # checksum fine: written so by a bug, not changed on disk
        raise UserError(f"checkpoint {path} is corrupt or unreadable (rank {rank}: "
                        f"{str(e).splitlines()[0]}); delete it or resume from another "
                        "--ckpt-dir") from None
    where = f"checkpoint {path} (rank {rank})"
    if not isinstance(obj, dict) or obj.get("format") != CKPT_FORMAT:
        raise UserError(f"{where}: not a {CKPT_FORMAT} checkpoint")
    meta, state = obj.get("meta"), obj.get("state")
    for name, value in (("meta", meta), ("state", state)):
        if not isinstance(value, dict):
            raise UserError(f"{where}: {name} is {type(value).__name__}, not a mapping")
    saved_d, want_d = meta.get("shard_degree", 1), expect_meta.get("shard_degree", 1)
    # shard groups (issue 22): checked first, a shard's rows depend on D
    if saved_d != want_d and not any_shard_degree:
        raise UserError(f"checkpoint {path}: written with shard degree D = {saved_d}, this run "
                        f"has D = {want_d}; resume with a plan of D = {saved_d} or start fresh")
    for key, want in expect_meta.items():
        if meta.get(key) != want:
            hint = META_HINTS.get(key, "it was written for another plan or rank")
            raise UserError(f"checkpoint {path}: {key} is {meta.get(key)!r} but this run has "
                            f"{want!r}; {hint}")
    bad = nonfinite_tensors(state)
    if bad:
        raise UserError(f"{where}: {bad[0]} holds non-finite values ({len(bad)} tensor(s) in "
                        "all); it was saved after training diverged, resume from an older step")
    return meta, state


# -- finiteness ------------------------------------------------------------------------------
def nonfinite_tensors(obj: Any, prefix: str = "") -> list[str]:
    """Dotted names of the floating-point tensors in nested dicts/lists that hold NaN or inf."""
    if isinstance(obj, torch.Tensor):
        bad = obj.is_floating_point() and not bool(torch.isfinite(obj).all())
        return [prefix or "tensor"] if bad else []
    if isinstance(obj, dict):
        items: Iterable[tuple[Any, Any]] = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return []
    return [n for k, v in items
            for n in nonfinite_tensors(v, f"{prefix}.{k}" if prefix else str(k))]


def check_finite_state(loss: float | torch.Tensor | None,
                       params: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """None if the loss and every named parameter and its gradient are finite, else what is not.

    `params` is e.g. `model.named_parameters()`; `loss` None (a stage without the loss) is
    skipped. Fast path: one fp32-accumulated sum per tensor and a single device sync (NaN and
    inf reach the sum; about 12x cheaper than isfinite on every element on a CPU); only when a
    sum is not finite are the tensors looked at element by element, so a sum that merely
    overflows is no false alarm.
    """
    if loss is not None and not math.isfinite(float(loss)):
        return f"the loss is {float(loss)}"
    named = [(f"{kind} {name}", t)
             for name, p in params for kind, t in (("parameter", p), ("the gradient of", p.grad))
             if t is not None and t.is_floating_point()]
    if not named:
        return None
    with torch.no_grad():
        sums = torch.stack([t.sum(dtype=torch.float32) for _, t in named])
        if bool(torch.isfinite(sums).all()):
            return None
        bad = [(name, t) for name, t in named if not bool(torch.isfinite(t).all())]
    if not bad:
        return None
    name, t = bad[0]
    count = int((~torch.isfinite(t)).sum())
    more = f"; {len(bad) - 1} more tensor(s) too" if len(bad) > 1 else ""
    return f"{name} has {count} non-finite value(s) of {t.numel()}{more}"
