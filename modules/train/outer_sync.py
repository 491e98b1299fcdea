"""DiLoCo's outer sync of one rank, composed into the Trainer (as torchft's `DiLoCo(manager, ...)`
holds what it uses): the DiLoCo optimizer around the inner AdamW, its all-reduces through the
rank's `Membership` (every member there, commit everywhere; redone after a membership change)
and, with sync.overlap, the background all-reduces on the stage group's second communicator
(modules.sync.overlap) with their own accounting; with --outer-backend hivemind the all-reduce
goes through a hivemind averager over a DHT instead (modules.sync.hivemind_outer). Joining a
running job is here too: a joiner takes the outer state of its stage from a live peer.
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
from modules.model.decoder import StageModel
from modules.sync.average import GroupAverage, make_group_average, no_average
from modules.sync.diloco import DiLoCoOptimizer, outer_param_order
from modules.sync.overlap import OverlapSync

if TYPE_CHECKING:
    from modules.shard.runtime import ShardRuntime
    from modules.sync.hivemind_outer import HivemindOuter


class OuterSync:
    """The outer optimizer of sync mode diloco and everything only it uses."""

    def __init__(self, run: ResolvedRun, stage: int, model: StageModel,
                 inner: torch.optim.Optimizer, membership: Membership,
                 background_stats: CommStats | None, on_change: Callable[[GenerationChange], None],
                 on_sent: Callable[[int], None], step: Callable[[], int], log=print,
                 shard: ShardRuntime | None = None, hivemind: HivemindOuter | None = None) -> None:
        """`background_stats`: the accounting of the stage group's background communicator
        (with sync.overlap; the group builder counts into it too); `on_change`: takes a new
        generation (the Trainer's one place for that); `on_sent`: counts data-parallel bytes
        this rank sent; `step`: the rank's current step (what a joiner is handed); `shard`:
        shard groups (plan/2): DiLoCo runs on this rank's local shards; `hivemind`: the outer
        all-reduce goes through it (--outer-backend hivemind) instead of the membership."""
        sync = run.plan.sync
        self.hivemind = hivemind
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
        self.overlap: OverlapSync | None = None
        if run.overlapped and hivemind is not None:  # rounds in the averager's background
            from modules.sync.hivemind_outer import BackgroundRounds, background_attempt

            self.overlap = BackgroundRounds(background_attempt(hivemind, background_stats),
                                            lambda: None, log)
        elif run.overlapped:
            self.overlap = OverlapSync(self._attempt, self.refresh, log)
        """Runs the outer all-reduces in the background (modules.sync.overlap)."""
        self.average: GroupAverage = no_average
        """Averages a flat tensor over my stage group (sync.compression's payload)."""
        self.background_average: GroupAverage = no_average
        """Averages a flat tensor over my stage group's background communicator."""
        ordered = outer_param_order(params, model.tied_pair(), sync.fragments)
        if shard is not None:  # per-shard DiLoCo: on my local shards
            ordered = shard.local_params(ordered)
        where = run.plan.outer_state  # --outer-state applied by RunConfig.resolve
        # its anchor: the parameters as they are now, on the device (or in host memory)
        self.optimizer = DiLoCoOptimizer(
            ordered, inner,
            outer_lr=sync.outer_lr, outer_momentum=sync.outer_momentum,
            inner_steps=sync.inner_steps, all_reduce_fn=self._all_reduce,
            fragments=sync.fragments, overlap=sync.overlap,
            overlap_alpha=run.cfg.outer.overlap_alpha, reducer=self.overlap,
            anchor_device="cpu" if where == "host" else None)
        if hivemind is not None:  # my stage's size and outer state (what a joining peer loads)
            hivemind.attach(sum(p.numel() for p in ordered), self.optimizer.outer_state(),
                            joining=run.cfg.elastic.join)

    def take(self, groups: Groups) -> None:
        """A new generation's stage group: average over it from now on."""
        self.average = make_group_average(groups.stage, self.sync.compression,
                                          f"all-reduce of stage {self.stage}")
        self.background_average = make_group_average(
            groups.outer, self.sync.compression, f"background all-reduce of stage {self.stage}")

    def _all_reduce(self, flat: torch.Tensor) -> int:
        """DiLoCo's outer communication: take any new generation, then let the membership
        average (every member there, commit everywhere); retry with the input otherwise.
        With hivemind: its averager's round (OuterRoundSkipped when it failed here)."""
        if self.hivemind is not None:  # the whole round counts as waiting
            t0 = time.perf_counter()
            try:
                sent = self.hivemind.all_reduce(flat, self.optimizer.syncs)
            finally:
                self.membership.stats.wait_s += time.perf_counter() - t0
            self.on_sent(sent)
            return sent
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

    def join(self) -> int:
        """--join: be admitted, take the outer state of my stage from a live peer, and take
        part in the next outer step (with pseudo-gradient 0 and weight 0); the step to go on
        from."""
        t0 = time.monotonic()
        if self.hivemind is not None:
            step = self._join_hivemind()
        else:
            self.on_change(self.membership.join(self.handover))
            self.optimizer.outer_step()  # the same outer step as everybody
            step = self.step()
        self.log(f"joined at step {step} (outer step {self.optimizer.outer_count}) after "
                 f"{time.monotonic() - t0:.2f} s")
        return step

    def _join_hivemind(self) -> int:
        """--join over hivemind: load the outer state of my stage from the most advanced peer,
        take part in the next round with weight 0 (bit-identical after it), publish the state;
        the step of that round (nothing else runs yet: no lock needed)."""
        assert self.hivemind is not None
        self.optimizer.load_outer_state(self.hivemind.join())
        self.optimizer.outer_step()  # weight 0: the others' average
        self.hivemind.catching_up = False
        self.hivemind.publish(self.optimizer.outer_state())
        return self.optimizer.outer_count * self.sync.inner_steps

    def resumed(self) -> None:
        """After --resume restored the outer state: hivemind declares and shares it."""
        if self.hivemind is not None:
            self.hivemind.resumed(self.optimizer.outer_state())

    def after_round(self, step: int) -> int:
        """After an outer step, the step to go on from. With hivemind: publish the outer state
        (what joiners load) and, when it was a later round's state taken from a peer, continue
        at that round's step, in phase with the other replicas."""
        if self.hivemind is None:
            return step
        count = self.optimizer.outer_count
        at = count * self.sync.inner_steps
        if at > step:
            self.log(f"took the state of outer round {count}: continuing at step {at} "
                     f"(was {step}), in phase with the other replicas")
            step = at
        self.hivemind.publish(self.optimizer.outer_state())
        return step

    def catch_up(self, step: int, agreed: int) -> int:
        """hivemind: my replica goes on from step `agreed` while my part is at `step` (a
        sibling part took a later round's state): take part in the round at my outer count
        with weight 0, as a joiner does (its average, or the state of a peer that completed
        it already); the step that puts me at. Loading a peer's state at once instead
        deadlocked: my peers were in that very round, waiting for me (I am in their roster)."""
        # with overlap a failed round takes a peer's average, never a later state: parts
        # never differ in rounds there
        assert self.hivemind is not None and self.overlap is None
        before = self.optimizer.outer_count
        self.hivemind.catching_up = True
        try:
            self.optimizer.outer_step()
        finally:
            self.hivemind.catching_up = False
        self.hivemind.publish(self.optimizer.outer_state())
        at = self.optimizer.outer_count * self.sync.inner_steps
        self.log(f"my replica is at step {agreed}: took outer round "
                 f"{self.optimizer.outer_count} of {self.hivemind.what} from my peers "
                 f"(was at round {before}), continuing at step {at} (was {step})")
        return at

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
