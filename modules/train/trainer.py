"""The training loop of one rank: pipeline step, tied-embedding sum, data-parallel sync, metrics,
checkpoints. dist_runner.py resolves the run once and calls `Trainer(run, ...).run()`. The loop
is composed of parts that hold what they use: who the rank trains with is its `Membership`
(modules.control.elastic), DiLoCo's outer sync its `OuterSync` (modules.train.outer_sync), the
checkpoint lifecycle its `Checkpointing` (modules.train.checkpointing).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from formats.run_metrics import STATUS_ENV, status_line
from modules.comm import CommStats, PeerError, agree_range
from modules.comm.errors import first_line
from modules.config import ResolvedRun, RunConfig
from modules.control.dist import Topology, members_of
from modules.control.elastic import GenerationChange, Membership, MembershipSettings
from modules.control.groups import GroupBuilder, Groups
from modules.control.signals import TERM_STATUS, on_terminate
from modules.data.dataset import FakeData, Sharder, TextData
from modules.device.compile import maybe_compile
from modules.device.mfu import flops_per_token, mfu
from modules.device.placement import Placement
from modules.device.precision import LossScaling
from modules.device.select import rng_states, set_rng_states, to_device
from modules.pipeline.stage import PipelineStage
from modules.shard.runtime import ShardRuntime
from modules.sync.average import (
    GroupAverage,
    average_grads,
    make_group_average,
    no_average,
    sum_tied_grads,
)
from modules.sync.diloco import DiLoCoOptimizer
from modules.train.checkpoint import check_finite_state
from modules.train.checkpointing import Checkpointing, checkpoint_meta
from modules.train.hf_weights import load_stage_weights
from modules.train.model import StageModel
from modules.train.outer_sync import OuterSync
from modules.train.stopping import stop_at_loss
from modules.train.tracking import open_rank_timing, open_trackers

if TYPE_CHECKING:
    from modules.sync.hivemind_outer import HivemindOuter

PHASE_ATTEMPTS = 5
"""hivemind: tries of a replica's parts at one round's outer state (`Trainer._in_phase`): each
may find its peers a round further on (they train meanwhile), at most one round a try."""


def make_inner_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """AdamW with GPT-style betas; the same in the runtime and in single-process references."""
    params = list(model.parameters())
    # FSDP's DTensor parameters: the multi-tensor (foreach) kernels, one DTensor dispatch per
    # op for all of them; the per-parameter loop dispatched each op of each parameter
    sharded = any(isinstance(p, DTensor) for p in params)
    return torch.optim.AdamW(params, lr=cfg.optim.lr, betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=cfg.optim.weight_decay, foreach=sharded or None)


def lr_factor(step: int, cfg: RunConfig) -> float:
    """Multiplier of the learning rate for optimizer step `step` (0-based): warm-up, then the
    schedule."""
    if step < cfg.optim.warmup_steps:
        return (step + 1) / cfg.optim.warmup_steps
    if cfg.optim.lr_schedule == "cosine":
        span = max(1, cfg.steps - cfg.optim.warmup_steps)
        progress = min(1.0, (step - cfg.optim.warmup_steps) / span)
        low = cfg.optim.min_lr_ratio
        return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0


def set_lr(opt: torch.optim.Optimizer, step: int, cfg: RunConfig) -> None:
    """Set the (inner) optimizer's learning rate for step `step`; a pure function of the step."""
    for group in opt.param_groups:
        group["lr"] = cfg.optim.lr * lr_factor(step, cfg)


class TrainingDiverged(Exception):  # noqa: N818 - the name says what happened
    """A non-finite loss or parameter: the run stops (exit 1) after saving the last finite
    state. Not a RuntimeError, which the loop reads as a lost peer."""


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
        self._init_model_and_data(data)
        self.stats = CommStats()
        """Bytes sent and seconds waited by every communicator of this rank."""
        self.shard: ShardRuntime | None = self._make_shard(store)
        """Shard groups (plan/2): this rank's FSDP2 shard group; None without."""
        self.pipe = PipelineStage(self.model, topo, None, plan.micro_batch_size,
                                  self.placement.precision, plan.pipeline_compression)
        if self.shard is not None:
            self.pipe.before_backward = self.shard.before_backward
            self.pipe.loss_divisor = topo.shard_degree if topo.is_last else 1
        self.scaling: LossScaling = self.placement.precision.loss_scaling(self._agree_overflow)
        """fp16: loss scaling whose skip decisions agree over the ranks that step together."""
        self.inner = make_inner_optimizer(self.model, cfg)
        self.step = 0
        self.tokens = 0
        self.tokens_per_step = (plan.num_micro_batches * plan.micro_batch_size
                                * self.spec.seq_len * topo.lanes_per_replica)  # L lanes a replica
        self.dp_bytes = 0
        """Data-parallel bytes this rank sent (all-reduces of gradients or pseudo-gradients)."""
        self.round_dp0 = 0
        """dp_bytes when the current DiLoCo round began (a round's F fragment syncs fall on
        different steps; its log line counts them all)."""
        self.mfu_values: list[float] = []
        """MFU of each measured step (empty without a peak)."""
        self.flops_per_token = flops_per_token(self.spec)
        """Training FLOPs per token of the whole model (the MFU's numerator per token)."""
        self.state_lock = threading.Lock()
        """Held by the training thread while it changes parameters / optimizer state."""
        background = CommStats() if run.overlapped else None  # the outer sync's own accounting
        self.membership = self._make_membership(store, store_addr, background)
        self.outer: OuterSync | None = self._make_outer_sync(background)
        """DiLoCo's outer sync around `inner` (None in allreduce mode)."""
        self.opt: torch.optim.Optimizer | DiLoCoOptimizer = (
            self.outer.optimizer if self.outer is not None else self.inner)
        """What each step steps: DiLoCo (inner step, every H steps the outer one) or AdamW."""
        self.stopping = stop_at_loss(cfg, self.membership.store, self.log)  # None: no flag
        self.ckpt = self._make_checkpointing()
        """Saves, resume, and the saves of a failing rank (writes nothing without --ckpt-dir)."""
        self.groups: Groups | None = None
        """The current generation's communicators (None on a joiner until admitted)."""
        self.replicas: tuple[int, ...] = self.membership.replicas
        """Live replicas of the current generation."""
        self.average: GroupAverage = no_average
        """Averages a flat tensor over my stage group (sync.compression's payload)."""
        if not cfg.elastic.join or hivemind is not None:  # a hivemind joiner: its own replica
            self._apply(self.membership.first_generation())

    def _replicas_training(self) -> int:
        """Replicas whose tokens a step's tokens/s counts: the generation's live ones, or with
        hivemind (my replica alone) the DHT roster's live replicas of my stage at the last round."""
        if self.hivemind is None:
            return len(self.replicas)
        return len(self.hivemind.live) or self.hivemind.cfg.starting

    def _init_model_and_data(self, data: TextData | FakeData) -> None:
        """My stage's model (vocabulary from the tokenizer), its data shard and validation."""
        plan, cfg = self.plan, self.cfg
        # the vocabulary follows the tokenizer (modules.data.dataset.run_vocab)
        self.spec = dataclasses.replace(plan.model_spec(), vocab_size=data.vocab_size)
        self.tokenizer = data.tokenizer
        start, end = plan.stages[self.topo.stage]
        # initialised on the CPU (the same weights on every device), then moved
        model = StageModel(self.spec, start, end, seed=cfg.seed)
        if cfg.ckpt.init_from:  # issue 25: pretrained weights, my stage's tensors only
            n = load_stage_weights(model, self.spec, cfg.ckpt.init_from)
            self.log(f"initialised {n} tensors of layers [{start}, {end}) from "
                     f"--init-from {cfg.ckpt.init_from}")
        self.model = maybe_compile(model.to(self.device), self.placement.compile)
        self.params = list(self.model.parameters())
        self.sharder = Sharder(data, len(plan.lanes()), plan.num_micro_batches,
                               plan.micro_batch_size)
        self.val = (to_device(data.val_batches(cfg.data.eval_sequences, plan.micro_batch_size),
                              self.device) if cfg.data.eval_sequences else [])

    def _make_checkpointing(self) -> Checkpointing:
        """This rank's checkpoints: saves, resume, and the saves of a failing rank."""
        cfg = self.cfg
        return Checkpointing(
            cfg.ckpt, self.topo.rank, self._checkpoint_meta(), self.state,
            lambda: self.step, self.state_lock, outer_steps=self.outer is not None, log=self.log,
            die_at=cfg.debug.ckpt_die_at(self.topo.rank),
            fail_from=cfg.debug.ckpt_fail_at(self.topo.rank),
            healthy=lambda what: self.groups.check_health(what))  # nothing an abort touched

    def _checkpoint_meta(self) -> dict[str, Any]:
        """What my checkpoints must match to be resumed (with shard groups: the shard too)."""
        meta = checkpoint_meta(self.plan, self.topo, self.cfg.seed, self.tokenizer)
        return {**self.shard.meta(), **meta} if self.shard is not None else meta

    def _make_shard(self, store: dist.Store) -> ShardRuntime | None:
        """Shard groups: form mine and shard my stage with FSDP2 (before any optimizer)."""
        if not self.plan.is_sharded:
            return None
        flag = self.cfg.device.reshard_after_forward
        shard = ShardRuntime(self.topo, store, self.model, self.device, self.cfg.timeout_s,
                             self.plan.reshard_after_forward if flag == "plan" else flag == "on",
                             self.stats)
        self.params = list(self.model.parameters())  # now DTensors
        self.log(f"shard {self.topo.shard} of {self.topo.shard_degree} of stage "
                 f"{self.topo.stage} with devices {list(self.topo.shard_group)} (FSDP2)")
        return shard

    def _make_membership(self, store: dist.Store, store_addr: tuple[str, int] | None,
                         background: CommStats | None) -> Membership:
        """Who this rank trains with; its groups are built with the placement's backend."""
        plan, cfg = self.plan, self.cfg
        builder = GroupBuilder(plan, self.topo, store, self.spec.tie_embeddings, cfg.timeout_s,
                               self.stats, self.placement.comm, self.log, background)
        settings = MembershipSettings.of(self.resolved, store_addr)
        if self.hivemind is not None:  # my replica alone here; the others in the DHT
            settings = dataclasses.replace(settings, start_replicas=(self.topo.replica,),
                                           store_addr=None, join=False)
        return Membership(store, plan, self.topo, settings, builder, self.stats, self.log)

    def _make_outer_sync(self, background: CommStats | None) -> OuterSync | None:
        """DiLoCo around the inner AdamW, or None in allreduce mode."""
        if self.plan.sync.mode != "diloco":
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
        state. Each part of a replica (a stage, a shard) takes rounds from its own peers, so
        one may have taken a later round's state (and step) than another, while the pipeline
        and FSDP's collectives need all of them on the same step: a part behind takes part
        in its peers' round with weight 0 (`OuterSync.catch_up`), until all agree. (A part
        that went on from its older state missed the round the others ran at that step;
        their roster group then partly failed and the outer models went apart: seen with a
        sharded joiner.)"""
        if self.hivemind is None or self.groups.world.size == 1:
            return step  # a replica of one rank agrees with itself
        # A sibling may still be in its round (attempts until --timeout-s, then recovering)
        # or --join for longer than the run's timeout: wait as long as that can take.
        what, wait_s = "agreeing on the step with my replica", self.hivemind.longest_wait_s
        for _ in range(PHASE_ATTEMPTS):
            lowest, agreed = agree_range(self.groups.world, step, what, wait_s)
            if lowest == agreed:
                return agreed
            if step < agreed:
                with self.state_lock:
                    step = self.outer.catch_up(step, agreed)
        raise PeerError(f"the parts of my replica stayed at steps {lowest} to {agreed} after "
                        f"{PHASE_ATTEMPTS} tries to take one round's outer state from their "
                        "peers; stopping rather than training on different outer states")

    @property
    def outer_count(self) -> int | None:
        """DiLoCo outer steps done (None in allreduce mode)."""
        return self.outer.optimizer.outer_count if self.outer is not None else None

    # -- failures ----------------------------------------------------------------------------
    def _on_fatal(self, reason: str, status: int = 1) -> None:
        """Say why, checkpoint what can be checkpointed, and leave with `status` (any thread)."""
        print(f"rank {self.topo.rank}: error: {reason}", file=sys.stderr, flush=True)
        try:
            saved = self.ckpt.emergency()
        except Exception as e:  # never let a failed save keep a dying rank alive
            saved = f"no checkpoint ({type(e).__name__}: {e})"
        if saved:
            self.log(saved)
        sys.stdout.flush()
        sys.stderr.flush()
        if self.hivemind is not None:  # its processes stop first, so none sees this one die
            self.hivemind.abort()
        os._exit(status)

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
        cfg, topo = self.cfg, self.topo
        self.membership.start(self._on_fatal, self.ckpt.stop)
        on_terminate(lambda why: self._on_fatal(why, TERM_STATUS))  # emergency checkpoint
        if cfg.elastic.join:
            assert self.outer is not None
            self.step = self._in_phase(self.outer.join())
        elif cfg.ckpt.resume:
            self.ckpt.load(self.groups.world, self.restore)
            self.log(f"resumed from step {self.step}")
            if self.outer is not None:
                self.outer.resumed()
        resume = self.step if cfg.ckpt.resume else None
        reports = topo.reports  # one writer per replica
        writer = open_trackers(cfg.metrics, topo.replica, resume) if reports else None
        # the plan as this rank runs it (its overrides applied): what explain replays
        timing = open_rank_timing(cfg.metrics, topo.rank, self.plan, resume)
        records = []
        try:
            vanish_step, status = cfg.debug.vanish_at(topo.rank)  # tests' lost-peer hook
            last = False
            while not last and self.step < cfg.steps:
                if self.step + 1 == vanish_step:
                    self.log(f"debug: vanishing before step {self.step + 1}")
                    os._exit(status)
                rec = self._measured_step()
                last = self._evaluate_if_due(rec)  # --steps, or --stop-at-loss agreed
                if reports:
                    records.append(rec)
                    self._log_progress(rec, last)
                ckpt_every = cfg.ckpt.interval(cfg.steps)
                if ckpt_every and (self.step % ckpt_every == 0 or last):
                    self._share_ckpt_floor()
                    rec["ckpt_block_s"] = round(self.ckpt.save(), 6)
                if last and self.outer is not None:
                    self._last_background(rec)
                for w in (writer, timing):
                    if w:
                        w.log(rec)
            if self.outer is not None:
                self.outer.finish()  # the last rounds' background all-reduces
            self.ckpt.flush()
            self._share_ckpt_floor()  # published before finish's barrier / done marks
        finally:
            for w in (writer, timing):
                if w:
                    w.close()
            if self.outer is not None:
                self.outer.close()
        self.membership.finish(last_reads=lambda: self.ckpt.at_end(  # prune, settle failures
            self.membership.store, members_of(self.plan, self.replicas),
            self.membership.reads_settled))
        self.ckpt.raise_at_end()  # a failed last write under --on-checkpoint-error stop
        return records

    def _share_ckpt_floor(self, publish: bool = True) -> int | None:
        """Publish my newest complete checkpoint step and keep the oldest such step over the
        live ranks from being pruned, so --resume always finds a common step."""
        if self.ckpt.writer is None:
            return None
        return self.ckpt.share_floor(self.membership.store, members_of(self.plan, self.replicas),
                                     publish)

    def _last_background(self, rec: dict[str, Any]) -> None:
        """sync.overlap: the rounds in flight after the last step, counted in its record."""
        assert self.outer is not None
        bg, exposed = self.outer.finish()
        if self.resolved.overlapped:
            rec["bytes_sent"] += bg
            rec["dp_bytes_sent"] += bg
            rec["outer_wait_s"] = round(rec.get("outer_wait_s", 0.0) + exposed, 6)

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
        """TrainingDiverged when this rank's loss, parameters or gradients hold NaN/inf (before
        the update: the model and optimizer still hold the last finite state)."""
        why = check_finite_state(loss, self.model.named_parameters() if self.shard is None
                                 else self.shard.named_local())
        if why is not None:
            raise TrainingDiverged(f"step {self.step + 1}: {why}")

    def evaluate(self) -> float | None:
        """Mean validation loss over the fixed validation set (returned on the last stage)."""
        if not self.val:
            return None
        self.model.eval()
        lanes = len(self.topo.my_lanes)  # every lane evaluates the set (FSDP: same calls)
        xs = [b[0] for b in self.val] * lanes if self.topo.is_first else None
        ys = [b[1] for b in self.val] * lanes if self.topo.is_last else None
        loss = self.pipe.eval_loss(xs, ys, len(self.val))
        self.model.train()
        if self.shard is not None:
            self.shard.after_eval()
        return loss

    def _evaluate_if_due(self, rec: dict[str, Any]) -> bool:
        """Evaluate after this step when due (every --eval-every steps and the last); True when
        the run ends after it: the step is --steps, or --stop-at-loss stops every rank here."""
        cfg = self.cfg
        last, every = self.step == cfg.steps, cfg.data.eval_every
        if not self.val or not ((every and self.step % every == 0) or last):
            return last
        self._evaluate_into(rec)
        if not last and self._should_stop(rec):
            rec["stopped_at_loss"] = True
            return True
        return last

    def _should_stop(self, rec: dict[str, Any]) -> bool:
        """--stop-at-loss: the run's one decision at this evaluation (the reporting rank of the
        lowest live replica decides from its validation loss; modules.train.stopping); its
        wait is in `stop_check_s` (after the record's wall_time, like an evaluation: the lab
        benchmarks leave both out of their training clock)."""
        stopping = self.stopping
        if stopping is None or not stopping.due(self.step):
            return False
        t0, topo, decider = time.perf_counter(), self.topo, min(self.replicas)
        try:
            if topo.reports and topo.replica == decider:
                decision = stopping.decide(self.step, rec.get("val_loss"), topo.replica)
            else:
                decision = stopping.follow(self.step, decider)
        except RuntimeError as e:  # the store itself is gone
            raise self._peer_failure(e) from None
        rec["stop_check_s"] = round(time.perf_counter() - t0, 6)
        if decision.stop:
            self.log(stopping.stop_line(self.step, decision))
        return decision.stop

    def _evaluate_into(self, rec: dict[str, Any]) -> None:
        """The validation loss into this step's record, and the evaluation's time (it runs
        after the record's wall_time: benchmarks take it out of their timings)."""
        t0 = time.perf_counter()
        val = self.evaluate()
        if val is not None:
            rec["val_loss"] = val
        rec["eval_s"] = round(time.perf_counter() - t0, 6)

    def _measured_step(self) -> dict[str, Any]:
        """One train_step and its metrics record; a lost peer ends the run with its reason."""
        self.stats.settle()  # NCCL's spans timed on the stream before this step
        t0, wait0, bytes0 = time.perf_counter(), self.stats.wait_s, self.stats.bytes_sent
        fsdp0 = self.shard.clock.seconds if self.shard is not None else 0.0
        dp0, pipe, ppb0 = self.dp_bytes, self.pipe.comm, self.pipe.bytes_sent
        pp0 = pipe.wait_s if pipe is not None else 0.0
        try:
            loss = self.train_step()
            self.stats.settle()  # NCCL: comm_s and pp_wait_s from CUDA events, not enqueues
        except RuntimeError as e:  # PeerError, or the store's own error (its host is gone)
            raise self._peer_failure(e) from None
        except TrainingDiverged as e:
            raise TrainingDiverged(self.ckpt.save_diverged(str(e))) from None
        step_s = time.perf_counter() - t0
        bg_bytes, exposed_s = (self.outer.background_share() if self.outer is not None
                               else (0, 0.0))
        comm_s = self.stats.wait_s - wait0 + exposed_s
        fsdp_s = self.shard.clock.seconds - fsdp0 if self.shard is not None else 0.0
        rec = {"step": self.step, "loss": loss, "tokens": self.tokens,
               "step_s": round(step_s, 6), "compute_s": round(step_s - comm_s - fsdp_s, 6),
               "comm_s": round(comm_s, 6),
               "bytes_sent": self.stats.bytes_sent - bytes0 + bg_bytes,
               "dp_bytes_sent": self.dp_bytes - dp0, "pp_bytes_sent": self.pipe.bytes_sent - ppb0,
               "outer_step": self.outer_count,
               "tokens_per_s": round(self.tokens_per_step * self._replicas_training() / step_s,
                                     1),
               "replica": self.topo.replica, "wall_time": round(time.time(), 3),
               "rank": self.topo.rank, "stage": self.topo.stage,
               "pp_wait_s": round(pipe.wait_s - pp0, 6) if pipe is not None else 0.0}
        if self.shard is not None:  # FSDP2's collectives, out of compute_s (not in comm_s)
            rec["fsdp_s"] = round(fsdp_s, 6)
        if self.membership.monitor is not None and self.outer is not None:
            rec["live_replicas"] = len(self.replicas)
        if self.resolved.overlapped:  # the part of the background sync the step waited for
            rec["outer_wait_s"] = round(exposed_s, 6)
        rec["comm"] = {c.group: c.backend for c in self.groups.choices} or {"all": "gloo"}
        value = mfu(self.tokens_per_step / step_s, self.flops_per_token,
                    self.placement.replica_peak_tflops)
        if value is not None:
            rec["mfu"] = round(value, 6)
            self.mfu_values.append(value)
        return rec

    def _peer_failure(self, e: RuntimeError) -> PeerError:
        """The error to end the run with after a failed step: the heartbeat first gets time
        to name the lost peer (it exits the process then)."""
        if not isinstance(e, PeerError):
            e = PeerError(f"step {self.step + 1}: {first_line(e)}")
        if not e.diagnosed:
            self.membership.await_verdict()
        if self.membership.dropped:
            self.membership.finish()  # rank 0: host the store until the others are done
            return PeerError(f"my replica {self.topo.replica} was dropped at step {self.step}; "
                             "the store was kept up until the other replicas finished")
        return e

    def _log_progress(self, rec: dict[str, Any], last: bool) -> None:
        """The progress line of the first live replica's last stage, every cfg.log_every steps."""
        if self.topo.replica != min(self.replicas) or not (self.step % self.cfg.log_every == 0
                                                            or last):
            return
        extra = f" val_loss {rec['val_loss']:.4f}" if "val_loss" in rec else ""
        extra += f" mfu {rec['mfu']:.1%}" if "mfu" in rec else ""
        self.log(f"step {self.step}/{self.cfg.steps} loss {rec['loss']:.4f} "
                 f"tok/s {rec['tokens_per_s']:.0f} step_s {rec['step_s']:.3f} "
                 f"comm_s {rec['comm_s']:.3f}{extra}")
        if os.environ.get(STATUS_ENV) == "1":  # a launcher reads this line, not the one above
            self.log(status_line({**rec, "step": self.step, "steps": self.cfg.steps}))
