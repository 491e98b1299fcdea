"""Per-host `tc` rules from a cluster file (pure: builds argv lists, runs nothing).

Devices are grouped onto hosts; devices on one host share that host's links (traffic between them
stays on the host and is not shaped). The link from host A to host B takes the slowest bandwidth
and the largest one-way latency over all device pairs (a on A, b on B): what the slowest pair of
the two hosts would see. Each sending host gets

    tc qdisc add dev IF root handle 1: htb default 0           # unmatched traffic: not shaped
    tc class add dev IF parent 1: classid 1:1 htb rate LINK ceil LINK quantum Q
    tc class add dev IF parent 1:1 classid 1:MINOR htb rate R ceil R quantum Q  # per (R, delay)
    tc qdisc add dev IF parent 1:MINOR handle MINOR: netem delay Dms limit P  # if delay > 0
    tc filter add dev IF parent 1: protocol ip prio 1 u32 match ip dst ADDR/32 flowid 1:MINOR

htb class ids are `major:minor` with 16-bit hexadecimal parts; leaf classes use minors 0x10 ..
0xfffe (their netem qdiscs reuse the minor as handle major, and ffff: is the ingress handle), so
a host can have at most MAX_CLASSES = 65519 (rate, delay) classes. The u32 filters all sit in
hash table 800: whose node ids are 12-bit (0x001..0xfff), so a host can send to at most
MAX_FILTERS = 4095 other hosts.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass, field

import numpy as np

from formats.cluster import Cluster
from formats.errors import UserError

FIRST_MINOR = 0x10
LAST_MINOR = 0xFFFE
MAX_CLASSES = LAST_MINOR - FIRST_MINOR + 1
MAX_FILTERS = 0xFFF
GROUP_MODES = ("host", "modulo", "region")
MTU_BYTES = 1500


@dataclass(frozen=True)
class HostGroup:
    """One emulated host: its address and the cluster devices it holds."""

    index: int
    address: str
    devices: tuple[int, ...]


@dataclass
class TcClass:
    """One htb leaf: every destination host reached at this (rate, delay)."""

    minor: int
    rate_kbit: int
    delay_ms: float
    dest_hosts: list[int] = field(default_factory=list)
    dest_addresses: list[str] = field(default_factory=list)

    @property
    def classid(self) -> str:
        """`1:MINOR` in tc's hexadecimal notation."""
        return f"1:{self.minor:x}"


@dataclass
class HostRules:
    """Everything tc must hold on one sending host."""

    host: HostGroup
    iface: str
    link_kbit: int
    classes: list[TcClass]


def group_devices(cluster: Cluster, by: str = "host", num_hosts: int | None = None
                  ) -> list[tuple[int, ...]]:
    """Device ids per host. `host`: one host per distinct device.host (in id order);
    `modulo`: device i on host i % N; `region`: region k (in order of first appearance) on host
    k % N (N = number of regions unless given)."""
    n = cluster.num_devices
    if by not in GROUP_MODES:
        raise UserError(f"--group-by: expected one of {', '.join(GROUP_MODES)}, got {by!r}")
    if num_hosts is not None and not 1 <= num_hosts <= n:
        raise UserError(f"--hosts: must be 1..{n} (the cluster has {n} devices), got {num_hosts}")
    if by == "modulo":
        k = num_hosts or n
        return [tuple(range(h, n, k)) for h in range(k)]
    keys = [d.host if by == "host" else d.region for d in cluster.devices]
    order = list(dict.fromkeys(keys))
    if by == "host" and num_hosts is not None and num_hosts != len(order):
        raise UserError(
            f"--hosts {num_hosts}: the cluster names {len(order)} distinct device.host values; "
            "use --group-by modulo or region to put devices on a different number of hosts")
    k = num_hosts or len(order)
    groups: list[list[int]] = [[] for _ in range(k)]
    for dev, key in enumerate(keys):
        groups[order.index(key) % k].append(dev)
    empty = [h for h, g in enumerate(groups) if not g]
    if empty:
        raise UserError(f"--hosts {k}: host {empty[0]} would hold no device (only {len(order)} "
                        f"distinct {by} values)")
    return [tuple(g) for g in groups]


def host_links(cluster: Cluster, groups: list[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """(latency_ms, bandwidth_gbps) between hosts: max latency, min bandwidth over device pairs."""
    k = len(groups)
    lat = np.zeros((k, k))
    bw = np.full((k, k), np.inf)
    for a, ga in enumerate(groups):
        for b, gb in enumerate(groups):
            if a != b:
                sub = np.ix_(list(ga), list(gb))
                lat[a, b] = float(cluster.latency_ms[sub].max())
                bw[a, b] = float(cluster.bandwidth_gbps[sub].min())
    return lat, bw


def format_rate(kbit: int) -> str:
    """An exact tc rate: `Nmbit` when a whole number of Mbit/s, else `Nkbit` (SI units)."""
    return f"{kbit // 1000}mbit" if kbit % 1000 == 0 else f"{kbit}kbit"


def format_delay(ms: float) -> str:
    """A tc time in milliseconds, microsecond resolution."""
    return f"{round(ms * 1000) / 1000:g}ms"


def gbps_to_kbit(gbps: float, where: str) -> int:
    """Gbit/s -> whole kbit/s; errors for rates tc cannot express (< 1 kbit/s, nan, inf)."""
    if not math.isfinite(gbps):
        raise UserError(f"{where}: {gbps} Gbit/s is not a finite rate")
    kbit = round(gbps * 1e6)
    if kbit < 1:
        raise UserError(f"{where}: {gbps} Gbit/s is below tc's smallest rate (1 kbit/s)")
    return kbit


def build_host_rules(cluster: Cluster, groups: list[tuple[int, ...]], addresses: list[str],
                     iface: str = "eth0", link_gbps: float = 100.0,
                     max_classes: int = MAX_CLASSES, max_filters: int = MAX_FILTERS
                     ) -> list[HostRules]:
    """The rules of every host; errors name the host pair for an impossible rate or class count."""
    if len(addresses) != len(groups):
        raise UserError(f"{len(groups)} hosts but {len(addresses)} addresses; give one address "
                        "per host (host list lines, or distinct device.host values)")
    if len(set(addresses)) != len(addresses):
        raise UserError(f"host addresses must be distinct, got {addresses}")
    link_kbit = gbps_to_kbit(link_gbps, "--link-gbps")
    if len(groups) - 1 > max_filters:
        raise UserError(f"{len(groups)} hosts: each host needs one u32 filter per other host, and "
                        f"tc's u32 node ids allow at most {max_filters} per host; use fewer hosts "
                        "(--num-hosts, --group-by region)")
    lat, bw = host_links(cluster, groups)
    hosts = [HostGroup(i, a, g) for i, (a, g) in enumerate(zip(addresses, groups))]
    out = []
    for src in hosts:
        by_key: dict[tuple[int, float], TcClass] = {}
        for dst in hosts:
            if dst.index == src.index:
                continue
            where = f"host {src.index} ({src.address}) -> host {dst.index} ({dst.address})"
            kbit = gbps_to_kbit(float(bw[src.index, dst.index]), where)
            if kbit > link_kbit:
                raise UserError(
                    f"{where}: rate {format_rate(kbit)} is above the link capacity "
                    f"{format_rate(link_kbit)}; raise --link-gbps to the NIC speed or lower the "
                    "cluster's bandwidth_gbps")
            delay = round(float(lat[src.index, dst.index]), 3)
            cls = by_key.get((kbit, delay))
            if cls is None:
                if len(by_key) >= max_classes:
                    raise UserError(
                        f"host {src.index} ({src.address}) needs more than {max_classes} distinct "
                        "(rate, delay) classes; htb class minor ids are 16-bit hex "
                        f"(0x{FIRST_MINOR:x}..0x{LAST_MINOR:x}); round the cluster's matrices")
                cls = TcClass(FIRST_MINOR + len(by_key), kbit, delay)
                by_key[(kbit, delay)] = cls
            cls.dest_hosts.append(dst.index)
            cls.dest_addresses.append(dst.address)
        out.append(HostRules(src, iface, link_kbit, list(by_key.values())))
    return out


def netem_limit_packets(rate_kbit: int, delay_ms: float) -> int:
    """netem queue long enough for twice the bandwidth-delay product (default 1000 drops)."""
    bdp = rate_kbit * 1000 * delay_ms / 1000 / (8 * MTU_BYTES)
    return max(1000, 2 * math.ceil(bdp))


def htb_quantum(rate_kbit: int) -> int:
    """htb's default quantum (rate/r2q, r2q = 10) clamped to the 1514..200000 bytes it accepts
    without a kernel warning; with ceil = rate no class borrows, so it only silences that."""
    return min(200_000, max(1514, rate_kbit * 1000 // 8 // 10))


def apply_commands(rules: HostRules, netem: bool = True) -> list[list[str]]:
    """tc argv lists that install `rules` (netem leaves only when `netem`)."""
    dev = ["dev", rules.iface]
    link = format_rate(rules.link_kbit)
    cmds = [["tc", "qdisc", "add", *dev, "root", "handle", "1:", "htb", "default", "0"],
            ["tc", "class", "add", *dev, "parent", "1:", "classid", "1:1", "htb",
             "rate", link, "ceil", link, "quantum", str(htb_quantum(rules.link_kbit))]]
    for c in rules.classes:
        rate = format_rate(c.rate_kbit)
        cmds.append(["tc", "class", "add", *dev, "parent", "1:1", "classid", c.classid, "htb",
                     "rate", rate, "ceil", rate, "quantum", str(htb_quantum(c.rate_kbit))])
        if netem and c.delay_ms > 0:
            cmds.append(["tc", "qdisc", "add", *dev, "parent", c.classid, "handle",
                         f"{c.minor:x}:", "netem", "delay", format_delay(c.delay_ms),
                         "limit", str(netem_limit_packets(c.rate_kbit, c.delay_ms))])
        elif c.delay_ms > 0:
            # Delay added elsewhere (receiver's delay line): the default 1000-packet leaf queue
            # would drop TCP's slow-start overshoot on a long path and the flow would recover
            # slowly, so give the leaf room for the round trip's bandwidth-delay product.
            cmds.append(["tc", "qdisc", "add", *dev, "parent", c.classid, "handle",
                         f"{c.minor:x}:", "pfifo", "limit",
                         str(netem_limit_packets(c.rate_kbit, 2 * c.delay_ms))])
        for addr in c.dest_addresses:
            cmds.append(["tc", "filter", "add", *dev, "parent", "1:", "protocol", "ip", "prio",
                         "1", "u32", "match", "ip", "dst", f"{addr}/32", "flowid", c.classid])
    return cmds


def reset_commands(iface: str) -> list[list[str]]:
    """tc argv lists that remove the rules (deleting the root qdisc removes classes/filters)."""
    return [["tc", "qdisc", "del", "dev", iface, "root"]]


def receiver_delays(cluster: Cluster, groups: list[tuple[int, ...]], addresses: list[str]
                    ) -> list[dict[str, float]]:
    """Per receiving host: {source address: one-way delay ms} for a receiver-side delay line."""
    lat, _ = host_links(cluster, groups)
    return [{addresses[j]: round(float(lat[j, i]), 3) for j in range(len(groups))
             if j != i and lat[j, i] > 0} for i in range(len(groups))]


def delay_line_command(delays: dict[str, float]) -> str:
    """The shell command that holds traffic into a host for `delays` ({source: ms})."""
    return shlex.join(["python3", "scripts/delay_line.py", "--delays", json.dumps(delays)])


def render(rules: HostRules, netem: bool = True, line_delays: dict[str, float] | None = None
           ) -> str:
    """Human/shell text for one host: a comment header, apply commands, reset commands.

    Without netem, `line_delays` (this host's entry of receiver_delays) names the delay line
    that must run on the host, so the missing delay is stated, not only implied by comments."""
    h = rules.host
    lines = [f"# host {h.index} {h.address} devices {list(h.devices)} iface {rules.iface}: "
             f"{len(rules.classes)} class(es), link {format_rate(rules.link_kbit)}"]
    for c in rules.classes:
        lines.append(f"#   {c.classid}: rate {format_rate(c.rate_kbit)} delay "
                     f"{format_delay(c.delay_ms)} -> hosts {c.dest_hosts}")
    if not netem and (line_delays or any(c.delay_ms > 0 for c in rules.classes)):
        todo = (f"run on this host (root): {delay_line_command(line_delays)}" if line_delays
                else "nothing to hold on this host (no delay into it); the receivers' delay "
                     "lines hold its packets")
        lines.append(f"# delay NOT APPLIED by these commands (no netem): {todo}")
    lines += [shlex.join(c) for c in apply_commands(rules, netem)]
    lines.append("# reset:")
    lines += [shlex.join(c) for c in reset_commands(rules.iface)]
    return "\n".join(lines)
