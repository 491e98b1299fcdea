#!/usr/bin/env python3
"""Emulator fidelity: configured vs measured bandwidth and RTT per host pair (needs root).

Builds 4 namespace hosts with per-destination rates of 50/100/200 Mbit/s and one-way delays of
10-100 ms (netem where the kernel has it, else the NFQUEUE delay line), probes every ordered
pair (TCP stream for bandwidth, TCP ping-pong for RTT) and prints both side by side.
Targets: bandwidth within 10% of the rate; RTT within 10% + 2 ms of the configured round trip.

    sudo .venv/bin/python benchmarks/emulator_fidelity.py [--seconds 1.5] [--delay auto|none]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np  # noqa: E402

from formats.cluster import Cluster, Device, save_cluster  # noqa: E402
from formats.errors import UserError, run_main  # noqa: E402
from scripts.netemu import netns  # noqa: E402
from scripts.netemu.local import apply_local  # noqa: E402
from scripts.netemu.probe import probe_local  # noqa: E402
from scripts.netemu.shell import missing_root_tools  # noqa: E402

RATES_MBIT = [[0, 50, 100, 200], [50, 0, 200, 100], [100, 200, 0, 50], [200, 100, 50, 0]]
ONE_WAY_MS = [[0, 10, 20, 50], [10, 0, 30, 100], [20, 30, 0, 40], [50, 100, 40, 0]]


def bench_cluster() -> Cluster:
    """4 devices, one per host, with the rate and delay tables above."""
    bw = np.array(RATES_MBIT, dtype=float) / 1000.0
    np.fill_diagonal(bw, np.inf)
    devs = [Device(i, f"h{i}", f"site-{i}", f"198.18.0.{i + 1}", "T4-16GB", 65.0, 16.0)
            for i in range(4)]
    return Cluster("fidelity-4", devs, np.array(ONE_WAY_MS, dtype=float), bw)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=1.5, help="stream per pair after warm-up")
    p.add_argument("--delay", choices=("auto", "none"), default="auto")
    p.add_argument("--prefix", default=f"fid{os.getpid() % 100000}")
    args = p.parse_args(argv)
    why = missing_root_tools(("ip", "tc", "iptables"))
    if why:
        raise UserError(f"emulator_fidelity: {why}")
    cluster = bench_cluster()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        save_cluster(cluster, Path(tmp) / "c.json")
        st = netns.create(args.prefix, 4)
        try:
            st.groups = [[i] for i in range(4)]
            st.link_gbps, st.out_dir = 1.0, tmp
            st.cluster_file = str(Path(tmp) / "c.json")
            for line in apply_local(st, cluster, args.delay):
                if line.startswith("WARNING"):
                    print(line)
            text, results, _ = probe_local(st, cluster, Path(tmp) / "measured.json",
                                        args.seconds, quiet=True)
            applied = st.delay_mode in ("netem", "delay-line")
        finally:
            netns.destroy(args.prefix)
    print(f"delay mechanism: {st.delay_mode}")
    print(text)
    bw_ok = sum(abs(r.bit_per_s / (RATES_MBIT[r.src][r.dst] * 1e6) - 1) <= 0.10 for r in results)
    rtt = [(r.rtt_ms, ONE_WAY_MS[r.src][r.dst] + ONE_WAY_MS[r.dst][r.src]) for r in results]
    rtt_ok = sum(abs(m - w) <= 0.1 * w + 2.0 for m, w in rtt) if applied else 0
    ratios = [r.bit_per_s / (RATES_MBIT[r.src][r.dst] * 1e6) for r in results]
    print(f"bandwidth within 10%: {bw_ok}/{len(results)} pairs (measured/configured "
          f"{min(ratios):.3f}..{max(ratios):.3f}); RTT within 10% + 2 ms: "
          + (f"{rtt_ok}/{len(results)} pairs" if applied else "n/a (delay not applied)")
          + f"; wall {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    run_main(main)
