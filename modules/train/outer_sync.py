"""DiLoCo's outer sync of one rank, composed into the Trainer (as torchft's `DiLoCo(manager, ...)`
holds what it uses): the DiLoCo optimizer around the inner AdamW, its all-reduces through the
rank's `Membership` (every member there, commit everywhere; redone after a membership change)
and, with sync.overlap, the background all-reduces on the stage group's second communicator
(modules.sync.overlap) with their own accounting. Joining a running job is here too: a joiner
takes the outer state of its stage from a live peer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from formats.errors import UserError
from modules.comm import CommStats
from modules.config import ResolvedRun
from modules.control.elastic import GenerationChange, Handover, Membership
from modules.control.groups import Groups
from modules.sync.average import GroupAverage, make_group_average, no_average
from modules.sync.diloco import DiLoCoOptimizer, outer_param_order
from modules.sync.overlap import OverlapSync
from modules.train.model import StageModel

if TYPE_CHECKING:
    from modules.shard.runtime import ShardRuntime


class OuterSync:
    """The outer optimizer of sync mode diloco and everything only it uses."""

    def __init__(self, run: ResolvedRun, stage: int, model: StageModel,
                 inner: torch.optim.Optimizer, membership: Membership,
                 background_stats: CommStats | None, on_change: Callable[[GenerationChange], None],
                 on_sent: Callable[[int], None], step: Callable[[], int], log=print,
                 shard: ShardRuntime | None = None) -> None:
        """`background_stats`: the accounting of the stage group's background communicator
        (with sync.overlap; the group builder counts into it too); `on_change`: takes a new
        generation (the Trainer's one place for that); `on_sent`: counts data-parallel bytes
        this rank sent; `step`: the rank's current step (what a joiner is handed); `shard`:
        shard groups (plan/2): DiLoCo runs on this rank's local shards."""
        sync = run.plan.sync
        self.sync, self.stage, self.membership, self.log = sync, stage, membership, log
        self.on_change, self.on_sent, self.step = on_change, on_sent, step
        params = list(model.parameters())
        if sync.fragments > len(params):
            raise UserError(f"sync.fragments: {sync.fragments} fragments, but stage {stage} has "
                            f"only {len(params)} parameters")
        self.stats = background_stats
        """What the background all-reduces sent and waited (their communicator's own; added
        to a step's record when counted)."""
        self.seen = (0, 0.0)
        """(background bytes, exposed wait s) already attributed to a step's record."""
        self.overlap: OverlapSync | None = (
            OverlapSync(self._attempt, self.refresh, log) if run.overlapped else None)
        """Runs the outer all-reduces in the background (modules.sync.overlap)."""
        self.average: GroupAverage = no_average
        """Averages a flat tensor over my stage group (sync.compression's payload)."""
        self.background_average: GroupAverage = no_average
        """Averages a flat tensor over my stage group's background communicator."""
        ordered = outer_param_order(params, model.tied_pair(), sync.fragments)
        if shard is not None:  # per-shard DiLoCo: on my local shards
            ordered = shard.local_params(ordered)
        where = run.cfg.outer.outer_state
        where = run.plan.outer_state if where == "plan" else where
        # its anchor: the parameters as they are now, on the device (or in host memory)
        self.optimizer = DiLoCoOptimizer(
            ordered, inner,
            outer_lr=sync.outer_lr, outer_momentum=sync.outer_momentum,
            inner_steps=sync.inner_steps, all_reduce_fn=self._all_reduce,
            fragments=sync.fragments, overlap=sync.overlap,
            overlap_alpha=run.cfg.outer.overlap_alpha, reducer=self.overlap,
            anchor_device="cpu" if where == "host" else None)

    def take(self, groups: Groups) -> None:
        """A new generation's stage group: average over it from now on."""
        self.average = make_group_average(groups.stage, self.sync.compression,
                                          f"all-reduce of stage {self.stage}")
        self.background_average = make_group_average(
            groups.outer, self.sync.compression, f"background all-reduce of stage {self.stage}")

    def _all_reduce(self, flat: torch.Tensor) -> int:
        """DiLoCo's outer communication: take any new generation, then let the membership
        average (every member there, commit everywhere); retry with the input otherwise."""
        keep = flat.clone()
        while True:
            self.refresh()
            sent = self.membership.outer_round(flat, self.average, self.optimizer.syncs)
            if sent is not None:
                self.on_sent(sent)
                return sent
            flat.copy_(keep)

    def _attempt(self, flat: torch.Tensor, index: int) -> int | None:
        """sync.overlap: one outer round on the background communicator (any thread)."""
        return self.membership.outer_round(flat, self.background_average, index, self.stats)

    def refresh(self) -> None:
        """Take a newer generation if the leader published one (nothing in flight)."""
        change = self.membership.poll(self.handover)
        if change is not None:
            self.on_change(change)

    def handover(self) -> Handover:
        """What this rank would hand a joiner of its stage: the step after this outer step's
        and the outer state."""
        return Handover(self.step() + 1, self.optimizer.outer_state())

    def join(self) -> None:
        """--join: be admitted, take the outer state of my stage from a live peer, and take
        part in the next outer step (with pseudo-gradient 0 and weight 0)."""
        t0 = time.monotonic()
        self.on_change(self.membership.join(self.handover))
        self.optimizer.outer_step()  # the same outer step as everybody
        self.log(f"joined at step {self.step()} (outer step {self.optimizer.outer_count}) after "
                 f"{time.monotonic() - t0:.2f} s")

    def log_round(self, sent: int) -> None:
        """Say what the outer round that just ended sent (`sent` bytes when blocking)."""
        count, ranks = self.optimizer.outer_count, list(self.membership.stage_ranks())
        if self.overlap is not None:
            self.log(f"outer_step {count}: {self.sync.fragments} fragment all-reduce(s) running "
                     f"in the background on stage group {ranks} (stage {self.stage})")
            return
        # DiLoCo's only communication: every rank says what it sent, spelt like the metrics
        # field (benchmarks/end_to_end.py echoes " step ")
        self.log(f"outer_step {count}: {sent} bytes sent to stage group {ranks} (stage "
                 f"{self.stage}, after {self.sync.inner_steps} inner steps)")

    def background_share(self) -> tuple[int, float]:
        """sync.overlap: background bytes sent and exposed wait since the last call; the bytes
        count as this rank's data-parallel bytes (the step they were counted in sent them)."""
        if self.overlap is None or self.stats is None:
            return 0, 0.0
        sent, waited = self.stats.bytes_sent, self.overlap.wait_s
        bg, exposed = sent - self.seen[0], waited - self.seen[1]
        self.seen = (sent, waited)
        self.on_sent(bg)
        return bg, exposed

    def finish(self) -> tuple[int, float]:
        """The last rounds' background all-reduces: every member finishes them (their inputs
        are checkpointed), and their bytes count in this rank's total; returns what
        `background_share` returns for them."""
        if self.overlap is None:
            return 0, 0.0
        self.overlap.drain()
        return self.background_share()

    def close(self) -> None:
        """Stop the background worker (after `finish`, or on the way out of a failure)."""
        if self.overlap is not None:
            self.overlap.close()
