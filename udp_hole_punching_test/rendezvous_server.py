"""Rendezvous server: tells the two peers of a session each other's public and private endpoints.

    python udp_hole_punching_test/rendezvous_server.py --bind HOST:3478 [--token T] \\
        [--relay-mbit-s 200]

It listens on two UDP ports, PORT and PORT+1 (the probe port). A peer registers on PORT and
probes PORT+1 from the same socket; the server answers each with the address it observed, so
a peer (and the other peer) can see whether its NAT keeps one public port for all destinations
(endpoint-independent mapping, punchable) or picks a new one per destination (symmetric NAT).

With --relay-mbit-s R > 0 it also relays, on PORT+2, the (WireGuard, end-to-end encrypted)
traffic of two peers that could not punch: each binds its socket there with an authenticated
`relay` request, after which anything not JSON from one bound address goes to the other.

Every datagram is validated (size, JSON schema, HMAC, clock skew, replay) before anything
acts on it or charges anything: only then is it counted against its session's budget
(--rate-per-s), so junk from a peer's own address (its NAT) costs that peer nothing. Replayed
datagrams are refused from any address, also after the session expired. Anything invalid is
counted and dropped without an answer (an unexpected error while handling one datagram is
counted as `internal_error`, logged, and the server goes on). Without --token the first
registration of a session fixes the session's server key (see README.md, "Security").
"""

from __future__ import annotations

import argparse
import logging
import os
import selectors
import signal
import socket
import sys
import time
from collections import Counter

from formats import argtypes  # noqa: E402
from formats.addresses import host_port, resolve  # noqa: E402
from formats.errors import UserError, run_main  # noqa: E402
from udp_hole_punching_test.protocol import ProtocolError, encode, parse  # noqa: E402
from udp_hole_punching_test.registry import (  # noqa: E402
    RateLimiter,
    Registration,
    Registry,
    SessionFull,
)

log = logging.getLogger("rendezvous")
SERVER_ID = "0" * 16  # the server's id in its replies
RECV_BUFFER_BYTES = 4 << 20
"""Socket receive buffer asked for (the kernel caps it at net.core.rmem_max): a burst of junk
then takes longer to overflow it and crowd out a peer's datagram."""


MAX_SECONDS = 1e6
MAX_RATE = 1e9


def parse_hostport(text: str, what: str) -> tuple[str, int]:
    """Split 'HOST:PORT' (`[IPv6]:PORT`), check the port and that the host resolves; raise
    UserError naming `what` otherwise."""
    host, port = host_port(text, what)
    resolve(host, what, socket.AF_INET6 if ":" in host else socket.AF_INET)
    return host, port


class RendezvousServer:
    """The UDP server loop; `serve` runs until `stop` is called."""

    def __init__(
        self,
        host: str,
        port: int,
        pinned_token: str | None = None,
        ttl_s: float = 60.0,
        rate_per_s: float = 50.0,
        relay_mbit_s: float = 0.0,
    ) -> None:
        try:
            # rate_per_s: authenticated datagrams per second and session, checked after
            # authentication; an unauthenticated source is never charged to a session
            self.registry = Registry(pinned_token=pinned_token, ttl_s=ttl_s,
                                     session_rate_per_s=rate_per_s, session_burst=2 * rate_per_s)
        except ProtocolError as exc:  # e.g. a token longer than the protocol allows
            raise UserError(f"--token: {exc}") from exc
        relay_bytes_s = relay_mbit_s * 1e6 / 8
        # bytes per second per source; one second of burst
        self.relay_limiter = RateLimiter(rate_per_s=relay_bytes_s, burst=relay_bytes_s)
        self.stats: Counter[str] = Counter()
        self.sockets: list[socket.socket] = []
        self._running = True
        ports = (port, port + 1, port + 2) if relay_mbit_s > 0 else (port, port + 1)
        try:
            for p in ports:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                s = socket.socket(family, socket.SOCK_DGRAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER_BYTES)
                s.bind((host, p))
                s.setblocking(False)
                self.sockets.append(s)
        except OSError as exc:
            self.close()
            raise UserError(f"cannot bind {host} ports {list(ports)}: {exc}") from exc
        self.main_sock, self.probe_sock = self.sockets[:2]
        self.relay_sock = self.sockets[2] if relay_mbit_s > 0 else None

    def close(self) -> None:
        """Close the sockets."""
        for s in self.sockets:
            s.close()

    def stop(self) -> None:
        """Ask `serve` to return."""
        self._running = False

    def handle(self, data: bytes, addr: tuple[str, int], sock: socket.socket) -> None:
        """Validate one datagram and answer it; drop (and count) anything invalid.

        Order matters: parse, port check and authentication (which records the timestamp, so
        no copy is accepted later) come before the session's budget is charged and before
        anything changes or is sent.
        """
        observed = (addr[0], addr[1])
        if sock is self.relay_sock and not data.startswith(b"{"):
            self._forward(data, observed)
            return
        try:
            msg = parse(data)
            self._check_port(msg, sock)
            key = self.registry.authenticate(msg)
        except ProtocolError as exc:
            self.stats["rejected"] += 1
            log.debug("dropped datagram from %s:%d: %s", addr[0], addr[1], exc)
            return
        if not self.registry.within_rate(msg["s"]):
            self.stats["rate_limited"] += 1
            return
        try:
            if msg["t"] == "relay":
                ready = self.registry.bind_relay(msg, observed)
                self.stats["relay_bound"] += 1
                self._send(sock, addr, key, msg, "relay_ok", pub=list(observed), ready=ready)
                return
            _, reg = self.registry.register(msg, key, observed)
        except SessionFull as exc:  # authenticated, so it deserves an answer
            self.stats["rejected"] += 1
            self._send(sock, addr, key, msg, "err", reason=str(exc))
            return
        except ProtocolError as exc:
            self.stats["rejected"] += 1
            log.debug("dropped datagram from %s:%d: %s", addr[0], addr[1], exc)
            return
        self.stats["accepted"] += 1
        self._introduce(sock, addr, key, msg, reg)

    def _check_port(self, msg: dict, sock: socket.socket) -> None:
        """Relay requests only on the relay port, probes only on the probe port."""
        if (msg["t"] == "relay") != (sock is self.relay_sock):
            raise ProtocolError("relay requests go to the relay port, and only they")
        if msg["t"] == "reg" and msg["probe"] != (sock is self.probe_sock):
            raise ProtocolError("probe flag does not match the port it was sent to")

    def _introduce(self, sock, addr, key: bytes, msg: dict, reg: Registration) -> None:
        """Answer an accepted registration; tell both peers about each other once both are in."""
        observed = [addr[0], addr[1]]
        self._send(sock, addr, key, msg, "reg_ok", pub=observed, probe=msg["probe"])
        other = self.registry.other(msg["s"], msg["id"])
        if other is not None and not msg["probe"]:
            self._send(sock, addr, key, msg, "peer", pub=observed, other=other.as_other())
            # tell the waiting peer now rather than at its next registration
            self._send(sock, other.pub, key, msg, "peer", pub=list(other.pub), other=reg.as_other())

    def handle_safely(self, data: bytes, addr: tuple[str, int], sock: socket.socket) -> None:
        """`handle`, but a bug it hits costs one datagram (counted), never the server."""
        try:
            self.handle(data, addr, sock)
        except Exception as exc:  # anyone can send us anything: never let input stop us
            self.stats["internal_error"] += 1
            log.error("internal error on a datagram from %s:%d: %r", addr[0], addr[1], exc)

    def _forward(self, data: bytes, source: tuple[str, int]) -> None:
        """Relay an opaque datagram (WireGuard, end-to-end encrypted) to the bound other peer."""
        assert self.relay_sock is not None
        target = self.registry.relay_target(source)
        if target is None:
            self.stats["relay_unbound"] += 1
            return
        if not self.relay_limiter.allow(source[0], cost=len(data)):
            self.stats["relay_rate_limited"] += 1
            return
        try:
            self.relay_sock.sendto(data, target)
            self.stats["relayed"] += 1
        except OSError as exc:
            log.debug("relay to %s failed: %s", target, exc)

    def _send(self, sock, addr, key: bytes, msg: dict, mtype: str, **fields) -> None:
        try:
            data = encode(key, mtype, msg["s"], SERVER_ID, **fields)
            sock.sendto(data, addr)
        except ProtocolError as exc:  # e.g. an address the protocol cannot carry
            self.stats["unanswerable"] += 1
            log.debug("cannot answer %s: %s", addr, exc)
        except OSError as exc:  # an unreachable peer must not stop the server
            log.debug("send to %s failed: %s", addr, exc)

    def serve(self) -> None:
        """Answer datagrams until stopped; expire stale registrations every second."""
        sel = selectors.DefaultSelector()
        for s in self.sockets:
            sel.register(s, selectors.EVENT_READ)
        last_expiry = time.monotonic()
        while self._running:
            for key, _ in sel.select(timeout=0.5):
                sock = key.fileobj
                for _ in range(64):  # drain, but let the other socket have its turn
                    try:
                        data, addr = sock.recvfrom(4096)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError as exc:  # e.g. ICMP errors surfacing on the socket
                        log.debug("recvfrom: %s", exc)
                        break
                    self.handle_safely(data, addr, sock)
            if time.monotonic() - last_expiry > 1.0:
                dropped = self.registry.expire()
                if dropped:
                    log.info("expired %d stale registration(s)", dropped)
                last_expiry = time.monotonic()
        sel.close()


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bind", required=True, help="HOST:PORT; PORT+1 is used as the probe port")
    ap.add_argument(
        "--token",
        default=os.environ.get("PUNCH_TOKEN") or None,
        help="accept only sessions using this token (default: $PUNCH_TOKEN; unset: first "
        "registration of a session fixes its key)",
    )
    ap.add_argument("--ttl-s", type=argtypes.number(0, MAX_SECONDS, lo_open=True), default=60.0,
                    help="forget peers silent this long")
    ap.add_argument(
        "--relay-mbit-s",
        type=argtypes.number(0, MAX_RATE),
        default=0.0,
        help="relay traffic between peers that cannot punch, on PORT+2, at most this many "
        "Mbit/s per source IP (0: no relay)",
    )
    ap.add_argument("--rate-per-s", type=argtypes.number(0, MAX_RATE, lo_open=True), default=50.0,
                    help="authenticated datagrams/s per session (burst: twice that); "
                    "unauthenticated datagrams are dropped without charging anyone")
    ap.add_argument("-v", "--verbose", action="store_true", help="log every dropped datagram")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s rendezvous %(message)s",
    )
    try:
        host, port = parse_hostport(args.bind, "--bind")
        if port == 65535:
            raise UserError("--bind port must be below 65535 (PORT+1 is the probe port)")
        if port >= 65534 and args.relay_mbit_s > 0:
            raise UserError("--bind port must be below 65534 with a relay (PORT+2 is the relay)")
        server = RendezvousServer(
            host, port, args.token, args.ttl_s, args.rate_per_s, args.relay_mbit_s
        )
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    relay = f", relay port {port + 2}" if server.relay_sock is not None else ""
    print(f"listening on {host}:{port} (probe port {port + 1}{relay})", flush=True)
    if host in ("0.0.0.0", "::"):
        # the kernel picks a reply's source address per route; a NAT drops replies that do not
        # come from the address the peer sent to
        print(
            "warning: bound to a wildcard address; on a host with several addresses bind the "
            "public one, or NATs will drop replies sent from another address",
            flush=True,
        )
    try:
        server.serve()
    finally:
        server.close()
        print(f"stopped; datagrams {dict(server.stats)}", flush=True)
    return 0


if __name__ == "__main__":
    run_main(main)
