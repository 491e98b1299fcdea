"""What a rank reports of its steps: each step's metrics record (see docs/formats.md), the
progress line, and the writers the records go to (the replica's trackers, the rank's timing
file)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from formats.plan import Plan
from formats.run_metrics import STATUS_ENV, status_line
from modules.comm import CommStats
from modules.config import RunConfig
from modules.control.dist import Topology
from modules.device.mfu import mfu
from modules.pipeline.stage import PipelineStage
from modules.shard.runtime import ShardRuntime
from modules.train.outer_sync import OuterSync
from modules.train.tracking import open_rank_timing, open_trackers

if TYPE_CHECKING:
    from modules.sync.hivemind_outer import HivemindOuter


@dataclass(frozen=True)
class StepMark:
    """The counters as a step began (what its record subtracts)."""

    t0: float
    wait_s: float
    bytes_sent: int
    fsdp_s: float
    dp_bytes: int
    pipe: Any  # the pipeline's communicator then (None with one stage)
    pp_wait_s: float
    pp_bytes: int


class StepMeter:
    """Measures a rank's steps: the counters before one, its record after, the progress line."""

    def __init__(self, cfg: RunConfig, topo: Topology, stats: CommStats, pipe: PipelineStage,
                 shard: ShardRuntime | None, outer: OuterSync | None,
                 dp_bytes: Callable[[], int], tokens_per_step: int,
                 flops_per_token: float, peak_tflops: float | None, overlapped: bool,
                 live_count: bool, hivemind: HivemindOuter | None = None, log=print) -> None:
        """`dp_bytes`: the rank's data-parallel bytes so far (the outer sync's background
        share adds to them as a record is made); `peak_tflops`: the replica's peak (None: no
        MFU); `overlapped`: sync.overlap's background rounds; `live_count`: records say how
        many replicas are live; `hivemind`: the outer sync's DHT (whose roster says how many
        replicas train)."""
        self.cfg, self.topo, self.stats, self.pipe, self.shard = cfg, topo, stats, pipe, shard
        self.outer, self.tokens_per_step, self.flops_per_token = outer, tokens_per_step, \
            flops_per_token
        self.peak_tflops, self.overlapped, self.live_count, self.log = \
            peak_tflops, overlapped, live_count, log
        self.hivemind, self.dp_bytes = hivemind, dp_bytes
        self.mfu_values: list[float] = []
        """MFU of each measured step (empty without a peak)."""

    def start(self) -> StepMark:
        """The counters now, before a step."""
        self.stats.settle()  # NCCL's spans timed on the stream before this step
        pipe = self.pipe.comm
        return StepMark(time.perf_counter(), self.stats.wait_s, self.stats.bytes_sent,
                        self.shard.clock.seconds if self.shard is not None else 0.0,
                        self.dp_bytes(),
                        pipe, pipe.wait_s if pipe is not None else 0.0, self.pipe.bytes_sent)

    def record(self, mark: StepMark, loss: float | None, *, step: int, tokens: int,
               outer_step: int | None, replicas: int,
               comm: dict[str, str]) -> dict[str, Any]:
        """The step's metrics record: its time split, bytes, throughput and MFU.
        `replicas`: the generation's live replicas; `comm`: the backend of each group."""
        step_s = time.perf_counter() - mark.t0
        bg_bytes, exposed_s = (self.outer.background_share() if self.outer is not None
                               else (0, 0.0))
        comm_s = self.stats.wait_s - mark.wait_s + exposed_s
        fsdp_s = self.shard.clock.seconds - mark.fsdp_s if self.shard is not None else 0.0
        pipe, training = mark.pipe, self._replicas_training(replicas)
        rec = {"step": step, "loss": loss, "tokens": tokens,
               "step_s": round(step_s, 6), "compute_s": round(step_s - comm_s - fsdp_s, 6),
               "comm_s": round(comm_s, 6),
               "bytes_sent": self.stats.bytes_sent - mark.bytes_sent + bg_bytes,
               "dp_bytes_sent": self.dp_bytes() - mark.dp_bytes,  # after background_share
               "pp_bytes_sent": self.pipe.bytes_sent - mark.pp_bytes,
               "outer_step": outer_step,
               "tokens_per_s": round(self.tokens_per_step * training / step_s, 1),
               "replica": self.topo.replica, "wall_time": round(time.time(), 3),
               "rank": self.topo.rank, "stage": self.topo.stage,
               "pp_wait_s": round(pipe.wait_s - mark.pp_wait_s, 6) if pipe is not None else 0.0}
        if self.shard is not None:  # FSDP2's collectives, out of compute_s (not in comm_s)
            rec["fsdp_s"] = round(fsdp_s, 6)
        if self.live_count:
            rec["live_replicas"] = replicas
        if self.overlapped:  # the part of the background sync the step waited for
            rec["outer_wait_s"] = round(exposed_s, 6)
        rec["comm"] = comm or {"all": "gloo"}
        value = mfu(self.tokens_per_step / step_s, self.flops_per_token, self.peak_tflops)
        if value is not None:
            rec["mfu"] = round(value, 6)
            self.mfu_values.append(value)
        return rec

    def _replicas_training(self, live: int) -> int:
        """Replicas whose tokens a step's tokens/s counts: the generation's `live` ones, or with
        hivemind (my replica alone) the DHT roster's live replicas of my stage at the last round."""
        if self.hivemind is None:
            return live
        return len(self.hivemind.live) or self.hivemind.cfg.starting

    def last_background(self, rec: dict[str, Any]) -> None:
        """sync.overlap: the rounds in flight after the last step, counted in its record."""
        assert self.outer is not None
        bg, exposed = self.outer.finish()
        if self.overlapped:
            rec["bytes_sent"] += bg
            rec["dp_bytes_sent"] += bg
            rec["outer_wait_s"] = round(rec.get("outer_wait_s", 0.0) + exposed, 6)

    def progress(self, rec: dict[str, Any], last: bool, first_live: bool) -> None:
        """The progress line of the first live replica's last stage (`first_live`: mine is it),
        every cfg.log_every steps and at the last."""
        step = rec["step"]
        if not first_live or not (step % self.cfg.log_every == 0 or last):
            return
        extra = f" val_loss {rec['val_loss']:.4f}" if "val_loss" in rec else ""
        extra += f" mfu {rec['mfu']:.1%}" if "mfu" in rec else ""
        self.log(f"step {step}/{self.cfg.steps} loss {rec['loss']:.4f} "
                 f"tok/s {rec['tokens_per_s']:.0f} step_s {rec['step_s']:.3f} "
                 f"comm_s {rec['comm_s']:.3f}{extra}")
        if os.environ.get(STATUS_ENV) == "1":  # a launcher reads this line, not the one above
            self.log(status_line({**rec, "step": step, "steps": self.cfg.steps}))


class StepWriters:
    """Where a rank's step records go: its replica's trackers (on the reporting rank only) and,
    with --run-dir, the rank's timing file with the plan as this rank runs it (what explain
    replays)."""

    def __init__(self, cfg: RunConfig, topo: Topology, plan: Plan,
                 resume: int | None) -> None:
        """`resume`: the step a resumed run goes on from (earlier files keep records to it)."""
        writer = open_trackers(cfg.metrics, topo.replica, resume) if topo.reports else None
        timing = open_rank_timing(cfg.metrics, topo.rank, plan, resume)
        self.writers = [w for w in (writer, timing) if w]

    def log(self, rec: dict[str, Any]) -> None:
        """Write one step's record to every writer."""
        for w in self.writers:
            w.log(rec)

    def close(self) -> None:
        """Close every writer."""
        for w in self.writers:
            w.close()
