"""The training loop of one rank: pipeline step, tied-embedding sum, data-parallel sync, metrics,
checkpoints. dist_runner.py parses arguments and calls `Trainer(...).run()`; who the rank
trains with is the Trainer's `Membership` (modules.control.elastic).
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from formats.errors import UserError
from formats.plan import Plan
from modules.comm import CommStats, PeerError
from modules.comm.errors import first_line
from modules.config import RunConfig
from modules.control.dist import Topology
from modules.control.elastic import GenerationChange, Handover, Membership, MembershipSettings
from modules.control.groups import GroupBuilder, Groups
from modules.data.dataset import FakeData, Sharder, TextData
from modules.data.tokenizer import BYTES_ID, TokenizerId
from modules.device.compile import maybe_compile
from modules.device.mfu import flops_per_token, mfu
from modules.device.placement import Placement
from modules.device.precision import LossScaling
from modules.device.select import rng_states, set_rng_states, to_device
from modules.pipeline.stage import PipelineStage
from modules.sync.average import (
    GroupAverage,
    average_grads,
    make_group_average,
    no_average,
    sum_tied_grads,
)
from modules.sync.diloco import DiLoCoOptimizer
from modules.sync.overlap import OverlapSync
from modules.train.checkpoint import (
    AsyncCheckpointer,
    check_finite_state,
    complete_steps,
    fallback_note,
    load_checkpoint,
    prune,
    save_checkpoint,
    snapshot,
    step_path,
)
from modules.train.hf_weights import load_stage_weights
from modules.train.model import StageModel
from modules.train.tracking import open_rank_timing, open_trackers


def make_inner_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """AdamW with GPT-style betas; the same in the runtime and in single-process references."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=cfg.optim.weight_decay)


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


def checkpoint_meta(plan: Plan, topo: Topology, seed: int,
                    tokenizer: TokenizerId = BYTES_ID) -> dict[str, Any]:
    """What a rank's checkpoint must match to be resumed (model, split, rank, sync, batch,
    tokenizer)."""
    return {"model": plan.model, "stages": [list(s) for s in plan.stages], "rank": topo.rank,
            "replica": topo.replica, "stage": topo.stage, "world_size": topo.world_size,
            "sync_mode": plan.sync.mode, "inner_steps": plan.sync.inner_steps,
            "micro_batch_size": plan.micro_batch_size,
            "num_micro_batches": plan.num_micro_batches, "seed": seed,
            "tokenizer": tokenizer.meta(),
            # a config.json model: its fields (presets keep the old meta, so they resume)
            **({"model_config": plan.model_config} if plan.model_config is not None else {})}


class TrainingDiverged(Exception):  # noqa: N818 - the name says what happened
    """A non-finite loss or parameter: the run stops (exit 1) after saving the last finite
    state. Not a RuntimeError, which the loop reads as a lost peer."""


class Trainer:
    """One rank's share of the run described by a plan. Who it trains with (groups, failures,
    joining) is its composed `Membership` (modules.control.elastic), whose changes `_apply`
    takes."""

    def __init__(self, plan: Plan, topo: Topology, store: dist.Store,
                 data: TextData | FakeData, cfg: RunConfig, log=print,
                 placement: Placement | None = None,
                 store_addr: tuple[str, int] | None = None, coordinator: bool = False) -> None:
        """`placement`: device, precision, compile and backend (default: CPU, fp32, gloo);
        `store_addr`: (host, port) of the rendezvous store for the heartbeat thread's own
        connection (None: no heartbeat, e.g. single-process tests); `coordinator`: a
        coordinator process hosts that store and leads membership (no rank does)."""
        plan = cfg.outer.apply(plan)  # --fragments / --overlap override the plan's
        self.plan, self.topo, self.cfg, self.log = plan, topo, cfg, log
        self.placement = placement or Placement()
        self.device = self.placement.device
        self._init_model_and_data(data)
        self.stats = CommStats()
        """Bytes sent and seconds waited by every communicator of this rank."""
        self._init_overlap()
        self.pipe = PipelineStage(self.model, topo, None, plan.micro_batch_size,
                                  self.placement.precision,
                                  cfg.device.resolved_pipeline_compression(plan))
        self.scaling: LossScaling = self.placement.precision.loss_scaling(self._agree_overflow)
        """fp16: loss scaling whose skip decisions agree over the ranks that step together."""
        self.inner = make_inner_optimizer(self.model, cfg)
        self.diloco: DiLoCoOptimizer | None = self._make_diloco()
        """The outer optimizer around `inner` in sync mode diloco (None in allreduce mode)."""
        self.opt: torch.optim.Optimizer | DiLoCoOptimizer = self.diloco or self.inner
        """What each step steps: DiLoCo (inner step, every H steps the outer one) or AdamW."""
        self.step = 0
        self.tokens = 0
        self.tokens_per_step = plan.num_micro_batches * plan.micro_batch_size * self.spec.seq_len
        self.dp_bytes = 0
        """Data-parallel bytes this rank sent (all-reduces of gradients or pseudo-gradients)."""
        self.mfu_values: list[float] = []
        """MFU of each measured step (empty without a peak)."""
        self.flops_per_token = flops_per_token(self.spec)
        """Training FLOPs per token of the whole model (the MFU's numerator per token)."""
        self.state_lock = threading.Lock()
        """Held by the training thread while it changes parameters / optimizer state."""
        self.ckpt: AsyncCheckpointer | None = (
            AsyncCheckpointer(cfg.ckpt.dir, topo.rank, cfg.ckpt.keep,
                              debug_hook=self._debug_ckpt_hook) if cfg.ckpt.dir else None)
        self.outer_snapshot: tuple[int, int, dict[str, Any]] | None = None
        """DiLoCo with --ckpt-dir: (step, outer step, state) after the last outer step."""
        self.membership = self._make_membership(store, store_addr, coordinator)
        self.groups: Groups | None = None
        """The current generation's communicators (None on a joiner until admitted)."""
        self.replicas: tuple[int, ...] = self.membership.replicas
        """Live replicas of the current generation."""
        self.average: GroupAverage = no_average
        """Averages a flat tensor over my stage group (sync.compression's payload)."""
        if not cfg.elastic.join:
            self._apply(self.membership.first_generation())

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
        self.sharder = Sharder(data, plan.num_replicas, plan.num_micro_batches,
                               plan.micro_batch_size)
        self.val = (to_device(data.val_batches(cfg.data.eval_sequences, plan.micro_batch_size),
                              self.device) if cfg.data.eval_sequences else [])

    def _init_overlap(self) -> None:
        """sync.overlap: the background outer all-reduces and their own accounting."""
        overlapped = self.plan.sync.mode == "diloco" and self.plan.sync.overlap
        self.outer_stats: CommStats | None = CommStats() if overlapped else None
        """What the background all-reduces sent and waited (their communicator's own; added
        to a step's record when counted)."""
        self.outer_seen = (0, 0.0)
        """(background bytes, exposed wait s) already attributed to a step's record."""
        self.overlap: OverlapSync | None = (
            OverlapSync(self._outer_attempt, self._refresh, self.log)
            if overlapped else None)
        """Runs the outer all-reduces in the background (modules.sync.overlap)."""
        self.outer_average: GroupAverage = no_average
        """Averages a flat tensor over my stage group's background communicator."""

    def _make_membership(self, store: dist.Store, store_addr: tuple[str, int] | None,
                         coordinator: bool) -> Membership:
        """Who this rank trains with; its groups are built with the placement's backend."""
        plan, cfg = self.plan, self.cfg
        builder = GroupBuilder(plan, self.topo, store, self.spec.tie_embeddings, cfg.timeout_s,
                               self.stats, self.placement.comm, self.log, self.outer_stats)
        settings = MembershipSettings.of(cfg, plan.num_replicas, store_addr, coordinator)
        return Membership(store, plan, self.topo, settings, builder, self.stats, self.log)

    def _make_diloco(self) -> DiLoCoOptimizer | None:
        """DiLoCo around the inner AdamW (its anchor: the parameters as they are now, on the
        device), or None in allreduce mode."""
        sync = self.plan.sync
        if sync.mode != "diloco":
            return None
        if sync.fragments > len(self.params):
            raise UserError(f"sync.fragments: {sync.fragments} fragments, but stage "
                            f"{self.topo.stage} has only {len(self.params)} parameters")
        # the tied embedding copies first: with fragments they then sync in the same slot on
        # the first and the last stage, so the copies stay equal
        tied = {id(p) for p in self.model.tied_pair()} if sync.fragments > 1 else set()
        params = ([p for p in self.params if id(p) in tied]
                  + [p for p in self.params if id(p) not in tied])
        return DiLoCoOptimizer(params, self.inner, outer_lr=sync.outer_lr,
                               outer_momentum=sync.outer_momentum,
                               inner_steps=sync.inner_steps, all_reduce_fn=self._outer_all_reduce,
                               fragments=sync.fragments, overlap=sync.overlap,
                               overlap_alpha=self.cfg.outer.overlap_alpha, reducer=self.overlap)

    def _apply(self, change: GenerationChange) -> None:
        """Take a generation: its groups and live replicas and, on a joiner, the outer state
        and step handed over by a live peer. The one place membership changes the Trainer."""
        self.groups, self.replicas = change.groups, change.replicas
        self.pipe.comm = change.groups.pipeline
        self.average = make_group_average(change.groups.stage, self.plan.sync.compression,
                                          f"all-reduce of stage {self.topo.stage}")
        self.outer_average = make_group_average(change.groups.outer, self.plan.sync.compression,
                                                f"background all-reduce of stage "
                                                f"{self.topo.stage}")
        if change.handover is not None:
            assert self.diloco is not None
            with self.state_lock:
                self.diloco.load_outer_state(change.handover.outer)
                self.step = change.handover.step

    def _agree_overflow(self, flag: torch.Tensor) -> None:
        """MAX of the fp16 overflow flag over the ranks that step together: every rank in
        allreduce mode (stage groups average gradients), my replica's pipeline in DiLoCo."""
        comm = self.groups.world if self.diloco is None else self.groups.pipeline
        if comm is not None:
            comm.all_reduce(flag, "max", "agreeing on an fp16 gradient overflow")

    @property
    def outer_count(self) -> int | None:
        """DiLoCo outer steps done (None in allreduce mode)."""
        return self.diloco.outer_count if self.diloco is not None else None

    def _debug_ckpt_hook(self, step: int, where: str) -> None:
        if step == self.cfg.debug.ckpt_die_at(self.topo.rank) != 0:
            self.log(f"debug: killing myself while checkpoint step {step} is {where} written")
            os.kill(os.getpid(), signal.SIGKILL)

    def _stage_ranks(self) -> tuple[int, ...]:
        """Devices of my stage in every live replica."""
        return tuple(self.plan.pipelines[r][self.topo.stage] for r in self.replicas)

    # -- DiLoCo's outer step and joining -----------------------------------------------------
    def _outer_all_reduce(self, flat: torch.Tensor) -> int:
        """DiLoCo's outer communication: take any new generation, then let the membership
        average (every member there, commit everywhere); retry with the input otherwise."""
        keep = flat.clone()
        while True:
            change = self.membership.poll(self._handover)
            if change is not None:
                self._apply(change)
            sent = self.membership.outer_round(flat, self.average, self.diloco.syncs)
            if sent is not None:
                self.dp_bytes += sent
                return sent
            flat.copy_(keep)

    def _outer_attempt(self, flat: torch.Tensor, index: int) -> int | None:
        """sync.overlap: one outer round on the background communicator (any thread)."""
        return self.membership.outer_round(flat, self.outer_average, index, self.outer_stats)

    def _refresh(self) -> None:
        """Take a newer generation if the leader published one (nothing in flight)."""
        change = self.membership.poll(self._handover)
        if change is not None:
            self._apply(change)

    def _handover(self) -> Handover:
        """What this rank would hand a joiner of its stage: the step after this outer step's
        and the outer state."""
        assert self.diloco is not None
        return Handover(self.step + 1, self.diloco.outer_state())

    def _join(self) -> None:
        """--join: be admitted, take the outer state of my stage from a live peer, and take
        part in the next outer step (with pseudo-gradient 0 and weight 0)."""
        assert self.diloco is not None
        t0 = time.monotonic()
        self._apply(self.membership.join(self._handover))
        self.diloco.outer_step()  # the same outer step as everybody
        self.log(f"joined at step {self.step} (outer step {self.diloco.outer_count}) after "
                 f"{time.monotonic() - t0:.2f} s")

    # -- failures ----------------------------------------------------------------------------
    def _on_fatal(self, reason: str) -> None:
        """Say why, checkpoint what can be checkpointed, and leave with status 1 (any thread)."""
        print(f"rank {self.topo.rank}: error: {reason}", file=sys.stderr, flush=True)
        try:
            saved = self.emergency_checkpoint()
        except Exception as e:  # never let a failed save keep a dying rank alive
            saved = f"no checkpoint ({type(e).__name__}: {e})"
        if saved:
            self.log(saved)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def emergency_checkpoint(self) -> str:
        """Finish the write in flight, then save the last consistent state: in DiLoCo the one
        right after the last committed outer step (the same step on every rank, so --resume
        agrees on it); in allreduce the current one if the training thread is not inside an
        update (it is usually blocked waiting on the lost peer)."""
        if self.ckpt is None or not self.cfg.ckpt.dir:
            return ""
        if not self.ckpt.flush(timeout=2.0):
            return "checkpoint: the background write did not finish within 2 s"
        if self.diloco is not None:
            return self._save_outer_snapshot()
        if not self.state_lock.acquire(timeout=1.0):
            return self._newest_checkpoint()
        # keep the lock: the training thread must not change the state while it is saved
        if self.step == 0 or self.ckpt.last_step == self.step:
            return f"checkpoint: step {self.step} is already on disk"
        path = step_path(self.cfg.ckpt.dir, self.topo.rank, self.step)
        save_checkpoint(path, self._meta(), snapshot(self.state()))
        return f"checkpoint: saved step {self.step} to {path}"

    def _newest_checkpoint(self) -> str:
        last = self.ckpt.last_step if self.ckpt is not None else None
        return (f"checkpoint: newest complete one is step {last}" if last is not None
                else "checkpoint: none written yet")

    def _save_outer_snapshot(self) -> str:
        """DiLoCo: write the state kept at the last committed outer step (unless this run's
        periodic checkpoint already did). A rank that was inside an outer step's commit when
        the store vanished keeps the previous one; --resume then agrees on an older step that
        every rank has."""
        kept = self.outer_snapshot
        if kept is None:
            return self._newest_checkpoint()
        step, outer, snap = kept
        path = step_path(self.cfg.ckpt.dir, self.topo.rank, step)
        if self.ckpt.last_step != step:  # not written by this run's periodic checkpoint
            save_checkpoint(path, self._meta(), snap)
        newest = max(step, self.ckpt.last_step or 0)
        return (f"checkpoint: newest complete one is step {newest}; step {step} (right after "
                f"outer step {outer}, which every member averaged) is in {path}")

    # -- checkpoints -------------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        return checkpoint_meta(self.plan, self.topo, self.cfg.seed, self.tokenizer)

    def state(self) -> dict[str, Any]:
        """This rank's full training state (live tensors: snapshot before keeping it)."""
        return {"step": self.step, "tokens": self.tokens, "dp_bytes": self.dp_bytes,
                "model": self.model.state_dict(), "opt": self.opt.state_dict(),
                "rng": rng_states(self.device), "scaler": self.scaling.state_dict()}

    def save(self) -> float:
        """Checkpoint this step (model, optimizers, data position = step, RNG); returns the
        seconds the training thread was blocked (snapshot; the whole write with
        cfg.ckpt.sync)."""
        assert self.ckpt is not None and self.cfg.ckpt.dir
        if self.cfg.ckpt.sync:
            t0 = time.perf_counter()
            self.ckpt.flush()
            save_checkpoint(step_path(self.cfg.ckpt.dir, self.topo.rank, self.step),
                            self._meta(), snapshot(self.state()))
            prune(self.cfg.ckpt.dir, self.topo.rank, self.cfg.ckpt.keep)
            return time.perf_counter() - t0
        return self.ckpt.save(self.step, self._meta(), self.state())

    def _all_min(self, value: int, what: str) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        self.groups.world.all_reduce(t, "min", what)
        return int(t[0])

    def agree_resume_step(self) -> int:
        """The newest step with a complete checkpoint on every rank (all ranks agree)."""
        mine = complete_steps(self.cfg.ckpt.dir, self.topo.rank)
        cand = mine[-1] if mine else -1
        while True:
            cand = self._all_min(cand, "agreeing on the checkpoint step with every rank")
            if cand < 0:
                raise UserError(f"--resume: no step has a complete checkpoint on every rank in "
                                f"{self.cfg.ckpt.dir} (rank {self.topo.rank} has steps {mine}); "
                                "run without --resume to start fresh")
            if self._all_min(int(cand in mine), "agreeing on the checkpoint step") == 1:
                return cand
            older = [s for s in mine if s < cand]
            cand = older[-1] if older else -1

    def load(self) -> None:
        """Restore the newest checkpoint that every rank has completely written."""
        step = self.agree_resume_step()
        note = fallback_note(self.cfg.ckpt.dir, self.topo.rank, step)
        if note:
            self.log(note)
        path = step_path(self.cfg.ckpt.dir, self.topo.rank, step)
        state = load_checkpoint(path, self._meta())
        try:
            self.model.load_state_dict(state["model"])  # copies the CPU tensors onto the device
            self.opt.load_state_dict(state["opt"])  # torch moves optimizer state to the params'
            self.step, self.tokens = int(state["step"]), int(state["tokens"])
            self.dp_bytes = int(state["dp_bytes"])
            set_rng_states(state["rng"], self.device)
            if state.get("scaler"):
                self.scaling.load_state_dict(state["scaler"])
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            raise UserError(f"checkpoint {path}: does not fit this stage "
                            f"({str(e).splitlines()[0]})") from None
        if self.step != step:
            raise UserError(f"checkpoint {path}: holds step {self.step}, not {step}")

    # -- the loop ----------------------------------------------------------------------------
    def train_step(self) -> float | None:
        """One optimizer step of this rank; returns the replica's mean loss on the last stage."""
        topo, plan = self.topo, self.plan
        self.opt.zero_grad(set_to_none=True)
        x = y = None
        if topo.is_first or topo.is_last:
            x, y = to_device(self.sharder.micro_batches(self.step, topo.replica), self.device,
                             non_blocking=True)
        loss = self.pipe.train_step(x, y, plan.num_micro_batches, self.scaling.scale_loss)
        sum_tied_grads(self.model.tied_pair(), self.groups.tied)
        overflow = self.scaling.found_overflow(self.inner)  # fp16 only; agreed, so skipped alike
        if not overflow:
            self._check_finite(loss)
        if self.diloco is None and not overflow:
            self.dp_bytes += average_grads(self.params, self.average)
        outer0, dp0 = self.outer_count, self.dp_bytes
        with self.state_lock:
            set_lr(self.inner, self.step, self.cfg)
            # DiLoCo: inner step, and every H steps the outer (communicating) one
            self.scaling.step(self.opt, self.inner, overflow)
            self.step += 1
            self.tokens += self.tokens_per_step
        if self.outer_count != outer0 and self.overlap is not None:
            self.log(f"outer_step {self.outer_count}: {plan.sync.fragments} fragment "
                     f"all-reduce(s) running in the background on stage group "
                     f"{list(self._stage_ranks())} (stage {topo.stage})")
        elif self.outer_count != outer0:  # DiLoCo's only communication: every rank says what
            # it sent, spelt like the metrics field (benchmarks/end_to_end.py echoes " step ")
            self.log(f"outer_step {self.outer_count}: {self.dp_bytes - dp0} bytes sent to stage "
                     f"group {list(self._stage_ranks())} (stage {topo.stage}, after "
                     f"{plan.sync.inner_steps} inner steps)")
        if self.outer_count != outer0 and self.ckpt is not None:
            # taken here, on the only thread that changes the state, at the same round's end on
            # every rank; with overlap the rounds in flight are in it as sent (resume redoes them)
            self.outer_snapshot = (self.step, self.outer_count, snapshot(self.state()))
        return loss

    def _check_finite(self, loss: float | None) -> None:
        """TrainingDiverged when this rank's loss, parameters or gradients hold NaN/inf (before
        the update: the model and optimizer still hold the last finite state)."""
        why = check_finite_state(loss, self.model.named_parameters())
        if why is not None:
            raise TrainingDiverged(f"step {self.step + 1}: {why}")

    def save_diverged(self, e: TrainingDiverged) -> str:
        """Save the last finite state (the step before the divergence) and say where."""
        if self.ckpt is None or not self.cfg.ckpt.dir:
            return f"{e}; no --ckpt-dir, nothing saved"
        self.ckpt.flush()
        path = step_path(self.cfg.ckpt.dir, self.topo.rank, self.step)
        if self.ckpt.last_step != self.step:
            save_checkpoint(path, self._meta(), snapshot(self.state()))
        return f"{e}; the last finite state (step {self.step}) is in {path}"

    def evaluate(self) -> float | None:
        """Mean validation loss over the fixed validation set (returned on the last stage)."""
        if not self.val:
            return None
        self.model.eval()
        xs = [b[0] for b in self.val] if self.topo.is_first else None
        ys = [b[1] for b in self.val] if self.topo.is_last else None
        loss = self.pipe.eval_loss(xs, ys, len(self.val))
        self.model.train()
        return loss

    def run(self) -> list[dict[str, Any]]:
        """Train from the current step (0, the checkpoint's, or a joiner's) up to cfg.steps."""
        cfg, topo = self.cfg, self.topo
        self.membership.start(on_fatal=self._on_fatal)
        if cfg.elastic.join:
            self._join()
        elif cfg.ckpt.resume:
            self.load()
            self.log(f"resumed from step {self.step}")
        resume = self.step if cfg.ckpt.resume else None
        writer = open_trackers(cfg.metrics, topo.replica, resume) if topo.is_last else None
        # the plan as this rank runs it (--pipeline-compression too): what explain replays
        ran = dataclasses.replace(self.plan, pipeline_compression=self.pipe.wire.compression)
        timing = open_rank_timing(cfg.metrics, topo.rank, ran, resume)
        records = []
        try:
            vanish_step, status = cfg.debug.vanish_at(topo.rank)  # tests' lost-peer hook
            while self.step < cfg.steps:
                if self.step + 1 == vanish_step:
                    self.log(f"debug: vanishing before step {self.step + 1}")
                    os._exit(status)
                rec = self._measured_step()
                last = self.step == cfg.steps
                every = cfg.data.eval_every
                if self.val and ((every and self.step % every == 0) or last):
                    val = self.evaluate()
                    if val is not None:
                        rec["val_loss"] = val
                if topo.is_last:
                    records.append(rec)
                    self._log_progress(rec, last)
                ckpt_every = cfg.ckpt.interval(cfg.steps)
                if ckpt_every and (self.step % ckpt_every == 0 or last):
                    rec["ckpt_block_s"] = round(self.save(), 6)
                if writer:
                    writer.log(rec)
                if timing:
                    timing.log(rec)
            if self.overlap is not None:  # the last rounds' all-reduces: every member
                self.overlap.drain()       # finishes them (their inputs are checkpointed)
                self._background_share()  # their bytes count in this rank's total
            if self.ckpt:
                self.ckpt.flush()
        finally:
            for w in (writer, timing):
                if w:
                    w.close()
            if self.overlap is not None:
                self.overlap.close()
        self.membership.finish()
        return records

    def _measured_step(self) -> dict[str, Any]:
        """One train_step and its metrics record; a lost peer ends the run with its reason."""
        t0, wait0, bytes0 = time.perf_counter(), self.stats.wait_s, self.stats.bytes_sent
        dp0, pipe, ppb0 = self.dp_bytes, self.pipe.comm, self.pipe.bytes_sent
        pp0 = pipe.wait_s if pipe is not None else 0.0
        try:
            loss = self.train_step()
        except RuntimeError as e:  # PeerError, or the store's own error (its host is gone)
            raise self._peer_failure(e) from None
        except TrainingDiverged as e:
            raise TrainingDiverged(self.save_diverged(e)) from None
        step_s = time.perf_counter() - t0
        bg_bytes, exposed_s = self._background_share()
        comm_s = self.stats.wait_s - wait0 + exposed_s
        rec = {"step": self.step, "loss": loss, "tokens": self.tokens,
               "step_s": round(step_s, 6), "compute_s": round(step_s - comm_s, 6),
               "comm_s": round(comm_s, 6),
               "bytes_sent": self.stats.bytes_sent - bytes0 + bg_bytes,
               "dp_bytes_sent": self.dp_bytes - dp0, "pp_bytes_sent": self.pipe.bytes_sent - ppb0,
               "outer_step": self.outer_count,
               "tokens_per_s": round(self.tokens_per_step * len(self.replicas) / step_s, 1),
               "replica": self.topo.replica, "wall_time": round(time.time(), 3),
               "rank": self.topo.rank, "stage": self.topo.stage,
               "pp_wait_s": round(pipe.wait_s - pp0, 6) if pipe is not None else 0.0}
        if self.membership.monitor is not None and self.diloco is not None:
            rec["live_replicas"] = len(self.replicas)
        if self.overlap is not None:  # the part of the background sync the step waited for
            rec["outer_wait_s"] = round(exposed_s, 6)
        rec["comm"] = {c.group: c.backend for c in self.groups.choices} or {"all": "gloo"}
        value = mfu(self.tokens_per_step / step_s, self.flops_per_token,
                    self.placement.replica_peak_tflops)
        if value is not None:
            rec["mfu"] = round(value, 6)
            self.mfu_values.append(value)
        return rec

    def _background_share(self) -> tuple[int, float]:
        """sync.overlap: background bytes sent and exposed wait since the last call; the bytes
        are added to the data-parallel count (the step they were counted in sent them)."""
        if self.overlap is None or self.outer_stats is None:
            return 0, 0.0
        sent, waited = self.outer_stats.bytes_sent, self.overlap.wait_s
        bg, exposed = sent - self.outer_seen[0], waited - self.outer_seen[1]
        self.outer_seen = (sent, waited)
        self.dp_bytes += bg
        return bg, exposed

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
