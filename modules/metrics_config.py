"""--tracker, --metrics, --run-dir, --peak-tflops, --wandb-mode: where a run's per-step metrics
go (modules.config's RunConfig holds a MetricsConfig; the flags are declared like every other
setting), and the package each tracker needs."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from formats.errors import UserError
from formats.run_metrics import METRICS_NAME
from formats.settings import check, flag_of, setting

TRACKERS = ("jsonl", "tensorboard", "wandb")
"""Where per-step metrics can go (modules/train/tracking.py has one class per tracker)."""
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""The package each tracker needs (import name = pip name)."""
TRACKER_EXTRAS = {"tensorboard": "track", "wandb": "wandb"}
"""The setup.py extra that installs it (scripts/setup_env.sh installs `track`)."""


def _installed(package: str) -> bool:
    """Whether `package` can be imported (without importing it)."""
    if package in sys.modules:
        return sys.modules[package] is not None  # None: blocked, as a test does
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def missing_tracker_package(name: str) -> UserError:
    """The error of a tracker whose package is not installed: what to install."""
    pkg = TRACKER_PACKAGES[name]
    return UserError(f"--tracker {name}: the {pkg!r} package is not installed; install it with "
                     f"`pip install {pkg}` (or `pip install -e .[{TRACKER_EXTRAS[name]}]`), or "
                     f"leave {name} out of --tracker")


@dataclass(frozen=True)
class MetricsConfig:
    """Per-step metrics records, the run folder and the trackers."""

    metrics: str | None = None
    """metrics file, e.g. m.jsonl (replica r>0 writes m.r{r}.jsonl; default with --run-dir:
    RUN_DIR/metrics.jsonl)"""
    peak_tflops: float | None = setting(None, lo=0.0, lo_open=True)
    """this device's peak TFLOP/s for the MFU figure (default: the plan's cluster entry when
    --cluster is given; no MFU otherwise)"""
    run_dir: str | None = None
    """folder for this run's records: metrics.jsonl per replica, ranks/rank{R}.jsonl (every
    rank's compute and communication time per step, what `scheduler.py explain` reads), a copy
    of the plan, and the tensorboard/ and wandb/ logs"""
    tracker: str = "jsonl"
    """comma-separated trackers of the per-step metrics: jsonl (the --metrics file),
    tensorboard (RUN_DIR/tensorboard; needs the tensorboard package), wandb (RUN_DIR/wandb,
    offline unless --wandb-mode or $WANDB_MODE says online; needs the wandb package)"""
    wandb_mode: str | None = setting(None, choices=("offline", "online"))
    """wandb: offline (default: nothing leaves the machine; `wandb sync` uploads later) or
    online (default: $WANDB_MODE when set)"""

    def __post_init__(self) -> None:
        check(self, flag_of)
        if self.run_dir is not None and not self.run_dir.strip():
            raise UserError(f"--run-dir: must name a folder, got {self.run_dir!r}; leave it out "
                            "for no run folder")
        object.__setattr__(self, "_trackers", self._parse_trackers())  # parsed once

    def trackers(self) -> tuple[str, ...]:
        """The --tracker names (parsed and checked once, when the config is made)."""
        return self._trackers  # type: ignore[attr-defined]

    def _parse_trackers(self) -> tuple[str, ...]:
        """The --tracker names, checked (UserError naming the flag)."""
        items = [t.strip() for t in self.tracker.split(",")]
        names = tuple(dict.fromkeys(items))
        bad = [t for t in names if t not in TRACKERS]
        if bad or len(names) < len(items):  # an unknown, empty or repeated name: a typo
            raise UserError(f"--tracker: expected comma-separated names out of "
                            f"{', '.join(TRACKERS)}, each once, got {self.tracker!r}")
        if set(names) - {"jsonl"} and not self.run_dir:
            raise UserError(f"--tracker {self.tracker}: tensorboard and wandb write into the "
                            "run folder; give --run-dir DIR")
        return names

    def check_packages(self) -> None:
        """UserError (exit 2) naming what to install when a tracker's package is missing."""
        for name in self.trackers():
            pkg = TRACKER_PACKAGES.get(name)
            if pkg is not None and not _installed(pkg):
                raise missing_tracker_package(name)

    def metrics_path(self) -> str | None:
        """The jsonl metrics file of replica 0 (None: no jsonl file)."""
        if "jsonl" not in self.trackers():
            return None
        if self.metrics is None and self.run_dir:
            return str(Path(self.run_dir) / METRICS_NAME)
        return self.metrics
