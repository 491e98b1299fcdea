"""Store waits that a new generation cuts short.

DiLoCo's outer round waits in the store for every member's flag (its arrival, then its
commit confirmation). When the membership changes mid-wait, a lost rank's flag never comes
and the wait must end at once. A `wait` with a 0.5 s timeout, retried, did that, but c10d
prints two warnings per timeout ('waitForInput ... timed out after 500ms'): hundreds of lines
in a normal lab run whose replicas reach an outer step seconds apart. Polling `check` instead
would add a round trip per poll to every wait over a slow link.

So every flag is written once per reader, into the reader's inbox (`inbox_key`): a waiter
waits, with the run's whole timeout, on its own inbox only, and on a new generation the
heartbeat thread fills the inbox of every open wait itself (`Bells.ring`). Only that waiter
reads its inbox; it sees the new generation and drops the round. `set` costs no round trip
(TCPStore sends it without a reply), so a round still costs the round trips the simulator
charges (tests/test_outer_round_trips.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from modules.control.protocol import inbox_key


def announce(store: Any, prefix: str, writer: int, readers: Sequence[int]) -> None:
    """Put `writer`'s flag under `prefix` in the inbox of every reader."""
    for r in readers:
        store.set(inbox_key(prefix, r, writer), "1")


class Bells:
    """The inboxes this process is waiting on, so that another thread can fill them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, list[str]] = {}
        self._next = 0

    def wait(self, store: Any, prefix: str, reader: int, writers: Sequence[int],
             timeout_s: float, moot: Callable[[], bool]) -> bool:
        """Wait until every writer's flag is in `reader`'s inbox (True) or `moot()` says the
        wait no longer matters (False, also when the flags came meanwhile); c10d's
        RuntimeError when `timeout_s` passes first or the store stops answering."""
        keys = [inbox_key(prefix, reader, w) for w in writers]
        with self._lock:
            token, self._next = self._next, self._next + 1
            self._open[token] = keys
        try:
            if moot():  # checked after opening: a ring before that would be missed
                return False
            store.wait(keys, timedelta(seconds=timeout_s))
        finally:
            with self._lock:
                del self._open[token]
        return not moot()

    def ring(self, store: Any) -> None:
        """Fill every open wait's inbox (on a new generation; `store` is another connection
        than the waiting one's, which is blocked)."""
        with self._lock:
            keys = [k for ks in self._open.values() for k in ks]
        for k in keys:
            store.set(k, "1")
