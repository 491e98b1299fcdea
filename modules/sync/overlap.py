"""Background outer all-reduces of an overlapped DiLoCo (sync.overlap), and what a rank does
when one of them fails because the membership changed.

One worker thread runs the all-reduces in launch order on the stage group's own communicator
(modules.control.groups builds it apart from the pipeline's and the tied-embedding pair's), so they
never interleave with the training thread's messages. The training thread collects a result
when it is due (`finish`); a result that failed because a replica was lost is redone there:
every job still in flight is drained, the new generation is taken, and the failed rounds are
re-run in order among the survivors (the commit protocol of modules.control.elastic makes every
survivor agree on which rounds failed). A job's input is kept untouched, so a checkpoint can
store it and `--resume` re-runs the same all-reduce (modules.sync.diloco).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

Attempt = Callable[[torch.Tensor, int], "int | None"]
"""One try at averaging sync `index`'s flat pseudo-gradient in place: the bytes sent, or None
when the membership changed first (take the new generation and try again)."""


@dataclass
class OuterJob:
    """One fragment's outer all-reduce, launched and not yet applied."""

    index: int
    """Sync number (every fragment sync of the run counts once); the round's store keys."""
    flat: torch.Tensor
    """Averaged in place (by the worker thread while in flight)."""
    keep: torch.Tensor
    """The pseudo-gradient as sent: what a checkpoint stores and a retry restarts from."""
    done: threading.Event = field(default_factory=threading.Event)
    """Set by the worker thread when the attempt is over (ok, failed or error)."""
    ready: torch.cuda.Event | None = None
    """CUDA: recorded on the training thread's stream after `flat` was written."""
    ok: bool = False
    """The average is in `flat` and every member committed it."""
    error: BaseException | None = None
    """A failure that no new generation can repair (re-raised on the training thread)."""


@dataclass
class OverlapSync:
    """Runs outer all-reduces in the background and repairs the ones a membership change broke.

    `attempt` runs one outer round (modules.control.elastic.Membership.outer_round on the background
    communicator); `refresh` takes a newer generation if there is one (groups re-formed).
    """

    attempt: Attempt
    refresh: Callable[[], None]
    log: Callable[[str], None] = print
    jobs: list[OuterJob] = field(default_factory=list)
    """Launched and not yet finished, in launch order."""
    wait_s: float = 0.0
    """Seconds the training thread waited for results (the exposed part of the overlap)."""

    def __post_init__(self) -> None:
        self.queue: queue.SimpleQueue[OuterJob | None] = queue.SimpleQueue()
        # a daemon: a rank that exits on an error does not wait for a hung all-reduce
        self.worker = threading.Thread(target=self._work, name="outer-all-reduce", daemon=True)
        self.worker.start()
        self.stream: torch.cuda.Stream | None = None
        """CUDA: the worker's own stream (its all-reduces do not queue behind compute)."""

    def launch(self, flat: torch.Tensor, index: int) -> OuterJob:
        """Start averaging `flat` in the background. No repair here: whether a generation
        changed is seen at different times by different ranks, and taking it re-forms groups
        with every member; a round launched on stale groups abandons (outer_round sees the new
        generation) and is redone in `finish`, which every member reaches at the same step."""
        job = OuterJob(index, flat, flat.clone())
        if flat.is_cuda:
            job.ready = torch.cuda.Event()
            job.ready.record()
            if self.stream is None:
                self.stream = torch.cuda.Stream(flat.device)
        self.jobs.append(job)
        self.queue.put(job)
        return job

    def _work(self) -> None:
        """The worker thread: one job at a time, in launch order, until `close`."""
        while (job := self.queue.get()) is not None:
            try:
                if job.ready is not None:
                    with torch.cuda.stream(self.stream):
                        self.stream.wait_event(job.ready)
                        job.ok = self.attempt(job.flat, job.index) is not None
                    self.stream.synchronize()  # the result is complete before `done`
                else:
                    job.ok = self.attempt(job.flat, job.index) is not None
            except Exception as e:  # noqa: BLE001 - re-raised on the training thread (finish)
                # a PeerError or the store's own error, or a bug: either way the training
                # thread raises it; letting it end this thread would hang the next finish()
                job.error = e
            finally:
                job.done.set()

    def finish(self, job: OuterJob) -> None:
        """Block until `job.flat` holds the committed average (redone among the survivors if
        the membership changed meanwhile)."""
        t0 = time.perf_counter()
        try:
            job.done.wait()
            if job.error is not None:
                raise job.error
            if not job.ok:
                self._recover()
        finally:
            self.wait_s += time.perf_counter() - t0
        self.jobs.remove(job)

    def drain(self) -> None:
        """Wait for every job in flight (repairing failures); results stay for `finish`."""
        t0 = time.perf_counter()
        try:
            for j in list(self.jobs):
                j.done.wait()
            if any(not j.ok for j in self.jobs):
                self._recover()
        finally:
            self.wait_s += time.perf_counter() - t0

    def _recover(self) -> None:
        """Drain, take the new generation, re-run every failed round in order, synchronously."""
        for j in self.jobs:
            j.done.wait()
        for j in self.jobs:
            if j.error is not None:
                raise j.error
        self.refresh()
        failed = sorted(j.index for j in self.jobs if not j.ok)
        if failed:
            self.log(f"outer sync(s) {failed} failed in the background (membership changed); "
                     "redoing them with the live replicas")
        for j in sorted(self.jobs, key=lambda j: j.index):
            while not j.ok:
                j.flat.copy_(j.keep)
                j.ok = self.attempt(j.flat, j.index) is not None
                if not j.ok:
                    self.refresh()

    def close(self) -> None:
        """Stop the worker thread once the jobs queued are done (`drain` first)."""
        self.queue.put(None)
