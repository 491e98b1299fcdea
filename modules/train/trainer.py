"""The training loop of one rank: pipeline step, tied-embedding sum, data-parallel sync, metrics,
checkpoints. dist_runner.py resolves the run once and calls `Trainer(run, ...).run()`. The loop
is composed of parts that hold what they use: its stage's model and data (modules.train.
stage_parts), who the rank trains with its `Membership` (modules.control.elastic), DiLoCo's outer
sync its `OuterSync` (modules.train.outer_sync), the checkpoint lifecycle its `Checkpointing`
(modules.train.checkpointing), evaluation and --stop-at-loss its `Evaluation`
(modules.train.evaluation), step records and progress its `StepMeter` (modules.train.
step_record), the way out on a failure its `Failures` (modules.train.failures).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from modules.comm import CommStats
from modules.config import ResolvedRun
from modules.control.dist import Topology, members_of
from modules.control.elastic import GenerationChange
from modules.control.groups import Groups
from modules.control.signals import TERM_STATUS, on_terminate
from modules.data.dataset import FakeData, TextData
from modules.device.mfu import flops_per_token
from modules.device.placement import Placement
from modules.device.precision import LossScaling
from modules.device.select import rng_states, set_rng_states, to_device
from modules.sync.average import (
    GroupAverage,
    average_grads,
    make_group_average,
    no_average,
    sum_tied_grads,
)
from modules.sync.diloco import DiLoCoOptimizer
from modules.train.evaluation import Evaluation
from modules.train.failures import Failures, TrainingDiverged, check_finite
from modules.train.optim import make_inner_optimizer, set_lr
from modules.train.outer_sync import OuterSync
from modules.train.phase import agree_phase
from modules.train.stage_parts import (
    build_stage,
    make_checkpointing,
    make_membership,
    make_pipe,
    make_shard,
)
from modules.train.step_record import StepMeter, StepWriters
from modules.train.stopping import stop_at_loss

if TYPE_CHECKING:
    from modules.sync.hivemind_outer import HivemindOuter

__all__ = ["Trainer", "TrainingDiverged", "make_inner_optimizer", "set_lr"]


class Trainer:
    """One rank's share of the run: the loop, over composed parts. Who it trains with (groups,
    failures, joining) is its `Membership` (modules.control.elastic), whose changes `_apply`
    takes; DiLoCo's outer sync is its `OuterSync`, checkpoints its `Checkpointing`."""

    def __init__(self, run: ResolvedRun, topo: Topology, store: dist.Store,
                 data: TextData | FakeData, log=print, placement: Placement | None = None,
                 store_addr: tuple[str, int] | None = None,
                 hivemind: HivemindOuter | None = None) -> None:
        """`run`: the resolved run (effective plan and settings, launch target); `placement`:
        device, precision, compile and backend (default: CPU, fp32, gloo); `store_addr`: (host,
        port) of the rendezvous store for the heartbeat thread's own connection (None: no
        heartbeat, e.g. single-process tests); `hivemind`: DiLoCo's outer average goes through
        it (--outer-backend hivemind: the store is my replica's own)."""
        plan, cfg = run.plan, run.cfg
        self.hivemind = hivemind
        self.resolved, self.plan, self.topo, self.cfg, self.log = run, plan, topo, cfg, log
        self.placement = placement or Placement()
        self.device = self.placement.device
        parts = build_stage(run, topo, data, self.placement, log)
        self.spec, self.tokenizer, self.model = parts.spec, parts.tokenizer, parts.model
        self.sharder = parts.sharder
        self.stats = CommStats()
        """Bytes sent and seconds waited by every communicator of this rank."""
        self.shard = make_shard(run, topo, store, self.model, self.device, self.stats, log)
        """Shard groups (plan/2): this rank's FSDP2 shard group; None without."""
        self.params = list(self.model.parameters())  # with shard groups: DTensors
        self.pipe = make_pipe(plan, topo, self.model, self.placement.precision, self.shard)
        self.scaling: LossScaling = self.placement.precision.loss_scaling(self._agree_overflow)
        """fp16: loss scaling whose skip decisions agree over the ranks that step together."""
        self.inner = make_inner_optimizer(self.model, cfg)
        self.step = self.tokens = self.dp_bytes = self.round_dp0 = 0
        """dp_bytes: data-parallel bytes this rank sent (all-reduces of gradients or pseudo-
        gradients); round_dp0: dp_bytes as this DiLoCo round began (its log line counts all)."""
        self.tokens_per_step = (plan.num_micro_batches * plan.micro_batch_size
                                * self.spec.seq_len * topo.lanes_per_replica)  # L lanes a replica
        self.state_lock = threading.Lock()
        """Held by the training thread while it changes parameters / optimizer state."""
        self._compose(store, store_addr, parts.val)
        if not cfg.elastic.join or hivemind is not None:  # a hivemind joiner: its own replica
            self._apply(self.membership.first_generation())

    def _compose(self, store: dist.Store, store_addr: tuple[str, int] | None,
                 val: list) -> None:
        """The parts around the step: membership, outer sync, checkpoints, the way out,
        evaluation (on `val`) and records (in this order: each takes what the ones before made)."""
        run, topo, log = self.resolved, self.topo, self.log
        background = CommStats() if run.overlapped else None  # the outer sync's own accounting
        self.membership = make_membership(run, topo, store, store_addr, self.spec.tie_embeddings,
                                          self.placement, self.stats, background, self.hivemind,
                                          log)
        self.outer: OuterSync | None = self._make_outer_sync(background)
        """DiLoCo's outer sync around `inner` (None in allreduce mode)."""
        self.opt: torch.optim.Optimizer | DiLoCoOptimizer = (
            self.outer.optimizer if self.outer is not None else self.inner)
        """What each step steps: DiLoCo (inner step, every H steps the outer one) or AdamW."""
        self.ckpt = make_checkpointing(run, topo, self.tokenizer, self.shard, self.state,
                                       lambda: self.step, self.state_lock, self.outer is not None,
                                       lambda what: self.groups.check_health(what), log)
        """Saves, resume, and the saves of a failing rank (writes nothing without --ckpt-dir)."""
        self.failures = Failures(topo.rank, topo.replica, self.membership, self.ckpt.emergency,
                                 log, self.hivemind)
        self.evaluation = Evaluation(
            self.cfg, topo, self.model, self.pipe, self.shard, val,
            stop_at_loss(self.cfg, self.membership.store, log),  # None: no flag
            lambda e: self.failures.peer(e, self.step), log)
        self.meter = StepMeter(
            self.cfg, topo, self.stats, self.pipe, self.shard, self.outer,
            lambda: self.dp_bytes, self.tokens_per_step,
            flops_per_token(self.spec), self.placement.replica_peak_tflops, run.overlapped,
            live_count=self.membership.monitor is not None and self.outer is not None,
            hivemind=self.hivemind, log=log)
        self.mfu_values = self.meter.mfu_values  # MFU of each measured step (none without a peak)
        self.groups: Groups | None = None
        """The current generation's communicators (None on a joiner until admitted)."""
        self.replicas: tuple[int, ...] = self.membership.replicas
        """Live replicas of the current generation."""
        self.average: GroupAverage = no_average
        """Averages a flat tensor over my stage group (sync.compression's payload)."""

    def _make_outer_sync(self, background: CommStats | None) -> OuterSync | None:
        """DiLoCo around the inner AdamW, or None in allreduce mode."""
        if not self.plan.sync.rule.local_steps:
            return None
        return OuterSync(self.resolved, self.topo.stage, self.model, self.inner, self.membership,
                         background, self._apply, self._count_dp_bytes, lambda: self.step,
                         self.log, self.shard, self.hivemind)

    def _count_dp_bytes(self, sent: int) -> None:
        self.dp_bytes += sent

    def _apply(self, change: GenerationChange) -> None:
        """Take a generation: its groups and live replicas and, on a joiner, the outer state
        and step handed over by a live peer. The one place membership changes the Trainer."""
        self.groups, self.replicas = change.groups, change.replicas
        if self.shard is not None:
            self.shard.refresh()
        self.pipe.comm = change.groups.pipeline
        self.average = make_group_average(change.groups.stage, self.plan.sync.compression,
                                          f"all-reduce of stage {self.topo.stage}")
        if self.outer is not None:
            self.outer.take(change.groups)
        if change.handover is not None:
            assert self.outer is not None
            with self.state_lock:
                self.outer.optimizer.load_outer_state(change.handover.outer)
                self.step = change.handover.step

    def _agree_overflow(self, flag: torch.Tensor) -> None:
        """MAX of the fp16 overflow flag over the ranks that step together: every rank in
        allreduce mode and DiLoCo's warm-up (stage groups average gradients), my replica in
        DiLoCo (its pipeline, then with shard groups the shard group: every lane of the
        replica passes through every stage, so the two MAXes reach all of its devices)."""
        everyone = self.outer is None or self.warming
        comm = self.groups.world if everyone else self.groups.pipeline
        if comm is not None:
            comm.all_reduce(flag, "max", "agreeing on an fp16 gradient overflow")
        if self.shard is not None and not everyone:
            self.shard.agree_max(flag)

    def _in_phase(self, step: int) -> int:
        """hivemind: the step every rank of my replica goes on from, all on one round's outer
        state (modules.train.phase: a part behind catches up with its peers' round)."""
        if self.hivemind is None or self.groups.world.size == 1:
            return step  # a replica of one rank agrees with itself
        return agree_phase(self.groups.world, step, self.hivemind.longest_wait_s,
                           self.outer.catch_up, self.state_lock)

    @property
    def outer_count(self) -> int | None:
        """DiLoCo outer steps done (None in allreduce mode)."""
        return self.outer.optimizer.outer_count if self.outer is not None else None

    # -- the state a checkpoint holds --------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """This rank's full training state (live tensors: snapshot before keeping it)."""
        state = {"step": self.step, "tokens": self.tokens, "dp_bytes": self.dp_bytes,
                 "model": self.model.state_dict(), "opt": self.opt.state_dict(),
                 "rng": rng_states(self.device), "scaler": self.scaling.state_dict()}
        return self.shard.state(state) if self.shard is not None else state

    def restore(self, state: dict[str, Any]) -> None:
        """Take back a state that `state()` saved (a loaded checkpoint's CPU tensors)."""
        if self.shard is not None:  # local shards into the DTensors
            self.shard.load(state, self.opt, self.params)
        else:
            self.model.load_state_dict(state["model"])  # copies CPU tensors onto the device
            self.opt.load_state_dict(state["opt"])  # torch moves it to the params' device
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.dp_bytes = self.round_dp0 = int(state["dp_bytes"])
        set_rng_states(state["rng"], self.device)
        if state.get("scaler"):
            self.scaling.load_state_dict(state["scaler"])

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        """Train from the current step (0, the checkpoint's, or a joiner's) up to cfg.steps, or
        to the evaluation at which --stop-at-loss stops every rank."""
        cfg = self.cfg
        self.membership.start(self.failures.fatal, self.ckpt.stop)
        on_terminate(lambda why: self.failures.fatal(why, TERM_STATUS))  # emergency checkpoint
        if cfg.elastic.join:
            assert self.outer is not None
            self.step = self._in_phase(self.outer.join())
        elif cfg.ckpt.resume:
            self.ckpt.load(self.groups.world, self.restore)
            self.log(f"resumed from step {self.step}")
            if self.outer is not None:
                self.outer.resumed()
        writers = StepWriters(cfg, self.topo, self.plan, self.step if cfg.ckpt.resume else None)
        try:
            records = self._steps(writers)
            if self.outer is not None:
                self.outer.finish()  # the last rounds' background all-reduces
            self.ckpt.flush()
            self._share_ckpt_floor()  # published before finish's barrier / done marks
        finally:
            writers.close()
            if self.outer is not None:
                self.outer.close()
        self.membership.finish(last_reads=lambda: self.ckpt.at_end(  # prune, settle failures
            self.membership.store, members_of(self.plan, self.replicas),
            self.membership.reads_settled))
        self.ckpt.raise_at_end()  # a failed last write under --on-checkpoint-error stop
        return records

    def _steps(self, writers: StepWriters) -> list[dict[str, Any]]:
        """The steps up to the last: each measured, evaluated when due, reported, checkpointed
        when due; returns the records of the reporting rank (one writer per replica)."""
        cfg, topo, records, last = self.cfg, self.topo, [], False
        vanish_step, status = cfg.debug.vanish_at(topo.rank)  # tests' lost-peer hook
        while not last and self.step < cfg.steps:
            if self.step + 1 == vanish_step:
                self.log(f"debug: vanishing before step {self.step + 1}")
                os._exit(status)
            rec = self._measured_step()  # then: the last? (--steps, or --stop-at-loss agreed)
            last = self.evaluation.after_step(self.step, rec, min(self.replicas))
            if topo.reports:
                records.append(rec)
                self.meter.progress(rec, last, topo.replica == min(self.replicas))
            ckpt_every = cfg.ckpt.interval(cfg.steps)
            if ckpt_every and (self.step % ckpt_every == 0 or last):
                self._share_ckpt_floor()
                rec["ckpt_block_s"] = round(self.ckpt.save(), 6)
            if last and self.outer is not None:
                self.meter.last_background(rec)
            writers.log(rec)
        return records

    def _share_ckpt_floor(self, publish: bool = True) -> int | None:
        """Publish my newest complete checkpoint step and keep the oldest such step over the
        live ranks from being pruned, so --resume always finds a common step."""
        if self.ckpt.writer is None:
            return None
        return self.ckpt.share_floor(self.membership.store, members_of(self.plan, self.replicas),
                                     publish)

    def train_step(self) -> float | None:
        """One optimizer step of this rank; returns the replica's mean loss on the last stage."""
        topo, plan = self.topo, self.plan
        self.opt.zero_grad(set_to_none=True)
        x = y = None
        if topo.is_first or topo.is_last:
            x, y = to_device(self._my_micro_batches(), self.device, non_blocking=True)
        loss = self.pipe.train_step(x, y, plan.num_micro_batches, self.scaling.scale_loss)
        pair, average = self.model.tied_pair(), average_grads
        if self.shard is not None:  # the local shards; the replica's loss over its lanes
            pair, average = self.shard.tied(pair), self.shard.average_grads
            loss = self.shard.mean_loss(loss)
        sum_tied_grads(pair, self.groups.tied)
        overflow = self.scaling.found_overflow(self.inner)  # fp16 only; agreed, so skipped alike
        if not overflow:
            self._check_finite(loss)
        warm = self.warming
        if (self.outer is None or warm) and not overflow:
            self.dp_bytes += average(self.params, self.average)
        outer0 = self.outer_count
        self.groups.check_health(f"step {self.step + 1}")  # an aborted call's garbage: unused
        with self.state_lock:
            set_lr(self.inner, self.step, self.cfg)
            # DiLoCo: inner step, and every H steps the outer (communicating) one; in its
            # warm-up the inner AdamW alone, on all-reduced gradients
            self.scaling.step(self.inner if warm else self.opt, self.inner, overflow)
            self.step += 1
            self.tokens += self.tokens_per_step
            if warm and not self.warming:
                self._end_warmup()
        if self.outer is not None and self.outer_count != outer0:
            self.outer.log_round(self.dp_bytes - self.round_dp0)
            self.round_dp0 = self.dp_bytes
            # hivemind: in phase with the other replicas, then with the rest of mine
            self.step = self._in_phase(self.outer.after_round(self.step))
            self.ckpt.keep_outer(self.outer.optimizer.outer_count)
        return loss

    @property
    def warming(self) -> bool:
        """DiLoCo with sync.warmup_steps W: the next step all-reduces gradients (steps 1..W)."""
        return self.outer is not None and self.step < self.plan.sync.warmup_steps

    def _end_warmup(self) -> None:
        """Step W is done: DiLoCo from here, its outer optimizer starting at these weights."""
        assert self.outer is not None
        self.outer.optimizer.restart()
        self.log(f"warm-up over after step {self.step}: DiLoCo (H={self.plan.sync.inner_steps})"
                 " from here, the outer optimizer starting at these weights")

    def _my_micro_batches(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(inputs, targets) of this step's micro-batches of every lane I run, lane by lane."""
        xs, ys = [], []
        for lane in self.topo.my_lanes:
            x, y = self.sharder.micro_batches(self.step, lane)
            xs += list(x)
            ys += list(y)
        return xs, ys

    def _check_finite(self, loss: float | None) -> None:
        """TrainingDiverged when this rank's loss, parameters or gradients hold NaN/inf."""
        check_finite(loss, self.model.named_parameters() if self.shard is None
                     else self.shard.named_local(), self.step + 1)

    def evaluate(self) -> float | None:
        """Mean validation loss over the fixed validation set (returned on the last stage)."""
        return self.evaluation.evaluate()

    def _measured_step(self) -> dict[str, Any]:
        """One train_step and its metrics record; a lost peer ends the run with its reason."""
        mark = self.meter.start()
        try:
            loss = self.train_step()
            self.stats.settle()  # NCCL: comm_s and pp_wait_s from CUDA events, not enqueues
        except RuntimeError as e:  # PeerError, or the store's own error (its host is gone)
            raise self.failures.peer(e, self.step) from None
        except TrainingDiverged as e:
            raise TrainingDiverged(self.ckpt.save_diverged(str(e))) from None
        return self.meter.record(
            mark, loss, step=self.step, tokens=self.tokens, outer_step=self.outer_count,
            replicas=len(self.replicas),
            comm={c.group: c.backend for c in self.groups.choices})
