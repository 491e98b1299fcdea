"""Planning for the simulated step time vs planning for DT-FM's communication cost.

For the five DT-FM scenarios and `mixed` (64 GPUs, GPT3-XL, 8 stages x 8 replicas, 61
micro-batches of one sequence), prints the step time the event simulator predicts for:
  (a) our search minimising the `simulated` objective (layer split chosen per candidate by the
      DP of layer_split.py, then polished on the final plan by SimulatedObjective.polish),
  (b) our search minimising the `dtfm` objective (even split, as DT-FM plans),
  (c) our search minimising the simulated step time over even-split plans only,
  (d) random plans (median of --random-plans, even split, scored by the fast path) and the
      index-order plan,
with ratios to (a). Every search gets the same evaluation budget and time limit, on one core.
Then times one step replay of a 64-device step (vectorised fast path and event engine) and one
objective evaluation.

    python benchmarks/simulated_planning.py [--scenarios mixed worldwide] [--budget 8000]
        [--sync diloco --inner-steps 500 --compression int8]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one core, before numpy loads its thread pool

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from formats.models import get_model  # noqa: E402
from formats.plan import SyncConfig  # noqa: E402
from formats.sync_rules import sync_modes  # noqa: E402
from scheduler.baselines import index_order_plan  # noqa: E402
from scheduler.cost_dtfm import DtfmObjective  # noqa: E402
from scheduler.cost_simulated import SimulatedObjective  # noqa: E402
from scheduler.layer_split import even_split  # noqa: E402
from scheduler.planning import search_plan  # noqa: E402
from scheduler.scenarios import DTFM_SCENARIOS, make_scenario  # noqa: E402
from scheduler.search import SearchConfig  # noqa: E402
from scheduler.simulator import (  # noqa: E402
    LinkTables,
    SimConfig,
    build_inputs,
    replay_events,
    replay_fast,
    simulate,
)

S = R = 8
MICRO_BATCHES = 61
MODEL = get_model("gpt3-xl")


def event_step(cluster, stages, pipelines, sync) -> float:
    """Step time of a plan by the discrete-event simulator (memory checked)."""
    # timeline=True runs the event engine; without it simulate() takes the fast path, and the
    # `agree` check below would compare that path with itself
    return simulate(cluster, MODEL, stages, pipelines, sync, 1, MICRO_BATCHES,
                    timeline=True).step_s


def run_one(name: str, args: argparse.Namespace, sync: SyncConfig) -> dict:
    """All plans for one scenario."""
    cluster = make_scenario(name, args.seed)
    even = even_split(MODEL.num_layers, S)
    simulated = SimulatedObjective(cluster, MODEL, sync, 1, MICRO_BATCHES)
    even_only = SimulatedObjective(cluster, MODEL, sync, 1, MICRO_BATCHES, stages=even)
    dtfm = DtfmObjective(cluster, MODEL, S, R, MICRO_BATCHES)
    cfg = SearchConfig(budget=args.budget, time_limit_s=args.time_limit, seed=args.seed)
    out: dict = {"scenario": cluster.name}
    for key, objective in (("a", simulated), ("b", dtfm), ("c", even_only)):
        t = time.perf_counter()
        res = search_plan(cluster, objective, dtfm, S, R, cfg)
        wall = time.perf_counter() - t
        stages = even
        if key == "a":
            out["a_search"] = res.cost
            polished = simulated.polish(res.pipelines)  # final local search on the split
            wall = time.perf_counter() - t
            stages = polished.stages
        out[key] = event_step(cluster, stages, res.pipelines, sync)
        out[key + "_wall"], out[key + "_evals"] = wall, res.evaluations
        out[key + "_stop"] = res.stopped_by
        if key == "a":
            out["a_split"] = "-".join(str(b - a) for a, b in stages)
            # the objective the search minimised is the event simulator's fast path
            out["agree"] = abs(polished.cost_s - out["a"]) <= 1e-9 * out["a"]
    rng = np.random.default_rng(args.seed)
    randoms = [even_only.cost(rng.permutation(cluster.num_devices).reshape(R, S))
               for _ in range(args.random_plans)]
    out["random"] = statistics.median(randoms)
    out["index"] = event_step(cluster, even, index_order_plan(np.arange(64), S, R), sync)
    return out


def timings(sync: SyncConfig) -> list[str]:
    """Seconds per step replay and per objective call on a 64-device 8 x 8 GPT3-XL step."""
    cluster = make_scenario("mixed", 0)
    config = SimConfig()
    pipe = np.random.default_rng(0).permutation(64).reshape(R, S)
    inputs = build_inputs(LinkTables(cluster, config), MODEL, even_split(24, S), pipe, sync, 1,
                          MICRO_BATCHES, config)

    def best_of(fn, repeat: int) -> float:
        best = np.inf
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best

    fast = best_of(lambda: replay_fast(inputs), 50)
    event = best_of(lambda: replay_events(inputs), 5)
    obj = SimulatedObjective(cluster, MODEL, sync, 1, MICRO_BATCHES)
    rng = np.random.default_rng(1)
    fresh = best_of(lambda: obj.cost(rng.permutation(64).reshape(R, S)), 50)
    obj.cost(pipe)
    cached = best_of(lambda: obj.cost(pipe), 50)
    return [
        "one step replay, 64 devices, 8 x 8, 61 micro-batches, GPT3-XL (best of runs, 1 core):",
        f"  vectorised fast path (objective)   {fast * 1e3:8.2f} ms",
        f"  discrete-event engine (timeline)   {event * 1e3:8.2f} ms   "
        f"({event / fast:.0f}x the fast path)",
        f"  objective cost(), new stage groups {fresh * 1e3:8.2f} ms "
        "(ring orders, split DP, 2 replays)",
        f"  objective cost(), cached rings     {cached * 1e3:8.2f} ms",
    ]


def main() -> None:
    """Parse arguments, run every scenario, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", nargs="+", default=[*DTFM_SCENARIOS, "mixed"])
    ap.add_argument("--seed", type=int, default=0, help="scenario and search seed")
    ap.add_argument("--time-limit", type=float, default=60.0,
                    help="seconds per search (a safety net: the budget ends each search, so "
                         "the table is reproducible)")
    ap.add_argument("--budget", type=int, default=8_000,
                    help="evaluations per search (the planner's default for `simulated`)")
    ap.add_argument("--random-plans", type=int, default=20)
    ap.add_argument("--sync", choices=sync_modes(), default="allreduce")
    ap.add_argument("--inner-steps", type=int, default=1)
    ap.add_argument("--compression", choices=["none", "fp16", "int8"], default="none")
    args = ap.parse_args()
    sync = SyncConfig(args.sync, args.inner_steps if args.sync == "diloco" else 1,
                      args.compression)
    sync.validate()
    print(f"GPT3-XL, {S} stages x {R} replicas, {MICRO_BATCHES} micro-batches, sync "
          f"{sync.mode} H={sync.inner_steps} {sync.compression}; step time (s) by the event "
          f"simulator; ratio = plan / (a)")
    head = (f"{'scenario':<20}{'(a) sim':>9}{'split':>18}{'(b) dtfm':>10}{'b/a':>6}"
            f"{'(c) even':>10}{'c/a':>6}{'random':>9}{'r/a':>6}{'index':>9}{'i/a':>6}"
            f"{'search s':>10}")
    print(head)
    print("-" * len(head))
    rows = []
    for name in args.scenarios:
        o = run_one(name, args, sync)
        rows.append(o)
        a = o["a"]
        print(f"{o['scenario']:<20}{a:>9.2f}{o['a_split']:>18}{o['b']:>10.2f}{o['b'] / a:>6.2f}"
              f"{o['c']:>10.2f}{o['c'] / a:>6.2f}{o['random']:>9.2f}{o['random'] / a:>6.2f}"
              f"{o['index']:>9.2f}{o['index'] / a:>6.2f}{o['a_wall']:>10.1f}", flush=True)
    print()
    worst_wall = max(o["a_wall"] for o in rows)
    gain = max(o["a_search"] / o["a"] for o in rows)
    print(f"split polish on the final plan: up to {gain:.3f}x shorter than the search's split")
    print(f"search (a): at most {worst_wall:.1f} s wall and "
          f"{max(o['a_evals'] for o in rows)} evaluations per scenario; objective == event "
          f"simulator on every returned plan: {all(o['agree'] for o in rows)}")
    stops = sorted({o[k + "_stop"] for o in rows for k in "abc"})
    print(f"searches (a), (b), (c) stopped by: {', '.join(stops)} (reproducible from --seed "
          f"unless 'time')")
    for line in timings(sync):
        print(line)


if __name__ == "__main__":
    main()
