"""How `plan --sync auto` should search the sync configuration: which anchors to search under.

`--sync auto` searches the assignment under a few anchor configurations, then scores every
configuration within the bounds on every anchor's assignment (scheduler/sync_search.py). Under
the same --time-limit, this compares the predicted step of the fastest plan found (no risk
tolerance: pure speed) by
  (a) two anchors: allreduce and DiLoCo with the largest H, overlapped (the default),
  (b) one anchor: allreduce only,
  (c) one anchor: the largest-H DiLoCo only,
  (d) an outer loop over H: allreduce and DiLoCo overlapped at every H tried, each searched
      under an equal share of the time,
with ratios to (a).

    python benchmarks/sync_auto_search.py [--time-limit 20] [--cases badlink worldwide]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one core, before numpy loads its thread pool

import argparse  # noqa: E402
import time  # noqa: E402

from formats.models import get_model  # noqa: E402
from formats.plan import SyncConfig  # noqa: E402
from scheduler.planning import PlanRequest  # noqa: E402
from scheduler.scenarios import make_scenario  # noqa: E402
from scheduler.search import SearchConfig  # noqa: E402
from scheduler.simulator.config import RUNTIME_PROFILES  # noqa: E402
from scheduler.sync_search import (  # noqa: E402
    SyncBounds,
    SyncChoice,
    anchor_choices,
    inner_step_options,
    plan_sync_auto,
)

CASES = {
    # scenario, model, runtime, micro-batches, bounds
    "badlink": ("badlink", "gpt-tiny", "cpu", 4, SyncBounds(64, "int8", "int8")),
    "worldwide": ("worldwide", "gpt3-xl", "gpu", 16, SyncBounds(64, "int8", "bf16")),
}


def designs(bounds: SyncBounds) -> dict[str, list[SyncChoice]]:
    """Anchor lists by design name."""
    a, b = anchor_choices(bounds)
    by_h = [a] + [SyncChoice(SyncConfig("diloco", h, bounds.max_compression, overlap=True),
                             bounds.max_pipeline_compression)
                  for h in inner_step_options(bounds.max_inner_steps)]
    return {"(a) two anchors": [a, b], "(b) allreduce only": [a], "(c) largest H only": [b],
            f"(d) outer loop over H ({len(by_h)} searches)": by_h}


def main() -> None:
    """Print one table per case."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--time-limit", type=float, default=20.0)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for name in args.cases:
        scenario, model_name, runtime, micro, bounds = CASES[name]
        cluster, model = make_scenario(scenario, args.seed), get_model(model_name)
        req = PlanRequest(0, 0, 1, micro, "simulated",
                          search=SearchConfig(8000, args.time_limit, seed=args.seed),
                          sim=RUNTIME_PROFILES[runtime])
        print(f"{name}: {model_name} on {cluster.name}, {runtime} runtime, {micro} "
              f"micro-batches, bounds {bounds}, --time-limit {args.time_limit:g} s")
        rows = {}
        for label, anchors in designs(bounds).items():
            start = time.perf_counter()
            out = plan_sync_auto(cluster, model, req, bounds, anchors=anchors, tolerance=0.0)
            wall = time.perf_counter() - start
            rows[label] = (out.outcome.ours.cost_s, out.outcome.plan, wall)
        base = rows["(a) two anchors"][0]
        for label, (cost, plan, wall) in rows.items():
            print(f"  {label:34s} step {cost:9.4f} s  x{cost / base:6.3f} of (a)  "
                  f"{plan.sync.mode} H={plan.sync.inner_steps} overlap={plan.sync.overlap} "
                  f"F={plan.sync.fragments} dp {plan.sync.compression} pp "
                  f"{plan.pipeline_compression}, {plan.num_stages}x{plan.num_replicas}, "
                  f"{wall:.1f} s")


if __name__ == "__main__":
    main()
