"""Shared pieces of the scripts/ entry points: cluster arguments and cluster -> host resolution."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from formats import argtypes
from formats.cluster import Cluster, load_cluster
from formats.errors import UserError
from scripts.netemu.hostlist import HostEntry, ipv4_of, load_host_list
from scripts.netemu.tcrules import GROUP_MODES, group_devices


def add_cluster_args(p: argparse.ArgumentParser, host_list: bool = True) -> None:
    """--cluster, --group-by, --num-hosts, --iface, --link-gbps (and --hosts ip_list)."""
    p.add_argument("--cluster", required=True, help="cluster/1 JSON file")
    if host_list:
        p.add_argument("--hosts", metavar="IP_LIST",
                       help="host list (user@host[:port] per line); line k is host k and its "
                            "address is what the u32 filters match")
    p.add_argument("--group-by", choices=GROUP_MODES, default=None,
                   help="how devices map to hosts: host = one host per distinct device.host "
                        "(default without a host list), modulo = device i on host i %% N "
                        "(default with a host list), region = region k on host k %% N")
    p.add_argument("--num-hosts", type=argtypes.integer(1), default=None,
                   help="number of hosts N for --group-by modulo/region (default: the host "
                        "list's length)")
    p.add_argument("--iface", type=argtypes.interface_name, default="eth0",
                   help="egress interface on each host (eth0)")
    p.add_argument("--link-gbps", type=float, default=100.0,  # checked by tcrules.gbps_to_kbit
                   help="link capacity in Gbit/s; a class above it is an error (100)")


@dataclass
class Resolved:
    """A cluster mapped onto hosts."""

    cluster: Cluster
    groups: list[tuple[int, ...]]
    addresses: list[str]
    entries: list[HostEntry] | None


def resolve(args: argparse.Namespace) -> Resolved:
    """Load the cluster and map its devices onto hosts with addresses."""
    cluster = load_cluster(args.cluster)
    entries = load_host_list(args.hosts) if getattr(args, "hosts", None) else None
    by = args.group_by or ("modulo" if entries else "host")
    n = args.num_hosts if args.num_hosts is not None else (len(entries) if entries else None)
    if entries and n != len(entries):
        raise UserError(f"--num-hosts {n} but the host list {args.hosts} has {len(entries)} "
                        "hosts")
    groups = group_devices(cluster, by, n)
    if entries:
        addresses = [ipv4_of(e.host, f"{args.hosts} host {k}") for k, e in enumerate(entries)]
    else:
        addresses = [ipv4_of(cluster.devices[g[0]].host, f"devices[{g[0]}].host")
                     for g in groups]
    return Resolved(cluster, groups, addresses, entries)
