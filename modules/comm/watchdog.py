"""A timeout for a backend that has none (NCCL): a daemon thread watches the operations a
communicator enqueued and, when the oldest unfinished one is older than the timeout, aborts the
communicator (which ends its pending kernels) and keeps a CommError naming that operation and
its peers; the communicator's next call, or a wait, raises it."""

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
    """Bounds every watched operation by `timeout_s` (measured with `clock`, seconds)."""

    def __init__(self, timeout_s: float, abort: Callable[[], None], poll_s: float = 0.05,
                 on_failure: Callable[[CommError], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 thread_init: Callable[[], None] | None = None) -> None:
        self.timeout_s, self.poll_s, self.clock = timeout_s, poll_s, clock
        self._thread_init = thread_init
        """Run first on the watchdog's thread (NCCL: select the rank's CUDA device, so that
        querying events does not create a context on GPU 0)."""
        self._abort = abort
        self._on_failure = on_failure
        """Called once, on the watchdog's thread, right after the abort (e.g. to end the run)."""
        self._pending: deque[_Watched] = deque()
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self.failure: CommError | None = None
        """The error of the operation that timed out (None while none did)."""
        self._thread = threading.Thread(target=self._run, name="comm-watchdog", daemon=True)
        self._thread.start()

    def watch(self, done: Callable[[], bool], what: str, peers: Sequence[int]) -> None:
        """Watch an operation just enqueued; `done()` says whether it has finished."""
        self.check()
        with self._lock:
            self._pending.append(_Watched(self.clock() + self.timeout_s, done, what,
                                          tuple(peers)))

    def check(self) -> None:
        """Raise the failure, if an operation timed out."""
        if self.failure is not None:
            raise self.failure

    def wait_all(self) -> None:
        """Block until every watched operation finished; the failure if one timed out first."""
        while True:
            self.check()
            with self._lock:
                self._forget_done()
                if not self._pending:
                    return
            time.sleep(self.poll_s)

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
            with self._lock:
                self._forget_done()
                now = self.clock()
                late = next((w for w in self._pending if now > w.deadline), None)
            if late is not None:
                self._fail(late)
                return

    def _fail(self, late: _Watched) -> None:
        """Abort the communicator, then keep and report the error naming the late operation."""
        note = ""
        try:
            self._abort()
        except Exception as e:  # the error to report is the timeout; say the abort failed too
            note = f"; aborting it failed too ({first_line(e)})"
        self.failure = no_answer(late.what, late.peers, self.timeout_s,
                                 f"NCCL has no timeout: the communicator was aborted{note}")
        if self._on_failure is not None:
            self._on_failure(self.failure)
