#!/usr/bin/env python3
"""Userspace delay line: hold incoming packets per source address, then let them in.

For kernels without sch_netem. Installs `iptables -I INPUT -s SRC -j NFQUEUE --queue-num Q
--queue-bypass` (with a comment tag) for each source, holds each queued packet `delay_ms[SRC]` ms
and accepts it. --queue-bypass: if the delay line dies without removing its rules (SIGKILL), the
kernel lets those packets through undelayed instead of dropping them (SSH stays reachable).
It must sit on the receiver's INPUT chain: on the sender's OUTPUT chain TCP stalls.
Run it inside the receiving host (or `ip netns exec NS`); SIGTERM/SIGINT remove its rules.

    python scripts/delay_line.py --delays '{"198.18.0.2": 20.0, "198.18.0.3": 50}' [--queue 4213]
    python scripts/delay_line.py --cleanup [--tag TAG]     # remove leftover rules of a crash

Prints `ready` on stdout once the rules are in and the queue is bound.
"""

from __future__ import annotations

import argparse
import heapq
import ipaddress
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from itertools import count

try:
    from formats.errors import UserError
except ImportError:  # copied alone to a remote host by tc.py: stdlib + NetfilterQueue only
    class UserError(ValueError):  # type: ignore[no-redef]
        """Bad input (same role as formats.errors.UserError)."""

DEFAULT_TAG = "scattered-delay-line"
DEFAULT_QUEUE = 4213
MAX_HELD = 200_000  # packets the kernel may hold for us (default 1024 drops at BDP > 1.5 MB)
TAG_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
"""An iptables comment that `cleanup` can find again in `iptables -S` output (no spaces or
quotes)."""


def _iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(["iptables", "-w", "5", *args], capture_output=True, text=True,
                              timeout=30)
    except FileNotFoundError:
        raise UserError("`iptables` not found (Debian package iptables)") from None
    if check and proc.returncode != 0:
        raise UserError(f"iptables {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def rule_args(src: str, queue: int, tag: str) -> list[str]:
    """The INPUT rule for one source (without -I/-D)."""
    return ["INPUT", "-s", f"{src}/32", "-m", "comment", "--comment", tag, "-j", "NFQUEUE",
            "--queue-num", str(queue), "--queue-bypass"]


def cleanup(tag: str) -> int:
    """Delete every INPUT rule carrying `tag`; returns how many were removed."""
    rules = _iptables("-S", "INPUT").stdout.splitlines()
    removed = 0
    for line in rules:
        if f'--comment {tag} ' in line + " " or f'--comment "{tag}"' in line:
            parts = line.split()
            assert parts[0] == "-A"
            _iptables("-D", *parts[1:])
            removed += 1
    return removed


def parse_delays(text: str) -> dict[bytes, float]:
    """{source IPv4 as 4 bytes: delay seconds} from the JSON object `{addr: ms}`."""
    # (stdlib only here: this file also runs alone on remote hosts, without formats/)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"--delays: not JSON ({e.msg})") from None
    except (ValueError, RecursionError):  # a number of > 4300 digits; nesting too deep
        raise UserError("--delays: not a usable JSON object {source address: delay ms}") \
            from None
    if not isinstance(raw, dict):
        raise UserError("--delays: expected a JSON object {source address: delay ms}")
    out = {}
    for addr, ms in raw.items():
        try:
            packed = ipaddress.IPv4Address(addr).packed
        except ValueError:
            raise UserError(f"--delays: {addr!r} is not an IPv4 address") from None
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 <= ms <= 60_000:
            raise UserError(f"--delays[{addr}]: delay must be 0..60000 ms, got {repr(ms)[:40]}")
        out[packed] = float(ms) / 1000.0
    return out


def serve(delays: dict[bytes, float], queue: int, tag: str) -> None:
    """Bind the queue, install the rules, hold packets until SIGTERM; rules removed on exit."""
    from netfilterqueue import COPY_PACKET, NetfilterQueue

    held: list[tuple[float, int, object]] = []
    seq = count()

    def on_packet(pkt) -> None:  # type: ignore[no-untyped-def]
        src = pkt.get_payload()[12:16]
        due = time.monotonic() + delays.get(src, 0.0)
        pkt.retain()  # keep the packet after the callback returns; verdict given later
        heapq.heappush(held, (due, next(seq), pkt))

    nfq = NetfilterQueue()
    # 20 bytes: the IPv4 header is all we read (source address at offset 12).
    try:
        nfq.bind(queue, on_packet, max_len=MAX_HELD, mode=COPY_PACKET, range=20)
    except OSError as e:
        raise UserError(f"cannot bind NFQUEUE {queue} ({e}); not root, or another delay line "
                        "holds it") from None
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    added = []
    try:
        for src in delays:
            args = rule_args(socket.inet_ntoa(src), queue, tag)
            _iptables("-I", *args)
            added.append(args)
        sock = socket.fromfd(nfq.get_fd(), socket.AF_NETLINK, socket.SOCK_RAW)
        print("ready", flush=True)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # the starter may close its end of our stdout after `ready`
        while not stop:
            timeout = max(0.0, held[0][0] - time.monotonic()) if held else 0.5
            try:
                readable, _, _ = select.select([sock], [], [], timeout)
            except InterruptedError:
                continue
            if readable:
                nfq.run(block=False)
            now = time.monotonic()
            while held and held[0][0] <= now:
                heapq.heappop(held)[2].accept()
    finally:
        for args in added:
            _iptables("-D", *args, check=False)
        for _, _, pkt in held:
            pkt.accept()
        nfq.unbind()


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--delays", help="JSON object {source IPv4: one-way delay ms}")
    p.add_argument("--queue", type=int, default=DEFAULT_QUEUE, help="NFQUEUE number (4213)")
    p.add_argument("--tag", default=DEFAULT_TAG, help="iptables comment marking our rules")
    p.add_argument("--cleanup", action="store_true", help="remove leftover rules and exit")
    args = p.parse_args(argv)
    if not 0 <= args.queue <= 65535:
        raise UserError(f"--queue: must be an NFQUEUE number 0..65535, got {args.queue}")
    if not TAG_RE.fullmatch(args.tag):
        raise UserError(f"--tag: must be 1-64 letters, digits, '.', '_' or '-', got "
                        f"{args.tag[:64]!r}")
    if args.cleanup:
        print(f"removed {cleanup(args.tag)} rule(s) tagged {args.tag}")
        return 0
    if not args.delays:
        raise UserError("--delays is required (or --cleanup)")
    delays = parse_delays(args.delays)
    try:
        import netfilterqueue  # noqa: F401
    except ImportError:
        raise UserError("the NetfilterQueue package is missing (pip install NetfilterQueue; "
                        "needs libnetfilter-queue-dev): delay not applied") from None
    serve(delays, args.queue, args.tag)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
