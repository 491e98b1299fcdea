"""What `scripts/measure.py` learns about a host list, and the cluster file made from it.

Pure: parsing the agents' JSON lines, the fix for a pair that cannot connect, and the cluster.
Each host becomes one device per CUDA GPU (one device for a CPU host), all with the FLOP/s
measured on the host's first GPU (or its CPU). Links between hosts are the measured ones
(bandwidth of a TCP stream, one-way latency = half the TCP round trip); links between two GPUs
of one host are not measured and get INTRA_HOST_GBPS / INTRA_HOST_MS.

A pair where a TCP connection fails in either direction gets UNREACHABLE_GBPS and
UNREACHABLE_MS in both directions: the file still loads (the planner needs positive finite
links) and any plan that puts traffic on such a link costs ~1e6 s per step, so the search
avoids it whenever the rest of the cluster allows; the command reports every such pair with
its fix and exits 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from formats.cluster import Cluster, Device, cluster_from_dict
from formats.errors import UserError
from scripts.netemu.hostlist import HostEntry

INTRA_HOST_GBPS = 100.0
"""Assumed bandwidth between two GPUs of one host (PCIe-class; not measured)."""
INTRA_HOST_MS = 0.01
"""Assumed one-way latency between two GPUs of one host."""
UNREACHABLE_GBPS = 1e-6
"""Bandwidth written for a pair that cannot connect (1 kbit/s)."""
UNREACHABLE_MS = 1e6
"""One-way latency written for a pair that cannot connect (1000 s)."""
WIREGUARD_HINT = ("or, when the host sits behind a NAT or firewall you cannot change, put "
                  "the pair on a WireGuard tunnel with udp_hole_punching_test/peer.py (see "
                  "udp_hole_punching_test/README.md) and list the tunnel address in the host "
                  "list")


@dataclass(frozen=True)
class HostInfo:
    """One host's devices and measured speed."""

    kind: str
    """`gpu` or `cpu`."""
    names: list[str]
    """GPU names (one per GPU), or the CPU model."""
    memory_bytes: list[int]
    """Memory of each GPU, or the host's RAM."""
    flop_per_s: float
    """Forward matmul FLOP/s of one model layer on the first GPU (bf16) or the CPU (fp32)."""
    bench: str
    """What ran the benchmark, e.g. `cuda bfloat16`."""


@dataclass(frozen=True)
class LinkResult:
    """One direction src -> dst: measured, or why a TCP connection could not be made."""

    src: int
    dst: int
    rtt_ms: float = 0.0
    bit_per_s: float = 0.0
    error: str = ""
    """"" when measured; else `refused`, `timeout`, `unreachable` or `error`."""
    detail: str = ""

    @property
    def ok(self) -> bool:
        """Measured (a connection was made)."""
        return not self.error


def _last_json(out: str) -> dict | None:
    lines = [x for x in out.strip().splitlines() if x.strip()]
    try:
        obj = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def parse_host(out: str, status: int, err: str, where: str, python: str) -> HostInfo:
    """HostInfo from host_agent.py's output; UserError naming the host when it failed."""
    obj = _last_json(out)
    if obj is not None and obj.get("error") == "no torch":
        raise UserError(f"{where}: {python} has no torch ({obj.get('detail')}); install torch "
                        "there or pass --remote-python PATH of a python that has it")
    if status == 127 or (obj is None and "not found" in err):
        raise UserError(f"{where}: {python} not found on the host; install python3 there or "
                        "pass --remote-python PATH")
    try:
        assert obj is not None and status == 0
        devs = obj["devices"]
        return HostInfo(str(obj["kind"]), [str(d["name"]) for d in devs],
                        [int(d["memory_bytes"]) for d in devs], float(obj["flop_per_s"]),
                        str(obj.get("bench", "")))
    except (AssertionError, KeyError, TypeError, ValueError):
        tail = (err.strip() or out.strip())[-300:]
        raise UserError(f"{where}: the host benchmark failed (exit {status}): {tail!r}") \
            from None


def parse_link(out: str, src: int, dst: int, status: int, err: str) -> LinkResult:
    """LinkResult from probe_agent.py measure --connect-timeout's output."""
    obj = _last_json(out)
    if obj is not None and "error" in obj:
        return LinkResult(src, dst, error=str(obj["error"]), detail=str(obj.get("detail", "")))
    if obj is None or status != 0:
        return LinkResult(src, dst, error="error",
                          detail=f"exit {status}: {(err.strip() or out.strip())[-200:]}")
    return LinkResult(src, dst, float(obj["rtt_ms"]), float(obj["bit_per_s"]))


def fix_for(r: LinkResult, hosts: list[HostEntry], port: int, timeout_s: float) -> str:
    """What is wrong with the direction r.src -> r.dst, and what to do about it."""
    a, b = hosts[r.src].host, hosts[r.dst].host
    head = f"host {r.src} ({a}) -> host {r.dst} ({b}) TCP port {port}: "
    if r.error == "refused":
        why = ("connection refused (a REJECT rule, or another address of that host answers); "
               f"open TCP port {port} on {b} to {a} (and the training ports)")
    elif r.error == "timeout":
        why = (f"no answer within {timeout_s:g} s (a firewall DROP rule, a cloud security "
               f"group or a NAT in front of {b}); allow TCP port {port} into {b} from {a} "
               "(and the training ports)")
    elif r.error == "unreachable":
        why = (f"no route to {b} from {a} (the address is private to another network?); use an "
               "address both hosts can route to")
    else:
        why = f"failed ({r.detail}); check that both hosts can reach each other"
    return f"{head}{why}, {WIREGUARD_HINT}"


def blocked_pairs(links: list[LinkResult]) -> list[tuple[int, int]]:
    """Host pairs (i < j) where either direction failed to connect."""
    return sorted({(min(r.src, r.dst), max(r.src, r.dst)) for r in links if not r.ok})


def build_cluster(name: str, hosts: list[HostEntry], infos: list[HostInfo],
                  links: list[LinkResult]) -> Cluster:
    """The measured cluster (validated by the loader): devices per host, links per pair."""
    devices: list[Device] = []
    host_of: list[int] = []
    for k, (h, info) in enumerate(zip(hosts, infos)):
        for g, (gpu, mem) in enumerate(zip(info.names, info.memory_bytes)):
            label = gpu if info.kind == "gpu" else f"cpu: {gpu}"
            devices.append(Device(len(devices), f"host{k}-{info.kind}{g}", f"host{k}", h.host,
                                  label, info.flop_per_s / 1e12, max(mem, 1) / 1e9))
            host_of.append(k)
    hs = np.array(host_of)
    same = hs[:, None] == hs[None, :]
    lat = np.where(same, INTRA_HOST_MS, UNREACHABLE_MS)
    bw = np.where(same, INTRA_HOST_GBPS, UNREACHABLE_GBPS)
    blocked = set(blocked_pairs(links))
    for r in links:
        if r.ok and (min(r.src, r.dst), max(r.src, r.dst)) not in blocked:
            sub = np.ix_(hs == r.src, hs == r.dst)
            lat[sub] = r.rtt_ms / 2.0
            bw[sub] = max(r.bit_per_s, 1e3) / 1e9
    np.fill_diagonal(lat, 0.0)
    cluster = Cluster(name, devices, lat, bw)
    try:
        return cluster_from_dict(cluster.to_dict())  # the loader's checks, before any write
    except UserError as e:
        raise UserError(f"measured cluster is not valid ({e}); nothing written") from None
