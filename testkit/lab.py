"""The emulated lab the end-to-end benchmarks train on: one plan's Run (what was predicted and
what was measured), progress logging, commands, and the plan and prediction steps.

The rest of the lab: lab_calibration.py (the machine's measured speed, the verdicts),
lab_network.py (one network namespace host per device; loopback otherwise, and it says so),
lab_training.py (a plan's ranks launched on it) and lab_metrics.py (what a run measured: step
time, tokens/s, bytes on the wire, losses)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from formats.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


@dataclass
class Run:
    """One plan's run: what was predicted and what was measured."""

    name: str
    plan_path: Path
    predicted_s: float = 0.0
    measured_s: float = 0.0
    tokens_per_s: float = 0.0
    wire_bytes_per_step: float = 0.0
    runtime_dp_bytes_per_step: float = 0.0
    losses: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since the first step, loss) of replica 0."""
    final_val_loss: float | None = None
    """Validation loss at the end of the run (replica 0), when the run evaluated."""
    val_losses: list[tuple[float, float]] = field(default_factory=list)
    """(training seconds since the first step began, evaluations and relaunches left out;
    validation loss) of replica 0 at each evaluation (--eval-every)."""
    trained_s: float = 0.0
    """Training seconds over every step it trained (the same clock as val_losses)."""
    steps_trained: int = 0
    """Steps it trained, extensions (train_on) included."""
    resumed_at: list[int] = field(default_factory=list)
    """Steps at which train_on resumed it (each a new launch: its gap is left out)."""
    emulation_cpu_s_per_step: float = 0.0
    """CPU seconds per step the lab's userspace delay lines used (scripts/delay_line.py, where
    the kernel has no sch_netem): the link emulation's own CPU, on the cores the ranks use and
    not in the performance model (0 with netem or on loopback)."""

    @property
    def error(self) -> float:
        """Relative prediction error."""
        return (self.predicted_s - self.measured_s) / self.measured_s


def log(msg: str, prefix: str = "e2e") -> None:
    """Progress on stdout, flushed (the benchmarks run for minutes)."""
    print(f"{prefix}: {msg}", flush=True)


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """Run a command; UserError with its stderr when it fails."""
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise UserError(f"{' '.join(cmd[:4])} ... failed ({p.returncode}):\n"
                        f"{(p.stderr or p.stdout)[-3000:]}")
    return p


def plan_command(args: Any, cluster_path: Path, out: Path, *extra: str) -> list[str]:
    """`scheduler.py plan` for a benchmark's cluster: the CPU runtime profile (`--runtime cpu`:
    mfu 1 on the measured FLOP/s, fp32 activations, gloo collectives, the elastic DiLoCo outer
    step's store round trips; recorded in the plan, reused by `simulate`), the benchmark's
    model, batch, seed and time limit (args: .model, .micro_batch_size, .micro_batches,
    .plan_time_limit, .seed; .calibration: the lab's calibration file, when set), `extra` flags
    after them."""
    return [PY, str(ROOT / "scheduler/scheduler.py"), "plan", "--cluster", str(cluster_path),
            "--model", args.model, "--micro-batch-size", str(args.micro_batch_size),
            "--micro-batches", str(args.micro_batches), "--runtime", "cpu", "--time-limit",
            str(args.plan_time_limit), "--search-seed", str(args.seed), "--out", str(out),
            "--quiet", *calibration_flags(args), *extra]


def calibration_flags(args: Any) -> list[str]:
    """--calibration FILE when the benchmark calibrated the lab (args.calibration)."""
    path = getattr(args, "calibration", None)
    return ["--calibration", str(path)] if path else []


def predict(run: Run, cluster_path: Path) -> None:
    """Predicted step time by `scheduler.py simulate` (the plan's own performance model)."""
    p = sh([PY, str(ROOT / "scheduler/scheduler.py"), "simulate", "--cluster", str(cluster_path),
            "--plan", str(run.plan_path), "--json"])
    run.predicted_s = json.loads(p.stdout)["step_s"]
