"""The lab's network: one network namespace host per device with the cluster's links (root;
loopback otherwise, and it says so), its MTU and flags, and what it costs to emulate."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from formats.cluster import load_cluster
from testkit.lab import PY, ROOT, log, sh


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds process `pid` has used (None: no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


LAB_MTU = 65000
"""The lab's hosts' MTU: packets as large as a real host's segmentation offload hands its NIC
(64 KB), so that without sch_netem the userspace delay lines (Python per packet, on the ranks'
own cores) handle few packets: their CPU per MB is 0.13x 1500's, 0.47x 9000's
(benchmarks/delay_line_cpu.py). On the badlink lab's 2 x 4-way FSDP plan, one after the other,
9000 -> 65000: delay lines 0.785 -> 0.423 CPU s a step, the step 1.787 -> 1.504 s; the links'
probed rates and RTTs hold as well (`local_cluster.py probe`: rates 0.98-1.00x the cluster's).
What it changes: TCP's initial window is 10 segments, so a fresh or idle connection's first
flight is 640 KB (90 KB at 9000; 15 KB on a 1500-byte WAN): slow start is not emulated, as
the simulator does not model it either (docs/emulator.md)."""


def add_network_args(p: Any) -> None:
    """The lab benchmarks' network flags (argparse parser `p`): --no-netns, --mtu."""
    p.add_argument("--no-netns", action="store_true",
                   help="run on loopback without shaping even when root")
    p.add_argument("--mtu", type=int, default=LAB_MTU,
                   help="the namespace hosts' MTU (local_cluster.py up --mtu; default "
                   f"{LAB_MTU}: fewer packets for the userspace delay lines, docs/emulator.md)")


class Network:
    """The namespace hosts of the cluster (or loopback when they cannot be made)."""

    def __init__(self, cluster_path: Path, out: Path, use_netns: bool, mtu: int = LAB_MTU
                 ) -> None:
        self.prefix = f"e2e{os.getpid() % 10000}"
        self.mtu = mtu
        """The hosts' MTU (local_cluster.py up --mtu)."""
        self.dir = out / "net"
        self.active = False
        self.cluster_path = cluster_path
        self.reason = netns_unavailable() if use_netns else "--no-netns given"
        """Why the network is not emulated ('' when it is)."""

    def up(self) -> None:
        """Create the hosts and apply the cluster's links (or log why not)."""
        if self.reason:
            log(f"NOT shaping the network ({self.reason}): all ranks on loopback, so the "
                "measured times show compute only, not the emulated links")
            return
        log(f"bringing up {load_cluster(self.cluster_path).num_devices} namespace hosts "
            f"({self.prefix}-*) with the cluster's rates and delays")
        sh([PY, str(ROOT / "scripts/local_cluster.py"), "up", "--cluster", str(self.cluster_path),
            "--prefix", self.prefix, "--out-dir", str(self.dir), "--link-gbps", "10",
            "--mtu", str(self.mtu)])
        self.active = True
        mode = json.loads((self.dir / "netns_map.json").read_text())["delay_mode"]
        log(f"  delay applied by: {mode}; MTU {self.mtu}")

    def down(self) -> None:
        """Remove every namespace, veth, bridge and delay line of this run."""
        if self.active:
            subprocess.run([PY, str(ROOT / "scripts/local_cluster.py"), "down", "--prefix",
                            self.prefix], capture_output=True, text=True)
            self.active = False
            log(f"removed the namespace hosts {self.prefix}-*")

    def launch_args(self) -> list[str]:
        """launch_local.py flags that put each rank in its host."""
        if not self.active:
            return ["--host", "127.0.0.1"]
        return ["--netns-map", str(self.dir / "rank_netns.json"), "--host", "198.18.0.1",
                "--gloo-ifname", "eth0"]

    def emulation_cpu_s(self) -> float:
        """CPU seconds this lab's userspace delay lines have used so far (0 without any)."""
        if not self.active:
            return 0.0
        from scripts.netemu.netns import load_state

        # a delay line that is gone counts up to its last reading only
        return sum(process_cpu_s(pid) or 0.0
                   for pid in load_state(self.prefix).delay_pids.values())

    def tc_show(self, what: tuple[str, ...], after: tuple[str, ...] = ()) -> list[str]:
        """`tc -s WHAT dev IFACE AFTER` in every host, one stdout per host ([] on loopback),
        e.g. what ("-j", "qdisc", "show"), after ("root",)."""
        if not self.active:
            return []
        hosts = json.loads((self.dir / "netns_map.json").read_text())["hosts"]
        return [sh(["ip", "netns", "exec", h["netns"], "tc", "-s", *what, "dev", h["iface"],
                    *after]).stdout for h in hosts]

    def wire_bytes(self) -> int:
        """Bytes every host has sent on its eth0 so far (tc root qdisc counters)."""
        return sum(int(q.get("bytes", 0))
                   for out in self.tc_show(("-j", "qdisc", "show"), ("root",))
                   for q in json.loads(out))


def netns_unavailable() -> str:
    """Why namespace hosts cannot be made here ('' when they can)."""
    if os.geteuid() != 0:
        return "not root"
    missing = [t for t in ("ip", "tc", "iptables") if shutil.which(t) is None]
    return f"missing {', '.join(missing)}" if missing else ""
