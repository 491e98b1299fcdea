"""The lab benchmarks' row runner: a benchmark declares its rows (a plan each, in order, the
allreduce row first) and this trains them on one emulated network, every row with the same
flags. The flags every row passes on to its ranks are declared once, in ROW_FLAGS: adding one
there adds it to every lab benchmark's command line and to every row's launch
(benchmarks/end_to_end.py, bad_network.py, hierarchical.py)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from testkit import lab, lab_calibration, lab_network, lab_training
from testkit.lab import Run
from testkit.lab_calibration import LabCalibration
from testkit.lab_network import Network


@dataclass(frozen=True)
class RowFlag:
    """A benchmark flag that every lab row hands to its ranks as dist_runner's flag of the
    same name."""

    flag: str
    default: int
    help: str
    type: Callable[[str], int] = int


ROW_FLAGS = (
    RowFlag("--eval-sequences", 32, "validation sequences of each evaluation (the final loss "
            "and the time to allreduce's final loss)"),
    RowFlag("--eval-every", 5, "validation loss every K steps: the time to allreduce's final "
            "loss (evaluations left out of every timing)"),
)
"""The flags of every lab row (each also a dist_runner.py flag, passed on as given)."""


def add_row_args(p: argparse.ArgumentParser) -> None:
    """The flags every lab benchmark takes for its rows: ROW_FLAGS and the lab's network
    (--no-netns, --mtu)."""
    for f in ROW_FLAGS:
        p.add_argument(f.flag, type=f.type, default=f.default, help=f.help)
    lab_network.add_network_args(p)


def flag_dest(flag: str) -> str:
    """argparse's attribute name of `flag` (`--eval-every` -> `eval_every`)."""
    return flag.lstrip("-").replace("-", "_")


def runner_flags(args: argparse.Namespace, seed_ranks: bool = True) -> list[str]:
    """The dist_runner flags every row trains with: each of ROW_FLAGS with its value, and
    `--seed` (the benchmark's --seed, the data seed too) when `seed_ranks`."""
    out = [x for f in ROW_FLAGS for x in (f.flag, str(getattr(args, flag_dest(f.flag))))]
    return out + (["--seed", str(args.seed)] if seed_ranks else [])


def calibrate(args: argparse.Namespace, scenario: str, cluster_path: Path,
              fsdp: bool = False) -> LabCalibration:
    """The lab's calibration for the benchmark's model and batch (lab_calibration.calibrate_lab),
    made the calibration of every plan the benchmark makes (args.calibration, lab.plan_command)."""
    cal = lab_calibration.calibrate_lab(scenario, args.seed, args.model, args.micro_batch_size,
                                        cluster_path, args.micro_batches, fsdp=fsdp)
    args.calibration = cal.calibration_path
    return cal


@dataclass
class LabRow:
    """One row a benchmark declares: its run (the plan), and its steps when they are not the
    benchmark's --steps (equal tokens for a plan of another width, say)."""

    run: Run
    steps: int | None = None


Counter = Callable[[Network], float]
"""A reading of the lab's network that only grows (bytes some links carried so far)."""


@dataclass
class RowsOutcome:
    """What training the rows told beside the runs themselves."""

    why_not_shaped: str
    """Why the network was not emulated ('' when it was)."""
    per_step: dict[str, dict[str, float]] = field(default_factory=dict)
    """Counter name -> row name -> what it moved per step, over every launch of the row."""


def train_rows(rows: Sequence[Run | LabRow], args: argparse.Namespace, cluster_path: Path,
               out: Path, *, seed_ranks: bool = True,
               counters: dict[str, Counter] | None = None) -> RowsOutcome:
    """Predict every row (lab.predict), bring up the lab's network (args.no_netns, args.mtu),
    train the rows in order and tear the network down, after an error too. The first row (the
    allreduce row) trains its steps alone; every row after it is launched for the first's
    training seconds and stops at its final validation loss, resumed if it fell short
    (lab_training.train_row). Every row gets runner_flags(args, seed_ranks); a row's steps are
    its own or args.steps; args.warmup_steps and args.eval_every set what is measured. `counters`:
    what each moved per step trained, row by row (RowsOutcome.per_step)."""
    rows = [r if isinstance(r, LabRow) else LabRow(r) for r in rows]
    for r in rows:
        lab.predict(r.run, cluster_path)
    counters = counters or {}
    per_step: dict[str, dict[str, float]] = {name: {} for name in counters}
    net = Network(cluster_path, out, not args.no_netns, args.mtu)
    extra = runner_flags(args, seed_ranks)
    base = rows[0].run
    try:
        net.up()
        for r in rows:
            before = {name: read(net) for name, read in counters.items()}
            lab_training.train_row(r.run, net, out, extra,
                                   args.steps if r.steps is None else r.steps,
                                   args.warmup_steps, args.eval_every,
                                   None if r.run is base else base)
            for name, read in counters.items():  # the row may have stopped early: per step
                per_step[name][r.run.name] = (read(net) - before[name]) / r.run.steps_trained
    finally:
        net.down()
    return RowsOutcome(net.reason, per_step)
