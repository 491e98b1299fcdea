"""What `plan` prints: its progress line, the plan beside the baselines (or, with --sync auto,
beside the best allreduce plan), the --max-shard comparison; as a table or as --json."""

from __future__ import annotations

import sys

from formats.plan import Plan
from scheduler.objective import CostBreakdown
from scheduler.planning import PlanOutcome, per_replica_cost
from scheduler.shard_search import Candidate
from scheduler.simulator.report import sync_label
from scheduler.sync_search import AutoOutcome
from scheduler.time_to_target import target_rows


def progress(evaluations: int, best: float) -> None:
    """The search's progress line on stderr (rewritten in place)."""
    print(f"\rsearching: {evaluations:7d} evaluations, best {best:10.4f} s", end="",
          file=sys.stderr, flush=True)


def plan_table(out: PlanOutcome) -> str:
    """The plan's cost and parts beside each baseline's, and how the search ended."""
    ours, p = out.ours, out.plan
    taken = p.search.get("taken_from")  # a baseline beat a search cut short by the clock
    keys = [k for k in ours.parts if not k.endswith("bytes_per_step")]
    head = f"  {'':28s} {'cost (s)':>10s}" + "".join(f" {k:>12s}" for k in keys) + \
        f" {'ours / it':>10s}"

    def row(label: str, b: CostBreakdown) -> str:
        parts = "".join(f" {b.parts.get(k, float('nan')):12.3f}" for k in keys)
        return f"  {label:28s} {b.cost_s:10.3f}{parts} {ours.cost_s / b.cost_s:10.3f}"

    rows = [
        f"plan {p.model} on {p.cluster}: {p.num_stages} stages x {p.num_replicas} replicas, "
        f"objective {ours.objective}",
        head,
        row(f"ours = {taken.split(' (')[0]}" if taken else "ours (evolutionary)", ours),
        *(row(label, b) for label, b in out.baselines.items()),
        f"  search: {p.search['evaluations']} evaluations in {p.search['wall_s']:.2f} s "
        f"(seed {p.search['seed']}, stopped by {p.search['stopped_by']}); best starting plan "
        f"{out.best_structured[1]:.3f} s",
    ]
    return "\n".join(rows)


def plan_json(out: PlanOutcome, path: str) -> dict:
    """plan_table for --json (with the baselines' ratios)."""
    ours = out.ours
    return {
        "plan": path, "objective": ours.objective, "cost": ours.cost_s, "parts": ours.parts,
        "predicted": out.plan.predicted, "search": out.plan.search,
        "evaluations": out.plan.search["evaluations"], "wall_s": out.plan.search["wall_s"],
        "baselines": {label: {"cost": b.cost_s, "parts": b.parts,
                              "ratio_ours_to_it": ours.cost_s / b.cost_s}
                      for label, b in out.baselines.items()},
        "hand_structured": out.hand_structured,
        "random_cost": out.random_cost, "index_cost": out.index_cost,
        "random_scored": out.random_scored,
        "best_structured_cost": out.best_structured[1],
        "ratio_vs_random": ours.cost_s / out.random_cost,
        "ratio_vs_index": ours.cost_s / out.index_cost,
    }


def shard_table(shards: tuple[Candidate, list[Candidate]]) -> str:
    """Every layout the --max-shard comparison scored, by time per sequence."""
    best, every = shards
    rows = ["shard groups (--max-shard): S x D-way x R by simulated time per sequence "
            "(step / (R x D))",
            f"  {'layout':44s} {'step (s)':>10s} {'s/sequence':>12s}"]
    for c in every:
        mark = "  <- written" if c.label == best.label else ""
        rows.append(f"  {c.label:44s} {c.step_s:10.3f} {c.per_sequence_s:12.5f}{mark}")
    if best.shard_degree > 1:
        rows.append("  the sharded layout is written, not the D = 1 plan above (predicted "
                    f"{every[0].per_sequence_s / best.per_sequence_s:.2f}x its sequences/s)"
                    if every[0].shard_degree == 1 else "  no D = 1 plan fits: the sharded "
                    "layout is written")
    return "\n".join(rows)


def shard_json(shards: tuple[Candidate, list[Candidate]], path: str) -> dict:
    """The --max-shard comparison for --json."""
    best, every = shards
    return {"plan": path, "shard_degree": best.shard_degree, "chosen": best.label,
            "shard_candidates": [{"label": c.label, "stages": c.num_stages,
                                  "shard_degree": c.shard_degree, "replicas": c.num_replicas,
                                  "step_s": c.step_s, "per_sequence_s": c.per_sequence_s}
                                 for c in every]}


AUTO_ROWS = (("step time (s)", "step_s", 1.0), ("  compute (busiest device)", "compute_s", 1.0),
             ("  pipeline bubble", "bubble_s", 1.0),
             ("  exposed pipeline comm", "pp_comm_s", 1.0),
             ("  tied-embedding sum", "tied_comm_s", 1.0),
             ("  exposed DP / outer sync", "dp_comm_s", 1.0),
             ("hidden DP / outer sync (s)", "dp_hidden_s", 1.0),
             ("pipeline MB per step", "pp_bytes_per_step", 1e-6),
             ("DP / outer MB per step", "dp_bytes_per_step", 1e-6),
             ("tokens/s", "tokens_per_s", 1.0))
"""The rows of the --sync auto table: label, part, scale."""


def auto_table(auto: AutoOutcome) -> str:
    """The chosen plan's breakdown beside the best allreduce plan's."""
    ours, p, ar, arp = auto.outcome.ours, auto.outcome.plan, auto.allreduce_cost, auto.allreduce
    shape = lambda plan: f"{plan.num_stages} stages x {plan.num_replicas} replicas"  # noqa: E731
    rows = [f"plan {p.model} on {p.cluster}: objective {ours.objective}, --sync auto "
            f"({auto.choices} configurations within the bounds, {auto.scored} scored on "
            f"{len(auto.anchors)} searched assignments)",
            f"  chosen:    {sync_label(p.sync, p.pipeline_compression)}; {shape(p)}",
            f"  allreduce: {sync_label(arp.sync, arp.pipeline_compression)}; {shape(arp)}",
            *target_rows(p.predicted.get("to_target"), arp.predicted.get("to_target")),
            f"  {'':32s} {'chosen':>12s} {'allreduce':>12s}"]
    for label, key, scale in AUTO_ROWS:
        rows.append(f"  {label:32s} {ours.parts.get(key, float('nan')) * scale:12.3f} "
                    f"{ar.parts.get(key, float('nan')) * scale:12.3f}")
    rows.append(f"  the chosen plan trains {speedup(auto):.2f}x the sequences per second of the "
                f"best allreduce plan (predicted; step {ar.cost_s / ours.cost_s:.2f}x shorter)")
    if p.sync.warmup_steps:
        run_s = p.predicted["run_step_s"]
        rows.append(f"  warm-up: {p.sync.warmup_steps} all-reduce steps of "
                    f"{p.predicted['train_steps']}: the run's mean step {run_s:.3f} s "
                    f"({ar.cost_s / run_s:.2f}x shorter than allreduce's)")
    return "\n".join(rows)


def speedup(auto: AutoOutcome) -> float:
    """Sequences per second of the chosen plan over the allreduce plan's (widths may differ)."""
    ours, p, ar, arp = auto.outcome.ours, auto.outcome.plan, auto.allreduce_cost, auto.allreduce
    return (per_replica_cost(ar.cost_s, arp.num_replicas)
            / per_replica_cost(ours.cost_s, p.num_replicas))


def auto_json(auto: AutoOutcome, path: str) -> dict:
    """--sync auto --json: the chosen plan and the best allreduce plan, each with its parts."""
    ours, p, ar, arp = auto.outcome.ours, auto.outcome.plan, auto.allreduce_cost, auto.allreduce

    def entry(plan: Plan, cost: CostBreakdown) -> dict:
        return {"cost": cost.cost_s, "parts": cost.parts,
                "sync": plan.to_dict()["sync"], "pipeline_compression": plan.pipeline_compression,
                "num_stages": plan.num_stages, "num_replicas": plan.num_replicas}

    return {"plan": path, "objective": ours.objective, "cost": ours.cost_s, "parts": ours.parts,
            "predicted": p.predicted, "search": p.search, "chosen": entry(p, ours),
            "allreduce": entry(arp, ar), "speedup_vs_allreduce": speedup(auto),
            "anchors": auto.anchors, "scored": auto.scored, "configurations": auto.choices}
