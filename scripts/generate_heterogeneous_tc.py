#!/usr/bin/env python3
"""Print the exact `tc` commands (htb + netem + u32) that emulate a cluster file on each host.

    python scripts/generate_heterogeneous_tc.py --cluster cluster.json [--host-index I | --all]
        [--hosts ip_list] [--group-by host|modulo|region] [--num-hosts N] [--iface eth0]
        [--link-gbps 100] [--no-netem]

Rate classes above --link-gbps, or more classes than htb's 16-bit minor ids allow, are errors.
With --no-netem the delay is left to scripts/delay_line.py on each receiver: every host's
output names the exact delay_line.py command to run there.
"""

from __future__ import annotations

import argparse

from formats.errors import UserError, run_main  # noqa: E402
from scripts.netemu.cli import add_cluster_args, resolve  # noqa: E402
from scripts.netemu.tcrules import build_host_rules, receiver_delays, render  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cluster_args(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--host-index", type=int, help="print only host I (0-based)")
    which.add_argument("--all", action="store_true", help="print every host (the default)")
    p.add_argument("--no-netem", action="store_true",
                   help="leave out the netem delay leaves (kernels without sch_netem); the "
                        "output names the delay_line.py command each host must run instead")
    args = p.parse_args(argv)
    r = resolve(args)
    rules = build_host_rules(r.cluster, r.groups, r.addresses, args.iface, args.link_gbps)
    delays = receiver_delays(r.cluster, r.groups, r.addresses)
    if args.host_index is not None:
        if not 0 <= args.host_index < len(rules):
            raise UserError(f"--host-index: must be 0..{len(rules) - 1}, got {args.host_index}")
        rules = [rules[args.host_index]]
    print("\n\n".join(render(h, not args.no_netem, delays[h.host.index]) for h in rules))
    return 0


if __name__ == "__main__":
    run_main(main)
