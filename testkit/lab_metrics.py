"""What a lab run measured, read from its metrics files: step time, tokens/s, DP bytes, losses,
and the training clock they are timed on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from formats.errors import UserError
from formats.plan import load_plan
from formats.run_metrics import replica_metrics_path
from testkit.lab import Run, log


def step_records(path: Path) -> int:
    """The step records in a metrics file (steps trained, over every launch it holds)."""
    return len(step_records_of(path))


def read_metrics(run: Run, path: Path, warmup_steps: int, measured_steps: int | None = None
                 ) -> None:
    """From replica 0's metrics: the measured step time and tokens/s over every whole outer
    round of the run's first launch after the warm-up and the plan's W (rounded up to a
    round; more than the first `measured_steps` steps: one round of H = 8 is too few to judge
    a prediction by, and a DiLoCo row reaches its steady step only after its first rounds),
    DP bytes, and the final validation loss at `measured_steps` (None: the last; train_on's
    extension past them only adds to the losses, val_losses and trained_s)."""
    recs = step_records_of(path)
    clock = run_clock(recs, path, run.resumed_at)
    run.trained_s, run.steps_trained = (clock[-1] if clock else 0.0), len(recs)
    run.losses = [(t, r["loss"]) for t, r in zip(clock, recs)]
    run.val_losses = [(t, r["val_loss"]) for t, r in zip(clock, recs)
                      if r.get("val_loss") is not None]
    if measured_steps and len(recs) < measured_steps:  # not with stop_flags' --min-steps
        log(f"  note: {run.name} trained {len(recs)} steps, fewer than the {measured_steps} "
            "of the equal-steps loss: its loss ratio is that of its last evaluation")
    launch = recs[:run.resumed_at[0]] if run.resumed_at else recs  # one launch: one clock
    sync = load_plan(run.plan_path).sync  # its all-reduce warm-up W is not the predicted step
    round_steps, skip = sync.inner_steps, max(warmup_steps, sync.warmup_steps)
    first = -(-skip // round_steps) * round_steps
    last = len(launch) - (len(launch) - first) % round_steps  # whole DiLoCo rounds
    if last - first < 1:
        raise UserError(f"{len(launch)} steps leave no measured steps after {first} warm-up "
                        "steps")
    span = clock[last - 1] - (clock[first - 1] if first else 0.0)
    run.measured_s = span / (last - first)
    tokens = sum(r["tokens_per_s"] * r["step_s"] for r in launch[first:last])
    run.tokens_per_s = tokens / span
    run.runtime_dp_bytes_per_step = float(np.mean([r["dp_bytes_sent"] for r in recs]))
    equal = recs[:measured_steps] if measured_steps else recs
    vals = [r["val_loss"] for r in equal if r.get("val_loss") is not None]
    run.final_val_loss = vals[-1] if vals else None


def step_records_of(path: Path) -> list[dict[str, Any]]:
    """The step records of a metrics file (not the summaries)."""
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in recs if "step_s" in r]


def run_clock(recs: list[dict[str, Any]], path: Path, resumed_at: list[int] = ()
              ) -> list[float]:
    """The run's training clock at each of `recs`' steps (replica 0's, metrics file `path`):
    that of its slowest replica (the run goes at its pace), with each evaluation's seconds the
    slowest replica's (the run loses that much: a replica that evaluates sooner waits it out at
    its next blocking sync). Replicas' metrics files sit beside `path`; one that left or joined
    is not compared. Measured on the lab (bad_network's rows, 2026-11-26): replica 0 of the
    blocking DiLoCo row waited 0.035 s a step for replicas 1-2's longer evaluations (its own
    clock 0.805 s/step, theirs 0.770; 0.786 with no evaluations at all), while in the overlapped
    rows replica 0 ran ahead of replicas 1-2 (0.497 s/step vs 0.54-0.55: their pipeline links
    are slower, and an overlapped round does not wait for a laggard within a short run)."""
    steps = [r["step"] for r in recs]
    replicas = [recs]
    k = 1
    while (other := replica_metrics_path(path, k)).exists():
        theirs = step_records_of(other)
        if [r["step"] for r in theirs] == steps:
            replicas.append(theirs)
        k += 1
    slowest: dict[int, float] = {}
    for rep in replicas:
        for r in rep:
            if r.get("eval_s"):
                slowest[r["step"]] = max(slowest.get(r["step"], 0.0), r["eval_s"])
    clocks = [training_clock([r | {"eval_s": slowest[r["step"]]} if r["step"] in slowest else r
                              for r in rep], resumed_at) for rep in replicas]
    return max(clocks, key=lambda c: c[-1] if c else 0.0)


def training_clock(recs: list[dict[str, Any]], resumed_at: list[int] = ()) -> list[float]:
    """Training seconds at the end of each step record: wall time since its launch's first
    step began, less the evaluations and --stop-at-loss checks (both run after their record's
    wall_time: the check is the benchmark's own, a store round trip to the deciding replica,
    0.2-1 s each on the loaded lab) before it in that launch, plus what the launches before it
    trained; a launch begins at the first record and after each step of `resumed_at` (the
    relaunch's gap left out)."""
    out: list[float] = []
    start = evals = 0.0
    for i, r in enumerate(recs):
        if i == 0 or r["step"] - 1 in resumed_at:
            start, evals = r["wall_time"] - r["step_s"] - (out[-1] if out else 0.0), 0.0
        out.append(r["wall_time"] - start - evals)
        evals += r.get("eval_s", 0.0) + r.get("stop_check_s", 0.0)
    return out


def seconds_to_loss(run: Run, target: float | None) -> float | None:
    """Training seconds until replica 0's validation loss first reached `target` (at an
    evaluation; evaluations' own time left out); None when it never did or nothing to reach."""
    if target is None:
        return None
    return next((t for t, v in run.val_losses if v <= target), None)
