#!/usr/bin/env python3
"""The CPU lab's compute model alone: 1 x 8, 2 x 4 and 4 x 2 on loopback, predicted vs measured.

    .venv/bin/python benchmarks/core_sharing.py [--out-dir out/core_sharing] [--steps 16]

Calibrates the lab (testkit/lab_calibration.py calibrate_lab: 8 processes, each a session of
its own, all at once, 2 at once, one alone, 3 rounds), gives every link of the lab 0.05 ms and
10 Gbit/s (loopback, no namespaces: what is left to predict is compute), plans the three
shapes with `--runtime cpu --calibration`, trains each with dist_runner.py, and prints per shape the
prediction of the core-sharing model, of the old one (one speed, all 8 at once, for every
plan), the measured s/step, and each one's ratio to 1 x 8: the old model's error is in how
shapes compare (a pipeline's ranks take turns and get more CPU each). Then it measures again
and says NOISY when the machine's speed moved. Writes OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import numpy as np  # noqa: E402

from formats.atomic_io import atomic_write_json  # noqa: E402
from formats.cluster import Cluster, load_cluster, save_cluster  # noqa: E402
from formats.errors import run_main  # noqa: E402
from testkit import lab, lab_calibration, lab_metrics, lab_training  # noqa: E402
from testkit.lab import Run, sh  # noqa: E402
from testkit.lab_network import Network  # noqa: E402

SHAPES = ((1, 8), (2, 4), (4, 2))


def fast_links(cluster: Cluster, tflops: float | None = None) -> Cluster:
    """The cluster with 0.05 ms / 10 Gbit/s everywhere (and every device at `tflops`)."""
    n = cluster.num_devices
    lat, bw = np.full((n, n), 0.05), np.full((n, n), 10.0)
    np.fill_diagonal(lat, 0.0)
    np.fill_diagonal(bw, np.inf)
    devices = cluster.devices if tflops is None else [replace(d, tflops=tflops)
                                                      for d in cluster.devices]
    return Cluster("fast", devices, lat, bw)


def simulate(cluster: Path, plan: Path, *extra: str) -> float:
    """`scheduler.py simulate` step time."""
    p = sh([lab.PY, str(ROOT / "scheduler/scheduler.py"), "simulate", "--cluster", str(cluster),
            "--plan", str(plan), "--json", *extra])
    return json.loads(p.stdout)["step_s"]


def main(argv: list[str] | None = None) -> int:
    """Calibrate, plan, predict both ways, train, print, check the machine again."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default=str(ROOT / "out/core_sharing"))
    p.add_argument("--steps", type=int, default=16, help="steps per shape (4 are warm-up)")
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cal = lab_calibration.calibrate_lab("lab", 0, "gpt-tiny", 4, out / "calibrated.json", 4)
    calibrated = load_cluster(out / "calibrated.json")
    save_cluster(fast_links(calibrated), out / "cluster.json")
    save_cluster(fast_links(calibrated, cal.sharing.shared / 1e12), out / "old_cluster.json")
    plan_args = argparse.Namespace(model="gpt-tiny", micro_batch_size=4, micro_batches=4,
                                   plan_time_limit=5.0, seed=0,
                                   calibration=cal.calibration_path)
    runs, old = [], []
    for s, r in SHAPES:
        path = out / f"{s}x{r}.json"
        sh(lab.plan_command(plan_args, out / "cluster.json", path, "--stages", str(s),
                            "--replicas", str(r)))
        runs.append(Run(f"{s} x {r}", path))
        runs[-1].predicted_s = simulate(out / "cluster.json", path)
        old.append(simulate(out / "old_cluster.json", path, "--shared-cores", "0",
                            "--background-load", "0", "--optimizer-flops-per-param", "0"))
    net = Network(out / "cluster.json", out, False)
    for run in runs:
        lab_metrics.read_metrics(run, lab_training.train(run, net, args.steps, out), 4)
    noisy = lab_calibration.check_after(cal, "gpt-tiny", 4)
    print(f"\nmachine: {lab_calibration.describe_machine(cal.machine)}")
    print("| shape | sharing model s/step | old model s/step | measured s/step | sharing / 1x8 "
          "| old / 1x8 | measured / 1x8 |\n" + "|---" * 7 + "|")
    for run, o in zip(runs, old):
        print(f"| {run.name} | {run.predicted_s:.3f} ({run.error * 100:+.0f}%) | {o:.3f} "
              f"({(o / run.measured_s - 1) * 100:+.0f}%) | {run.measured_s:.3f} | "
              f"{run.predicted_s / runs[0].predicted_s:.3f} | {o / old[0]:.3f} | "
              f"{run.measured_s / runs[0].measured_s:.3f} |")
    if noisy:
        print(f"NOISY machine too noisy to judge the absolute predictions: {noisy}")
    atomic_write_json(out / "results.json", {**cal.record(), "rows": [
        {"shape": r.name, "predicted_s": r.predicted_s, "old_model_s": o,
         "measured_s": r.measured_s} for r, o in zip(runs, old)]})
    return 0


if __name__ == "__main__":
    run_main(main)
