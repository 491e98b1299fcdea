"""Our planner vs the baselines on the five DT-FM scenarios (64 V100s, GPT3-XL, 8 x 8), 3 seeds.

Prints, per scenario and seed, the DT-FM cost (s) of: our evolutionary search, the best
hand-structured plan (islands cut into chains or stage groups), best of N random plans, the
index-order plan, and our re-implementation of the published DT-FM search (GCMA: population
100, 4,900 trials by default), with ratios ours / theirs and wall times. All in one run, one core.

    python benchmarks/planner_vs_baselines.py [--seeds 0 1 2] [--gcma-trials 4900]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from scheduler.baselines import best_of_random, gcma, index_order_plan  # noqa: E402
from scheduler.cost_dtfm import DtfmObjective  # noqa: E402
from scheduler.heuristic_evolutionary_solver import (  # noqa: E402
    SearchConfig,
    evolutionary_search,
)
from scheduler.models import get_model  # noqa: E402
from scheduler.scenarios import DTFM_SCENARIOS, make_scenario  # noqa: E402


def run_one(scenario: str, seed: int, args: argparse.Namespace) -> dict:
    """Every method on one scenario and seed."""
    cluster = make_scenario(scenario, seed)
    obj = DtfmObjective(cluster, get_model("gpt3-xl"), 8, 8)
    devices = np.arange(64)
    t = time.perf_counter()
    ours = evolutionary_search(obj, obj.t_act, devices, 8, 8,
                               SearchConfig(budget=args.budget, time_limit_s=args.time_limit,
                                            seed=seed), [obj.t_grad])
    ours_wall = time.perf_counter() - t
    _, rand, _ = best_of_random(obj, devices, 8, 8, args.random_samples, seed=seed)
    index = obj.cost(index_order_plan(devices, 8, 8))
    t = time.perf_counter()
    _, published, _ = gcma(obj, obj.t_act, devices, 8, 8, trials=args.gcma_trials, seed=seed)
    gcma_wall = time.perf_counter() - t
    return {"scenario": scenario, "seed": seed, "ours": ours.cost, "evals": ours.evaluations,
            "wall": ours_wall, "structured": ours.best_structured[1], "random": rand,
            "index": index, "gcma": published, "gcma_wall": gcma_wall}


def main() -> int:
    """Run the grid and print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--scenarios", nargs="+", default=list(DTFM_SCENARIOS))
    p.add_argument("--budget", type=int, default=30_000)
    p.add_argument("--time-limit", type=float, default=10.0)
    p.add_argument("--random-samples", type=int, default=1000)
    p.add_argument("--gcma-trials", type=int, default=4900,
                   help="trials of the published algorithm (4,900 as published)")
    args = p.parse_args()
    head = (f"{'scenario':13s}{'seed':>5s}{'ours':>9s}{'struct':>9s}{'random':>9s}{'index':>9s}"
            f"{'DT-FM':>9s}{'o/struct':>9s}{'o/rand':>8s}{'o/index':>8s}{'o/DT-FM':>8s}"
            f"{'evals':>7s}{'ours s':>7s}{'DT-FM s':>8s}")
    print("DT-FM cost in seconds (GPT3-XL, 8 stages x 8 replicas); o/x = ours / x")
    print(head)
    for scenario in args.scenarios:
        for seed in args.seeds:
            r = run_one(scenario, seed, args)
            print(f"{r['scenario']:13s}{r['seed']:5d}{r['ours']:9.2f}{r['structured']:9.2f}"
                  f"{r['random']:9.2f}{r['index']:9.2f}{r['gcma']:9.2f}"
                  f"{r['ours'] / r['structured']:9.3f}{r['ours'] / r['random']:8.3f}"
                  f"{r['ours'] / r['index']:8.3f}{r['ours'] / r['gcma']:8.3f}"
                  f"{r['evals']:7d}{r['wall']:7.1f}{r['gcma_wall']:8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
