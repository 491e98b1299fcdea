"""The lab's calibration: each rank's FLOP/s and the cores the ranks share, measured on this
machine before the runs and checked after, and the verdict on a prediction (PASS, MISS, or
NOISY when the machine did not hold still)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from formats.cluster import save_cluster
from formats.models import get_model
from scheduler.scenarios import make_scenario
from scheduler.simulator.kernel import OUTER_CPU_FIELD as OUTER_FIELD
from testkit.lab import log

PREDICTION_BAR = 0.15
"""The benchmarks' target: every prediction within 15% of what was measured."""
NOISE_LIMIT = PREDICTION_BAR
"""The most the machine's measured speed may move (between the calibration's rounds, or between
the calibration before the runs and the check after) for a miss of PREDICTION_BAR to be blamed
on the model. Tied to the bar: a drift that alone could make a prediction miss by the bar makes
a miss NOISY (not judged); a smaller one cannot, so the miss is the model's (MISS). On a quiet
2-core machine the check after the runs moves 5-10% (2 rounds of 5 steps), so a limit equal to
that (the former 10%) said NOISY on quiet machines. A prediction within the bar is PASS
whatever the noise."""


def verdict(error: float, noisy: str) -> str:
    """PASS when |error| <= PREDICTION_BAR; else NOISY when the machine did not hold still
    (`noisy`: noise_verdict's reason), MISS when it did."""
    if abs(error) <= PREDICTION_BAR:
        return "PASS"
    return "NOISY" if noisy else "MISS"


def machine() -> dict[str, Any]:
    """The machine the figures are measured on: cores, the CPU's model name, the load."""
    name = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from testkit.calibrate import usable_cores  # the fit's cap: the same count

    cores = usable_cores()
    return {"cores": cores, "cpu": name, "load_1min": round(os.getloadavg()[0], 2)}


def describe_machine(m: dict[str, Any]) -> str:
    """One line for the logs."""
    return f"{m['cores']} cores, {m['cpu']}, load average {m['load_1min']}"


@dataclass
class LabCalibration:
    """The lab's calibration: the cluster (tflops = one rank computing alone), the calibration
    file (shared_cores), and what was measured."""

    cluster_path: Path
    calibration_path: Path
    sharing: Any
    """testkit.calibrate.CoreSharing of the calibration before the runs."""
    machine: dict[str, Any]
    micro_batches: int = 1
    """Micro-batches per measured step (the plans' num_micro_batches)."""
    after: Any = None
    """CoreSharing of the check after the runs (None until check_after)."""

    def record(self) -> dict[str, Any]:
        """For results.json: the machine and both calibrations."""
        return {"machine": self.machine, "calibration": sharing_record(self.sharing),
                "check_after_runs": self.after and sharing_record(self.after),
                "too_noisy": self.noisy()}

    def noisy(self) -> str:
        """Why the machine was too noisy to judge the predictions by ('' when it was not)."""
        return noise_verdict(self.sharing, self.after)


def sharing_record(c: Any) -> dict[str, Any]:
    """A CoreSharing measurement, for calibration.json and results.json."""
    return {"alone_gflops": [f / 1e9 for f in c.alone_flops],
            "pair_gflops": [f / 1e9 for f in c.pair_flops],
            "shared_gflops": [f / 1e9 for f in c.shared_flops], "processes": c.processes,
            "core_gflops": c.core_flops / 1e9, "shared_cores": c.shared_cores,
            "background_load": c.background_load, "core_contention": c.contention,
            "spread": c.spread,
            "outer_cpu_s": dict(c.outer_cpu_s)}


def noise_verdict(before: Any, after: Any = None) -> str:
    """'' when the speed held steady within NOISE_LIMIT between calibration rounds and (when
    given) between the calibration before the runs and the check after; else why not."""
    why = []
    if before.spread - 1 > NOISE_LIMIT:
        why.append(f"the calibration's rounds differ by {(before.spread - 1) * 100:.0f}%")
    if after is not None:
        for what, a, b in (("one rank alone", before.alone, after.alone),
                           ("all ranks at once", before.shared, after.shared)):
            moved = max(a, b) / min(a, b) - 1
            if moved > NOISE_LIMIT:
                why.append(f"the speed of {what} moved {moved * 100:.0f}% between the "
                           f"calibration and the check after the runs ({a / 1e9:.1f} -> "
                           f"{b / 1e9:.1f} GFLOP/s)")
    return "; ".join(why)


def calibrate_lab(scenario: str, seed: int, model: str, micro_batch_size: int,
                  cluster_path: Path, micro_batches: int, fsdp: bool = False) -> LabCalibration:
    """The scenario with each device's tflops = one rank training alone, and a calibration file
    (beside the cluster, `calibration.json`) with the cores the ranks share and the other work
    beside them: measured side by side, all ranks at once, 2 at once and one alone, 3 rounds,
    medians, fitted (testkit/calibrate.py); each measured step `micro_batches`
    micro-batches in the runtime's order (all forwards, then all backwards). `fsdp`: also
    FSDP2's own CPU per unit (for plans with shard groups)."""
    from scheduler.simulator import save_calibration
    from testkit.calibrate import (  # torch: only when measuring
        measure_core_sharing,
        measure_fsdp_cpu,
    )

    cluster = make_scenario(scenario, seed)
    m = machine()
    log(f"machine: {describe_machine(m)}")
    log(f"measuring FLOP/s per rank: processes training {model} ({micro_batches} micro-batches "
        f"of {micro_batch_size}), {cluster.num_devices} at once, 2 at once, 1 alone, 3 rounds, "
        "each process a session of its own (as the ranks are)")
    sharing = measure_core_sharing(get_model(model), micro_batch_size, cluster.num_devices,
                                   micro_batches=micro_batches)
    log(f"  alone {sharing.alone / 1e9:.1f}, 2 at once {sharing.pair / 1e9:.1f}, "
        f"{cluster.num_devices} at once {sharing.shared / 1e9:.1f} GFLOP/s per rank (rounds "
        f"within {(sharing.spread - 1) * 100:.0f}%): {sharing.core_flops / 1e9:.1f} GFLOP/s "
        f"with a core to itself, {sharing.shared_cores:.2f} cores shared with "
        f"{sharing.background_load:.1f} tasks of other work, each rank computing beside "
        f"another {sharing.contention * 100:.1f}% slower")
    log(f"  AdamW step: {sharing.optimizer_flops_per_param:.0f} FLOPs per parameter; DiLoCo "
        "outer round (all at once, gloo on loopback): " + ", ".join(
            f"{p} {sharing.outer_flops_per_param(p):.0f}" for p in sharing.outer_cpu_s)
        + " FLOPs per parameter")
    fsdp_keys = {}
    if fsdp:
        per_unit = measure_fsdp_cpu(get_model(model), micro_batch_size, micro_batches)
        log(f"  FSDP2's own CPU per unit and micro-batch (alone): {per_unit['reshard'] * 1e3:.2f}"
            f" ms with reshard_after_forward, {per_unit['gathered'] * 1e3:.2f} ms without")
        fsdp_keys = {"fsdp_flops_per_unit": round(per_unit["reshard"] * sharing.alone, 1),
                     "fsdp_gathered_flops_per_unit": round(per_unit["gathered"] * sharing.alone,
                                                           1)}
    save_cluster(cluster.with_devices([replace(d, tflops=sharing.core_flops / 1e12)  # s
                                       for d in cluster.devices]), cluster_path)
    cal_path = cluster_path.with_name("calibration.json")
    save_calibration(cal_path, {
        "shared_cores": round(sharing.shared_cores, 4),
        "background_load": round(sharing.background_load, 4),
        "core_contention": round(sharing.contention, 4),
        "optimizer_flops_per_param": round(sharing.optimizer_flops_per_param, 2),
        **{OUTER_FIELD[p]: round(sharing.outer_flops_per_param(p), 2)
           for p in sharing.outer_cpu_s}, **fsdp_keys},
        runtime="cpu", measured={"machine": m} | sharing_record(sharing))
    return LabCalibration(cluster_path, cal_path, sharing, m, micro_batches)


def check_after(cal: LabCalibration, model: str, micro_batch_size: int) -> str:
    """Measure again after the runs (the same way, 2 rounds); returns the noise verdict."""
    from testkit.calibrate import measure_core_sharing

    log("checking the machine's speed again after the runs")
    cal.after = measure_core_sharing(get_model(model), micro_batch_size,
                                     cal.sharing.processes, rounds=2, outer=False,
                                     micro_batches=cal.micro_batches)
    log(f"  alone {cal.after.alone / 1e9:.1f}, at once {cal.after.shared / 1e9:.1f} GFLOP/s "
        f"per rank ({cal.after.shared_cores:.2f} cores, {cal.after.background_load:.1f} tasks "
        "of other work)")
    why = cal.noisy()
    if why:
        log(f"  TOO NOISY to judge the predictions: {why}")
    return why
