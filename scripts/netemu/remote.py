"""tc.py over SSH: apply/show/reset/probe on a host list (tc needs root: log in as root or
use --sudo for passwordless sudo).

apply runs in two phases: tc on every host (netem leaves where the kernel has netem), then a
delay line on each receiver for the senders whose kernel had no netem (so a mixed fleet is not
delayed twice). The delay line (scripts/delay_line.py, copied to ~/.scattered/netemu) needs
python3 and the NetfilterQueue package on the receiver; apply waits for its `ready` line, and
where it cannot run or dies at once the output says "delay NOT APPLIED on traffic into ADDRESS"
and apply exits 1. `show` reads each running delay line's delays back from its command line
(/proc/PID/cmdline), so a line started for another cluster shows as a MISMATCH; `reset` stops
it and runs `delay_line.py --cleanup` for the rules a killed one left.
"""

from __future__ import annotations

import argparse
import json
import posixpath
import shlex
import time
import uuid
from pathlib import Path

import numpy as np
import paramiko

from formats.errors import UserError
from scripts.netemu import sshctl
from scripts.netemu.cli import Resolved
from scripts.netemu.hostlist import HostEntry
from scripts.netemu.probe import (
    AGENT,
    PORT,
    ProbeError,
    check_targets,
    comparison,
    measured_cluster,
    parse_measure,
)
from scripts.netemu.shaping import (
    LiveHost,
    apply_host,
    compare,
    dest_delays,
    line_delays_of,
    read_live,
    reset_host,
    sender_line_delays,
    table,
)
from scripts.netemu.shell import READY_TIMEOUT_S
from scripts.netemu.tcrules import HostRules, build_host_rules, host_links

REMOTE_DIR = ".scattered/netemu"
DELAY_LINE = Path(__file__).resolve().parent.parent / "delay_line.py"
DELAY_LINE_REMOTE = posixpath.join(REMOTE_DIR, DELAY_LINE.name)
DELAY_RUN = "delay-line"
PROBE_RUN = "probe-agent"


def _runner(client: paramiko.SSHClient, sudo: bool, timeout_s: float):  # type: ignore[no-untyped-def]
    def run(_k: int, argv: list[str]) -> tuple[int, str, str]:
        return sshctl.exec_command(client, ("sudo -n " if sudo else "") + shlex.join(argv),
                                   timeout_s)
    return run


def copy_files(client: paramiko.SSHClient, files: list[Path]) -> None:
    """Copy `files` into the host's REMOTE_DIR (atomically: a unique temp name, then rename)."""
    with client.open_sftp() as sftp:
        sshctl._mkdirs(sftp, REMOTE_DIR)
        for f in files:
            # via a unique name and an atomic rename: hosts sharing a home (NFS) copy at once
            tmp = posixpath.join(REMOTE_DIR, f".{f.name}.{uuid.uuid4().hex}")
            sftp.put(str(f), tmp)
            sftp.posix_rename(tmp, posixpath.join(REMOTE_DIR, f.name))


def _print(results: list[sshctl.HostResult]) -> bool:
    return sshctl.print_results(results)


def _stop_delay_line(args: argparse.Namespace, h: HostEntry, c: paramiko.SSHClient,
                     t: float) -> tuple[int, str, str]:
    """Stop this host's delay line, then remove rules that one killed without its own cleanup
    (SIGKILL) left behind: `delay_line.py --cleanup`, with the privileges tc gets."""
    _, out, err = sshctl.exec_command(
        c, sshctl.kill_script(h, DELAY_RUN, REMOTE_DIR, sudo=args.sudo), t)
    cleanup = ("sudo -n " if args.sudo else "") + shlex.join(
        [args.remote_python, DELAY_LINE_REMOTE, "--cleanup"])
    s, out2, err2 = sshctl.exec_command(
        c, f"if [ -e {shlex.quote(DELAY_LINE_REMOTE)} ]; then {cleanup}; fi", t)
    return s, out + out2, err + err2


def _live(args: argparse.Namespace, r: Resolved, opt: sshctl.SSHOptions, t: float
          ) -> tuple[list[sshctl.HostResult], dict[int, LiveHost], list[dict[str, float] | None]]:
    """Per host: tc's live rules, and what its running delay line holds ({source: ms}, read
    from the process's command line; None where none runs)."""
    assert r.entries is not None
    live: dict[int, LiveHost] = {}
    held: list[dict[str, float] | None] = [None] * len(r.entries)

    def one(k: int, h: HostEntry, c: paramiko.SSHClient) -> sshctl.HostResult:
        live[k] = read_live(_runner(c, args.sudo, t), k, args.iface)
        pid = shlex.quote(sshctl._run_path(REMOTE_DIR, DELAY_RUN, h, "pid"))
        _, out, _ = sshctl.exec_command(
            c, f"[ -e {pid} ] && tr '\\0' ' ' < /proc/\"$(cat {pid})\"/cmdline", t)
        held[k] = line_delays_of(out)
        return sshctl.HostResult(h, 0)
    return sshctl.for_all(r.entries, opt, one), live, held


def run_remote(args: argparse.Namespace, r: Resolved) -> int:
    """tc.py ACTION --hosts IP_LIST."""
    assert r.entries is not None
    opt = sshctl.SSHOptions(Path(args.known_hosts), args.key, args.timeout)
    if not opt.known_hosts.exists():
        raise UserError(f"--known-hosts: {opt.known_hosts} does not exist; record the hosts' "
                        f"keys first: cluster_ssh.py --hosts {args.hosts} accept-keys")
    rules = build_host_rules(r.cluster, r.groups, r.addresses, args.iface, args.link_gbps)
    t = max(opt.timeout_s, 30.0)
    if args.action == "reset":
        return _reset_remote(args, r, opt, rules, t)
    if args.action == "apply":
        return _apply_remote(args, r, opt, rules, t)
    if args.action == "show":
        return _show_remote(args, r, opt, rules, t)
    return probe_remote(args, r, opt, rules)


def _reset_remote(args: argparse.Namespace, r: Resolved, opt: sshctl.SSHOptions,
                  rules: list[HostRules], t: float) -> int:
    """tc.py reset --hosts: remove the rules and stop the delay lines on every host."""
    def reset(k: int, h: HostEntry, c: paramiko.SSHClient) -> sshctl.HostResult:
        notes = reset_host(_runner(c, args.sudo, t), rules[k])
        s, out, err = _stop_delay_line(args, h, c, t)
        if s != 0:
            notes.append(f"delay_line.py --cleanup failed (exit {s})")
        return sshctl.HostResult(h, 0 if not notes else 1,
                                 out + "tc rules removed\n", err + "\n".join(notes))
    return 0 if _print(sshctl.for_all(r.entries, opt, reset)) else 1


def _apply_remote(args: argparse.Namespace, r: Resolved, opt: sshctl.SSHOptions,
                  rules: list[HostRules], t: float) -> int:
    """tc.py apply --hosts: the rules on every host, then a delay line on each host that
    receives from a sender that could not delay its packets itself (no netem)."""
    hosts = r.entries
    lat, _ = host_links(r.cluster, r.groups)
    netem: dict[int, bool] = {}

    def phase1(k: int, h: HostEntry, c: paramiko.SSHClient) -> sshctl.HostResult:
        res = apply_host(_runner(c, args.sudo, t), rules[k],
                         try_netem=args.delay in ("auto", "netem"))
        netem[k] = res.netem or not res.delays_wanted
        return sshctl.HostResult(h, 0, "".join(f"{n}\n" for n in res.notes) +
                                 f"{len(rules[k].classes)} class(es) applied, delay "
                                 f"{'netem' if res.netem else 'pending'}\n")
    ok = _print(sshctl.for_all(hosts, opt, phase1))
    # receiver j holds packets from each sender i that could not delay them itself
    need = [{r.addresses[i]: float(lat[i, j]) for i in range(len(hosts))
             if i != j and not netem.get(i, True) and lat[i, j] > 0}
            for j in range(len(hosts))]
    if args.delay == "none" or not any(need):
        if any(need):
            print("WARNING: delay NOT APPLIED (--delay none): only rates are shaped")
        return 0 if ok else 1

    def phase2(k: int, h: HostEntry, c: paramiko.SSHClient) -> sshctl.HostResult:
        _stop_delay_line(args, h, c, t)
        if not need[k]:
            return sshctl.HostResult(h, 0, "no delay line needed\n")
        into = f"delay NOT APPLIED on traffic into {r.addresses[k]}"
        s, _, err = sshctl.exec_command(
            c, f"{shlex.quote(args.remote_python)} -c 'import netfilterqueue'", t)
        if s != 0:
            return sshctl.HostResult(h, 1, "", f"{into}: {args.remote_python} has no "
                                     f"NetfilterQueue ({err.strip().splitlines()[-1:]})\n")
        copy_files(c, [DELAY_LINE])
        cmd = shlex.join([args.remote_python, DELAY_LINE_REMOTE, "--delays",
                          json.dumps(need[k])])
        # Wait for its `ready` (rules in, queue bound), as the local path does: a delay line
        # that dies at once (no iptables, queue taken) must not pass as applied.
        s, out, err = sshctl.exec_command(c, sshctl.start_script(
            k, h, cmd, DELAY_RUN, REMOTE_DIR, sudo=args.sudo, ready_s=READY_TIMEOUT_S),
            t + READY_TIMEOUT_S)
        if s != 0:
            return sshctl.HostResult(h, 1, out, f"{into}: {sshctl.start_failure(err)}\n")
        return sshctl.HostResult(h, 0, f"delay line for {need[k]}: {out}")
    return 0 if _print(sshctl.for_all(hosts, opt, phase2)) and ok else 1


def _show_remote(args: argparse.Namespace, r: Resolved, opt: sshctl.SSHOptions,
                 rules: list[HostRules], t: float) -> int:
    """tc.py show --hosts: each host's live rules and delay lines beside the wanted ones."""
    reached, live, held = _live(args, r, opt, t)
    all_ok = all(x.ok for x in reached)
    for k, res in enumerate(reached):
        print(f"host {k} {res.host.label} devices {list(r.groups[k])}")
        if k not in live:
            print(f"  {res.error}")
            continue
        rows, ok = compare(rules[k], live[k], sender_line_delays(r.addresses, held, k))
        all_ok &= ok
        print(table(["class", "to", "rate", "live", "delay", "live", "check"], rows))
    return 0 if all_ok else 1


def _delay_applied(r: Resolved, rules: list[HostRules], live: dict[int, LiveHost],
                   held: list[dict[str, float] | None]) -> np.ndarray:
    """[i, j]: the one-way delay i -> j that tc/the delay lines really apply is the asked one."""
    n = len(rules)
    applied = np.zeros((n, n), dtype=bool)
    for i in live:
        got = dest_delays(rules[i], live[i], sender_line_delays(r.addresses, held, i))
        for c in rules[i].classes:
            for j, a in zip(c.dest_hosts, c.dest_addresses):
                applied[i, j] = abs(got[a][0] - c.delay_ms) <= 0.01
    return applied


def probe_remote(args: argparse.Namespace, r: Resolved, opt: sshctl.SSHOptions,
                 rules: list[HostRules]) -> int:
    """Probe every ordered pair over SSH; write --out (measured cluster)."""
    assert r.entries is not None
    hosts = r.entries
    t = max(opt.timeout_s, 30.0)
    agent = posixpath.join(REMOTE_DIR, AGENT.name)
    # what is really applied decides the configured RTT the measurements are held against
    _, live, held = _live(args, r, opt, t)
    applied = _delay_applied(r, rules, live, held)

    def setup(k: int, h: HostEntry, c: paramiko.SSHClient) -> sshctl.HostResult:
        copy_files(c, [AGENT])
        sshctl.exec_command(c, sshctl.kill_script(h, PROBE_RUN, REMOTE_DIR), t)
        cmd = shlex.join([args.remote_python, agent, "serve", "--bind", r.addresses[k], "--port",
                          str(PORT)])
        s, out, err = sshctl.exec_command(c, sshctl.start_script(
            k, h, cmd, PROBE_RUN, REMOTE_DIR, ready_s=READY_TIMEOUT_S), t + READY_TIMEOUT_S)
        return sshctl.HostResult(h, s, out, sshctl.start_failure(err) if s else err)
    try:
        if not _print(sshctl.for_all(hosts, opt, setup)):
            raise UserError("probe: could not start the agent on every host (see above)")
        clients = [sshctl.connect(h, opt) for h in hosts]
        try:
            def measure(i: int, j: int) -> tuple[float, float]:
                cmd = shlex.join([args.remote_python, agent, "measure", "--to",
                                  f"{r.addresses[j]}:{PORT}", "--seconds", str(args.seconds)])
                for attempt in range(10):  # the agent said `ready`; refused only if it hiccups
                    s, out, err = sshctl.exec_command(clients[i], cmd, 120)
                    if s == 0 or "Connection refused" not in err:
                        break
                    time.sleep(min(0.1 * 2 ** attempt, 2.0))
                if s != 0:
                    raise ProbeError(f"probe {i}->{j} failed: {err.strip()[-300:]}")
                return parse_measure(out, f"{i}->{j}", err)
            from scripts.netemu.probe import probe_pairs
            results = probe_pairs(len(hosts), measure, print)
        finally:
            for c in clients:
                c.close()
    finally:
        sshctl.for_all(hosts, opt, lambda k, h, c: sshctl.HostResult(h, *sshctl.exec_command(
            c, sshctl.kill_script(h, PROBE_RUN, REMOTE_DIR), t)))
    from formats.cluster import save_cluster
    save_cluster(measured_cluster(r.cluster, r.groups, results), args.out)
    text, ok = comparison(r.cluster, r.groups, results, delay_applied=applied)
    print(text)
    print(f"wrote {args.out}")
    return check_targets(ok)
