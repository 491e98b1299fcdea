#!/usr/bin/env python3
"""Hierarchical replicas (issue 22): shard groups inside a site, DiLoCo across sites.

    sudo flock /tmp/netns.lock .venv/bin/python benchmarks/hierarchical.py --out-dir out/hier \
        [--quick]

On the `badlink` namespace lab (two sites of 4 CPU ranks, 200 Mbit/s inside a site, one slow
link between them) it trains the same model on the same text, row by row:

    allreduce (the planner's plan) | flat DiLoCo (every rank its own replica, int8)
    | hierarchical (2 replicas x 4-way shard group, one per site, DiLoCo int8 across)
    | the same with reshard_after_forward off
    | planner (--max-shard 4 --sync auto: its own choice with sharding allowed)

Every row trains the same number of tokens (the allreduce row's). Columns: the simulator's
predicted s/step and the measured one, the bytes every host put on the wire per step (tc
counters) and those that crossed between the sites (the per-destination tc classes whose rate
is the cross-site rate), tokens/s, the final validation loss relative to allreduce's, the
largest parameter + gradient + AdamW (+ DiLoCo anchor and momentum) bytes a rank holds
(computed from the plan: 16 bytes a parameter, + 8 with DiLoCo, / D), and the training seconds
each row needed to reach allreduce's final validation loss (evaluated every --eval-every steps;
every row after allreduce trains on past its equal-token steps for allreduce's training seconds,
or until it reached that loss (--stop-at-loss from its equal-token steps on): equal wall time,
testkit/lab_training.budget_steps, train_on and stop_flags; the other columns are of the
equal-token steps). Writes OUT/results.json {"rows": [...]} (first row allreduce) and prints
the table and the targets.
Predictions use the lab's calibration (testkit/lab_calibration.py calibrate_lab: the cores the
ranks share, the optimizer's and the outer round's CPU; docs/simulator.md), checked again after
the runs: a miss is NOISY, not MISS, when the machine's speed moved by more than the 15% bar.
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from formats.atomic_io import atomic_write_json  # noqa: E402
from formats.cluster import Cluster, load_cluster  # noqa: E402
from formats.errors import UserError, run_main  # noqa: E402
from formats.models import get_model  # noqa: E402
from formats.plan import Plan, SyncConfig, load_plan, save_plan  # noqa: E402
from testkit import lab, lab_calibration, lab_metrics, lab_rows  # noqa: E402
from testkit.lab import Run, sh  # noqa: E402
from testkit.lab_network import Network  # noqa: E402


def log(msg: str) -> None:
    """Progress on stdout, flushed."""
    lab.log(msg, "hierarchical")


def sites(cluster: Cluster) -> list[list[int]]:
    """Device ids of each site (region), in region order."""
    names = sorted({d.region for d in cluster.devices})
    return [[i for i, d in enumerate(cluster.devices) if d.region == n] for n in names]


def make_plans(args: argparse.Namespace, cluster_path: Path, out: Path) -> list[Run]:
    """allreduce (planned), flat DiLoCo, hierarchical, and the planner's sharded choice."""
    cluster = load_cluster(cluster_path)
    spec = get_model(args.model)
    sh(lab.plan_command(args, cluster_path, out / "allreduce.json"))
    dil = SyncConfig("diloco", args.inner_steps, "int8", outer_lr=args.outer_lr,
                     outer_momentum=args.outer_momentum)
    one = [(0, spec.num_layers)]
    # the planned rows' performance model (the CPU runtime profile) for the hand-made ones too:
    # without it `simulate` used the generic GPU-like model (flat DiLoCo was predicted +437%)
    sim = load_plan(out / "allreduce.json").search.get("sim_config")
    common = {"micro_batch_size": args.micro_batch_size, "num_micro_batches": args.micro_batches,
              "sync": dil, "search": {"sim_config": sim} if sim else {}}
    flat = Plan(cluster.name, cluster.sha256(), args.model, one,
                [[d] for d in range(cluster.num_devices)], **common)
    hier = Plan(cluster.name, cluster.sha256(), args.model, one, [[s] for s in sites(cluster)],
                **common)
    save_plan(flat, out / "flat.json")
    save_plan(hier, out / "hier.json")
    save_plan(replace(hier, reshard_after_forward=False), out / "hier-gathered.json")
    sh(lab.plan_command(args, cluster_path, out / "planner.json", "--max-shard", "4",
                        "--sync", "auto", "--max-inner-steps", str(args.inner_steps),
                        "--compression", "int8", "--train-steps", str(args.steps)))
    planner = load_plan(out / "planner.json")
    outer = f"outer lr {args.outer_lr:g} m {args.outer_momentum:g}"
    return [Run("allreduce", out / "allreduce.json"),
            Run(f"flat diloco H={args.inner_steps} int8 {outer} ({cluster.num_devices} "
                "replicas)", out / "flat.json"),
            Run(f"hierarchical 2 x {hier.shard_degree(0)}-way, diloco H={args.inner_steps} int8 "
                f"{outer}", out / "hier.json"),
            Run("hierarchical, reshard_after_forward off (one gather + one scatter a step)",
                out / "hier-gathered.json"),
            Run(f"planner --max-shard 4 ({describe(planner)})", out / "planner.json")]


def describe(plan: Plan) -> str:
    """A plan's shape and sync in a few words."""
    s = plan.sync
    sync = s.mode if s.mode == "allreduce" else f"diloco H={s.inner_steps} {s.compression}"
    degrees = plan.shard_degrees()
    d = degrees[0] if len(set(degrees)) == 1 else "(" + ",".join(map(str, degrees)) + ")"
    return f"S={plan.num_stages} D={d} R={plan.num_replicas}, {sync}"


def lanes(plan: Plan) -> int:
    """Lanes of a plan: R x L (each reads its own micro-batches; L = the largest D)."""
    return plan.num_replicas * plan.lanes_per_replica


def max_state_mb(plan: Plan) -> float:
    """Largest parameter + gradient + AdamW (+ DiLoCo outer) state of any rank, MB."""
    spec = get_model(plan.model)
    per_param = 16 + (8 if plan.sync.mode == "diloco" else 0)
    return max(spec.stage_params(a, b) * per_param / plan.shard_degree(s)
               for s, (a, b) in enumerate(plan.stages)) / 1e6


RATE_UNITS = {"bit": 1e-3, "kbit": 1.0, "mbit": 1e3, "gbit": 1e6}
"""tc's rate suffixes in kbit (tc prints `20Mbit`, `200Mbit`, `10Gbit`)."""


def cross_site_bytes(net: Network, cross_kbit: int) -> int:
    """Bytes every host sent through its htb classes of the cross-site rate so far (tc's text
    output: iproute2 6.1 prints htb classes as text even with -j)."""
    total = 0
    for text in net.tc_show(("class", "show")):
        for value, unit, sent in re.findall(
                r"class htb \S+ .*?rate (\d+(?:\.\d+)?)([KMG]?bit).*?\n\s*Sent (\d+) bytes", text):
            kbit = float(value) * RATE_UNITS[unit.lower()]
            if abs(kbit - cross_kbit) <= 0.02 * cross_kbit:
                total += int(sent)
    return total


def equal_token_steps(plan: Plan, base_lanes: int, args: argparse.Namespace) -> int:
    """The steps that train `plan` on as many tokens as the allreduce row's --steps on its
    `base_lanes` lanes (whole rounds of H, at least the warm-up and one round)."""
    h = plan.sync.inner_steps
    return max(args.warmup_steps + h, round(args.steps * base_lanes / lanes(plan) / h) * h)


def train_all(runs: list[Run], args: argparse.Namespace, cluster_path: Path,
              out: Path) -> tuple[str, dict[str, float]]:
    """Predict and train every run on equal tokens, every run after allreduce on for
    allreduce's training seconds (lab_rows.train_rows); (why not shaped, cross-site MB/step
    over every launch of a row: it may have stopped)."""
    cluster = load_cluster(cluster_path)
    s = sites(cluster)
    cross_kbit = int(cluster.bandwidth_gbps[s[0][0], s[1][0]] * 1e6)
    base_lanes = lanes(load_plan(runs[0].plan_path))
    rows = [lab_rows.LabRow(r, equal_token_steps(load_plan(r.plan_path), base_lanes, args))
            for r in runs]
    done = lab_rows.train_rows(rows, args, cluster_path, out, counters={
        "cross_site": lambda net: cross_site_bytes(net, cross_kbit)})
    return done.why_not_shaped, {name: b / 1e6 for name, b in done.per_step["cross_site"].items()}


def result_rows(runs: list[Run], cross: dict[str, float]) -> list[dict]:
    """The results.json rows (first: allreduce)."""
    base = runs[0]
    rows = []
    for r in runs:
        plan = load_plan(r.plan_path)
        rows.append({
            "name": r.name, "shard_degree": plan.lanes_per_replica, "predicted_s": r.predicted_s,
            "measured_s": r.measured_s, "wire_mb_per_step": r.wire_bytes_per_step / 1e6,
            "emulation_cpu_s_per_step": r.emulation_cpu_s_per_step,
            "cross_site_mb_per_step": cross.get(r.name, 0.0), "tokens_per_s": r.tokens_per_s,
            "loss_ratio_vs_allreduce": (r.final_val_loss / base.final_val_loss
                                        if base.final_val_loss and r.final_val_loss else None),
            "max_state_mb_per_rank": max_state_mb(plan),
            "seconds_to_allreduce_loss": lab_metrics.seconds_to_loss(r, base.final_val_loss),
            "trained_s": r.trained_s, "steps_trained": r.steps_trained,
            "val_loss": r.final_val_loss, "prediction_error": r.error})
    return rows


def table(rows: list[dict], shaped: bool) -> str:
    """Markdown table of the rows."""
    note = "" if shaped else " (not shaped)"
    lines = [f"| row | D | predicted s/step | measured s/step | error | wire MB/step{note} | "
             f"cross-site MB/step{note} | tokens/s | loss ratio | state MB/rank | "
             "s to allreduce's loss |", "|" + "---|" * 11]
    for r in rows:
        loss, t = r["loss_ratio_vs_allreduce"], r["seconds_to_allreduce_loss"]
        reached = f"not in {r['trained_s']:.0f}" if t is None else f"{t:.0f}"
        lines.append(
            f"| {r['name']} | {r['shard_degree']} | {r['predicted_s']:.3f} | "
            f"{r['measured_s']:.3f} | {r['prediction_error'] * 100:+.0f}% | "
            f"{r['wire_mb_per_step']:.2f} | {r['cross_site_mb_per_step']:.2f} | "
            f"{r['tokens_per_s']:.0f} | {'-' if loss is None else f'{loss:.3f}'} | "
            f"{r['max_state_mb_per_rank']:.1f} | {reached} |")
    return "\n".join(lines)


def targets(rows: list[dict], noisy: str = "") -> list[str]:
    """The issue's targets, each with the measured value and PASS/MISS (a prediction that
    misses is NOISY when the machine's speed did not hold: lab_calibration.verdict)."""
    flat, hier = rows[1], rows[2]
    out = [f"NOISY machine too noisy to judge the predictions: {noisy}"] if noisy else []
    worst = max(rows, key=lambda r: abs(r["prediction_error"]))
    out.append(f"{lab_calibration.verdict(worst['prediction_error'], noisy)} every "
               f"prediction within 15% (worst {worst['prediction_error'] * 100:+.1f}%, "
               f"{worst['name']})")
    unsharded = max(r["max_state_mb_per_rank"] for r in rows if r["shard_degree"] == 1)
    for r in (x for x in rows if x["shard_degree"] > 1):
        ratio = r["max_state_mb_per_rank"] / unsharded
        out.append(f"{'PASS' if ratio <= 1.1 / r['shard_degree'] else 'MISS'} {r['name']}: "
                   f"state per rank {ratio:.3f} x the unsharded rows' (target <= 1.1/D = "
                   f"{1.1 / r['shard_degree']:.3f})")
    if flat["cross_site_mb_per_step"]:
        ratio = hier["cross_site_mb_per_step"] / flat["cross_site_mb_per_step"]
        out.append(f"{'PASS' if ratio <= 0.6 else 'MISS'} hierarchical cross-site bytes per "
                   f"step {ratio:.2f} x flat DiLoCo's (target <= 0.6)")
    loss = hier["loss_ratio_vs_allreduce"]
    out.append(f"{'PASS' if loss is not None and loss <= 1.02 else 'MISS'} hierarchical loss "
               f"ratio {loss if loss is None else round(loss, 3)} (target <= 1.02)")
    th, tf = hier["seconds_to_allreduce_loss"], flat["seconds_to_allreduce_loss"]
    ok = th is not None and (tf is None or th < tf)
    def said(t: float | None) -> str:
        return "never" if t is None else f"{t:.1f} s"

    out.append(f"{'PASS' if ok else 'MISS'} hierarchical reaches allreduce's loss in "
               f"{said(th)}, flat DiLoCo in {said(tf)} (target: sooner)")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default=str(ROOT / "out/hierarchical"), help="where it all goes")
    p.add_argument("--quick", action="store_true", help="fewer steps (minutes on 2 cores)")
    p.add_argument("--seed", type=int, default=0, help="scenario, search and data seed")
    p.add_argument("--model", default="gpt-tiny", help="model preset (default gpt-tiny)")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--inner-steps", type=int, default=5, help="DiLoCo H of the DiLoCo rows")
    p.add_argument("--outer-lr", type=float, default=1.0,
                   help="outer Nesterov lr of the flat and hierarchical DiLoCo rows (default "
                        "1.0: with the few outer steps of these runs, measured closer to "
                        "allreduce than the plan default 0.7 / momentum 0.9)")
    p.add_argument("--outer-momentum", type=float, default=0.3,
                   help="outer Nesterov momentum of the flat and hierarchical rows")
    p.add_argument("--steps", type=int, default=None,
                   help="allreduce row's training steps (default 30 with --quick, else 80); "
                        "the other rows train as many tokens")
    p.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the timing")
    p.add_argument("--plan-time-limit", type=float, default=10.0, help="per plan command, s")
    lab_rows.add_row_args(p)  # --eval-sequences, --eval-every, --no-netns, --mtu
    args = p.parse_args(argv)
    args.steps = args.steps or (30 if args.quick else 80)
    if args.steps <= args.warmup_steps:
        raise UserError(f"--steps {args.steps}: must exceed --warmup-steps {args.warmup_steps}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Plan, train the rows, print the table and targets, write results.json."""
    args = parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    cal = lab_rows.calibrate(args, "badlink", out / "cluster.json", fsdp=True)  # plan on it
    runs = make_plans(args, out / "cluster.json", out)
    why_not, cross = train_all(runs, args, out / "cluster.json", out)
    lab_calibration.check_after(cal, args.model, args.micro_batch_size)
    rows = result_rows(runs, cross)
    print(f"\nmachine: {lab_calibration.describe_machine(cal.machine)}")
    print("\n" + table(rows, not why_not) + ("" if not why_not else f"\n(NOT shaped: {why_not})"))
    print()
    for line in targets(rows, cal.noisy()):
        print(line)
    atomic_write_json(out / "results.json", {**cal.record(), "rows": rows})
    print(f"\nwrote {out / 'results.json'} ({time.monotonic() - t0:.0f} s in all)")
    return 0


if __name__ == "__main__":
    run_main(main)
