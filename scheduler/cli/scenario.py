"""`scenario NAME --seed S --out FILE`: export a built-in scenario as a cluster file."""

from __future__ import annotations

import argparse

from formats import argtypes
from formats.atomic_io import check_output_path
from formats.cluster import CLUSTER_FORMAT, COMPACT_FORMAT, MAX_DENSE_DEVICES, save_cluster
from formats.errors import UserError
from scheduler.cli.fields import SEED
from scheduler.scenarios import SCENARIOS, make_scenario

MAX_SCENARIO_DEVICES = 1_000_000
"""Largest random scenario (compact form: 1M devices take about 30 s and 170 MB)."""


def cmd_scenario(args: argparse.Namespace) -> int:
    """Export a built-in scenario as a cluster file."""
    check_output_path(args.out, "--out")
    given = {k: v for k, v in (("num_devices", args.devices), ("num_regions", args.regions))
             if v is not None}
    if given and args.name != "random":
        raise UserError(f"--devices/--regions apply to the random scenario only; "
                        f"'{args.name}' has a fixed layout")
    if args.devices is not None and args.devices > MAX_DENSE_DEVICES and not args.compact:
        raise UserError(f"--devices {args.devices}: the full form holds {args.devices} x "
                        f"{args.devices} link matrices; above {MAX_DENSE_DEVICES} devices give "
                        "--compact")
    if given.get("num_regions", 0) > given.get("num_devices", 64):
        raise UserError(f"--regions {args.regions}: more regions than the "
                        f"{given.get('num_devices', 64)} --devices")
    kwargs = {"num_devices": 64, "num_regions": 4, **given} if args.name == "random" else {}
    if args.name == "random" and args.compact:
        kwargs["compact"] = True  # built by region: never makes the N x N matrices
    cluster = make_scenario(args.name, args.seed, **kwargs)
    if args.compact:
        cluster = cluster.to_compact()
    save_cluster(cluster, args.out)
    form = f"compact form ({COMPACT_FORMAT})" if cluster.is_compact else \
        f"full form ({CLUSTER_FORMAT})"
    print(f"wrote {args.out}: {cluster.name}, {cluster.num_devices} devices in "
          f"{len(set(cluster.regions()))} regions, {form}")
    return 0


def add_scenario_command(sub: argparse._SubParsersAction) -> None:
    """`scenario NAME --seed S --out FILE`."""
    sc = sub.add_parser("scenario", help="export a built-in cluster scenario")
    sc.add_argument("name", choices=sorted(SCENARIOS))
    sc.add_argument("--seed", type=SEED, default=0, help="shuffles device ids (default 0)")
    sc.add_argument("--devices", type=argtypes.integer(1, MAX_SCENARIO_DEVICES),
                    help=f"random only: device count (default 64; above {MAX_DENSE_DEVICES} "
                    "only with --compact)")
    sc.add_argument("--regions", type=argtypes.integer(1, MAX_SCENARIO_DEVICES),
                    help="random only: region count, at most --devices (default 4)")
    sc.add_argument("--compact", action="store_true",
                    help=f"write the compact form ({COMPACT_FORMAT}: links per region pair, "
                         f"other links as exact pair links) instead of N x N matrices; what "
                         f"swarms of thousands of devices need")
    sc.add_argument("--out", required=True, help="cluster file to write")
    sc.set_defaults(func=cmd_scenario)
