"""Evaluation after a step: the validation loss on the fixed validation set, every --eval-every
steps and at the last, and at it the run's --stop-at-loss decision (modules.train.stopping).
Both run after the step record's wall_time: the lab benchmarks leave them out of their clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from modules.config import RunConfig
from modules.control.dist import Topology
from modules.pipeline.stage import PipelineStage
from modules.shard.runtime import ShardRuntime
from modules.train.stopping import StopAtLoss


class Evaluation:
    """A rank's evaluations and the stop decisions taken at them."""

    def __init__(self, cfg: RunConfig, topo: Topology, model: torch.nn.Module,
                 pipe: PipelineStage, shard: ShardRuntime | None,
                 val: list[tuple[torch.Tensor, torch.Tensor]], stopping: StopAtLoss | None,
                 on_store_error: Callable[[RuntimeError], Exception], log=print) -> None:
        """`val`: the validation batches on the device (empty: no evaluation); `stopping`:
        --stop-at-loss (None without the flag); `on_store_error`: the error to end the run with
        when the store is gone during a decision."""
        self.cfg, self.topo, self.model, self.pipe, self.shard = cfg, topo, model, pipe, shard
        self.val, self.stopping, self.on_store_error, self.log = val, stopping, on_store_error, log

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

    def after_step(self, step: int, rec: dict[str, Any], decider: int) -> bool:
        """Evaluate after step `step` when due (every --eval-every steps and the last); True when
        the run ends after it: the step is --steps, or --stop-at-loss stops every rank here
        (`decider`: the replica whose reporting rank decides, the lowest live one)."""
        last, every = step == self.cfg.steps, self.cfg.data.eval_every
        if not self.val or not ((every and step % every == 0) or last):
            return last
        self._evaluate_into(rec)
        if not last and self._should_stop(step, rec, decider):
            rec["stopped_at_loss"] = True
            return True
        return last

    def _should_stop(self, step: int, rec: dict[str, Any], decider: int) -> bool:
        """--stop-at-loss: the run's one decision at this evaluation (the reporting rank of the
        lowest live replica decides from its validation loss; modules.train.stopping); its
        wait is in `stop_check_s` (after the record's wall_time, like an evaluation)."""
        stopping = self.stopping
        if stopping is None or not stopping.due(step):
            return False
        t0, topo = time.perf_counter(), self.topo
        try:
            if topo.reports and topo.replica == decider:
                decision = stopping.decide(step, rec.get("val_loss"), topo.replica)
            else:
                decision = stopping.follow(step, decider)
        except RuntimeError as e:  # the store itself is gone
            raise self.on_store_error(e) from None
        rec["stop_check_s"] = round(time.perf_counter() - t0, 6)
        if decision.stop:
            self.log(stopping.stop_line(step, decision))
        return decision.stop

    def _evaluate_into(self, rec: dict[str, Any]) -> None:
        """The validation loss into this step's record, and the evaluation's time."""
        t0 = time.perf_counter()
        val = self.evaluate()
        if val is not None:
            rec["val_loss"] = val
        rec["eval_s"] = round(time.perf_counter() - t0, 6)
