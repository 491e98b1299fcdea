"""When this planner command started: `plan --time-limit` counts from here (imports included).

scheduler/scheduler.py imports this module before anything heavy, so the clock starts with
the process's imports, not after them."""

from __future__ import annotations

import time

STARTED = time.perf_counter()
"""When this command started (perf_counter seconds)."""
IMPORT_GRACE_S = 10.0
"""main() called later than this after the import counts its time from its own start."""


def restart_if_late() -> None:
    """Start the clock now when main() runs long after the import (tests, notebooks call it
    in-process): the command starts then, not when the module was first imported."""
    global STARTED
    if time.perf_counter() - STARTED > IMPORT_GRACE_S:
        STARTED = time.perf_counter()


def started() -> float:
    """When this command started (read at call time: restart_if_late may move it)."""
    return STARTED
