"""Where per-step metrics go (`--tracker jsonl,tensorboard,wandb`): one `Tracker` protocol, one
class per backend, and `open_trackers`, the one call the Trainer makes.

jsonl is the metrics file (every field of the record); tensorboard and wandb get the scalars of
SCALARS that a record has, against the step. wandb runs offline unless the user asked for
online (--wandb-mode online, or $WANDB_MODE): by default nothing leaves the machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from formats.plan import Plan, save_plan
from formats.run_metrics import PLAN_NAME, RANK_FIELDS, rank_timing_path
from modules.metrics_config import MetricsConfig, missing_tracker_package
from modules.train.metrics import MetricsWriter, replica_metrics_path

SCALARS = ("loss", "val_loss", "tokens", "tokens_per_s", "mfu", "step_s", "compute_s", "comm_s",
           "fsdp_s", "bytes_sent", "dp_bytes_sent", "outer_step", "live_replicas")
"""The numeric fields of a metrics record that tensorboard and wandb plot."""


class Tracker(Protocol):
    """Takes one metrics record per step."""

    def log(self, record: dict[str, Any]) -> None:
        """Record one step's metrics (`record["step"]` is the step)."""
        ...

    def close(self) -> None:
        """Flush and close."""
        ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The plottable numbers of a record (None and non-numbers left out)."""
    return {k: float(record[k]) for k in SCALARS
            if isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool)}


class JsonlTracker:
    """The metrics file: every field, one JSON line per step."""

    def __init__(self, path: str | Path, resume_step: int | None) -> None:
        self.writer = MetricsWriter(path, resume_step)

    def log(self, record: dict[str, Any]) -> None:
        """Append the record."""
        self.writer.write(record)

    def close(self) -> None:
        """Close the file."""
        self.writer.close()


class TensorBoardTracker:
    """torch.utils.tensorboard event files in RUN_DIR/tensorboard/replica{r}."""

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise missing_tracker_package("tensorboard") from None
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, record: dict[str, Any]) -> None:
        """One scalar per field, at the record's step."""
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, global_step=int(record["step"]))

    def close(self) -> None:
        """Flush the event file."""
        self.writer.flush()
        self.writer.close()


def wandb_mode(cfg: MetricsConfig) -> str:
    """--wandb-mode, else $WANDB_MODE, else offline."""
    return cfg.wandb_mode or os.environ.get("WANDB_MODE") or "offline"


class WandbTracker:
    """One wandb run per replica, offline by default (files in RUN_DIR/wandb)."""

    def __init__(self, cfg: MetricsConfig, replica: int, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise missing_tracker_package("wandb") from None
        run_dir = Path(cfg.run_dir or ".")
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "scattered-train"),
                              dir=str(run_dir), mode=wandb_mode(cfg),
                              group=run_dir.resolve().name, name=f"replica{replica}",
                              config=config)

    def log(self, record: dict[str, Any]) -> None:
        """The record's scalars at its step."""
        self.run.log(scalars(record), step=int(record["step"]))

    def close(self) -> None:
        """Finish the run (offline: its files stay in RUN_DIR/wandb)."""
        self.run.finish()


class Trackers:
    """Every tracker of a rank, fed the same records."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log(self, record: dict[str, Any]) -> None:
        """Give the record to each tracker."""
        for t in self.trackers:
            t.log(record)

    def close(self) -> None:
        """Close each tracker."""
        for t in self.trackers:
            t.close()


def open_trackers(cfg: MetricsConfig, replica: int, resume_step: int | None,
                  run_config: dict[str, Any] | None = None) -> Trackers:
    """The trackers of --tracker for a replica's metrics (its last stage calls this)."""
    out: list[Tracker] = []
    for name in cfg.trackers():
        if name == "jsonl":
            path = cfg.metrics_path()
            if path is not None:
                out.append(JsonlTracker(replica_metrics_path(path, replica), resume_step))
        elif name == "tensorboard":
            out.append(TensorBoardTracker(Path(cfg.run_dir or ".") / "tensorboard"
                                          / f"replica{replica}"))
        elif name == "wandb":
            out.append(WandbTracker(cfg, replica, run_config or {}))
    return Trackers(out)


class RankTiming:
    """This rank's timing records in RUN_DIR/ranks/rank{R}.jsonl (what `explain` reads)."""

    def __init__(self, run_dir: str | Path, rank: int, resume_step: int | None) -> None:
        self.writer = MetricsWriter(rank_timing_path(run_dir, rank), resume_step)

    def log(self, record: dict[str, Any]) -> None:
        """Keep the RANK_FIELDS of a step's record."""
        self.writer.write({k: record[k] for k in RANK_FIELDS if k in record})

    def close(self) -> None:
        """Close the file."""
        self.writer.close()


def open_rank_timing(cfg: MetricsConfig, rank: int, plan: Plan,
                     resume_step: int | None) -> RankTiming | None:
    """With --run-dir: copy the plan there and open this rank's timing file (else None)."""
    if not cfg.run_dir:
        return None
    save_plan(plan, Path(cfg.run_dir) / PLAN_NAME)  # atomic: every rank may write it
    return RankTiming(cfg.run_dir, rank, resume_step)
