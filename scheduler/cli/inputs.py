"""The cluster and plan files a planner subcommand reads (errors name the flag)."""

from __future__ import annotations

import argparse
import sys

from formats.cluster import Cluster, load_cluster
from formats.errors import UserError
from formats.plan import Plan, id_ranges, load_plan
from scheduler.scenarios import make_scenario


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    """The cluster of `--cluster FILE` or `--scenario NAME [--seed S]` (exactly one)."""
    if args.cluster and args.scenario:
        raise UserError("give either --cluster FILE or --scenario NAME, not both")
    if args.cluster:
        if args.seed is not None:
            raise UserError("--seed shuffles a --scenario's device ids; a --cluster file has "
                            "its own ids (leave --seed out)")
        return load_cluster(args.cluster)
    if args.scenario:
        return make_scenario(args.scenario, args.seed or 0)
    raise UserError("which cluster? give --cluster FILE or --scenario NAME")


def load_cluster_and_plan(args: argparse.Namespace) -> tuple[Cluster, Plan]:
    """Load both files; warn when the plan was made for a cluster with other contents."""
    cluster = load_cluster(args.cluster)
    plan = load_plan(args.plan, cluster)
    if plan.cluster_sha256 and plan.cluster_sha256 != cluster.sha256():
        print(f"warning: {args.plan} was made for cluster '{plan.cluster}' with other "
              f"contents than {args.cluster}", file=sys.stderr)
    unused = sorted(set(range(cluster.num_devices)) - set(plan.devices()))
    if unused:
        print(f"note: {args.plan} leaves devices {id_ranges(unused)} of {args.cluster} idle",
              file=sys.stderr)
    return cluster, plan
