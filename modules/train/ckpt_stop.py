"""What happens when a checkpoint cannot be written (full disk, read-only folder, I/O error).

The writer retries a failed write once. If the retry fails too, `--on-checkpoint-error stop`
(the default) stops every rank of the run, not only the one whose disk failed: a rank that
trained on past its last checkpoint while the others kept theirs would leave no step to resume
on every rank, and a preemption would lose everything since the last checkpoint that fit. The
failing rank records the failure here; its heartbeat thread (modules.control.fault.Monitor)
publishes it in the store under STOP_KEY, and every rank's heartbeat thread reads that key on
each beat and stops its rank (exit 1) with the same message: the path and reason, and the
newest step each rank has completely written, so the user knows where `--resume` restarts
(or that no step is on every rank). `continue` warns and trains on instead. At the end of a run,
a failure of the last write is settled the same way through the training thread's store.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from modules.comm import PeerError
from modules.control.protocol import checkpoint_key

STOP_KEY = "ckpt/stop"
"""The first failed checkpoint's record {rank, step, why} (signed, like every control key)."""
POLICIES = ("stop", "continue")


class CheckpointFailed(PeerError):
    """A checkpoint could not be written and --on-checkpoint-error is stop: exit 1."""


class CheckpointStop:
    """One rank's side of the stop: its own failure (set by the writer thread) and the run's
    (read from the store by the heartbeat or the training thread)."""

    def __init__(self, rank: int, policy: str = "stop") -> None:
        self.rank, self.policy = rank, policy
        self._lock = threading.Lock()
        self._mine: str | None = None
        """My failure's record (JSON), once the retry failed under the stop policy."""
        self.reason: str | None = None
        """The run's stop message, once read (None: no rank failed)."""

    def failed(self, step: int, why: str, last_step: int | None) -> None:
        """The writer's retry of `step` failed with `why`; `last_step`: my newest complete one.
        Any thread; the first failure is the one published."""
        with self._lock:
            if self._mine is None:
                self._mine = json.dumps({"rank": self.rank, "step": step, "why": why,
                                         "last": -1 if last_step is None else last_step})

    @property
    def pending(self) -> bool:
        """This rank failed to write a checkpoint (under the stop policy)."""
        return self._mine is not None

    def poll(self, store: Any, members: tuple[int, ...] | list[int]) -> str | None:
        """Publish my failure (first one wins), else read another rank's; the stop message
        when some rank failed, else None. `store`: a signed store client of the caller's
        thread."""
        if self.reason is not None:
            return self.reason
        if self._mine is not None:
            record = json.loads(self._mine)
            store.put(checkpoint_key(self.rank), str(record["last"]))  # the step I really have
            raw = store.claim(STOP_KEY, self._mine)
        else:
            raw = store.read(STOP_KEY)
        if raw is None:
            return None
        try:
            record = json.loads(raw)
            rank, step, why = int(record["rank"]), int(record["step"]), str(record["why"])
        except (ValueError, KeyError, TypeError):
            return None  # not our record: signed keys make this the run's own bug, not a stop
        self.reason = (f"rank {rank} could not write its checkpoint of step {step}, also on a "
                       f"retry: {why}; every rank stops (--on-checkpoint-error stop; `continue` "
                       f"trains on without it); {newest_steps(store, members)}")
        return self.reason


def newest_steps(store: Any, members: tuple[int, ...] | list[int]) -> str:
    """Where --resume restarts: the newest step every rank has (as each rank published it),
    each rank's newest when they differ, or that no step is on every rank."""
    try:
        steps = {r: store.read_int(checkpoint_key(r), -1) for r in members}
    except (RuntimeError, OSError):
        return "the ranks' newest checkpoints could not be read from the store"
    if not steps:
        return "no rank's checkpoint is known"
    common = min(steps.values())
    detail = ("" if len(set(steps.values())) == 1 else " (newest complete step by rank: "
              + ", ".join(f"{r}: {'none' if s < 0 else s}" for r, s in sorted(steps.items()))
              + ")")
    if common < 0:
        return ("no step is completely written on every rank: this run cannot be resumed "
                f"(start it again without --resume){detail}")
    return f"step {common} is complete on every rank: --resume restarts there{detail}"


def start_note(ckpt: Any, steps: int) -> str:
    """The start line's part on checkpoints: where, how often, and what a failed write does."""
    if not ckpt.dir:
        return ""
    every = ckpt.interval(steps)
    when = "at the end" if every >= steps else f"every {every} steps and at the end"
    then = ("stops every rank" if ckpt.on_error == "stop" else "is reported and training goes on")
    return (f"; checkpoints to {ckpt.dir} {when} (a write that fails twice {then}: "
            f"--on-checkpoint-error {ckpt.on_error})")
