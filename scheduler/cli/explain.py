"""`explain --plan FILE --metrics RUN_DIR [--cluster FILE] [--json]`: measured time per stage
and rank of a run beside the simulator's prediction (the analysis: scheduler.explain)."""

from __future__ import annotations

import argparse
import json
import sys

from formats.atomic_io import check_output_path
from formats.cluster import save_cluster
from formats.errors import UserError
from formats.plan import Plan, load_plan
from scheduler.cli.inputs import load_cluster_and_plan
from scheduler.cli.perf_model import add_perf_model_args, sim_config_from_args
from scheduler.time_to_target import explain_rows


def cmd_explain(args: argparse.Namespace) -> int:
    """Measured time per stage and rank of a run beside the simulator's prediction."""
    from formats.run_metrics import CLUSTER_NAME, load_run
    from scheduler.explain import (
        explain,
        explanation_dict,
        format_explanation,
        measured_cluster,
    )

    if args.write_cluster:
        check_output_path(args.write_cluster, "--write-cluster")
    run = load_run(args.metrics, "--metrics", need_ranks=True)
    if args.cluster is None:
        copy = run.run_dir / CLUSTER_NAME
        if not copy.is_file():
            raise UserError(f"--cluster: not given and {copy} does not exist; give the cluster "
                            "file the plan was made for")
        args.cluster = str(copy)
    cluster, plan = load_cluster_and_plan(args)
    if run.plan_path is not None and not same_run_plan(load_plan(run.plan_path), plan):
        raise UserError(f"--plan {args.plan}: not the plan the run in {args.metrics} trained "
                        f"(compare {run.plan_path}); give that plan")
    result = explain(plan, cluster, sim_config_from_args(args, plan), run.ranks)
    to_target = explain_rows(plan.predicted, run.replicas.get(0, []))
    if args.json:
        print(json.dumps({**explanation_dict(result), "to_target": to_target}))
    else:
        print("\n".join([format_explanation(result), *to_target]))
    if args.write_cluster:
        save_cluster(measured_cluster(cluster, result.rows), args.write_cluster)
        print(f"wrote {args.write_cluster}: the cluster with each device's tflops as its "
              "compute measured in this run (plan with it: scheduler.py plan --cluster "
              f"{args.write_cluster} ...)", file=sys.stderr if args.json else sys.stdout)
    return 0


def same_run_plan(a: Plan, b: Plan) -> bool:
    """Whether two plans train the same run (model, split, placement, batch, sync)."""
    def key(p: Plan) -> tuple:
        return (p.model, [list(s) for s in p.stages], p.pipelines, p.micro_batch_size,
                p.num_micro_batches, p.sync.mode, p.sync.inner_steps, p.sync.compression)
    return key(a) == key(b)


def add_explain_command(sub: argparse._SubParsersAction) -> None:
    """`explain --plan FILE --metrics RUN_DIR [--cluster FILE] [--json]`."""
    ex = sub.add_parser("explain", help="measured vs predicted time per stage and rank of a "
                        "run, and the biggest difference")
    ex.add_argument("--plan", required=True, help="plan/1 JSON file the run trained")
    ex.add_argument("--metrics", required=True, metavar="RUN_DIR",
                    help="the run's --run-dir (ranks/rank*.jsonl)")
    ex.add_argument("--cluster", help="cluster file the plan was made for (default: "
                    "RUN_DIR/cluster.json)")
    ex.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ex.add_argument("--write-cluster", metavar="FILE",
                    help="also write the cluster with each device's tflops as its compute "
                         "measured in this run (calibrates the planner from the run's own "
                         "steps: plan again with --cluster FILE and the same performance "
                         "model, e.g. the same --calibration)")
    add_perf_model_args(ex)
    ex.set_defaults(func=cmd_explain)
