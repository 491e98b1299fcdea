"""hivemind: every part of a replica (a stage, a shard) on one round's outer state before the
replica trains on.

Each part takes rounds from its own peers, so one may have taken a later round's state (and
step) than another, while the pipeline and FSDP's collectives need all of them on the same step:
a part behind takes part in its peers' round with weight 0 (`OuterSync.catch_up`), until all
agree. (A part that went on from its older state missed the round the others ran at that step;
their roster group then partly failed and the outer models went apart: seen with a sharded
joiner.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from modules.comm import PeerError, agree_range

PHASE_ATTEMPTS = 5
"""Tries of a replica's parts at one round's outer state: each may find its peers a round
further on (they train meanwhile), at most one round a try."""


def agree_phase(world: Any, step: int, wait_s: float, catch_up: Callable[[int, int], int],
                lock: threading.Lock) -> int:
    """The step every rank of my replica (`world`, its communicator) goes on from, all on one
    round's outer state; `catch_up(step, agreed)` takes a later round's state (under `lock`,
    the training thread's) and returns the step it reached. PeerError when they cannot agree
    in PHASE_ATTEMPTS tries. `wait_s`: how long a sibling may take to answer (it may still be
    in its round, or --join for longer than the run's timeout)."""
    what = "agreeing on the step with my replica"
    for _ in range(PHASE_ATTEMPTS):
        lowest, agreed = agree_range(world, step, what, wait_s)
        if lowest == agreed:
            return agreed
        if step < agreed:
            with lock:
                step = catch_up(step, agreed)
    raise PeerError(f"the parts of my replica stayed at steps {lowest} to {agreed} after "
                    f"{PHASE_ATTEMPTS} tries to take one round's outer state from their "
                    "peers; stopping rather than training on different outer states")
