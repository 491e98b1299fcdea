"""Per-pair bandwidth and RTT between hosts, written back as a cluster file.

The agent (probe_agent.py, stdlib only) runs a server on every host; each ordered pair is then
measured one at a time (a TCP ping-pong for RTT, then a TCP stream for bandwidth), so pairs do
not compete for the same sender's link or the CPU. In the measured cluster, device pairs on two
different hosts get the measured bandwidth and half the measured RTT as one-way latency (the
probe cannot split a round trip); device pairs on the same host keep the configured values.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from formats.cluster import Cluster, save_cluster
from formats.errors import UserError
from scripts.netemu.shaping import table
from scripts.netemu.tcrules import host_links

AGENT = Path(__file__).resolve().parent / "probe_agent.py"
PORT = 47913
BW_TOLERANCE = 0.10
RTT_TOLERANCE = 0.10
RTT_SLACK_MS = 2.0
CONNECT_TIMEOUT_S = 10.0
"""The agent's bound on each connect and socket operation of a local probe."""
MIN_PAIR_LIMIT_S = 120.0
"""The least time a local probe gives one pair before calling it failed."""
PAIR_SLACK_S = 30.0
"""A pair's bound: 4 x CONNECT_TIMEOUT_S + 2 x --seconds + this (as scripts/measure.py's)."""


class ProbeError(UserError):
    """A pair could not be measured, or a measurement is outside the target: not a user
    mistake, so exit 1, but reported the same way (one line, no traceback)."""

    exit_code = 1


@dataclass
class PairResult:
    """One ordered host pair."""

    src: int
    dst: int
    rtt_ms: float
    bit_per_s: float


def parse_measure(out: str, where: str, err: str = "") -> tuple[float, float]:
    """(rtt_ms, bit/s) from the agent's JSON line; ProbeError naming the pair and why when
    the agent reported a failure (`--connect-timeout`'s {"error": ...}) or printed no result."""
    try:
        obj = json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        obj = None
    if isinstance(obj, dict) and "error" in obj:
        raise ProbeError(f"probe {where}: {obj['error']} ({str(obj.get('detail'))[:200]})")
    try:
        return float(obj["rtt_ms"]), float(obj["bit_per_s"])  # type: ignore[index]
    except (KeyError, ValueError, TypeError):
        said = (out.strip() or err.strip())[-200:]
        raise ProbeError(f"probe {where}: unexpected agent output {said!r}") from None


def probe_pairs(num_hosts: int, measure: Callable[[int, int], tuple[float, float]],
                log: Callable[[str], None] | None = None) -> list[PairResult]:
    """Measure every ordered pair (src, dst) one after the other. A pair that fails is named
    and the others still measured; then ProbeError naming every failed pair."""
    out, failed = [], []
    for i in range(num_hosts):
        for j in range(num_hosts):
            if i == j:
                continue
            try:
                rtt, bps = measure(i, j)
            except ProbeError as e:
                failed.append(str(e).removeprefix("probe "))
                if log:
                    log(f"  {i}->{j}: FAILED: {failed[-1]}")
                continue
            out.append(PairResult(i, j, rtt, bps))
            if log:
                log(f"  {i}->{j}: rtt {rtt:.1f} ms, {bps / 1e6:.1f} Mbit/s")
    if failed:
        n = num_hosts * (num_hosts - 1)
        raise ProbeError(f"probe: {len(failed)} of {n} host pairs could not be measured, so no "
                         f"measured cluster was written: {'; '.join(failed)}")
    return out


def check_targets(ok: bool) -> int:
    """The exit status of a probe whose table says `ok` (1, said on stderr, when a pair
    missed the target)."""
    if ok:
        return 0
    print(f"error: probe: some host pairs are outside the target (bandwidth within "
          f"{BW_TOLERANCE:.0%} of the configured rate, RTT within {RTT_TOLERANCE:.0%} + "
          f"{RTT_SLACK_MS:g} ms): the rows not marked `ok` above", file=sys.stderr)
    return 1


def measured_cluster(cluster: Cluster, groups: list[tuple[int, ...]],
                     results: list[PairResult]) -> Cluster:
    """The cluster with inter-host entries replaced by measurements."""
    lat = np.array(cluster.latency_ms, dtype=float)
    bw = np.array(cluster.bandwidth_gbps, dtype=float)
    for r in results:
        sub = np.ix_(list(groups[r.src]), list(groups[r.dst]))
        lat[sub] = r.rtt_ms / 2.0
        bw[sub] = max(r.bit_per_s, 1.0) / 1e9
    return Cluster(f"{cluster.name}-measured", list(cluster.devices), lat, bw)


def comparison(cluster: Cluster, groups: list[tuple[int, ...]], results: list[PairResult],
               delay_applied: bool | np.ndarray) -> tuple[str, bool]:
    """Configured vs measured table per pair; whether every pair meets the targets.

    Targets: bandwidth within 10% of the configured rate; RTT within 10% + 2 ms of the
    configured round trip, which counts a one-way delay only where it is applied
    (`delay_applied`: one bool, or a host x host matrix, [i, j] for the direction i -> j)."""
    lat, bw = host_links(cluster, groups)
    applied = np.broadcast_to(np.asarray(delay_applied, dtype=bool), lat.shape)
    rows, all_ok = [], True
    for r in results:
        want_bps = bw[r.src, r.dst] * 1e9
        want_rtt = (lat[r.src, r.dst] * applied[r.src, r.dst] +
                    lat[r.dst, r.src] * applied[r.dst, r.src])
        bw_ok = abs(r.bit_per_s - want_bps) <= BW_TOLERANCE * want_bps
        rtt_ok = abs(r.rtt_ms - want_rtt) <= RTT_TOLERANCE * want_rtt + RTT_SLACK_MS
        all_ok &= bw_ok and rtt_ok
        rows.append([f"{r.src}->{r.dst}", f"{want_bps / 1e6:g}", f"{r.bit_per_s / 1e6:.1f}",
                     f"{r.bit_per_s / want_bps:.3f}", f"{want_rtt:g}", f"{r.rtt_ms:.1f}",
                     ("ok" if bw_ok else "BW") + ("" if rtt_ok else " RTT")])
    head = ["pair", "rate Mbit/s", "measured", "ratio", "RTT ms", "measured", "within target"]
    missing = [f"{i}->{j}" for i, j in zip(*np.nonzero(~applied & (lat > 0)))]
    note = ("" if not missing else "\n(delay not applied: configured RTT shown as 0)"
            if not applied.any() else
            f"\n(delay not applied on {', '.join(missing)}: not counted in the configured RTT)")
    return table(head, rows) + note, all_ok


def stop_agent(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """Stop a probe agent: SIGTERM, and SIGKILL after `grace_s` (one that ignores SIGTERM,
    or a loaded host, must not turn a finished probe into a traceback)."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def probe_local(st, cluster: Cluster, out: Path, seconds: float = 1.5,  # type: ignore[no-untyped-def]
                pings: int = 10, quiet: bool = False) -> tuple[str, list[PairResult], bool]:
    """Probe the namespace hosts of `st`; write the measured cluster; (table text, results,
    whether every pair meets the target). ProbeError when a pair cannot be measured."""
    from scripts.netemu.netns import address, start_in_namespace
    from scripts.netemu.shell import sh
    # the agent bounds every connect and socket operation; this bounds the whole pair (as
    # scripts/measure.py does), so a link that swallows packets ends in a named failure
    limit = max(MIN_PAIR_LIMIT_S, 4 * CONNECT_TIMEOUT_S + 2 * seconds + PAIR_SLACK_S)
    servers = []
    try:
        for i in range(st.num_hosts):
            log = Path(st.out_dir or "/tmp") / f"probe_agent.{st.namespace(i)}.log"
            servers.append(start_in_namespace(st, i, [sys.executable, str(AGENT), "serve",
                                                      "--bind", address(i), "--port",
                                                      str(PORT)], log))

        def measure(i: int, j: int) -> tuple[float, float]:
            try:
                p = sh([*st.exec_prefix(i), sys.executable, str(AGENT), "measure", "--to",
                        f"{address(j)}:{PORT}", "--seconds", str(seconds), "--pings",
                        str(pings), "--connect-timeout", str(CONNECT_TIMEOUT_S)],
                       check=False, timeout=limit)
            except subprocess.TimeoutExpired:
                raise ProbeError(f"probe {i}->{j}: no result within {limit:g} s") from None
            return parse_measure(p.stdout, f"{i}->{j}", p.stderr)

        results = probe_pairs(st.num_hosts, measure, None if quiet else print)
    finally:
        for proc in servers:
            stop_agent(proc)
    groups = [tuple(g) for g in st.groups]
    save_cluster(measured_cluster(cluster, groups, results), out)
    applied = st.delay_mode in ("netem", "delay-line")
    text, ok = comparison(cluster, groups, results, applied)
    return text, results, ok
