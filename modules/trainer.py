"""The training loop of one rank: pipeline step, tied-embedding sum, data-parallel sync, metrics,
checkpoints. dist_runner.py parses arguments and calls `Trainer(...).run()`.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from formats.errors import UserError
from formats.models import get_model
from formats.plan import Plan
from modules.checkpoint import (
    AsyncCheckpointer,
    complete_steps,
    load_checkpoint,
    prune,
    save_checkpoint,
    snapshot,
    step_path,
)
from modules.comm import CommStats, PeerError
from modules.data import FakeData, Sharder, TextData
from modules.diloco import DiLoCoOptimizer
from modules.dist import Groups, Topology, build_groups, wait_for_peers
from modules.elastic import ElasticMembership
from modules.fault import Monitor, members_of
from modules.metrics import MetricsWriter, replica_metrics_path
from modules.model import StageModel
from modules.pipeline import PipelineStage
from modules.sync import average_grads, make_group_average, sum_tied_grads


@dataclass
class RunConfig:
    """What a run does besides the plan (dist_runner's flags)."""

    steps: int
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup_steps: int = 0
    """Linear learning-rate warm-up from lr/warmup_steps to lr."""
    lr_schedule: str = "constant"
    """After warm-up: `constant`, or `cosine` decay to min_lr_ratio x lr at the last step."""
    min_lr_ratio: float = 0.1
    seed: int = 0
    timeout_s: float = 60.0
    ckpt_dir: str | None = None
    ckpt_every: int = 0
    """Save every K steps (and at the end) when > 0 and ckpt_dir is set."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept per rank (older ones are deleted after a new one is written)."""
    sync_checkpoints: bool = False
    """Write checkpoints on the training thread (for comparison) instead of in the background."""
    resume: bool = False
    metrics: str | None = None
    eval_every: int = 0
    """Validation loss every K steps (0: only at the end when eval_sequences > 0)."""
    eval_sequences: int = 0
    """Validation sequences per evaluation (0: no validation)."""
    wait_for_peers: bool = False
    """DiLoCo: keep waiting (and logging) for a missing peer instead of failing."""
    log_every: int = 1
    debug_vanish: tuple[int, int] = (0, 0)
    """Tests only: (step, status): exit at once before that step, like a lost peer."""
    debug_ckpt_die: int = 0
    """Tests only: SIGKILL this process when the checkpoint of this step is half written."""
    store_addr: tuple[str, int] | None = None
    """(host, port) of the rendezvous store: the heartbeat thread's own connection (None: no
    heartbeat, e.g. single-process tests)."""
    heartbeat_timeout_s: float = 5.0
    """A peer whose heartbeat has not moved for this long is gone."""
    min_replicas: int = 1
    """DiLoCo: below this many live replicas the run stops (checkpointing first)."""
    start_replicas: tuple[int, ...] | None = None
    """Replicas that start now (None: all); the others may come later with `join`."""
    join: bool = False
    """DiLoCo: this rank's replica joins a running job (state fetched from a live peer)."""


def make_inner_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """AdamW with GPT-style betas; the same in the runtime and in single-process references."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=cfg.weight_decay)


def lr_factor(step: int, cfg: RunConfig) -> float:
    """Multiplier of cfg.lr for optimizer step `step` (0-based): warm-up, then the schedule."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "cosine":
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0


def set_lr(opt: torch.optim.Optimizer, step: int, cfg: RunConfig) -> None:
    """Set the (inner) optimizer's learning rate for step `step`; a pure function of the step."""
    for group in opt.param_groups:
        group["lr"] = cfg.lr * lr_factor(step, cfg)


def checkpoint_meta(plan: Plan, topo: Topology, seed: int) -> dict[str, Any]:
    """What a rank's checkpoint must match to be resumed (model, split, rank, sync, batch)."""
    return {"model": plan.model, "stages": [list(s) for s in plan.stages], "rank": topo.rank,
            "replica": topo.replica, "stage": topo.stage, "world_size": topo.world_size,
            "sync_mode": plan.sync.mode, "inner_steps": plan.sync.inner_steps,
            "micro_batch_size": plan.micro_batch_size,
            "num_micro_batches": plan.num_micro_batches, "seed": seed}


class Trainer(ElasticMembership):
    """One rank's share of the run described by a plan (failure handling: modules.elastic)."""

    def __init__(self, plan: Plan, topo: Topology, store: dist.Store,
                 data: TextData | FakeData, cfg: RunConfig, log=print) -> None:
        self.plan, self.topo, self.store, self.cfg = plan, topo, store, cfg
        self.log = log
        self.spec = get_model(plan.model)
        start, end = plan.stages[topo.stage]
        self.model = StageModel(self.spec, start, end, seed=cfg.seed)
        self.stats = CommStats()
        """Bytes sent and seconds waited by every communicator of this rank."""
        self.groups: Groups | None = None
        self.pipe = PipelineStage(self.model, topo, None, plan.micro_batch_size)
        self.sharder = Sharder(data, plan.num_replicas, plan.num_micro_batches,
                               plan.micro_batch_size)
        self.val = (data.val_batches(cfg.eval_sequences, plan.micro_batch_size)
                    if cfg.eval_sequences else [])
        self.params = list(self.model.parameters())
        self.replicas = sorted(cfg.start_replicas if cfg.start_replicas is not None
                               else range(plan.num_replicas))
        """Live replicas of the current generation (process groups span their ranks)."""
        self.active: set[int] = set() if cfg.join else set(self.replicas)
        """Replicas that took part in the last outer step (a joiner is not one yet)."""
        self.gen = 0
        self.monitor: Monitor | None = None
        self.state_lock = threading.Lock()
        """Held by the training thread while it changes parameters / optimizer state."""
        self.rejoin_s: float | None = None
        if not cfg.join:  # generation 0 (a subset's default group numbers its members 0..n-1)
            members = members_of(plan, self.replicas)
            self._set_groups(build_groups(plan, topo, self.spec.tie_embeddings, self.replicas,
                                          {d: i for i, d in enumerate(members)}, cfg.timeout_s,
                                          self.stats))
        inner = make_inner_optimizer(self.model, cfg)
        self.inner = inner
        if plan.sync.mode == "diloco":
            self.opt: Any = DiLoCoOptimizer(
                self.params, inner, outer_lr=plan.sync.outer_lr,
                outer_momentum=plan.sync.outer_momentum, inner_steps=plan.sync.inner_steps,
                all_reduce_fn=self._outer_all_reduce)
        else:
            self.opt = inner
        self.step = 0
        self.tokens = 0
        self.tokens_per_step = plan.num_micro_batches * plan.micro_batch_size * self.spec.seq_len
        self.dp_bytes = 0
        self.ckpt: AsyncCheckpointer | None = None
        if cfg.ckpt_dir:
            self.ckpt = AsyncCheckpointer(cfg.ckpt_dir, topo.rank, cfg.keep_checkpoints,
                                          debug_hook=self._debug_ckpt_hook)

    def _debug_ckpt_hook(self, step: int, where: str) -> None:
        if self.cfg.debug_ckpt_die and step == self.cfg.debug_ckpt_die:
            self.log(f"debug: killing myself while checkpoint step {step} is {where} written")
            os.kill(os.getpid(), signal.SIGKILL)

    def _stage_ranks(self) -> tuple[int, ...]:
        """Devices of my stage in every live replica."""
        return tuple(self.plan.pipelines[r][self.topo.stage] for r in self.replicas)

    def _set_groups(self, groups: Groups) -> None:
        self.groups = groups
        self.pipe.comm = groups.pipeline
        self.average = make_group_average(groups.stage, self.plan.sync.compression,
                                          f"all-reduce of stage {self.topo.stage}")

    def _outer_all_reduce(self, flat: torch.Tensor) -> int:
        """DiLoCo's outer communication: check every group member is there, then average."""
        if self.monitor is not None:
            return self._elastic_outer_all_reduce(flat)
        if len(self.topo.stage_ranks) > 1:
            t0 = time.perf_counter()
            outer = self.opt.outer_count if isinstance(self.opt, DiLoCoOptimizer) else 0
            wait_for_peers(self.store, f"diloco/stage{self.topo.stage}/outer{outer}",
                           self.topo.rank, self.topo.stage_ranks, self.cfg.timeout_s,
                           self.cfg.wait_for_peers, self.log,
                           what=f"DiLoCo outer step {outer + 1} of stage {self.topo.stage}")
            self.stats.wait_s += time.perf_counter() - t0
        sent = self.average(flat)
        self.dp_bytes += sent
        return sent

    # -- checkpoints -------------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        return checkpoint_meta(self.plan, self.topo, self.cfg.seed)

    def state(self) -> dict[str, Any]:
        """This rank's full training state (live tensors: snapshot before keeping it)."""
        return {"step": self.step, "tokens": self.tokens, "dp_bytes": self.dp_bytes,
                "model": self.model.state_dict(), "opt": self.opt.state_dict(),
                "rng": torch.get_rng_state()}

    def save(self) -> float:
        """Checkpoint this step (model, optimizers, data position = step, RNG); returns the
        seconds the training thread was blocked (snapshot; the whole write with
        cfg.sync_checkpoints)."""
        assert self.ckpt is not None and self.cfg.ckpt_dir
        if self.cfg.sync_checkpoints:
            t0 = time.perf_counter()
            self.ckpt.flush()
            save_checkpoint(step_path(self.cfg.ckpt_dir, self.topo.rank, self.step),
                            self._meta(), snapshot(self.state()))
            prune(self.cfg.ckpt_dir, self.topo.rank, self.cfg.keep_checkpoints)
            return time.perf_counter() - t0
        return self.ckpt.save(self.step, self._meta(), self.state())

    def _all_min(self, value: int, what: str) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        self.groups.world.all_reduce(t, "min", what)
        return int(t[0])

    def agree_resume_step(self) -> int:
        """The newest step with a complete checkpoint on every rank (all ranks agree)."""
        mine = complete_steps(self.cfg.ckpt_dir, self.topo.rank)
        cand = mine[-1] if mine else -1
        while True:
            cand = self._all_min(cand, "agreeing on the checkpoint step with every rank")
            if cand < 0:
                raise UserError(f"--resume: no step has a complete checkpoint on every rank in "
                                f"{self.cfg.ckpt_dir} (rank {self.topo.rank} has steps {mine}); "
                                "run without --resume to start fresh")
            if self._all_min(int(cand in mine), "agreeing on the checkpoint step") == 1:
                return cand
            older = [s for s in mine if s < cand]
            cand = older[-1] if older else -1

    def load(self) -> None:
        """Restore the newest checkpoint that every rank has completely written."""
        step = self.agree_resume_step()
        path = step_path(self.cfg.ckpt_dir, self.topo.rank, step)
        state = load_checkpoint(path, self._meta())
        try:
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["opt"])
            self.step, self.tokens = int(state["step"]), int(state["tokens"])
            self.dp_bytes = int(state["dp_bytes"])
            torch.set_rng_state(state["rng"])
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
            x, y = self.sharder.micro_batches(self.step, topo.replica)
        loss = self.pipe.train_step(x, y, plan.num_micro_batches)
        sum_tied_grads(self.model.tied_pair(), self.groups.tied)
        if plan.sync.mode == "allreduce":
            self.dp_bytes += average_grads(self.params, self.average)
        outer0, dp0 = getattr(self.opt, "outer_count", 0), self.dp_bytes
        with self.state_lock:
            set_lr(self.inner, self.step, self.cfg)
            self.opt.step()  # DiLoCo: inner step, and every H steps the outer (communicating) one
            self.step += 1
            self.tokens += self.tokens_per_step
        outer = getattr(self.opt, "outer_count", 0)
        if outer > outer0:  # DiLoCo's only communication: every rank says what it sent
            # spelt like the metrics field: benchmarks/end_to_end.py echoes lines with " step "
            self.log(f"outer_step {outer}: {self.dp_bytes - dp0} bytes sent to stage group "
                     f"{list(self._stage_ranks())} (stage {topo.stage}, after "
                     f"{plan.sync.inner_steps} inner steps)")
        return loss

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
        """Train from the current step (0, or the checkpoint's) up to cfg.steps."""
        cfg, topo, plan = self.cfg, self.topo, self.plan
        self.start_monitor()
        if cfg.join:
            self.join()
        elif cfg.resume:
            self.load()
            self.log(f"resumed from step {self.step}")
        writer = None
        if cfg.metrics and topo.is_last:
            writer = MetricsWriter(replica_metrics_path(cfg.metrics, topo.replica),
                                   resume_step=self.step if cfg.resume else None)
        tokens_per_step = self.tokens_per_step
        records = []
        try:
            while self.step < cfg.steps:
                if cfg.debug_vanish[0] and self.step + 1 == cfg.debug_vanish[0]:
                    self.log(f"debug: vanishing before step {self.step + 1}")
                    os._exit(cfg.debug_vanish[1])
                t0, wait0, bytes0 = time.perf_counter(), self.stats.wait_s, self.stats.bytes_sent
                dp0 = self.dp_bytes
                try:
                    loss = self.train_step()
                except RuntimeError as e:  # PeerError, or gloo's own error from a posted op
                    if not isinstance(e, PeerError):
                        e = PeerError(f"step {self.step + 1}: "
                                      f"{str(e).strip().splitlines()[0][:300]}")
                    if not getattr(e, "diagnosed", False):
                        self.await_verdict()  # the heartbeat names the lost peer and exits
                    if self.monitor is not None and self.monitor.dropped:
                        self.finish()  # rank 0: host the store until the others are done
                        raise PeerError(f"my replica {topo.replica} was dropped at step "
                                        f"{self.step}; the store was kept up until the other "
                                        "replicas finished") from None
                    raise e from None
                step_s = time.perf_counter() - t0
                comm_s = self.stats.wait_s - wait0
                rec = {"step": self.step, "loss": loss, "tokens": self.tokens,
                       "step_s": round(step_s, 6), "compute_s": round(step_s - comm_s, 6),
                       "comm_s": round(comm_s, 6),
                       "bytes_sent": self.stats.bytes_sent - bytes0,
                       "dp_bytes_sent": self.dp_bytes - dp0,
                       "outer_step": getattr(self.opt, "outer_count", None),
                       "tokens_per_s": round(tokens_per_step * len(self.replicas) / step_s, 1),
                       "replica": topo.replica, "wall_time": round(time.time(), 3)}
                if self.monitor is not None and plan.sync.mode == "diloco":
                    rec["live_replicas"] = len(self.replicas)
                last = self.step == cfg.steps
                if self.val and ((cfg.eval_every and self.step % cfg.eval_every == 0) or last):
                    val = self.evaluate()
                    if val is not None:
                        rec["val_loss"] = val
                if topo.is_last:
                    records.append(rec)
                    if topo.replica == min(self.replicas) and (self.step % cfg.log_every == 0
                                                               or last):
                        extra = f" val_loss {rec['val_loss']:.4f}" if "val_loss" in rec else ""
                        self.log(f"step {self.step}/{cfg.steps} loss {loss:.4f} "
                                 f"tok/s {rec['tokens_per_s']:.0f} step_s {step_s:.3f} "
                                 f"comm_s {comm_s:.3f}{extra}")
                if cfg.ckpt_dir and cfg.ckpt_every and (self.step % cfg.ckpt_every == 0 or last):
                    rec["ckpt_block_s"] = round(self.save(), 6)
                if writer:
                    writer.write(rec)
            if self.ckpt:
                self.ckpt.flush()
        finally:
            if writer:
                writer.close()
        self.finish()
        return records


