"""tc.py over SSH: apply/show/reset/probe on a host list (tc needs root: log in as root or
use --sudo for passwordless sudo).

apply runs in two phases: tc on every host (netem leaves where the kernel has netem), then a
delay line on each receiver for the senders whose kernel had no netem (so a mixed fleet is not
delayed twice). The delay line (scripts/delay_line.py, copied to ~/.scattered/netemu) needs
python3 and the NetfilterQueue package on the receiver; where it cannot run, the output says
"delay NOT APPLIED" for exactly those pairs.
"""

from __future__ import annotations

import argparse
import json
import posixpath
import shlex
from pathlib import Path

import paramiko

from scheduler.errors import UserError
from scripts.netemu import sshctl
from scripts.netemu.cli import Resolved
from scripts.netemu.hostlist import HostEntry
from scripts.netemu.probe import AGENT, PORT, comparison, measured_cluster, parse_measure
from scripts.netemu.shaping import apply_host, compare, read_live, reset_host, table
from scripts.netemu.tcrules import build_host_rules, host_links

REMOTE_DIR = ".scattered/netemu"
DELAY_LINE = Path(__file__).resolve().parent.parent / "delay_line.py"
DELAY_RUN = "delay-line"
PROBE_RUN = "probe-agent"


def _runner(client: paramiko.SSHClient, sudo: bool, timeout_s: float):  # type: ignore[no-untyped-def]
    def run(_k: int, argv: list[str]) -> tuple[int, str, str]:
        return sshctl.exec_command(client, ("sudo -n " if sudo else "") + shlex.join(argv),
                                   timeout_s)
    return run


def _copy(client: paramiko.SSHClient, files: list[Path]) -> None:
    with client.open_sftp() as sftp:
        sshctl._mkdirs(sftp, REMOTE_DIR)
        for f in files:
            sftp.put(str(f), posixpath.join(REMOTE_DIR, f.name))


def _print(results: list[sshctl.HostResult]) -> bool:
    return sshctl.print_results(results)


def run_remote(args: argparse.Namespace, r: Resolved) -> int:
    """tc.py ACTION --hosts IP_LIST."""
    assert r.entries is not None
    opt = sshctl.SSHOptions(Path(args.known_hosts), args.key, args.timeout)
    if not opt.known_hosts.exists():
        raise UserError(f"--known-hosts: {opt.known_hosts} does not exist; record the hosts' "
                        f"keys first: cluster_ssh.py --hosts {args.hosts} accept-keys")
    rules = build_host_rules(r.cluster, r.groups, r.addresses, args.iface, args.link_gbps)
    hosts = r.entries
    t = max(opt.timeout_s, 30.0)
    lat, _ = host_links(r.cluster, r.groups)
    if args.action == "reset":
        def reset(k: int, h: HostEntry, c: paramiko.SSHClient) -> sshctl.HostResult:
            notes = reset_host(_runner(c, args.sudo, t), rules[k])
            s, out, err = sshctl.exec_command(
                c, sshctl.kill_script(h, DELAY_RUN, REMOTE_DIR, sudo=args.sudo), t)
            return sshctl.HostResult(h, 0 if not notes else 1,
                                     out + "tc rules removed\n", err + "\n".join(notes))
        return 0 if _print(sshctl.for_all(hosts, opt, reset)) else 1
    if args.action == "apply":
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
            sshctl.exec_command(c, sshctl.kill_script(h, DELAY_RUN, REMOTE_DIR,
                                                      sudo=args.sudo), t)
            if not need[k]:
                return sshctl.HostResult(h, 0, "no delay line needed\n")
            s, _, err = sshctl.exec_command(
                c, f"{shlex.quote(args.remote_python)} -c 'import netfilterqueue'", t)
            if s != 0:
                return sshctl.HostResult(h, 1, "", f"delay NOT APPLIED on traffic into this "
                                         f"host: {args.remote_python} has no NetfilterQueue "
                                         f"({err.strip().splitlines()[-1:]})\n")
            _copy(c, [DELAY_LINE])
            cmd = shlex.join([args.remote_python, posixpath.join(REMOTE_DIR, DELAY_LINE.name),
                              "--delays", json.dumps(need[k])])
            s, out, err = sshctl.exec_command(c, sshctl.start_script(
                k, h, cmd, DELAY_RUN, REMOTE_DIR, sudo=args.sudo), t)
            return sshctl.HostResult(h, s, f"delay line for {need[k]}: {out}", err)
        return 0 if _print(sshctl.for_all(hosts, opt, phase2)) and ok else 1
    if args.action == "show":
        alive: dict[int, bool] = {}

        def check(k: int, h: HostEntry, c: paramiko.SSHClient) -> sshctl.HostResult:
            pid = shlex.quote(sshctl._run_path(REMOTE_DIR, DELAY_RUN, h, "pid"))
            s, _, _ = sshctl.exec_command(
                c, f"[ -e {pid} ] && {'sudo -n ' if args.sudo else ''}kill -0 $(cat {pid})", t)
            alive[k] = s == 0
            return sshctl.HostResult(h, 0)
        sshctl.for_all(hosts, opt, check)
        texts: dict[int, str] = {}
        all_ok = [True]

        def show(k: int, h: HostEntry, c: paramiko.SSHClient) -> sshctl.HostResult:
            live = read_live(_runner(c, args.sudo, t), k, args.iface)
            by_dest = {r.addresses[j]: float(lat[k, j]) for j in range(len(hosts))
                       if j != k and alive.get(j)}
            rows, ok = compare(rules[k], live, by_dest)
            all_ok[0] &= ok
            texts[k] = table(["class", "to", "rate", "live", "delay", "live", "check"], rows)
            return sshctl.HostResult(h, 0 if ok else 1)
        reached = sshctl.for_all(hosts, opt, show)
        for k, res in enumerate(reached):
            print(f"host {k} {res.host.label} devices {list(r.groups[k])}")
            print(texts.get(k, f"  {res.error}"))
        return 0 if all_ok[0] and all(x.status is not None for x in reached) else 1
    return probe_remote(args, r, opt)


def probe_remote(args: argparse.Namespace, r: Resolved, opt: sshctl.SSHOptions) -> int:
    """Probe every ordered pair over SSH; write --out (measured cluster)."""
    assert r.entries is not None
    hosts = r.entries
    t = max(opt.timeout_s, 30.0)
    agent = posixpath.join(REMOTE_DIR, AGENT.name)

    def setup(k: int, h: HostEntry, c: paramiko.SSHClient) -> sshctl.HostResult:
        _copy(c, [AGENT])
        sshctl.exec_command(c, sshctl.kill_script(h, PROBE_RUN, REMOTE_DIR), t)
        cmd = shlex.join([args.remote_python, agent, "serve", "--bind", r.addresses[k], "--port",
                          str(PORT)])
        s, out, err = sshctl.exec_command(c, sshctl.start_script(k, h, cmd, PROBE_RUN,
                                                                 REMOTE_DIR), t)
        return sshctl.HostResult(h, s, out, err)
    try:
        if not _print(sshctl.for_all(hosts, opt, setup)):
            raise UserError("probe: could not start the agent on every host (see above)")
        clients = [sshctl.connect(h, opt) for h in hosts]
        try:
            def measure(i: int, j: int) -> tuple[float, float]:
                cmd = shlex.join([args.remote_python, agent, "measure", "--to",
                                  f"{r.addresses[j]}:{PORT}", "--seconds", str(args.seconds)])
                for _attempt in range(50):  # the server may still be binding its port
                    s, out, err = sshctl.exec_command(clients[i], cmd, 120)
                    if s == 0 or "Connection refused" not in err:
                        break
                if s != 0:
                    raise UserError(f"probe {i}->{j} failed: {err.strip()[-300:]}")
                return parse_measure(out, f"{i}->{j}")
            from scripts.netemu.probe import probe_pairs
            results = probe_pairs(len(hosts), measure, print)
        finally:
            for c in clients:
                c.close()
    finally:
        sshctl.for_all(hosts, opt, lambda k, h, c: sshctl.HostResult(h, *sshctl.exec_command(
            c, sshctl.kill_script(h, PROBE_RUN, REMOTE_DIR), t)))
    from scheduler.cluster import save_cluster
    save_cluster(measured_cluster(r.cluster, r.groups, results), args.out)
    text, _ = comparison(r.cluster, r.groups, results, delay_applied=True)
    print(text)
    print(f"wrote {args.out}")
    return 0
