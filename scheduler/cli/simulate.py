"""`simulate --cluster FILE --plan FILE [--timeline out.png] [--json]`: replay one training
step of any plan and print its breakdown."""

from __future__ import annotations

import argparse
import json

from formats.atomic_io import check_output_path
from formats.errors import UserError
from scheduler.cli.inputs import load_cluster_and_plan
from scheduler.cli.perf_model import add_perf_model_args, sim_config_from_args
from scheduler.simulator.report import format_sim_table
from scheduler.simulator.step import simulate_plan
from scheduler.time_to_target import simulate_rows


def cmd_simulate(args: argparse.Namespace) -> int:
    """Replay one training step of any plan and print its breakdown."""
    if args.timeline:
        check_output_path(args.timeline, "--timeline", ".png")
    cluster, plan = load_cluster_and_plan(args)
    if args.timeline and plan.is_sharded:
        raise UserError(f"--timeline: {args.plan} has shard groups; the event timeline draws "
                        f"D = 1 plans only (leave out --timeline)")
    try:
        result = simulate_plan(cluster, None, plan, sim_config_from_args(args, plan),
                               timeline=bool(args.timeline))
    except UserError as e:  # e.g. memory: say which plan file does not fit
        raise UserError(f"{args.plan}: {e}") from None
    if args.timeline:
        from scheduler.timeline import save_timeline_png  # matplotlib only when asked
        save_timeline_png(result, args.timeline, f"{plan.model} on {cluster.name}")
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print("\n".join([format_sim_table(result),
                         *simulate_rows(plan.predicted, result.run_step_s or result.step_s)]))
        if args.timeline:
            print(f"wrote {args.timeline}")
    return 0


def add_simulate_command(sub: argparse._SubParsersAction) -> None:
    """`simulate --cluster FILE --plan FILE [--timeline out.png] [--json]`."""
    si = sub.add_parser("simulate", help="replay one step of a plan: step time and breakdown")
    si.add_argument("--cluster", required=True,
                    help="cluster JSON file (cluster/1, or cluster/2: compact)")
    si.add_argument("--plan", required=True, help="plan/1 or plan/2 JSON file (ours or anyone's)")
    si.add_argument("--timeline", help="Gantt chart PNG: one row per device")
    si.add_argument("--json", action="store_true", help="one JSON object on stdout")
    add_perf_model_args(si)
    si.set_defaults(func=cmd_simulate)
