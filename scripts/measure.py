#!/usr/bin/env python3
"""Measure a host list and write the cluster file the planner reads.

    python scripts/measure.py --hosts ip_list --model gpt-small --out cluster.json
        [--known-hosts known_hosts] [--key KEY] [--remote-python python3] [--port 47913]
        [--seconds 1.0] [--connect-timeout 5] [--bench-seconds 2]

On every host (over SSH; host keys only from --known-hosts, filled by `cluster_ssh.py
accept-keys`): the GPUs (name, memory) or the CPU model and RAM, and the FLOP/s of one layer of
--model at its d_model/d_ff/seq_len shapes (host_agent.py; needs torch in --remote-python).
Between every pair of hosts, both directions: can a TCP connection be made to --port at all
(the connect and every socket operation bounded by --connect-timeout, the whole direction by
4 x --connect-timeout + 2 x --seconds + 30 s), then the RTT (median of 10 TCP ping-pongs) and
the bandwidth (one TCP stream for --seconds after a warm-up). Pairs run in rounds of disjoint
pairs (circle method: N-1 rounds for even N, each host in one pair per round). A pair that
cannot connect is reported with its fix and written as a 1 kbit/s, 1000 s link
(scripts/netemu/fleet.py); the file is validated with the planner's loader, then written
atomically.

Exit status: 0 when every pair connected; 1 when the file was written but some pairs could not
connect (listed); 2 on bad input or a host that could not be used (named).
"""

from __future__ import annotations

import argparse
import posixpath
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import paramiko  # noqa: E402

from formats import argtypes  # noqa: E402
from formats.atomic_io import check_output_path  # noqa: E402
from formats.cluster import save_cluster  # noqa: E402
from formats.errors import UserError, run_main  # noqa: E402
from formats.hf_config import resolve_model  # noqa: E402
from formats.models import ModelSpec  # noqa: E402
from scripts.netemu import sshctl  # noqa: E402
from scripts.netemu.fleet import (  # noqa: E402
    HostInfo,
    LinkResult,
    blocked_pairs,
    build_cluster,
    fix_for,
    parse_host,
    parse_link,
)
from scripts.netemu.hostlist import HostEntry, load_host_list  # noqa: E402
from scripts.netemu.probe import AGENT as PROBE_AGENT  # noqa: E402
from scripts.netemu.probe import PORT  # noqa: E402
from scripts.netemu.remote import REMOTE_DIR, copy_files  # noqa: E402
from scripts.netemu.rounds import estimate_s, pair_rounds  # noqa: E402
from scripts.netemu.shaping import table  # noqa: E402
from scripts.netemu.shell import READY_TIMEOUT_S  # noqa: E402

START_MARGIN_S = 20.0
"""All-at-once benchmarks start timing this long after the command starts: time to connect,
copy the agent and import torch on every host (a late host still runs, just not in step)."""
HOST_AGENT = Path(__file__).resolve().parent / "netemu" / "host_agent.py"
RUN_NAME = "measure-agent"
MAX_SECONDS = 600.0
PINGS = 10


class Progress:
    """Timestamped progress lines on stdout (the run can take minutes on real hosts)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self, msg: str) -> None:
        """Print msg after the seconds since start."""
        print(f"[{time.monotonic() - self.t0:6.1f}s] {msg}", flush=True)


def _remote(args: argparse.Namespace, script: Path, *argv: str) -> str:
    return shlex.join([args.remote_python, posixpath.join(REMOTE_DIR, script.name), *argv])


def _bench_argv(spec: ModelSpec, args: argparse.Namespace) -> list[str]:
    return ["--d-model", str(spec.d_model), "--d-ff", str(spec.d_ff),
            "--ffn-mats", "2" if spec.arch == "gpt" else "3", "--seq-len", str(spec.seq_len),
            "--tokens", str(spec.seq_len * args.micro_batch_size),
            "--seconds", str(args.bench_seconds)]


def setup_hosts(hosts: list[HostEntry], opt: sshctl.SSHOptions, args: argparse.Namespace,
                spec: ModelSpec, say: Progress) -> list[HostInfo]:
    """Copy the agents, benchmark every host, start its probe server; UserError naming every
    host that failed (after stopping the servers that did start)."""
    infos: dict[int, HostInfo] = {}
    bench_timeout = args.bench_seconds * 20 + 120  # first CUDA init and torch import included
    # all at once: every host times the same window, so hosts that share a machine's cores
    # (namespaces, containers) measure the share they will have while training together
    start_at = [] if args.one_at_a_time else ["--start-at", f"{time.time() + START_MARGIN_S:.3f}"]

    def one(k: int, h: HostEntry, c: paramiko.SSHClient) -> sshctl.HostResult:
        copy_files(c, [HOST_AGENT, PROBE_AGENT])
        s, out, err = sshctl.exec_command(
            c, _remote(args, HOST_AGENT, *_bench_argv(spec, args), *start_at), bench_timeout)
        try:
            info = parse_host(out, s, err, f"host {k} {h.label}", args.remote_python)
        except UserError as e:
            return sshctl.HostResult(h, 1, error=str(e))
        sshctl.exec_command(c, sshctl.kill_script(h, RUN_NAME, REMOTE_DIR), opt.timeout_s)
        serve = _remote(args, PROBE_AGENT, "serve", "--bind", "0.0.0.0", "--port", str(args.port))
        s, out, err = sshctl.exec_command(c, sshctl.start_script(
            k, h, serve, RUN_NAME, REMOTE_DIR, ready_s=READY_TIMEOUT_S),
            opt.timeout_s + READY_TIMEOUT_S)
        if s != 0:
            return sshctl.HostResult(h, s, error=f"host {k} {h.label}: probe server on port "
                                     f"{args.port} did not start: {sshctl.start_failure(err)} "
                                     "(port taken? pick another --port)")
        infos[k] = info
        say(f"host {k} {h.label}: {len(info.names)} x {info.names[0]}, "
            f"{info.memory_bytes[0] / 1e9:.1f} GB, {info.flop_per_s / 1e9:.1f} GFLOP/s "
            f"({info.bench}, {spec.name} layer)")
        return sshctl.HostResult(h, 0)

    results = sshctl.for_all(hosts, replace(opt, parallel=1) if args.one_at_a_time else opt, one)
    bad = [r.error if r.error.startswith("host ") else f"host {k} {r.host.label}: {r.error}"
           for k, r in enumerate(results) if not r.ok]
    if bad:
        stop_servers(hosts, opt)
        raise UserError(f"{len(bad)} of {len(hosts)} host(s) could not be measured:\n  " +
                        "\n  ".join(bad))
    return [infos[k] for k in range(len(hosts))]


def stop_servers(hosts: list[HostEntry], opt: sshctl.SSHOptions) -> None:
    """Stop the probe servers this command started (by their pid files)."""
    sshctl.for_all(hosts, opt, lambda k, h, c: sshctl.HostResult(h, *sshctl.exec_command(
        c, sshctl.kill_script(h, RUN_NAME, REMOTE_DIR), opt.timeout_s)))


def measure_direction(client: paramiko.SSHClient, hosts: list[HostEntry], src: int, dst: int,
                      args: argparse.Namespace) -> LinkResult:
    """Connect, ping-pong and stream from host src to host dst (run on src)."""
    cmd = _remote(args, PROBE_AGENT, "measure", "--to", f"{hosts[dst].host}:{args.port}",
                  "--seconds", str(args.seconds), "--pings", str(PINGS), "--connect-timeout",
                  str(args.connect_timeout))
    # the agent prints only at its end: bound the whole exchange, not only the connect
    limit = 4 * args.connect_timeout + 2 * args.seconds + 30
    try:
        s, out, err = sshctl.exec_command(client, cmd, limit)
    except (OSError, paramiko.SSHException) as e:
        return LinkResult(src, dst, error="error", detail=f"no answer over SSH in {limit:g} s "
                          f"({type(e).__name__})")
    return parse_link(out, src, dst, s, err)


def _pair_line(a: LinkResult, b: LinkResult) -> str:
    def one(r: LinkResult) -> str:
        if not r.ok:
            return f"{r.src}->{r.dst} BLOCKED ({r.error})"
        return f"{r.src}->{r.dst} {r.bit_per_s / 1e6:.1f} Mbit/s rtt {r.rtt_ms:.2f} ms"
    return f"{one(a)}, {one(b)}"


def measure_pairs(hosts: list[HostEntry], opt: sshctl.SSHOptions, args: argparse.Namespace,
                  say: Progress) -> tuple[list[LinkResult], list[float]]:
    """Every pair, both directions, in rounds of disjoint pairs; (results, seconds per round)."""
    rounds = pair_rounds(len(hosts))
    clients = []
    for k, h in enumerate(hosts):
        try:
            clients.append(sshctl.connect(h, opt))
        except (OSError, paramiko.SSHException) as e:
            for c in clients:
                c.close()
            raise UserError(f"host {k} {h.label}: SSH lost after the benchmark "
                            f"({type(e).__name__}: {e})") from None
    links: list[LinkResult] = []
    round_s = []
    try:
        with ThreadPoolExecutor(max_workers=max(1, len(hosts) // 2)) as pool:
            for n, pairs in enumerate(rounds, 1):
                t = time.monotonic()

                def pair(p: tuple[int, int]) -> tuple[LinkResult, LinkResult]:
                    i, j = p  # one direction after the other: each host in one stream at a time
                    return (measure_direction(clients[i], hosts, i, j, args),
                            measure_direction(clients[j], hosts, j, i, args))
                done = list(pool.map(pair, pairs))
                round_s.append(time.monotonic() - t)
                for a, b in done:
                    links += [a, b]
                say(f"round {n}/{len(rounds)} ({round_s[-1]:.1f} s): " +
                    "; ".join(_pair_line(a, b) for a, b in done))
    finally:
        for c in clients:
            c.close()
    return links, round_s


def report(hosts: list[HostEntry], infos: list[HostInfo], links: list[LinkResult],
           args: argparse.Namespace) -> str:
    """The host table, the link table and every blocked pair with its fix."""
    hrows = [[str(k), h.label, f"{len(i.names)} x {i.names[0]}",
              f"{i.memory_bytes[0] / 1e9:.1f}", f"{i.flop_per_s / 1e9:.1f}"]
             for k, (h, i) in enumerate(zip(hosts, infos))]
    lrows = [[f"{r.src}->{r.dst}", f"{r.bit_per_s / 1e6:.1f}" if r.ok else "-",
              f"{r.rtt_ms:.2f}" if r.ok else "-", "ok" if r.ok else f"BLOCKED ({r.error})"]
             for r in sorted(links, key=lambda r: (r.src, r.dst))]
    text = (table(["host", "address", "device", "memory GB", "GFLOP/s"], hrows) + "\n" +
            table(["pair", "Mbit/s", "RTT ms", "direct TCP"], lrows))
    fixes = [fix_for(r, hosts, args.port, args.connect_timeout) for r in links if not r.ok]
    if fixes:
        text += "\nBLOCKED (written as 1 kbit/s, 1000 s links; fix, then measure again):\n" + \
            "\n".join(f"  {f}" for f in fixes)
    return text


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--hosts", required=True, metavar="IP_LIST", help="host list file")
    p.add_argument("--model", required=True,
                   help="model whose layer shapes to time: a preset or a Hugging Face "
                        "config.json (or its folder), as scheduler.py plan takes")
    p.add_argument("--out", required=True, help="cluster file to write (atomically)")
    p.add_argument("--known-hosts", default="known_hosts", help="known_hosts file (known_hosts)")
    p.add_argument("--key", help="private key file (default: ssh agent and ~/.ssh keys)")
    p.add_argument("--timeout", type=argtypes.number(0, MAX_SECONDS, lo_open=True), default=10.0,
                   help="SSH connect timeout in s (10)")
    p.add_argument("--remote-python", type=argtypes.name(), default="python3",
                   help="python with torch on the hosts (python3)")
    p.add_argument("--port", type=argtypes.integer(1, 65535), default=PORT,
                   help=f"TCP port of the probe servers (must be open between hosts; {PORT})")
    p.add_argument("--seconds", type=argtypes.number(0, MAX_SECONDS, lo_open=True), default=1.0,
                   help="TCP stream per direction after the warm-up, s (1.0)")
    p.add_argument("--connect-timeout", type=argtypes.number(0, MAX_SECONDS, lo_open=True),
                   default=5.0, help="give up on a pair's TCP connect after this many s (5)")
    p.add_argument("--bench-seconds", type=argtypes.number(0, MAX_SECONDS, lo_open=True),
                   default=2.0, help="compute benchmark per host, s (2)")
    p.add_argument("--micro-batch-size", type=argtypes.integer(1, 4096), default=1,
                   help="sequences per benchmark step (1)")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="benchmark the hosts one after the other (each alone on its machine); "
                        "default: all at once, timing the same window, as they will train")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = _args(argv)
    hosts = load_host_list(args.hosts)
    try:
        spec = resolve_model(args.model)  # a preset, or a config.json like the planner's
    except UserError as e:
        text = str(e)
        raise UserError(text if text.startswith("--model") else f"--model: {text}") from None
    check_output_path(args.out, "--out")
    opt = sshctl.SSHOptions(Path(args.known_hosts), args.key, args.timeout, 64)
    opt.check(True, args.hosts)
    say = Progress()
    rounds = pair_rounds(len(hosts))
    say(f"{len(hosts)} host(s): benchmark {spec.name} layer on each, then "
        f"{len(hosts) * (len(hosts) - 1) // 2} pair(s) in {len(rounds)} round(s) of disjoint "
        "pairs")
    infos = setup_hosts(hosts, opt, args, spec, say)
    try:
        links, round_s = measure_pairs(hosts, opt, args, say)
    finally:
        stop_servers(hosts, opt)
    cluster = build_cluster(f"measured-{Path(args.hosts).name}", hosts, infos, links)
    save_cluster(cluster, args.out)
    print(report(hosts, infos, links, args))
    if round_s:
        per = sum(round_s) / len(round_s)
        say(f"pairs: {len(round_s)} round(s) in {sum(round_s):.1f} s ({per:.1f} s per round); "
            f"16 hosts would take 15 rounds, about {estimate_s(16, per):.0f} s")
    blocked = blocked_pairs(links)
    say(f"wrote {args.out}: {cluster.num_devices} device(s); " +
        (f"{len(blocked)} pair(s) cannot connect: {blocked}" if blocked else
         "every pair connects"))
    return 1 if blocked else 0


def entry() -> None:
    """Console entry point (setup.py): run main() under run_main."""
    run_main(main)


if __name__ == "__main__":
    entry()
