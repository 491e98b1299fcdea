#!/usr/bin/env python3
"""Time to a loss past the plateau, in three link regimes: does `plan --sync auto` get the
model sooner than the best all-reduce plan, and are its predictions of that time right?

    sudo .venv/bin/python benchmarks/time_to_loss.py --out-dir D [--quick] [--regimes ...]

For each regime (REGIMES: `fast`, datacenter-like links; `lab`, the lab cluster of the demo;
`wan`, the lab's links thinned until all-reduce's step is mostly communication):
1. the lab's 8 CPU ranks with this machine's measured FLOP/s (measured once,
   testkit/lab_calibration.py), links per regime;
2. `scheduler.py plan --sync auto --train-steps N` (the target: the validation loss the best
   all-reduce plan reaches after N steps) and `--allreduce-out`: the best all-reduce plan the
   same search found, with its own predicted time to the target;
3. network-namespace hosts with the regime's rates and delays (root; else loopback, said so);
4. the all-reduce row trains N steps (evaluating every 10): the target is its validation loss
   at step N; then the planner's row trains until it reaches that loss (--stop-at-loss) or
   has trained for the all-reduce row's time (lab_training.train_row);
5. each row's measured seconds and tokens to the target (training time, evaluations left out)
   beside its predicted seconds (the plan's predicted.to_target).
Both rows are measured end to end on the emulated links; nothing is extrapolated. Writes
D/results.json ({"regimes": [{name, allreduce_comm_share, allreduce_steps, target_loss, rows:
[{name, chosen_by_planner, seconds_to_target, predicted_seconds_to_target, tokens_to_target,
...}]}]}) after every regime, and prints the targets of the time-to-loss issue with verdicts.
`allreduce_comm_share` is the simulator's share of communication in the all-reduce plan's
step (the measured step beside it in the row).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from formats.atomic_io import atomic_write_json  # noqa: E402
from formats.cluster import load_cluster, save_cluster  # noqa: E402
from formats.errors import UserError, run_main  # noqa: E402
from formats.plan import load_plan  # noqa: E402
from formats.run_metrics import METRICS_NAME  # noqa: E402
from testkit import lab, lab_calibration, lab_metrics, lab_network, lab_training  # noqa: E402
from testkit.lab import Run, log, predict, sh  # noqa: E402
from testkit.lab_network import Network  # noqa: E402


@dataclass(frozen=True)
class Regime:
    """One link regime: the lab's links scaled."""

    name: str
    bandwidth_scale: float
    """Every link's bandwidth times this."""
    latency_scale: float
    """Every link's latency times this."""
    max_ratio: float
    """The issue's target: the planner's time to the target over all-reduce's, at most."""


REGIMES = (Regime("fast", 50.0, 0.05, 1.05), Regime("lab", 1.0, 1.0, 0.6),
           Regime("wan", 0.4, 1.5, 1 / 3))
"""fast: 2-10 Gbit/s at 0.1-3 ms (compute-bound on 2 cores); lab: the demo's links; wan: 16-20
Mbit/s across regions at 17-100 ms, where all-reduce's step is at least 80% communication."""


def regime_cluster(base: Path, regime: Regime, path: Path) -> None:
    """The calibrated lab cluster with the regime's links."""
    c = load_cluster(base)
    lat, bw = c.latency_ms * regime.latency_scale, c.bandwidth_gbps * regime.bandwidth_scale
    save_cluster(type(c)(f"{c.name}-{regime.name}", c.devices, lat, bw), path)


def comm_share(run: Run, cluster_path: Path) -> float:
    """The simulator's share of communication in `run`'s step (exposed pipeline, tied and
    data-parallel communication over the step)."""
    p = sh([lab.PY, str(ROOT / "scheduler/scheduler.py"), "simulate", "--cluster",
            str(cluster_path), "--plan", str(run.plan_path), "--json"])
    d = json.loads(p.stdout)
    return (d["pp_comm_s"] + d["tied_comm_s"] + d["dp_comm_s"]) / d["step_s"]


def plan_regime(args: argparse.Namespace, cluster_path: Path, out: Path) -> tuple[Run, Run]:
    """The planner's --sync auto plan and the best all-reduce plan beside it."""
    auto, ar = out / "auto.json", out / "allreduce.json"
    sh(lab.plan_command(args, cluster_path, auto, "--sync", "auto", "--max-inner-steps",
                        str(args.max_inner_steps), "--compression", "int8",
                        "--allow-pipeline-compression", "int8", "--train-steps",
                        str(args.steps), "--allreduce-out", str(ar)))
    plan = load_plan(auto)
    s = plan.sync
    what = ("allreduce" if s.mode == "allreduce" else
            f"DiLoCo H={s.inner_steps} {s.compression}{' overlap' if s.overlap else ''}"
            f"{f' F={s.fragments}' if s.fragments > 1 else ''}"
            f"{f' W={s.warmup_steps}' if s.warmup_steps else ''}")
    arp = load_plan(ar)
    return (Run(f"allreduce ({arp.num_stages}x{arp.num_replicas})", ar),
            Run(f"planner --sync auto ({plan.num_stages}x{plan.num_replicas}, {what}, "
                f"pipeline {plan.pipeline_compression})", auto))


def same_plan(a: Run, b: Run) -> bool:
    """Whether two rows train the same plan (placement, shape, sync; predictions aside):
    training it twice would only measure the machine's noise as a difference."""
    def key(run: Run) -> dict:
        d = load_plan(run.plan_path).to_dict()
        aside = ("name", "predicted", "description", "search")
        return {k: v for k, v in d.items() if k not in aside}
    return key(a) == key(b)


def row_record(run: Run, target: float | None, chosen: bool) -> dict:
    """One row of results.json."""
    plan = load_plan(run.plan_path)
    t = lab_metrics.seconds_to_loss(run, target)
    step = None if t is None else first_step_at(run, target)
    per_step = plan.num_replicas * plan.lanes_per_replica * plan.num_micro_batches \
        * plan.micro_batch_size * plan.model_spec().seq_len
    pred = plan.predicted.get("to_target", {})
    return {"name": run.name, "chosen_by_planner": chosen, "seconds_to_target": t,
            "predicted_seconds_to_target": pred.get("seconds"),
            "steps_to_target": step, "predicted_steps_to_target": pred.get("steps"),
            "tokens_to_target": None if step is None else step * per_step,
            "measured_s_per_step": run.measured_s, "predicted_s_per_step": run.predicted_s,
            "steps_trained": run.steps_trained, "final_val_loss": run.final_val_loss,
            "sync": plan.to_dict()["sync"], "shape": [plan.num_stages, plan.num_replicas],
            "flags": pred.get("flags", [])}


def first_step_at(run: Run, target: float) -> int | None:
    """The step of replica 0's first evaluation at or below `target` (every launch's
    records: train_on appends to the same metrics file)."""
    path = run.plan_path.parent / run.plan_path.stem / METRICS_NAME
    for r in lab_metrics.step_records_of(path):
        if r.get("val_loss") is not None and r["val_loss"] <= target:
            return int(r["step"])
    return None


EVAL_EVERY = 10
"""Steps between evaluations (the quality model's curves were evaluated as often)."""


def run_regime(args: argparse.Namespace, regime: Regime, base_cluster: Path, out: Path) -> dict:
    """Plan, emulate and train one regime; its results.json entry."""
    d = out / regime.name
    d.mkdir(parents=True, exist_ok=True)
    cluster_path = d / "cluster.json"
    regime_cluster(base_cluster, regime, cluster_path)
    log(f"== regime {regime.name}: links x{regime.bandwidth_scale:g} bandwidth, "
        f"x{regime.latency_scale:g} latency; planning")
    ar, auto = plan_regime(args, cluster_path, d)
    for r in (ar, auto):
        predict(r, cluster_path)
    share = comm_share(ar, cluster_path)
    extra = ["--eval-sequences", "32", "--eval-every", str(EVAL_EVERY)]
    net = Network(cluster_path, d, not args.no_netns, args.mtu)
    try:
        net.up()
        lab_training.train_row(ar, net, d, extra, args.steps, args.warmup_steps, EVAL_EVERY)
        if same_plan(ar, auto):
            log("the planner chose the all-reduce plan itself: its row is that measurement")
            auto = replace(ar, name=f"{auto.name} = the allreduce row")
        else:
            lab_training.train_row(auto, net, d, extra, EVAL_EVERY, args.warmup_steps,
                                   EVAL_EVERY, ar)
    finally:
        net.down()
    target = ar.final_val_loss
    rows = [row_record(ar, target, False), row_record(auto, target, True)]
    return {"name": regime.name, "shaped": not net.reason, "why_not_shaped": net.reason,
            "allreduce_comm_share": round(share, 4), "allreduce_steps": args.steps,
            "target_loss": target, "rows": rows}


def verdicts(regimes: list[dict]) -> list[str]:
    """The issue's targets, each with its measured value."""
    out = []
    limits = {r.name: r.max_ratio for r in REGIMES}
    for g in regimes:
        ar, auto = g["rows"]
        if ar["seconds_to_target"] and auto["seconds_to_target"]:
            ratio = auto["seconds_to_target"] / ar["seconds_to_target"]
            ok = ratio <= limits[g["name"]]
            out.append(f"{'PASS' if ok else 'MISS'} {g['name']}: planner's time to the target "
                       f"{ratio:.2f}x allreduce's (target <= {limits[g['name']]:.2f})")
        else:
            out.append(f"MISS {g['name']}: the planner's row did not reach the target")
        for r in g["rows"]:
            if r["seconds_to_target"] and r["predicted_seconds_to_target"]:
                err = r["predicted_seconds_to_target"] / r["seconds_to_target"] - 1
                out.append(f"{'PASS' if abs(err) <= 0.25 else 'MISS'} {g['name']} {r['name']}: "
                           f"predicted time to target {err:+.0%} off measured")
        if g["name"] == "wan":
            out.append(f"{'PASS' if g['allreduce_comm_share'] >= 0.8 else 'MISS'} wan: "
                       f"allreduce's step {g['allreduce_comm_share']:.0%} communication")
    return out


def table(g: dict) -> str:
    """One regime's rows, time to the target first."""
    lines = [f"regime {g['name']} (target: allreduce's validation loss after "
             f"{g['allreduce_steps']} steps, {g['target_loss']:.4f}; allreduce's step "
             f"{g['allreduce_comm_share']:.0%} communication, simulated)",
             "| plan | s to target | predicted | steps to target | predicted | tokens to target "
             "| s/step | predicted |", "|" + "---|" * 8]
    for r in g["rows"]:
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        lines.append(f"| {r['name']} | {fmt(r['seconds_to_target'], '.1f')} | "
                     f"{fmt(r['predicted_seconds_to_target'], '.1f')} | "
                     f"{fmt(r['steps_to_target'], 'd')} | "
                     f"{fmt(r['predicted_steps_to_target'], '.0f')} | "
                     f"{fmt(r['tokens_to_target'], ',d')} | {r['measured_s_per_step']:.3f} | "
                     f"{r['predicted_s_per_step']:.3f} |")
    ar, auto = g["rows"]
    if ar["seconds_to_target"] and auto["seconds_to_target"]:
        ratio = auto["seconds_to_target"] / ar["seconds_to_target"]
        lines.append(f"time to the target: {ratio:.2f}x allreduce's; tokens/s "
                     f"{_tps(auto) / _tps(ar):.2f}x")
    return "\n".join(lines)


def _tps(r: dict) -> float:
    return (r["tokens_to_target"] or 0) / max(r["seconds_to_target"] or 1e-9, 1e-9)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True, help="where everything goes (results.json)")
    p.add_argument("--quick", action="store_true",
                   help="150 all-reduce steps (default 200), a shorter planner search")
    p.add_argument("--regimes", default="fast,lab,wan", help="comma-separated, of fast,lab,wan")
    p.add_argument("--seed", type=int, default=0, help="scenario and search seed")
    p.add_argument("--max-inner-steps", type=int, default=32,
                   help="--sync auto: the largest H it may choose (default 32)")
    lab_network.add_network_args(p)
    args = p.parse_args(argv)
    known = {r.name for r in REGIMES}
    args.regime_list = [r for r in REGIMES if r.name in args.regimes.split(",")]
    bad = set(args.regimes.split(",")) - known
    if bad:
        raise UserError(f"--regimes: unknown {', '.join(sorted(bad))}; known: fast, lab, wan")
    args.steps = 150 if args.quick else 200
    args.plan_time_limit = 15.0 if args.quick else 30.0
    args.model, args.micro_batch_size, args.micro_batches = "gpt-tiny", 4, 4
    args.warmup_steps = 0
    return args


def main(argv: list[str] | None = None) -> int:
    """Every regime in turn; results.json after each."""
    args = parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    base = out / "cluster-lab.json"
    cal = lab_calibration.calibrate_lab("lab", args.seed, args.model, args.micro_batch_size,
                                        base, args.micro_batches)
    args.calibration = cal.calibration_path
    results: dict = {**cal.record(), "regimes": []}
    for regime in args.regime_list:
        results["regimes"].append(run_regime(args, regime, base, out))
        atomic_write_json(out / "results.json", results)
        print(table(results["regimes"][-1]), flush=True)
    results["verdicts"] = verdicts(results["regimes"])
    atomic_write_json(out / "results.json", results)
    print()
    for line in results["verdicts"]:
        print(line)
    print(f"\nwrote {out / 'results.json'} ({time.monotonic() - t0:.0f} s in all)")
    return 0


if __name__ == "__main__":
    run_main(main)
