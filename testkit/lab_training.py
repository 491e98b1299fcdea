"""Training a lab row: a plan's ranks launched on the lab's network for some steps, and the
equal-wall-time sequence of a row after the allreduce one (budget, stop at its loss, resume)."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

from formats.errors import UserError
from formats.plan import load_plan
from formats.run_metrics import METRICS_NAME, STATUS_ENV, STATUS_PREFIX, format_status, parse_status
from testkit.lab import PY, ROOT, Run, log
from testkit.lab_metrics import read_metrics, seconds_to_loss, step_records
from testkit.lab_network import Network

LAB_HEARTBEAT_TIMEOUT_S = 30.0
"""--heartbeat-timeout-s of the lab's ranks (the runtime's default: 5 s). Eight ranks and eight
userspace delay lines share 2 cores here, and a heartbeat crosses a delay line starved of CPU:
the demo's 1 x 8 row once lost a live rank to a 5 s gap at load 3 (2026-11-26). The benchmarks
measure speed, not failure detection (tests/test_fault_elastic.py and the kill trials do)."""


def train(run: Run, net: Network, steps: int, out: Path, extra: list[str] = (),
          checkpoint: bool = False, resume: bool = False) -> Path:
    """Run the plan's ranks for `steps` steps (dist_runner flags `extra` added); fill in the
    wire bytes per step (not when resuming: those of the first launch stay); returns replica
    0's metrics file. `checkpoint`: every rank saves at the end (what `resume` continues from,
    bit-identically: train_on)."""
    run_dir = out / run.plan_path.stem
    if not resume:
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
    metrics = run_dir / METRICS_NAME  # what --run-dir writes for replica 0
    what = f"on to step {steps}" if resume else f"{steps} steps"
    log(f"training {run.name}: {what} (predicted {run.predicted_s:.3f} s/step)")
    before, cpu_before = net.wire_bytes(), net.emulation_cpu_s()
    ckpt = ["--ckpt-dir", str(run_dir / "ckpt")] if checkpoint or resume else []
    cmd = [PY, str(ROOT / "scripts/launch_local.py"), "--plan", str(run.plan_path),
           *net.launch_args(), "--", "--steps", str(steps), "--threads", "1",
           "--run-dir", str(run_dir),  # metrics.jsonl and the per-rank timings
           "--log-every", str(max(1, steps // 5)),
           "--timeout-s", "120", "--heartbeat-timeout-s", str(LAB_HEARTBEAT_TIMEOUT_S),
           *ckpt, *(["--resume"] if resume else []), *extra]
    with open(run_dir / "launch.log", "w") as logf:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, STATUS_ENV: "1"})  # pass status lines on
        for line in proc.stdout:
            logf.write(line)
            status = parse_status(line)
            if status is not None:
                print(f"    {line.split(STATUS_PREFIX)[0]}{format_status(status)}", flush=True)
            elif line.startswith("launch:") and " pid " not in line:
                print(f"    {line.rstrip()}", flush=True)
        if proc.wait() != 0:
            raise UserError(f"{run.name}: launch_local.py exited {proc.returncode}; "
                            f"see {run_dir / 'launch.log'}")
    trained = step_records(metrics)
    if trained < steps:  # --stop-at-loss (stop_flags) ended it at an evaluation
        log(f"  {run.name}: stopped after step {trained} of {steps} (--stop-at-loss: reached "
            "the target)")
    if not resume:
        run.wire_bytes_per_step = (net.wire_bytes() - before) / trained
        run.emulation_cpu_s_per_step = (net.emulation_cpu_s() - cpu_before) / trained
        if run.emulation_cpu_s_per_step:
            log(f"  the delay lines used {run.emulation_cpu_s_per_step:.3f} CPU s a step "
                "(link emulation, not in the model)")
    return metrics


def stop_flags(target: float | None, measured_steps: int) -> list[str]:
    """dist_runner flags that end a row once its validation loss reached `target` (the
    allreduce row's final one) at an evaluation at or after step `measured_steps` (the
    equal-steps columns need those steps): --stop-at-loss, --min-steps; none without a
    target. The loss is written as repr: the runtime compares the same float."""
    if target is None:
        return []
    return ["--stop-at-loss", repr(target), "--min-steps", str(measured_steps)]


BUDGET_MARGIN = 1.1
"""budget_steps plans this much more than the budget over the predicted s/step (the lab's
predictions were measured within about 10% on a quiet machine; train_on covers the rest)."""
BUDGET_COVERED = 0.97
"""train_on stops extending a run once it trained this share of the budget (a relaunch costs
more than the last few steps would tell)."""
MAX_EXTENSIONS = 2
"""train_on's relaunches per run at most (the first usually covers the budget)."""


def budget_steps(run: Run, budget_s: float | None, steps: int, round_steps: int = 1,
                 eval_every: int = 0) -> int:
    """Steps to launch `run` with so that it likely trains `budget_s` training seconds in one
    launch (a relaunch costs a fresh start): the budget over its predicted s/step with
    BUDGET_MARGIN, at least `steps`, rounded up to whole rounds of `round_steps`. Just `steps`
    when a longer launch would not evaluate at step `steps` (not a multiple of `eval_every`):
    the equal-steps loss needs that evaluation (train_on relaunches for the rest)."""
    if not (budget_s and run.predicted_s > 0 and eval_every and steps % eval_every == 0):
        return steps
    want = math.ceil(budget_s * BUDGET_MARGIN / run.predicted_s)
    return max(steps, -(-want // round_steps) * round_steps)


def train_on(run: Run, net: Network, out: Path, extra: list[str], target: float | None,
             budget_s: float, warmup_steps: int, measured_steps: int) -> None:
    """Equal wall time: resume `run` (trained by `train(..., checkpoint=True)`) from its last
    checkpoint and train it on until it has trained `budget_s` training seconds, unless its
    validation loss already reached `target`. Steps to add: the budget left over the run's
    measured s/step, plus one (the relaunch's first step is slower). The steps before
    `measured_steps` keep the equal-steps columns; resuming is bit-identical to having
    trained that many steps in one launch (constant learning rate; the plan's warm-up W is
    a step count, unchanged by a longer run)."""
    for _ in range(MAX_EXTENSIONS):
        left = budget_s - run.trained_s
        if (target is None or seconds_to_loss(run, target) is not None
                or left <= budget_s * (1 - BUDGET_COVERED) or run.measured_s <= 0):
            return
        more = int(np.ceil(left / run.measured_s)) + 1
        log(f"  {run.name}: allreduce's loss not reached in {run.trained_s:.1f} s: "
            f"{more} more steps for its {budget_s:.1f} s")
        run.resumed_at.append(run.steps_trained)
        metrics = train(run, net, run.steps_trained + more, out, extra, resume=True)
        read_metrics(run, metrics, warmup_steps, measured_steps)


def train_row(run: Run, net: Network, out: Path, extra: list[str], steps: int,
              warmup_steps: int, eval_every: int, base: Run | None = None) -> None:
    """One benchmark row: `steps` steps (the equal-steps columns), read (read_metrics). After
    `base` (the allreduce row, trained first): launched for base's training seconds
    (budget_steps), stopped once at base's final validation loss from step `steps` on
    (stop_flags), resumed for the rest of the budget if it fell short (train_on)."""
    round_steps = load_plan(run.plan_path).sync.inner_steps
    launched = budget_steps(run, base and base.trained_s, steps, round_steps, eval_every)
    if base is not None:
        extra = [*extra, *stop_flags(base.final_val_loss, steps)]
    read_metrics(run, train(run, net, launched, out, extra, checkpoint=base is not None),
                 warmup_steps, steps)
    if base is not None:
        train_on(run, net, out, extra, base.final_val_loss, base.trained_s, warmup_steps, steps)
