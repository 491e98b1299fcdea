"""Shaping namespace hosts: tc rules in every namespace plus a delay line where netem is missing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from formats.cluster import Cluster
from formats.errors import UserError
from scripts.netemu.netns import IFACE, NetnsState, address, start_in_namespace, stop_delay_lines
from scripts.netemu.shaping import (
    Runner,
    apply_host,
    compare,
    line_delays_of,
    read_live,
    reset_host,
    sender_line_delays,
    table,
)
from scripts.netemu.shell import cmdline, sh
from scripts.netemu.tcrules import build_host_rules, receiver_delays

DELAY_LINE = Path(__file__).resolve().parent.parent / "delay_line.py"
DELAY_MODES = ("auto", "netem", "line", "none")


def ns_runner(st: NetnsState) -> Runner:
    """A runner that executes argv inside host k's namespace."""
    def run(k: int, argv: list[str]) -> tuple[int, str, str]:
        p = sh([*st.exec_prefix(k), *argv], check=False)
        return p.returncode, p.stdout, p.stderr
    return run


def _rules(st: NetnsState, cluster: Cluster):  # type: ignore[no-untyped-def]
    groups = [tuple(g) for g in st.groups]
    addrs = [address(i) for i in range(st.num_hosts)]
    return groups, addrs, build_host_rules(cluster, groups, addrs, IFACE, st.link_gbps)


def apply_local(st: NetnsState, cluster: Cluster, delay: str = "auto") -> list[str]:
    """Install the cluster's rules in every namespace; returns report lines (delay status too).

    delay: auto = netem where the kernel has it, else the NFQUEUE delay line; netem = netem or
    fail; line = always the delay line; none = shape rates only and say so."""
    if delay not in DELAY_MODES:
        raise UserError(f"--delay: expected one of {', '.join(DELAY_MODES)}, got {delay!r}")
    groups, addrs, rules = _rules(st, cluster)
    run = ns_runner(st)
    report = _stop_delay_lines(st)
    results = [apply_host(run, r, try_netem=delay in ("auto", "netem")) for r in rules]
    for res in results:
        report += res.notes
    wanted = any(r.delays_wanted for r in results)
    if not wanted:
        st.delay_mode = "none"
    elif all(r.netem or not r.delays_wanted for r in results):
        st.delay_mode = "netem"
    elif delay == "netem":
        raise UserError("--delay netem: the kernel has no sch_netem (use --delay auto or line)")
    elif delay == "none":
        st.delay_mode = "not-applied: --delay none"
    else:
        st.delay_mode = _start_delay_lines(st, receiver_delays(cluster, groups, addrs))
    st.save()
    if st.delay_mode.startswith("not-applied"):
        report.append(f"WARNING: delay not applied ({st.delay_mode.split(': ', 1)[1]}); "
                      "only rates are shaped")
    else:
        report.append(f"delay: {st.delay_mode}")
    return report


def _stop_delay_lines(st: NetnsState) -> list[str]:
    """Stop the recorded delay lines, then remove the rules one killed without its own cleanup
    (SIGKILL) left behind in its namespace (`delay_line.py --cleanup`); returns notes."""
    hosts = [i for i in range(st.num_hosts) if st.namespace(i) in st.delay_pids]
    notes = stop_delay_lines(st)
    for i in hosts:
        p = sh([*st.exec_prefix(i), sys.executable, str(DELAY_LINE), "--cleanup"], check=False)
        if p.returncode != 0:
            notes.append(f"host {i}: delay_line.py --cleanup failed: {p.stderr.strip()}")
    return notes


def _start_delay_lines(st: NetnsState, delays: list[dict[str, float]]) -> str:
    try:
        import netfilterqueue  # noqa: F401
    except ImportError:
        return "not-applied: NetfilterQueue package missing (pip install NetfilterQueue)"
    for i, d in enumerate(delays):
        if not d:
            continue
        log = Path(st.out_dir or "/tmp") / f"delay_line.{st.namespace(i)}.log"
        try:
            pid = start_in_namespace(st, i, [sys.executable, str(DELAY_LINE), "--delays",
                                             json.dumps(d)], log).pid
        except UserError as e:
            stop_delay_lines(st)
            return f"not-applied: {e}"
        st.delay_pids[st.namespace(i)] = pid
        st.save()
    return "delay-line"


def show_local(st: NetnsState, cluster: Cluster) -> tuple[str, bool]:
    """Table of wanted vs live rules per host, and whether everything matches."""
    groups, addrs, rules = _rules(st, cluster)
    run = ns_runner(st)
    # What each running delay line really holds, from its command line (not from `cluster`).
    held = [line_delays_of(cmdline(st.delay_pids[st.namespace(j)]))
            if st.namespace(j) in st.delay_pids else None for j in range(st.num_hosts)]
    lines, all_ok = [], True
    for r in rules:
        i = r.host.index
        rows, ok = compare(r, read_live(run, i, IFACE), sender_line_delays(addrs, held, i))
        all_ok &= ok
        lines.append(f"host {i} {st.namespace(i)} {addrs[i]} devices {list(r.host.devices)}")
        lines.append(table(["class", "to", "rate", "live", "delay", "live", "check"], rows))
    return "\n".join(lines), all_ok


def reset_local(st: NetnsState, cluster: Cluster) -> list[str]:
    """Remove tc rules and stop delay lines in every namespace."""
    _, _, rules = _rules(st, cluster)
    notes = _stop_delay_lines(st)
    run = ns_runner(st)
    for r in rules:
        notes += reset_host(run, r)
    st.delay_mode = "none"
    st.save()
    return notes
