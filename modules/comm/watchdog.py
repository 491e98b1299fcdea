"""A timeout for a backend that has none (NCCL): a daemon thread watches what a communicator
has in flight, host calls and enqueued operations alike, and when the oldest unfinished one is
older than the timeout (or the backend reports an asynchronous error) it records a CommError
naming that operation and its peers, then aborts the communicator (which ends its pending
kernels and a host call blocked on a peer that is gone). The communicator's next call, or a
wait, raises it. The error is recorded before the abort starts: nobody can see a healthy
communicator while it is being aborted."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from modules.comm.errors import CommError, first_line, no_answer


@dataclass
class _Watched:
    deadline: float
    done: Callable[[], bool]
    what: str
    peers: tuple[int, ...]


class Watchdog:
    """Bounds every watched operation by `timeout_s` (measured with `clock`, seconds).

    `abort`: ends the communicator (called once, on the watchdog's thread, after the failure
    is recorded). `poll`: raises when the backend already knows of a failure (NCCL's
    ncclCommGetAsyncError, cupy's `check_async_error`); called every `poll_s`, so a peer that
    NCCL saw die costs a poll, not the whole timeout."""

    def __init__(self, timeout_s: float, abort: Callable[[], None], poll_s: float = 0.05,
                 on_failure: Callable[[CommError], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 thread_init: Callable[[], None] | None = None,
                 poll: Callable[[], None] | None = None, peers: Sequence[int] = ()) -> None:
        self.timeout_s, self.poll_s, self.clock = timeout_s, poll_s, clock
        self._thread_init = thread_init
        """Run first on the watchdog's thread (NCCL: select the rank's CUDA device, so that
        querying events does not create a context on GPU 0)."""
        self._abort = abort
        self._poll, self._peers = poll, tuple(peers)
        self._on_failure = on_failure
        """Called once, on the watchdog's thread, right after the abort (e.g. to end the run)."""
        self._pending: deque[_Watched] = deque()
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self.failure: CommError | None = None
        """The error of the operation that timed out or failed (None while none did)."""
        self._thread = threading.Thread(target=self._run, name="comm-watchdog", daemon=True)
        self._thread.start()

    def watch(self, done: Callable[[], bool], what: str, peers: Sequence[int]) -> None:
        """Watch an operation just enqueued (or a host call about to start); `done()` says
        whether it has finished."""
        self.check()
        with self._lock:
            self._pending.append(_Watched(self.clock() + self.timeout_s, done, what,
                                          tuple(peers)))

    def check(self) -> None:
        """Raise the failure, if an operation timed out or the backend reported an error."""
        if self.failure is not None:
            raise self.failure

    def wait_all(self) -> None:
        """Block until every watched operation finished; the failure if one failed first.
        Polls from 0.1 ms up to poll_s: a step's last all-reduce is usually done soon."""
        pause = 1e-4
        while True:
            self.check()
            with self._lock:
                self._forget_done()
                if not self._pending:
                    break
            time.sleep(pause)
            pause = min(2 * pause, self.poll_s)
        self.check()  # an op that ended because it was aborted is done, and failed

    def in_flight(self) -> int:
        """How many watched operations are not done yet."""
        with self._lock:
            self._forget_done()
            return len(self._pending)

    def close(self) -> None:
        """Stop watching (the thread ends within poll_s)."""
        self._halt.set()

    def _forget_done(self) -> None:
        self._pending = deque(w for w in self._pending if not w.done())

    def _run(self) -> None:
        if self._thread_init is not None:
            self._thread_init()
        while not self._halt.wait(self.poll_s):
            if self._poll is not None:
                try:
                    self._poll()
                except Exception as e:  # cupy's NcclError: the backend's own verdict
                    if not self._halt.is_set():
                        self._fail(CommError(f"NCCL reported an asynchronous error "
                                             f"({first_line(e)}); the communicator was "
                                             "aborted", op="NCCL async error",
                                             peers=self._peers))
                    return
            with self._lock:
                self._forget_done()
                now = self.clock()
                late = next((w for w in self._pending if now > w.deadline), None)
            if late is not None:
                self._fail(no_answer(late.what, late.peers, self.timeout_s,
                                     "NCCL has no timeout: the communicator was aborted"))
                return

    def _fail(self, error: CommError) -> None:
        """Record the error first (every check from here on raises it), abort the
        communicator, then report."""
        self.failure = error
        try:
            self._abort()
        except Exception as e:  # the error to report is the first one; say the abort failed
            self.failure = CommError(f"{error}; aborting it failed too ({first_line(e)})",
                                     op=error.op, peers=error.peers)
        if self._on_failure is not None:
            self._on_failure(self.failure)
