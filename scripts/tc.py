#!/usr/bin/env python3
"""Apply, show or reset a cluster's tc rules on every host: over SSH, or on local namespace hosts.

    python scripts/tc.py apply|show|reset|probe --cluster cluster.json --hosts ip_list
        [--known-hosts FILE] [--key KEY] [--sudo] [--group-by ...] [--iface eth0]
    python scripts/tc.py apply|show|reset|probe --cluster cluster.json --local PREFIX

Over SSH, line k of ip_list is host k; its address is what the other hosts' u32 filters match.
Where a kernel has no sch_netem the rules go in without netem leaves and the delay is handled
by the delay line (local namespaces: started automatically; SSH hosts: started when python3 and
NetfilterQueue are present there and it reports `ready`, else "delay NOT APPLIED" and exit 1).
`show` compares the live qdiscs/classes/filters and the running delay lines' delays (read back
from their command lines) with the cluster and exits 1 on a mismatch. `probe` measures bandwidth
and RTT of every ordered host pair (stdlib agent copied to ~/.scattered/netemu) and writes them
as a cluster file (--out measured.json), with configured vs measured printed side by side.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from formats import argtypes  # noqa: E402
from formats.atomic_io import check_output_path  # noqa: E402
from formats.cluster import load_cluster  # noqa: E402
from formats.errors import UserError, run_main  # noqa: E402
from scripts.netemu import netns  # noqa: E402
from scripts.netemu.cli import add_cluster_args, resolve  # noqa: E402
from scripts.netemu.local import DELAY_MODES, apply_local, reset_local, show_local  # noqa: E402
from scripts.netemu.shell import missing_root_tools  # noqa: E402
from scripts.netemu.sshctl import SSHOptions  # noqa: E402
from scripts.netemu.tcrules import build_host_rules  # noqa: E402

MAX_SECONDS = 3600.0


def run_local(args: argparse.Namespace) -> int:
    """The local namespace cluster `--local PREFIX`."""
    cluster = load_cluster(args.cluster)
    why = missing_root_tools(("ip", "tc"))
    if why:
        raise UserError(f"tc.py --local: {why}")
    st = netns.load_state(args.local)
    if cluster.num_devices != sum(len(g) for g in st.groups):
        raise UserError(f"{args.cluster}: {cluster.num_devices} devices, but local cluster "
                        f"{st.prefix} was built for {sum(len(g) for g in st.groups)}")
    if args.action == "apply":
        st.cluster_file = str(Path(args.cluster).resolve())
        for line in apply_local(st, cluster, args.delay):
            print(line)
        text, ok = show_local(st, cluster)
        print(text)
        return 0 if ok else 1
    if args.action == "probe":
        from scripts.netemu.probe import check_targets, probe_local
        text, _, ok = probe_local(st, cluster, Path(args.out), args.seconds)
        print(text)
        print(f"wrote {args.out}")
        return check_targets(ok)
    if args.action == "show":
        text, ok = show_local(st, cluster)
        print(f"delay: {st.delay_mode}")
        print(text)
        return 0 if ok else 1
    for line in reset_local(st, cluster):
        print(line)
    print(f"reset {st.num_hosts} namespace hosts of {st.prefix}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("action", choices=("apply", "show", "reset", "probe"))
    add_cluster_args(p)
    p.add_argument("--local", metavar="PREFIX",
                   help="the namespace hosts of `local_cluster.py up --prefix PREFIX`")
    p.add_argument("--delay", choices=DELAY_MODES, default="auto",
                   help="auto: netem if the kernel has it, else the delay line")
    p.add_argument("--known-hosts", default="known_hosts",
                   help="known_hosts file written by cluster_ssh.py accept-keys (known_hosts)")
    p.add_argument("--key", help="private key file (default: ssh agent / ~/.ssh keys)")
    p.add_argument("--sudo", action="store_true", help="prefix remote tc/iptables with sudo -n")
    p.add_argument("--timeout", type=argtypes.number(0, MAX_SECONDS, lo_open=True),
                   default=20.0, help="SSH connect timeout s (20)")
    p.add_argument("--remote-python", type=argtypes.name(), default="python3",
                   help="python on the hosts for the delay line and probe agent (python3)")
    p.add_argument("--out", default="measured.json", help="probe: measured cluster file")
    p.add_argument("--seconds", type=argtypes.number(0, MAX_SECONDS, lo_open=True), default=1.5,
                   help="probe: TCP stream per pair (1.5)")
    args = p.parse_args(argv)
    if (args.local is not None) == (args.hosts is not None):
        raise UserError("give exactly one of --hosts IP_LIST (SSH) or --local PREFIX")
    if args.action == "probe":
        check_output_path(args.out, "--out")
    if args.local is not None:
        netns.check_prefix(args.local, "--local")
        return run_local(args)
    SSHOptions(Path(args.known_hosts), args.key).check(True, args.hosts)
    r = resolve(args)
    build_host_rules(r.cluster, r.groups, r.addresses, args.iface, args.link_gbps)
    from scripts.netemu.remote import run_remote
    return run_remote(args, r)



def entry() -> None:
    """Console entry point (setup.py): run main() under run_main."""
    run_main(main)


if __name__ == "__main__":
    entry()
