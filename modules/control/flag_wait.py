"""Waiting for store flags that a membership change may make moot, without polling the store.

DiLoCo's arrival and commit waits (modules.control.elastic) must end early when a new
generation comes (the heartbeat thread reads it). They were `store.wait`s of 0.5 s, retried:
every timed-out wait makes c10d print two warnings (`waitForInput: ... likely a timeout`,
`... timed out after 500ms`: 46-398 lines per rank of a lab run), and one whole-timeout wait
on the rank's own client would hold it (c10d serialises a client's calls: the training
thread's store calls queued behind a background round's wait; seen as a 60 s stall).

`FlagWaiter` runs each wait whole, on a store connection of its own, in a helper thread; the
caller watches `abandon` (a local check, no store traffic) every `poll_s` and gives up on a
change. An abandoned helper stays blocked on its own connection until the flags come or its
timeout ends; the next wait then opens another connection (rare: once per membership change).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any


class FlagWaiter:
    """Whole waits for store flags on connections of their own (see the module docstring)."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        """`connect()` opens a store connection whose `wait(keys, timeout)` names the keys as
        the callers' store does (the run's HiddenStore over a TCPStore client)."""
        self.connect = connect
        self.idle: list[Any] = []
        """Connections no helper is blocked on."""
        self.lock = threading.Lock()

    def wait(self, keys: list[str], timeout_s: float, abandon: Callable[[], bool],
             poll_s: float = 0.5) -> bool:
        """True once every key is set; False as soon as `abandon()` says the wait is moot;
        RuntimeError (the store's) when the keys did not all come within `timeout_s`."""
        store = self._take()
        done, outcome = threading.Event(), []

        def run() -> None:
            try:
                store.wait(keys, timedelta(seconds=timeout_s))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                outcome.append(e)
            with self.lock:  # only now is the connection free again (one spare is enough)
                if len(self.idle) < 2:
                    self.idle.append(store)
            done.set()

        threading.Thread(target=run, name="flag-wait", daemon=True).start()
        while not done.wait(poll_s):
            if abandon():
                return False
        if outcome:
            raise outcome[0]
        return True

    def _take(self) -> Any:
        """An idle connection, or a new one."""
        with self.lock:
            if self.idle:
                return self.idle.pop()
        return self.connect()
