"""Our planner vs the baselines on the five DT-FM scenarios (64 V100s, GPT3-XL, 8 x 8), 3 seeds.

Prints, per scenario and seed, the DT-FM cost (s) of: our evolutionary search (with its DP and
PP parts), the best plan built by hand from the cluster's regions (chains or stage groups kept
inside regions, or region-sized pieces of chains), the best of N random plans, the index-order
plan, and our step-by-step re-implementation of the published DT-FM search (GCMA: population
100, 4,900 trials by default), with ratios ours / theirs and wall times. One process, and
numpy's thread pools are pinned to one thread, so every method runs on one core.

    python benchmarks/planner_vs_baselines.py [--seeds 0 1 2] [--gcma-trials 4900]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one core, before numpy loads its thread pool

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from formats.models import get_model  # noqa: E402
from scheduler.baselines import (  # noqa: E402
    best_of_random,
    gcma,
    hand_structured,
    index_order_plan,
)
from scheduler.cost_dtfm import DtfmObjective  # noqa: E402
from scheduler.planning import search_plan  # noqa: E402
from scheduler.scenarios import DTFM_SCENARIOS, make_scenario  # noqa: E402
from scheduler.search import SearchConfig  # noqa: E402


def run_one(scenario: str, seed: int, args: argparse.Namespace) -> dict:
    """Every method on one scenario and seed."""
    cluster = make_scenario(scenario, seed)
    obj = DtfmObjective(cluster, get_model("gpt3-xl"), 8, 8)
    devices = np.arange(cluster.num_devices)
    t = time.perf_counter()
    ours = search_plan(cluster, obj, obj, 8, 8,
                       SearchConfig(budget=args.budget, time_limit_s=args.time_limit,
                                    seed=args.search_seed))
    ours_wall = time.perf_counter() - t
    parts = obj.breakdown(ours.pipelines).parts
    _, _, structured = hand_structured(obj, cluster.regions(), obj.t_act, devices, 8, 8)
    _, rand, _ = best_of_random(obj, devices, 8, 8, args.random_samples, seed=seed)
    index = obj.cost(index_order_plan(devices, 8, 8))
    t = time.perf_counter()
    _, published, _ = gcma(obj, obj.t_act, devices, 8, 8, trials=args.gcma_trials, seed=seed)
    gcma_wall = time.perf_counter() - t
    return {"scenario": scenario, "seed": seed, "ours": ours.cost, "dp": parts["dp_comm_s"],
            "pp": parts["pp_comm_s"], "evals": ours.evaluations, "wall": ours_wall,
            "structured": structured, "random": rand, "index": index, "gcma": published,
            "gcma_wall": gcma_wall}


def main() -> int:
    """Run the grid, print the table and a one-line verdict on the quality target."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="scenario seeds (they shuffle device ids); default 0 1 2")
    p.add_argument("--scenarios", nargs="+", default=list(DTFM_SCENARIOS),
                   choices=list(DTFM_SCENARIOS))
    p.add_argument("--budget", type=int, default=20_000, help="our search's evaluation budget")
    p.add_argument("--time-limit", type=float, default=10.0, help="our search's wall limit (s)")
    p.add_argument("--search-seed", type=int, default=0, help="our search's seed")
    p.add_argument("--random-samples", type=int, default=1000)
    p.add_argument("--gcma-trials", type=int, default=4900,
                   help="trials of the published algorithm (4,900 as published; fewer for a "
                        "quick run)")
    args = p.parse_args()
    print("DT-FM cost in seconds (GPT3-XL, 8 stages x 8 replicas); o/x = ours / x; "
          f"DT-FM = published GCMA, population 100, {args.gcma_trials} trials")
    print(f"{'scenario':13s}{'seed':>5s}{'ours':>8s}{'DP':>7s}{'PP':>7s}{'struct':>8s}"
          f"{'random':>8s}{'index':>8s}{'DT-FM':>8s}{'o/struct':>9s}{'o/rand':>7s}"
          f"{'o/index':>8s}{'o/DT-FM':>8s}{'evals':>7s}{'ours s':>7s}{'DT-FM s':>8s}")
    rows = []
    for scenario in args.scenarios:
        for seed in args.seeds:
            r = run_one(scenario, seed, args)
            rows.append(r)
            print(f"{r['scenario']:13s}{r['seed']:5d}{r['ours']:8.2f}{r['dp']:7.2f}{r['pp']:7.2f}"
                  f"{r['structured']:8.2f}{r['random']:8.2f}{r['index']:8.2f}{r['gcma']:8.2f}"
                  f"{r['ours'] / r['structured']:9.3f}{r['ours'] / r['random']:7.3f}"
                  f"{r['ours'] / r['index']:8.3f}{r['ours'] / r['gcma']:8.3f}"
                  f"{r['evals']:7d}{r['wall']:7.1f}{r['gcma_wall']:8.1f}", flush=True)
    missed = [f"{r['scenario']}/{r['seed']}" for r in rows
              if r["ours"] > min(r["structured"], r["gcma"]) * (1 + 1e-9) or r["wall"] > 10.0]
    worst = max(rows, key=lambda r: r["gcma"] / r["structured"])
    verdict = f"met on all {len(rows)} runs" if not missed else "missed on " + ", ".join(missed)
    print(f"target (ours <= min(struct, DT-FM) in <= 10 s): {verdict}"
          f"; ours wall max {max(r['wall'] for r in rows):.1f} s; published search at worst "
          f"{worst['gcma'] / worst['structured']:.2f}x the hand-structured plan "
          f"({worst['scenario']}/{worst['seed']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
