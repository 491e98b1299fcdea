"""sync.overlap over hivemind: the rounds of modules.sync.hivemind_outer on OverlapSync's
worker thread."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from modules.comm import CommStats
from modules.sync.diloco import OuterRoundSkipped
from modules.sync.hivemind_errors import BackendClosed
from modules.sync.overlap import OuterJob, OverlapSync


class BackgroundRounds(OverlapSync):
    """sync.overlap over hivemind: the rounds run on OverlapSync's worker thread, which never
    touches the model; a round that failed there (nobody completed it: the attempt returned
    None) is not redone, `finish` raises OuterRoundSkipped(None) on the training thread at the
    next round boundary and DiLoCo skips that outer step (a round that failed only here was
    already completed on the worker with a peer's average: HivemindOuter._recover_background)."""

    def finish(self, job: OuterJob) -> None:
        """Block until `job` is over; OuterRoundSkipped(None) when nobody completed it."""
        t0 = time.perf_counter()
        try:
            job.done.wait()
        finally:
            self.wait_s += time.perf_counter() - t0
        self.jobs.remove(job)
        if job.error is not None:
            raise job.error
        if not job.ok:
            raise OuterRoundSkipped(None)

    def drain(self) -> None:
        """Wait for every job in flight; results (or skips) stay for `finish`."""
        t0 = time.perf_counter()
        try:
            for j in list(self.jobs):
                j.done.wait()
        finally:
            self.wait_s += time.perf_counter() - t0
        for j in self.jobs:
            if j.error is not None:
                raise j.error


def background_attempt(hivemind: Any, stats: CommStats | None
                       ) -> Callable[[torch.Tensor, int], int | None]:
    """BackgroundRounds' attempt: one round of `hivemind` (a HivemindOuter) on the worker
    thread; the bytes sent (counted into `stats`, the background accounting), or None when
    nobody completed it."""
    hivemind.background = True

    def attempt(flat: torch.Tensor, index: int) -> int | None:
        try:
            sent = hivemind.all_reduce(flat, index)
        except OuterRoundSkipped:
            return None
        except Exception as e:
            if hivemind.closing.is_set():  # whatever the stopped DHT raised: not a failure
                raise BackendClosed(index, hivemind.what) from e
            raise
        if stats is not None:
            stats.bytes_sent += sent
        return sent
    return attempt
