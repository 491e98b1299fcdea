"""A rank's checkpoint lifecycle, composed into the Trainer: periodic saves, the resume step
every rank agrees on, the state kept at DiLoCo's last committed outer step, and the saves of a
dying rank (a lost peer) and of a diverged run. The files themselves are
modules.train.checkpoint's (ckpt/2, the background writer, keep-last-N).

The Trainer hands it what it uses: the state to save (`state`, `step`), the lock the training
thread holds while it changes that state, and, when resuming, the world communicator and a
`restore` that takes a loaded state back.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from formats.errors import UserError
from formats.plan import Plan
from modules.comm import Communicator, agree_int
from modules.config import CheckpointConfig
from modules.control.dist import Topology
from modules.data.tokenizer import BYTES_ID, TokenizerId
from modules.train.checkpoint import (
    AsyncCheckpointer,
    complete_steps,
    fallback_note,
    load_checkpoint,
    prune,
    save_checkpoint,
    shared_floor,
    snapshot,
    step_path,
)
from modules.train.ckpt_stop import CheckpointFailed, CheckpointStop, newest_steps


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
            # a DiLoCo warm-up decides the phase of each step (W = 0 keeps the old meta)
            **({"warmup_steps": plan.sync.warmup_steps} if plan.sync.warmup_steps else {}),
            # a config.json model: its fields (presets keep the old meta, so they resume)
            **({"model_config": plan.model_config} if plan.model_config is not None else {})}


class Checkpointing:
    """Checkpoints of one rank (nothing is written without --ckpt-dir)."""

    def __init__(self, cfg: CheckpointConfig, rank: int, meta: dict[str, Any],
                 state: Callable[[], dict[str, Any]], step: Callable[[], int],
                 state_lock: threading.Lock, outer_steps: bool, log=print,
                 die_at: int = 0, fail_from: int = 0,
                 healthy: Callable[[str], None] | None = None) -> None:
        """`state`: the rank's full training state (live tensors); `step`: its current step;
        `state_lock`: held by the training thread while it changes them; `outer_steps`: DiLoCo
        (the consistent state is the one after the last committed outer step); `die_at`: the
        step whose write kills this rank half-way (--debug-ckpt-die); `fail_from`: writes of
        that step and later fail (--debug-ckpt-fail); `healthy(what)`: raises when a
        communicator the state came through was aborted (a periodic save checks it first: an
        aborted operation's buffers hold garbage)."""
        self.cfg, self.rank, self.meta, self.log = cfg, rank, meta, log
        self.healthy = healthy
        self.state, self.step, self.state_lock = state, step, state_lock
        self.outer_steps, self.die_at = outer_steps, die_at
        self.stop = CheckpointStop(rank, cfg.on_error)
        """A write that failed twice under --on-checkpoint-error stop (modules.train.ckpt_stop)."""
        self.writer: AsyncCheckpointer | None = (
            AsyncCheckpointer(cfg.dir, rank, cfg.keep, debug_hook=self._debug_hook, log=log,
                              on_failure=self._failed if cfg.on_error == "stop" else None)
            if cfg.dir else None)
        """Writes snapshots in the background (None without --ckpt-dir)."""
        if self.writer is not None:
            self.writer.fail_from = fail_from
        self.outer_snapshot: tuple[int, int, dict[str, Any]] | None = None
        """DiLoCo with --ckpt-dir: (step, outer step, state) after the last outer step."""

    def _debug_hook(self, step: int, where: str) -> None:
        if step == self.die_at != 0:
            self.log(f"debug: killing myself while checkpoint step {step} is {where} written")
            os.kill(os.getpid(), signal.SIGKILL)

    def _path(self, step: int) -> Path:
        return step_path(self.cfg.dir, self.rank, step)

    def save(self) -> float:
        """Checkpoint this step (model, optimizers, data position = step, RNG); returns the
        seconds the training thread was blocked (snapshot; the whole write with
        --sync-checkpoints)."""
        assert self.writer is not None and self.cfg.dir
        if self.healthy is not None:
            self.healthy(f"checkpoint of step {self.step()}")
        if self.cfg.sync:
            t0 = time.perf_counter()
            self.writer.flush()
            step = self.step()
            why = self.writer.write_retried(step, self.meta, snapshot(self.state()))
            if why is None:
                self.writer.last_step = step
                prune(self.cfg.dir, self.rank, self.cfg.keep, self.writer.floor)
            else:  # reported, the previous complete step kept; stop or train on
                self.writer.report_failure(step, why)
            return time.perf_counter() - t0
        return self.writer.save(self.step(), self.meta, self.state())

    def _failed(self, step: int, why: str) -> None:
        """--on-checkpoint-error stop: a write failed twice; the heartbeat thread stops every
        rank at its next beat (any thread; the older steps stay, nothing is pruned)."""
        assert self.writer is not None
        self.log(f"error: checkpoint of step {step} failed, also on a retry: {why}; stopping "
                 "every rank")
        self.stop.failed(step, why, self.writer.last_step)

    def at_end(self, store: Any, ranks: list[int], settled: bool = True) -> None:
        """The last use of the store (`settled`: every rank's last save is published there):
        settle a failed last write (CheckpointFailed from `raise_at_end`), prune to keep
        --resume's common step, and say when the ranks' newest complete steps differ or no
        step is on every rank."""
        if self.writer is None:
            return
        with contextlib.suppress(RuntimeError, OSError):  # store gone: raise_at_end says mine
            self.stop.poll(store, ranks)
        floor = self.share_floor(store, ranks, publish=False)
        if self.stop.reason is not None or floor is None:
            return
        if self.writer.last_step is not None:
            self.prune(floor)
        # unsettled (a DiLoCo rank that does not host the store): a slower rank may not have
        # published its last step yet, so only my own shortfall is certain
        if floor != self.writer.last_step and (settled or self.writer.last_step is None):
            self.log(f"warning: checkpoints at the end of the run: {newest_steps(store, ranks)}")

    def raise_at_end(self) -> None:
        """CheckpointFailed when a rank's checkpoint failed (stop policy) and the run ended
        before the heartbeats stopped it; nothing otherwise."""
        if self.stop.reason is not None:
            raise CheckpointFailed(self.stop.reason)
        if self.stop.pending:  # the store did not answer: my own failure, all I know
            raise CheckpointFailed(f"rank {self.rank}'s last checkpoint could not be written "
                                   f"(also on a retry): {self.writer.failures[-1]}"
                                   if self.writer and self.writer.failures else
                                   f"rank {self.rank}'s last checkpoint could not be written")

    @property
    def last_step(self) -> int | None:
        """The newest step this run wrote completely (None: none, or no --ckpt-dir)."""
        return self.writer.last_step if self.writer is not None else None

    def share_floor(self, store: Any, ranks: list[int], publish: bool = True) -> int | None:
        """Publish my newest complete step in the store and keep the oldest such step over
        `ranks` from being pruned (checkpoint.shared_floor): --resume finds a common step."""
        assert self.writer is not None
        if publish and self.stop.pending:  # my failed write, for the others' end of run
            with contextlib.suppress(RuntimeError, OSError):
                self.stop.poll(store, ranks)
        floor = shared_floor(store, self.rank, ranks, self.writer.last_step, publish)
        if floor is not None:
            self.writer.floor = floor
        return floor

    def prune(self, floor: int) -> None:
        """Keep the newest --keep-checkpoints steps, and every step at or above `floor`."""
        prune(self.cfg.dir, self.rank, self.cfg.keep, floor)

    def keep_outer(self, outer_count: int) -> None:
        """DiLoCo: keep the state right after outer step `outer_count` (called on the only
        thread that changes the state, at the same round's end on every rank; with overlap the
        rounds in flight are in it as sent, and resume redoes them)."""
        if self.writer is not None:
            self.outer_snapshot = (self.step(), outer_count, snapshot(self.state()))

    def flush(self) -> None:
        """Wait for the write in flight."""
        if self.writer is not None:
            self.writer.flush()

    # -- resume ----------------------------------------------------------------------------
    def agree_resume_step(self, world: Communicator) -> int:
        """The newest step with a complete checkpoint on every rank (all ranks agree)."""
        mine = complete_steps(self.cfg.dir, self.rank)
        cand = mine[-1] if mine else -1
        while True:
            cand = agree_int(world, cand, "min", "agreeing on the checkpoint step with every rank")
            if cand < 0:
                raise UserError(f"--resume: no step has a complete checkpoint on every rank in "
                                f"{self.cfg.dir} (rank {self.rank} has steps {mine}); "
                                "run without --resume to start fresh")
            if agree_int(world, int(cand in mine), "min", "agreeing on the checkpoint step") == 1:
                return cand
            older = [s for s in mine if s < cand]
            cand = older[-1] if older else -1

    def load(self, world: Communicator, restore: Callable[[dict[str, Any]], None]) -> None:
        """Give `restore` the newest checkpoint that every rank has completely written
        (UserError naming the file when it does not fit this stage)."""
        step = self.agree_resume_step(world)
        note = fallback_note(self.cfg.dir, self.rank, step)
        if note:
            self.log(note)
        path = self._path(step)
        state = load_checkpoint(path, self.meta)
        try:
            restore(state)
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            raise UserError(f"checkpoint {path}: does not fit this stage "
                            f"({str(e).splitlines()[0]})") from None
        if self.step() != step:
            raise UserError(f"checkpoint {path}: holds step {self.step()}, not {step}")
        if self.writer is not None and self.writer.last_step is None:
            self.writer.last_step = step  # on disk: published as my newest, no resave needed

    # -- failures --------------------------------------------------------------------------
    def save_diverged(self, reason: str) -> str:
        """Save the last finite state (the step before the divergence) and say where."""
        if self.writer is None or not self.cfg.dir:
            return f"{reason}; no --ckpt-dir, nothing saved"
        self.writer.flush()
        step = self.step()
        path = self._path(step)
        if self.writer.last_step != step:
            save_checkpoint(path, self.meta, snapshot(self.state()))
        return f"{reason}; the last finite state (step {step}) is in {path}"

    def emergency(self) -> str:
        """Finish the write in flight, then save the last consistent state: in DiLoCo the one
        right after the last committed outer step (the same step on every rank, so --resume
        agrees on it); in allreduce the current one if the training thread is not inside an
        update (it is usually blocked waiting on the lost peer). Any thread."""
        if self.writer is None or not self.cfg.dir:
            return ""
        if not self.writer.flush(timeout=2.0):
            return "checkpoint: the background write did not finish within 2 s"
        if self.outer_steps:
            return self._save_outer_snapshot()
        if not self.state_lock.acquire(timeout=1.0):
            return self._newest()
        # keep the lock: the training thread must not change the state while it is saved
        step = self.step()
        if step == 0 or self.writer.last_step == step:
            return f"checkpoint: step {step} is already on disk"
        path = self._path(step)
        save_checkpoint(path, self.meta, snapshot(self.state()))
        return f"checkpoint: saved step {step} to {path}"

    def _newest(self) -> str:
        last = self.writer.last_step if self.writer is not None else None
        return (f"checkpoint: newest complete one is step {last}" if last is not None
                else "checkpoint: none written yet")

    def _save_outer_snapshot(self) -> str:
        """DiLoCo: write the state kept at the last committed outer step (unless this run's
        periodic checkpoint already did). A rank that was inside an outer step's commit when
        the store vanished keeps the previous one; --resume then agrees on an older step that
        every rank has."""
        kept = self.outer_snapshot
        if kept is None:
            return self._newest()
        step, outer, snap = kept
        path = self._path(step)
        assert self.writer is not None
        if self.writer.last_step != step:  # not written by this run's periodic checkpoint
            save_checkpoint(path, self.meta, snap)
        newest = max(step, self.writer.last_step or 0)
        return (f"checkpoint: newest complete one is step {newest}; step {step} (right after "
                f"outer step {outer}, which every member averaged) is in {path}")
