"""A real two-NAT topology on one Linux host, built from network namespaces (needs root).

    pub (server, router) 10.200.1.1 -- 10.200.1.2 natA 192.168.1.1 -- 192.168.1.2 cliA
                         10.200.2.1 -- 10.200.2.2 natB 192.168.2.1 -- 192.168.2.2 cliB

Each NAT namespace masquerades its LAN behind its WAN address (optionally `--random-fully`,
which picks a new public port per destination, like a symmetric NAT) and filters like a home
router: on the WAN side only ESTABLISHED,RELATED packets are accepted (INPUT and FORWARD).
The two LANs have no route to each other. `Lab.close()` deletes everything it created.

    python udp_hole_punching_test/netns_lab.py up|down --prefix NAME [--random-fully]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

SERVER_IP = "10.200.1.1"
CLIENT_IPS = {"a": "192.168.1.2", "b": "192.168.2.2"}
NAT_WAN_IPS = {"a": "10.200.1.2", "b": "10.200.2.2"}


def missing_requirements() -> str | None:
    """Why the lab cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, iptables)"
    for tool, pkg in (("ip", "iproute2"), ("iptables", "iptables")):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (Debian package {pkg})"
    return _nat_namespace_unusable()


def _nat_namespace_unusable() -> str | None:
    """Why a namespace with a NAT table cannot be made (a container may forbid either)."""
    probe = f"natprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        nat = subprocess.run(["ip", "netns", "exec", probe, "iptables", "-t", "nat", "-L"],
                             capture_output=True, text=True)
        if nat.returncode != 0:
            return f"iptables NAT table unusable in a namespace: {nat.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
    return proc


@dataclass
class Lab:
    """The namespaces of one topology; names start with `prefix` so parallel runs differ."""

    prefix: str
    random_fully: dict[str, bool] = field(default_factory=lambda: {"a": False, "b": False})
    router_firewall: bool = True
    created: list[str] = field(default_factory=list)

    def ns(self, role: str) -> str:
        """Namespace name of 'pub', 'nata', 'natb', 'clia' or 'clib'."""
        return f"{self.prefix}{role}"

    def exec_prefix(self, role: str) -> list[str]:
        """Command prefix that runs a program inside the namespace of `role`."""
        return ["ip", "netns", "exec", self.ns(role)]

    def run(self, role: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a command inside a namespace."""
        return _sh(*self.exec_prefix(role), *cmd, check=check)

    def up(self) -> Lab:
        """Create namespaces, links, addresses, routes, NAT and firewall rules."""
        try:
            for role in ("pub", "nata", "natb", "clia", "clib"):
                _sh("ip", "netns", "add", self.ns(role))
                self.created.append(self.ns(role))
                self.run(role, "ip", "link", "set", "lo", "up")
            self.run("pub", "sysctl", "-qw", "net.ipv4.ip_forward=1")
            for side, n in (("a", 1), ("b", 2)):
                nat, cli = f"nat{side}", f"cli{side}"
                wan_pub, wan_nat = f"{self.prefix}w{side}0", f"{self.prefix}w{side}1"
                lan_nat, lan_cli = f"{self.prefix}l{side}0", f"{self.prefix}l{side}1"
                self._veth(wan_pub, "pub", f"10.200.{n}.1/24", wan_nat, nat, f"10.200.{n}.2/24")
                self._veth(lan_nat, nat, f"192.168.{n}.1/24", lan_cli, cli, f"192.168.{n}.2/24")
                self.run(nat, "ip", "route", "add", "default", "via", f"10.200.{n}.1")
                self.run(cli, "ip", "route", "add", "default", "via", f"192.168.{n}.1")
                self.run(nat, "sysctl", "-qw", "net.ipv4.ip_forward=1")
                masq = ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", wan_nat]
                masq += ["-j", "MASQUERADE"]
                if self.random_fully.get(side):
                    masq.append("--random-fully")
                self.run(nat, *masq)
                if self.router_firewall:
                    for chain in ("INPUT", "FORWARD"):
                        self.run(
                            nat, "iptables", "-A", chain, "-i", wan_nat, "-m", "conntrack",
                            "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT",
                        )  # fmt: skip
                        self.run(nat, "iptables", "-A", chain, "-i", wan_nat, "-j", "DROP")
        except BaseException:
            self.close()
            raise
        return self

    def _veth(self, a: str, ns_a: str, ip_a: str, b: str, ns_b: str, ip_b: str) -> None:
        _sh("ip", "link", "add", a, "netns", self.ns(ns_a), "type", "veth", "peer", b,
            "netns", self.ns(ns_b))  # fmt: skip
        for dev, ns, ip in ((a, ns_a, ip_a), (b, ns_b, ip_b)):
            self.run(ns, "ip", "address", "add", ip, "dev", dev)
            self.run(ns, "ip", "link", "set", dev, "up")

    def close(self) -> None:
        """Delete every namespace this lab created (their links, rules and conntrack go too)."""
        for name in reversed(self.created):
            _sh("ip", "netns", "del", name, check=False)
        self.created.clear()

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    """CLI: build or remove a lab by prefix (for trying things by hand)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["up", "down"])
    ap.add_argument("--prefix", default="natlab")
    ap.add_argument("--random-fully", action="store_true", help="symmetric-like NAT on side a")
    ap.add_argument(
        "--no-router-firewall",
        action="store_true",
        help="accept all WAN input on the NAT boxes (breaks punching; see docs/nat.md)",
    )
    args = ap.parse_args(argv)
    why = missing_requirements()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    lab = Lab(
        args.prefix,
        random_fully={"a": args.random_fully, "b": False},
        router_firewall=not args.no_router_firewall,
    )
    if args.action == "up":
        lab.up()
        print(f"namespaces: {', '.join(lab.created)}; server address {SERVER_IP}")
    else:
        lab.created = [lab.ns(r) for r in ("pub", "nata", "natb", "clia", "clib")]
        lab.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
