#!/usr/bin/env python3
"""Stand-alone probe agent (stdlib only, so it can be copied to any host and run with python3).

    python3 probe_agent.py serve --bind ADDR --port P     # prints `ready`, serves until killed
    python3 probe_agent.py measure --to ADDR:P [--seconds 1.5] [--pings 10]   # prints JSON
        [--connect-timeout S]   # then a failed connect prints {"error": KIND, ...}, exit 3

Protocol per connection: the client sends one byte, `P` (ping-pong: echo 1-byte messages
until EOF) or `B` + 12 ASCII bytes of warm-up seconds (bulk: the server counts bytes until EOF,
then answers JSON with the byte count and the receive-side throughput after the warm-up, which
skips TCP slow start).
RTT is a TCP ping-pong (not ICMP ping: a userspace delay line on INPUT is not seen by ping
replies the same way).
"""

from __future__ import annotations

import argparse
import errno
import json
import socket
import statistics
import sys
import threading
import time

CHUNK = 256 * 1024


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            raise ConnectionError("peer closed")
        buf += part
    return buf


def _handle(conn: socket.socket) -> None:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        kind = conn.recv(1)
        if kind == b"P":
            while True:
                b = conn.recv(1)
                if not b:
                    return
                conn.sendall(b)
        elif kind == b"B":
            skip_s = float(_recv_exact(conn, 12).decode())
            samples = []  # (time, cumulative bytes) per recv
            total = 0
            while True:
                data = conn.recv(CHUNK)
                if not data:
                    break
                total += len(data)
                samples.append((time.monotonic(), total))
            rate = 0.0
            if len(samples) > 4:
                t0, t1 = samples[0][0], samples[-1][0]
                start = next(s for s in samples if s[0] >= min(t0 + skip_s, t1))
                if t1 > start[0]:
                    rate = (total - start[1]) * 8 / (t1 - start[0])
            conn.sendall(json.dumps({"bytes": total, "bit_per_s": rate}).encode())


def serve(bind: str, port: int) -> None:
    """Accept probe connections forever (one thread each)."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((bind, port))
    srv.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_handle, args=(conn,), daemon=True).start()


def _pings(s: socket.socket, pings: int) -> list[float]:
    """Round trips of one byte each way, ms (the first left out: connection warm-up)."""
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(b"P")
    rtts = []
    for _ in range(pings + 1):
        t = time.perf_counter()
        s.sendall(b"x")
        _recv_exact(s, 1)
        rtts.append((time.perf_counter() - t) * 1000.0)
    return rtts[1:]


def _stream(s: socket.socket, seconds: float, skip_s: float) -> bytes:
    """Send zeros for skip_s + seconds, then the receiver's JSON count."""
    s.sendall(b"B" + f"{skip_s:<12.4f}".encode())
    block = b"\0" * CHUNK
    end = time.monotonic() + seconds + skip_s
    while time.monotonic() < end:
        s.sendall(block)
    s.shutdown(socket.SHUT_WR)
    reply = b""
    while part := s.recv(4096):
        reply += part
    return reply


def reach_error(e: OSError) -> str:
    """Why a connect failed, as one word: `refused` (the host answered: nothing listens or a
    REJECT rule), `timeout` (no answer: a DROP rule, a NAT, a security group), `unreachable`
    (no route, ICMP host/net unreachable) or `error`."""
    if isinstance(e, TransferError):
        return "error"
    if isinstance(e, ConnectionRefusedError):
        return "refused"
    if isinstance(e, TimeoutError | socket.timeout):
        return "timeout"
    if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN):
        return "unreachable"
    return "error"


class TransferError(OSError):
    """The pair connected, then a transfer failed: not a reachability problem."""


def measure(addr: str, port: int, seconds: float, pings: int, timeout_s: float = 30.0) -> dict:
    """RTT (median of TCP ping-pongs, ms) and bandwidth (bit/s) from here to addr:port; every
    connect gives up after timeout_s, every transfer after max(timeout_s, seconds + 60) (a
    slow link drains MBs of send buffer: that is a measurement, not a blocked pair)."""
    transfer_s = max(timeout_s, seconds + 60.0)
    with socket.create_connection((addr, port), timeout=timeout_s) as s:
        s.settimeout(transfer_s)
        try:
            rtts = _pings(s, pings)
        except OSError as e:
            raise TransferError(f"ping-pong after connecting: {type(e).__name__}: {e}") from e
    # Slow start takes ~10 round trips to fill a long fat path: stream that long on top of
    # `seconds` and let the receiver count only after it.
    skip_s = max(0.25 * seconds, 10 * statistics.median(rtts) / 1000.0)
    with socket.create_connection((addr, port), timeout=timeout_s) as s:
        s.settimeout(transfer_s + skip_s)
        try:
            reply = _stream(s, seconds, skip_s)
        except OSError as e:
            raise TransferError(f"stream after connecting: {type(e).__name__}: {e}") from e
    bulk = json.loads(reply)
    return {"rtt_ms": statistics.median(rtts), "rtt_min_ms": min(rtts),
            "bit_per_s": bulk["bit_per_s"], "bytes": bulk["bytes"]}


def main() -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description="probe agent: serve, or measure RTT + bandwidth")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--bind", default="0.0.0.0")
    s.add_argument("--port", type=int, default=47913)
    m = sub.add_parser("measure")
    m.add_argument("--to", required=True, help="ADDR:PORT")
    m.add_argument("--seconds", type=float, default=1.5)
    m.add_argument("--pings", type=int, default=10)
    m.add_argument("--connect-timeout", type=float, default=None,
                   help="seconds per connect/socket operation; a failure is reported as JSON")
    a = p.parse_args()
    if a.cmd == "serve":
        serve(a.bind, a.port)
        return 0
    host, _, port = a.to.rpartition(":")
    if a.connect_timeout is None:
        print(json.dumps(measure(host, int(port), a.seconds, a.pings)))
        return 0
    try:
        print(json.dumps(measure(host, int(port), a.seconds, a.pings, a.connect_timeout)))
    except OSError as e:
        print(json.dumps({"error": reach_error(e), "detail": f"{type(e).__name__}: {e}"}))
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
