#!/usr/bin/env python3
"""A cluster file emulated on one machine: network-namespace hosts with shaped links.

    python scripts/local_cluster.py up --cluster cluster.json [--hosts N] [--prefix stn]
    python scripts/local_cluster.py probe [--prefix stn] [--out measured.json]
    python scripts/local_cluster.py status|down [--prefix stn]

`up` creates N namespace hosts `{prefix}-0..N-1` (eth0 198.18.0.1.., lo up, veths into bridge
`{prefix}-br`), maps devices onto them (--group-by modulo: device i on host i % N; region:
region k on host k % N), applies the cluster's tc rules in each namespace (netem where the
kernel has it, else the NFQUEUE delay line on each receiver's INPUT; a missing delay is
reported, never silent) and writes into --out-dir (default out/local_cluster/PREFIX):
  ip_list         one `root@ADDRESS` per host (for cluster_ssh.py when sshd runs in them)
  netns_map.json  hosts and rank -> namespace/address/iface (format netns-map/1)
  rank_netns.json {"RANK": "NAMESPACE"} for `launch_local.py --netns-map`
  cluster.json    the cluster with every device.host set to its namespace host's address
`down` removes everything of the prefix (idempotent; also after a crash). Needs root.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from formats import argtypes  # noqa: E402
from formats.atomic_io import (  # noqa: E402
    atomic_write_bytes,
    atomic_write_json,
    check_output_dir,
    check_output_path,
)
from formats.cluster import Cluster, load_cluster, save_cluster  # noqa: E402
from formats.errors import UserError, run_main  # noqa: E402
from scripts.netemu import netns  # noqa: E402
from scripts.netemu.hostlist import HostEntry, format_host_list  # noqa: E402
from scripts.netemu.local import DELAY_MODES, apply_local, show_local  # noqa: E402
from scripts.netemu.shell import missing_root_tools  # noqa: E402
from scripts.netemu.sshd import sshd_missing, start_sshds  # noqa: E402
from scripts.netemu.tcrules import build_host_rules, group_devices  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NETNS_MAP_FORMAT = "netns-map/1"
MAX_PROBE_SECONDS = 3600.0
MAX_PINGS = 10_000


def netns_map(st: netns.NetnsState) -> dict:
    """The rank -> namespace map the launcher reads (rank = device id)."""
    hosts = [{"index": i, "netns": st.namespace(i), "address": netns.address(i),
              "iface": netns.IFACE, "devices": list(g)} for i, g in enumerate(st.groups)]
    ranks = {str(d): {"netns": h["netns"], "address": h["address"], "iface": netns.IFACE,
                      "host": h["index"]} for h in hosts for d in h["devices"]}
    return {"format": NETNS_MAP_FORMAT, "prefix": st.prefix, "delay_mode": st.delay_mode,
            "hosts": hosts, "ranks": dict(sorted(ranks.items(), key=lambda kv: int(kv[0])))}


def local_cluster_file(cluster: Cluster, st: netns.NetnsState) -> Cluster:
    """The cluster with each device.host replaced by its namespace host's address."""
    host_of = {d: i for i, g in enumerate(st.groups) for d in g}
    devices = [replace(d, host=netns.address(host_of[d.id])) for d in cluster.devices]
    return Cluster(cluster.name, devices, cluster.latency_ms, cluster.bandwidth_gbps)


def cmd_up(args: argparse.Namespace) -> int:
    """Create, shape and describe the namespace hosts."""
    cluster = load_cluster(args.cluster)
    n = args.hosts if args.hosts is not None else cluster.num_devices
    groups = group_devices(cluster, args.group_by, n)
    out_dir = Path(args.out_dir or ROOT / "out" / "local_cluster" / args.prefix)
    check_output_dir(out_dir, "--out-dir")
    # Check the rules before creating anything (a rate above --link-gbps, too many classes).
    build_host_rules(cluster, groups, [netns.address(i) for i in range(len(groups))],
                     netns.IFACE, args.link_gbps)
    if args.sshd is not None and (sshd_missing() or not Path(args.sshd).is_file()):
        raise UserError(f"--sshd {args.sshd}: " + (sshd_missing() or "no such file (give a "
                        "public key, e.g. ~/.ssh/id_ed25519.pub, or an authorized_keys file)"))
    require_root_tools(args.cmd)
    st = netns.create(args.prefix, len(groups), args.mtu)
    try:
        st.groups = [list(g) for g in groups]
        st.group_by, st.link_gbps = args.group_by, args.link_gbps
        st.cluster_file, st.out_dir = str(Path(args.cluster).resolve()), str(out_dir)
        st.save()
        report = apply_local(st, cluster, args.delay)
        entries = [HostEntry("root", netns.address(i)) for i in range(st.num_hosts)]
        atomic_write_bytes(out_dir / "ip_list", format_host_list(
            entries, f"namespace hosts of local cluster {st.prefix}").encode())
        nm = netns_map(st)
        atomic_write_json(out_dir / "netns_map.json", nm)
        atomic_write_json(out_dir / "rank_netns.json",
                          {r: v["netns"] for r, v in nm["ranks"].items()})
        save_cluster(local_cluster_file(cluster, st), out_dir / "cluster.json")
        if args.sshd:
            report += start_sshds(st, Path(args.sshd), out_dir / "sshd")
            report.append(f"pin their host keys: python scripts/cluster_ssh.py --hosts "
                          f"{out_dir}/ip_list --known-hosts {out_dir}/known_hosts accept-keys")
    except BaseException:
        netns.destroy(args.prefix)
        raise
    for i, g in enumerate(st.groups):
        print(f"host {i}: netns {st.namespace(i)} {netns.address(i)} devices {g}")
    for line in report:
        print(line)
    print(f"wrote {out_dir}/ip_list, netns_map.json, rank_netns.json, cluster.json")
    print(f"state {netns.state_path(st.prefix)}; remove with: python scripts/local_cluster.py "
          f"down --prefix {st.prefix}")
    return 0


def require_root_tools(cmd: str) -> None:
    """UserError unless this runs as root with ip, tc and iptables (after the input checks,
    so that a bad flag is named as such on any machine)."""
    why = missing_root_tools(("ip", "tc", "iptables"))
    if why:
        raise UserError(f"local_cluster.py {cmd}: {why}")


def cmd_down(args: argparse.Namespace) -> int:
    """Remove everything of the prefix."""
    require_root_tools(args.cmd)
    removed = netns.destroy(args.prefix)
    print(f"removed: {', '.join(removed)}" if removed else
          f"nothing of prefix {args.prefix!r} was left")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Show live rules vs the cluster; exit 1 on a mismatch."""
    require_root_tools(args.cmd)
    st = netns.load_state(args.prefix)
    text, ok = show_local(st, load_cluster(st.cluster_file))
    print(f"local cluster {st.prefix}: {st.num_hosts} hosts, delay {st.delay_mode}")
    print(text)
    return 0 if ok else 1


def cmd_probe(args: argparse.Namespace) -> int:
    """Measure every ordered host pair; write measured.json. Exit 1 when a pair is outside
    the target, or cannot be measured (then nothing is written)."""
    from scripts.netemu.probe import check_targets, probe_local
    if args.out:
        check_output_path(args.out, "--out")
    require_root_tools(args.cmd)
    st = netns.load_state(args.prefix)
    out = Path(args.out or Path(st.out_dir) / "measured.json")
    text, _, ok = probe_local(st, load_cluster(st.cluster_file), out, args.seconds,
                              args.pings)
    print(text)
    print(f"wrote {out}")
    return check_targets(ok)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create namespace hosts and shape their links")
    up.add_argument("--cluster", required=True, help="cluster/1 JSON file")
    up.add_argument("--hosts", type=argtypes.integer(1), default=None,
                    help="number of namespace hosts N (default: one per device)")
    up.add_argument("--group-by", choices=("modulo", "region"), default="modulo",
                    help="device -> host mapping (modulo: device i on host i %% N)")
    up.add_argument("--link-gbps", type=float, default=100.0,  # checked by tcrules.gbps_to_kbit
                    help="link capacity in Gbit/s; a class above it is an error (100)")
    up.add_argument("--delay", choices=DELAY_MODES, default="auto",
                    help="auto: netem if the kernel has it, else the NFQUEUE delay line")
    up.add_argument("--mtu", type=argtypes.integer(netns.MIN_MTU, netns.MAX_MTU),
                    default=netns.DEFAULT_MTU,
                    help="the hosts' interface MTU in bytes (1500). Without netem the NFQUEUE "
                    "delay line handles every packet in Python on the ranks' cores: 9000 cuts "
                    "its CPU per byte ~3x, 65000 (the lab benchmarks') ~7x (docs/emulator.md)")
    up.add_argument("--out-dir", help="where ip_list, netns_map.json, cluster.json go")
    up.add_argument("--sshd", metavar="AUTHORIZED_KEYS",
                    help="also run a real sshd on port 22 of every host, accepting root logins "
                    "by the keys in this file (e.g. ~/.ssh/id_ed25519.pub): rehearse the "
                    "SSH workflow for real hosts (measure.py, cluster_ssh.py) on one machine")
    probe = sub.add_parser("probe", help="measure bandwidth and RTT per host pair")
    probe.add_argument("--out", help="measured cluster file (default OUT_DIR/measured.json)")
    probe.add_argument("--seconds", type=argtypes.number(0, MAX_PROBE_SECONDS, lo_open=True),
                       default=1.5, help="TCP stream per pair (1.5)")
    probe.add_argument("--pings", type=argtypes.integer(1, MAX_PINGS), default=10,
                       help="TCP ping-pongs per pair (10)")
    for name in ("down", "status"):
        sub.add_parser(name, help=f"{name} the local cluster")
    for sp in sub.choices.values():
        sp.add_argument("--prefix", default="stn", help="name prefix of the namespace hosts (stn)")
    args = p.parse_args(argv)
    netns.check_prefix(args.prefix)
    return {"up": cmd_up, "down": cmd_down, "status": cmd_status, "probe": cmd_probe}[args.cmd](
        args)



def entry() -> None:
    """Console entry point (setup.py): run main() under run_main."""
    run_main(main)


if __name__ == "__main__":
    entry()
