"""`evaluate --cluster FILE --plan FILE [--objective NAME] [--json]`: the cost of any plan
file under an objective."""

from __future__ import annotations

import argparse
import json

import numpy as np

from formats.cluster import Cluster
from formats.errors import UserError
from formats.plan import Plan
from scheduler.cli.fields import add_field_flags, arg
from scheduler.cli.inputs import load_cluster_and_plan
from scheduler.cli.perf_model import add_perf_model_args, sim_config_from_args
from scheduler.cost_simulated import SimulatedObjective
from scheduler.memory import check_plan_memory
from scheduler.planning import OBJECTIVES, PlanRequest
from scheduler.simulator.step import simulate_plan


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Print the cost of any plan file under an objective."""
    cluster, plan = load_cluster_and_plan(args)
    model = plan.model_spec()
    if plan.is_sharded:
        return _evaluate_sharded(args, cluster, plan)
    objective_name = arg(args, PlanRequest, "objective")
    if objective_name == "simulated":
        sim = sim_config_from_args(args, plan)
        try:  # a plan that does not fit costs inf to the search; here it is the user's error
            check_plan_memory(cluster, model, list(plan.stages), plan.pipelines,
                              plan.micro_batch_size, plan.num_micro_batches,
                              plan.sync.rule.local_steps, sim.memory())
        except UserError as e:
            raise UserError(f"{args.plan}: {e}") from None
        # Score the plan as written: its own layer split, not one the objective would choose.
        objective = SimulatedObjective(cluster, model, plan.sync, plan.micro_batch_size,
                                       plan.num_micro_batches, sim, stages=list(plan.stages),
                                       pipeline_compression=plan.pipeline_compression)
    else:
        req = PlanRequest(plan.num_stages, plan.num_replicas, plan.micro_batch_size,
                          plan.num_micro_batches, objective_name, plan.sync)
        objective = OBJECTIVES[objective_name](cluster, model, req)
    result = objective.breakdown(np.asarray(plan.pipelines))
    if args.json:
        print(json.dumps({"objective": result.objective, "cost": result.cost_s, **result.parts}))
    else:
        unit = lambda k: "" if k == "tokens_per_s" else \
            " B" if k.endswith("bytes_per_step") else " s"  # noqa: E731
        parts = ", ".join(f"{k} {v:.3f}{unit(k)}" for k, v in result.parts.items())
        print(f"{args.plan} on {cluster.name}: {result.objective} cost {result.cost_s:.3f} s "
              f"({parts})")
    return 0


def _evaluate_sharded(args: argparse.Namespace, cluster: Cluster, plan: Plan) -> int:
    """`evaluate` of a plan with shard groups: the simulator's step (the only objective that
    models FSDP and the per-shard sync)."""
    objective = arg(args, PlanRequest, "objective")
    if objective != "simulated":
        raise UserError(f"--objective {objective}: {args.plan} has shard groups, which only "
                        f"the simulated objective models; use --objective simulated")
    try:
        result = simulate_plan(cluster, None, plan, sim_config_from_args(args, plan),
                               timeline=False)
    except UserError as e:
        raise UserError(f"{args.plan}: {e}") from None
    parts = {**result.parts(), "fsdp_comm_s": result.fsdp_comm_s,
             "tokens_per_s": result.tokens_per_s,
             "pp_bytes_per_step": result.pp_bytes_per_step,
             "dp_bytes_per_step": result.dp_bytes_per_step,
             "fsdp_bytes_per_step": result.fsdp_bytes_per_step}
    if args.json:
        print(json.dumps({"objective": "simulated", "cost": result.step_s, **parts}))
    else:
        text = ", ".join(f"{k} {v:.3f}" for k, v in parts.items())
        print(f"{args.plan} on {cluster.name}: simulated cost {result.step_s:.3f} s "
              f"(D = {' '.join(map(str, result.shard_degrees))}; {text})")
    return 0


def add_evaluate_command(sub: argparse._SubParsersAction) -> None:
    """`evaluate --cluster FILE --plan FILE [--objective NAME] [--json]`."""
    ev = sub.add_parser("evaluate", help="cost of any plan file")
    ev.add_argument("--cluster", required=True,
                    help="cluster JSON file (cluster/1, or cluster/2: compact)")
    ev.add_argument("--plan", required=True, help="plan/1 or plan/2 JSON file (ours or anyone's)")
    add_field_flags(ev, PlanRequest, ("objective",))
    ev.add_argument("--json", action="store_true", help="one JSON object on stdout")
    add_perf_model_args(ev)
    ev.set_defaults(func=cmd_evaluate)
