"""The run folder (`dist_runner.py --run-dir DIR`) and the records in it, shared by the runtime
that writes them (modules/train/metrics.py, modules/train/tracking.py) and the tools that read them
(`scheduler.py explain`, scripts/plot_run.py).

    DIR/metrics.jsonl          replica 0's per-step records (the last stage writes them);
    DIR/metrics.r{r}.jsonl     replica r > 0's
    DIR/ranks/rank{R}.jsonl    every rank's own timing per step (RANK_FIELDS)
    DIR/plan.json              the plan the run trained (a copy)
    DIR/cluster.json           the --cluster file it was checked against (a copy, if given)
    DIR/tensorboard/, DIR/wandb/   the other trackers' logs (--tracker)

Every file is JSON lines, one object per step; a line cut off by a crash is skipped.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from formats.errors import UserError
from formats.safe_open import read_bytes

METRICS_NAME = "metrics.jsonl"
RANKS_DIR = "ranks"
PLAN_NAME = "plan.json"
CLUSTER_NAME = "cluster.json"
MAX_JSONL_BYTES = 1 << 30
MAX_RECORD_VALUE = 1e15
"""Largest number a record field may hold to be read (seconds, bytes, tokens, loss): beyond it a
value is damage, and 1e308 turns means into inf and plot axes into errors."""
MAX_STEP = 10 ** 12
"""Largest step number a record may hold (runs are bounded to 1e9 steps)."""
"""Largest metrics or timing file read (a record a step of ~300 bytes: millions of steps)."""
"""The --cluster file of the run (a copy, when dist_runner was given one)."""
RANK_FIELDS = ("step", "rank", "replica", "stage", "step_s", "compute_s", "comm_s", "pp_wait_s",
               "fsdp_s", "bytes_sent", "dp_bytes_sent", "wall_time")
"""What a per-rank timing record holds: seconds of the step, of compute (step_s - comm_s -
fsdp_s), of waiting on communication (comm_s) and of that the pipeline's share (pp_wait_s),
inside FSDP2's collectives (fsdp_s, shard groups only), bytes sent."""
_REPLICA_FILE = re.compile(r"^(?P<stem>.+?)(?:\.r(?P<r>\d+))?\.jsonl$")
_RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")


def replica_metrics_path(path: str | Path, replica: int) -> Path:
    """PATH for replica 0; PATH with `.r{r}` before the suffix for replica r > 0."""
    path = Path(path)
    if replica == 0:
        return path
    return path.with_name(f"{path.stem}.r{replica}{path.suffix}")


def rank_timing_path(run_dir: str | Path, rank: int) -> Path:
    """Where rank `rank` writes its timing records."""
    return Path(run_dir) / RANKS_DIR / f"rank{rank}.jsonl"


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file (a line cut off by a crash, nested too deep, or
    not an object, is skipped); UserError when it cannot be read."""
    text = read_bytes(path, "run file", MAX_JSONL_BYTES).decode("utf-8", errors="replace")
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested too deep to parse
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


@dataclass
class RunRecords:
    """What a run folder holds."""

    run_dir: Path
    replicas: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    """Per replica, its per-step metrics records (from the replica's last stage)."""
    ranks: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    """Per rank (device id), its timing records."""
    plan_path: Path | None = None
    """The plan copy, when the run wrote one."""


def replica_files(run_dir: Path) -> dict[int, Path]:
    """{replica: metrics file} of a run folder (metrics.jsonl, metrics.r{r}.jsonl)."""
    out = {}
    for p in sorted(run_dir.glob("metrics*.jsonl")):
        m = _REPLICA_FILE.match(p.name)
        if m and m["stem"] == "metrics":
            out[int(m["r"] or 0)] = p
    return out


def load_run(run_dir: str | Path, flag: str = "RUN_DIR", need_ranks: bool = False) -> RunRecords:
    """Read a run folder; UserError naming `flag` when it is missing or holds no records."""
    d = Path(run_dir)
    if not d.is_dir():
        raise UserError(f"{flag} {run_dir}: no such folder (give the --run-dir of a run)")
    run = RunRecords(d)
    for r, p in replica_files(d).items():
        recs = [x for x in read_jsonl(p) if has_step(x)]
        if recs:
            run.replicas[r] = recs
    rank_dir = d / RANKS_DIR
    for p in sorted(rank_dir.glob("rank*.jsonl")) if rank_dir.is_dir() else []:
        m = _RANK_FILE.match(p.name)
        recs = [x for x in read_jsonl(p) if has_step(x)] if m else []
        if recs:
            run.ranks[int(m[1])] = recs
    if not run.replicas and not run.ranks:
        raise UserError(f"{flag} {run_dir}: no metrics records ({METRICS_NAME} or "
                        f"{RANKS_DIR}/rank*.jsonl); was the run started with --run-dir?")
    if need_ranks and not run.ranks:
        raise UserError(f"{flag} {run_dir}: no per-rank timing ({RANKS_DIR}/rank*.jsonl); "
                        "rerun with --run-dir, which writes them")
    plan = d / PLAN_NAME
    run.plan_path = plan if plan.is_file() else None
    return run


def number(rec: dict[str, Any], key: str) -> float | None:
    """rec[key] as a float when it is a finite number of at most MAX_RECORD_VALUE, else None
    (also for a JSON integer beyond the float range)."""
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        v = float(v)
    except OverflowError:
        return None
    return v if math.isfinite(v) and abs(v) <= MAX_RECORD_VALUE else None


STATUS_PREFIX = "STATUS "
"""A rank's progress for programs: `STATUS {json}` on its stdout, one line per logged step."""
STATUS_ENV = "SCATTERED_STATUS"
"""Set to 1 in a rank's environment to make it print status lines (scripts/launch_local.py does;
a launcher started with it set passes its ranks' status lines on to its own stdout)."""
STATUS_FIELDS = ("step", "steps", "loss", "tokens_per_s", "step_s", "comm_s")
"""What a status line holds: the step reached of the run's total, its loss, tokens per second,
and the step's seconds (of them waiting on communication)."""


def status_line(record: dict[str, Any]) -> str:
    """The status line of a step's metrics record (plus `steps`, the run's total)."""
    return STATUS_PREFIX + json.dumps({k: record[k] for k in STATUS_FIELDS if k in record},
                                      separators=(",", ":"))


def parse_status(line: str) -> dict[str, Any] | None:
    """The record of a status line (anything before `STATUS ` is ignored: a rank prefix), or
    None when the line is not one."""
    at = line.find(STATUS_PREFIX)
    if at < 0:
        return None
    try:
        rec = json.loads(line[at + len(STATUS_PREFIX):])
    except (ValueError, RecursionError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("step"), int) else None


def format_status(rec: dict[str, Any]) -> str:
    """`step 5/10 loss 2.3456 tok/s 1234`: a status record for people."""
    loss, tok = number(rec, "loss"), number(rec, "tokens_per_s")
    return (f"step {rec.get('step')}/{rec.get('steps', '?')} loss "
            f"{'nan' if loss is None else f'{loss:.4f}'} tok/s "
            f"{'?' if tok is None else f'{tok:.0f}'}")


def has_step(rec: dict[str, Any]) -> bool:
    """Whether a record names its step: an integer in [0, MAX_STEP]."""
    step = rec.get("step")
    return isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= MAX_STEP
