"""What keeps an NCCL communicator from hanging a rank or being used after an abort.

- Every host call (an enqueue, and the connection NCCL 2.22+ makes lazily inside the first
  call to each peer, which blocks until that peer answers) runs under the watchdog's deadline:
  it is watched before it starts, and a call still inside at the deadline is ended by
  ncclCommAbort from the watchdog's thread (NCCL's documented way to end a blocked call).
- `HostCalls` is the communicator's state machine: open -> aborting -> aborted, or open ->
  closed. Once it left `open` no call starts; an abort happens once (a second one, from the
  watchdog or the runtime, is a no-op); an abort first lets a call that is merely enqueueing
  leave (a short grace), and ends one still inside after that (the blocked one).
- `device_lock`: one lock per CUDA device around every host call of this process's cupy
  communicators, so at most one of them is inside NCCL on a device at a time (the training
  thread's pipeline / stage / tied communicators and the overlapped outer sync's worker
  thread); NCCL documents that concurrent host calls of several communicators on one device
  can deadlock (a lazy connection's allocation waits for the other communicator's kernels).
- `bounded`: ncclCommInitRank has no communicator to abort yet: it runs on a helper thread
  and a late one is a CommError naming the group (the helper is left behind; the rank ends).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from modules.comm.errors import CommError

T = TypeVar("T")
ABORT_GRACE_S = 0.5
"""How long an abort waits for a call in flight to leave before it aborts under it (an
enqueue takes microseconds; a call still inside after this is blocked on a peer)."""

_DEVICE_LOCKS: dict[int, threading.RLock] = {}
_LOCKS_LOCK = threading.Lock()


def device_lock(index: int) -> threading.RLock:
    """The one lock around NCCL host calls on CUDA device `index` in this process."""
    with _LOCKS_LOCK:
        return _DEVICE_LOCKS.setdefault(index, threading.RLock())


def bounded(fn: Callable[[], T], timeout_s: float, what: str, peers: Sequence[int]) -> T:
    """fn() on a helper thread, waited for at most `timeout_s`; CommError naming `what` and
    `peers` when it is late; what fn raised when it fails."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the caller
            out["error"] = e

    helper = threading.Thread(target=run, name="nccl-init", daemon=True)
    helper.start()
    helper.join(timeout_s)
    if helper.is_alive():
        raise CommError(f"{what}: rank(s) {list(peers)} did not join within {timeout_s:g} s "
                        "(NCCL init)", op=what, peers=peers)
    if "error" in out:  # as fn raised it (cupy's own errors stay what they are)
        raise out["error"]  # type: ignore[misc]
    return out["value"]  # type: ignore[return-value]


class HostCalls:
    """A communicator's state machine around its host calls (see the module docstring)."""

    OPEN, ABORTING, ABORTED, CLOSED = "open", "aborting", "aborted", "closed"

    def __init__(self, device_index: int, abort: Callable[[], None],
                 destroy: Callable[[], None], grace_s: float = ABORT_GRACE_S) -> None:
        self.state = self.OPEN
        self._device = device_lock(device_index)
        self._abort, self._destroy, self.grace_s = abort, destroy, grace_s
        self._cond = threading.Condition()
        self._inside = 0

    def call(self, fn: Callable[[], None], refused: Callable[[], CommError]) -> None:
        """Run one host call; `refused()` is the error when the communicator is not open."""
        with self._device:
            with self._cond:
                if self.state != self.OPEN:
                    raise refused()
                self._inside += 1
            try:
                fn()
            finally:
                with self._cond:
                    self._inside -= 1
                    self._cond.notify_all()

    def abort(self) -> bool:
        """ncclCommAbort once (True when this call did it); a second abort, or one after
        close, does nothing."""
        with self._cond:
            if self.state != self.OPEN:
                return False
            self.state = self.ABORTING
            self._cond.wait_for(lambda: self._inside == 0, self.grace_s)
        try:
            self._abort()  # under a call still inside: the blocked one, which this ends
        finally:
            with self._cond:
                self.state = self.ABORTED
        return True

    def close(self) -> bool:
        """ncclCommDestroy once, after the calls inside left (True when this call did it); a
        call still inside after the grace is blocked on a peer: abort instead (a destroy
        would flush it, and hang)."""
        with self._cond:
            if self.state != self.OPEN:
                return False
            self.state = self.CLOSED
            left = self._cond.wait_for(lambda: self._inside == 0, self.grace_s)
        (self._destroy if left else self._abort)()
        return True
