"""Every path a rank will write, checked before the rendezvous.

RunConfig.check_paths checks the flags' own paths (--metrics, --run-dir, --ckpt-dir); the
files and folders a rank makes under them (run/ranks/rank{R}.jsonl, the replica's
metrics.r{r}.jsonl, ckpt/rank{R}/) depend on where the rank sits in the plan. A file or a
folder in the way there, a dangling symlink, a name too long or a full device would otherwise
show only after every rank has joined, as a traceback on one rank and a timeout on the others.
Nothing is created here.
"""

from __future__ import annotations

from pathlib import Path

from formats.atomic_io import check_output_dir, check_output_path
from formats.run_metrics import PLAN_NAME, RANKS_DIR, rank_timing_path, replica_metrics_path
from modules.config import RunConfig
from modules.control.dist import Topology
from modules.train.checkpoint import rank_dir


def output_paths(cfg: RunConfig, topo: Topology) -> list[tuple[str, Path, bool]]:
    """(flag, path, is a folder) of everything this rank writes."""
    out: list[tuple[str, Path, bool]] = []
    m = cfg.metrics
    if m.run_dir:
        run = Path(m.run_dir)
        out += [("--run-dir", run, True), ("--run-dir", run / RANKS_DIR, True),
                ("--run-dir", rank_timing_path(run, topo.rank), False),
                ("--run-dir", run / PLAN_NAME, False)]
        if "tensorboard" in m.trackers():
            out.append(("--run-dir", run / "tensorboard" / f"replica{topo.replica}", True))
    metrics = m.metrics_path()
    if metrics is not None and topo.is_last:
        flag = "--metrics" if m.metrics is not None else "--run-dir"
        out.append((flag, replica_metrics_path(metrics, topo.replica), False))
    if cfg.ckpt.dir:
        out += [("--ckpt-dir", Path(cfg.ckpt.dir), True),
                ("--ckpt-dir", rank_dir(cfg.ckpt.dir, topo.rank), True)]
    return out


def check_outputs(cfg: RunConfig, topo: Topology) -> None:
    """UserError naming the flag and the path if this rank could not write one of its
    outputs (called before the rendezvous)."""
    for flag, path, is_dir in output_paths(cfg, topo):
        if is_dir:
            check_output_dir(path, flag)
        else:
            check_output_path(path, flag)
