"""Peer: register at the rendezvous server, punch a UDP hole to the other peer, then tunnel.

    python udp_hole_punching_test/peer.py --server HOST:PORT --session NAME --token T

Steps: (1) register on the server's port and probe its port+1 from the same socket, learning
our public endpoint as seen from two destinations and the other peer's endpoints and WireGuard
key (which the other peer authenticated with `wgmac`); (2) send authenticated hellos to the
other's public and private endpoints at once, with back-off, until each side has received a
hello that echoes one of its own fresh nonces (a two-way exchange that a spoofed or replayed
packet cannot fake); (3) close the socket and bring up WireGuard on the same local port, the
other's confirmed endpoint as its peer endpoint, and keep-alives holding both NAT mappings
open; it stays up until SIGINT/SIGTERM or --hold-s.

Exit status: 0 success, 2 user error, 3 punching failed (the diagnosis names the NAT
behaviour that was observed), 4 the tunnel did not come up, 128 + the signal number when
SIGTERM/SIGINT stopped it before the tunnel was up.
"""

from __future__ import annotations

import argparse
import base64
import hmac
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from formats import argtypes  # noqa: E402
from formats.addresses import host_port, resolve  # noqa: E402
from formats.atomic_io import atomic_write_json, check_output_path  # noqa: E402
from formats.errors import UserError, run_main  # noqa: E402
from udp_hole_punching_test.protocol import (  # noqa: E402
    ProtocolError,
    SessionKeys,
    derive_keys,
    encode,
    new_nonce,
    new_peer_id,
    parse,
    verify,
    wg_hash,
    wg_mac,
)

log = logging.getLogger("peer")
Endpoint = tuple[str, int]
EXIT_PUNCH_FAILED = 3
EXIT_TUNNEL_FAILED = 4
MAX_SECONDS = 1e6
"""Longest timeout or hold time a flag may give (11 days)."""
HANDSHAKE_TIMEOUT_S = 30.0
"""How long the WireGuard handshake through the hole may take: WireGuard retries every 5 s, and
on a loaded machine the first tries can go out before the other side's interface listens."""


@dataclass
class PeerConfig:
    """Settings of one peer run."""

    server: Endpoint
    session: str
    token: str
    local_port: int = 0
    private_ip: str | None = None
    register_timeout_s: float = 30.0
    punch_timeout_s: float = 15.0
    linger_s: float = 1.0
    low_ttl: int = 2  # IP TTL of the first hellos (0: off); 2 = expires behind our own NAT
    # Low-TTL hellos for this long after punching starts, or until the other's first hello
    # arrives: the phase must outlast the gap between the two peers' starts (a loaded host can
    # start one peer's punching several hundred ms after the other's; 0.3 s failed once in CI).
    low_ttl_phase_s: float = 1.0
    relay_fallback: bool = False  # after a failed punch, tunnel through the server's relay
    relay_timeout_s: float = 10.0
    wg_public_key: str | None = None  # None: punch only, no tunnel


@dataclass
class OtherPeer:
    """The other peer as announced by the server."""

    peer_id: str
    pub: Endpoint
    pub_probe: Endpoint | None
    priv: Endpoint
    wg: str


@dataclass
class PunchResult:
    """Outcome of registration + punching (also what --result-json holds)."""

    ok: bool
    peer_id: str
    local_port: int
    my_public: Endpoint | None = None
    my_public_probe: Endpoint | None = None
    other: dict[str, Any] | None = None
    endpoint: Endpoint | None = None  # the other's endpoint that carried the handshake
    path: str = ""  # "direct" (punched) or "relay" (through the server)
    rtt_ms: float | None = None
    my_mapping: str = "unknown"
    other_mapping: str = "unknown"
    diagnosis: str = ""
    hellos_received: int = 0
    rejected_datagrams: int = 0
    tunnel: dict[str, Any] = field(default_factory=dict)


def mapping_behaviour(pub: Endpoint | None, probe: Endpoint | None, priv: Endpoint | None) -> str:
    """Classify a NAT mapping from the endpoints two server ports observed for one socket."""
    if pub is None or probe is None:
        return "unknown"
    if tuple(pub) != tuple(probe):
        return "endpoint-dependent (symmetric NAT)"
    if priv is not None and tuple(pub) == tuple(priv):
        return "no NAT"
    return "endpoint-independent"


def detect_private_ip(server: Endpoint) -> str:
    """The local address the kernel would use to reach the server (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(server)
        except OSError as exc:
            raise UserError(f"--server {server[0]}:{server[1]}: no route to it ({exc})") from exc
        return s.getsockname()[0]


class Puncher:
    """Registration and hole punching on one UDP socket."""

    def __init__(self, cfg: PeerConfig, keys: SessionKeys | None = None) -> None:
        self.cfg = cfg
        self.keys = keys or derive_keys(cfg.token, cfg.session)
        self.peer_id = new_peer_id()
        # without a tunnel the key field still has to be valid: send a random one
        self.wg_key = cfg.wg_public_key or base64.b64encode(os.urandom(32)).decode()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self.sock.bind(("0.0.0.0", cfg.local_port))
        except OSError as exc:
            self.sock.close()
            raise UserError(f"--local-port {cfg.local_port}: cannot bind: {exc}") from exc
        self.local_port = self.sock.getsockname()[1]
        self._default_ttl = self.sock.getsockopt(socket.IPPROTO_IP, socket.IP_TTL)
        priv_ip = cfg.private_ip or detect_private_ip(cfg.server)
        self.priv: Endpoint = (priv_ip, self.local_port)
        self.probe_server: Endpoint = (cfg.server[0], cfg.server[1] + 1)
        self.relay_server: Endpoint = (cfg.server[0], cfg.server[1] + 2)
        self.relay_ready = False
        self.result = PunchResult(ok=False, peer_id=self.peer_id, local_port=self.local_port)
        self.other: OtherPeer | None = None
        self.server_error = ""
        self._regs_sent = 0
        self._sent: dict[str, float] = {}  # my hello nonces -> send time
        self._last_from_other = ""  # latest nonce received from the other
        self._rtts: list[float] = []
        self.confirmed_at: float | None = None
        self.other_done = False

    # ------------------------------------------------------------ sending

    def _sendto(self, data: bytes, addr: Endpoint) -> None:
        try:
            self.sock.sendto(data, addr)
        except OSError as exc:  # unreachable private endpoints are expected
            log.debug("sendto %s: %s", addr, exc)

    def _register(self) -> None:
        # Only a server without a pinned token needs `skey`, and only in the registration that
        # creates the session; a pinned server answers without it. So the key goes out in
        # cleartext only after two registrations went unanswered.
        skey = self.result.my_public is None and self._regs_sent >= 2
        self._regs_sent += 1
        wgmac = wg_mac(self.keys.peer_key, self.cfg.session, self.peer_id, self.wg_key)
        for probe, addr in ((False, self.cfg.server), (True, self.probe_server)):
            fields: dict[str, Any] = {
                "priv": list(self.priv), "wg": self.wg_key, "wgmac": wgmac, "probe": probe,
            }  # fmt: skip
            if skey and not probe:  # a probe never creates a session
                fields["skey"] = self.keys.server_key.hex()
            data = encode(self.keys.server_key, "reg", self.cfg.session, self.peer_id, **fields)
            self._sendto(data, addr)

    def _hello(self, addr: Endpoint, ttl: int | None = None) -> None:
        assert self.other is not None
        nonce = new_nonce()
        if len(self._sent) > 4096:  # bounded memory; old nonces cannot be echoed usefully
            self._sent.clear()
        self._sent[nonce] = time.monotonic()
        data = encode(
            self.keys.peer_key, "hello", self.cfg.session, self.peer_id, nonce=nonce,
            to=self.other.peer_id, echo=self._last_from_other,
            done=self.confirmed_at is not None, wgh=wg_hash(self.wg_key),
        )  # fmt: skip
        if ttl is None:
            self._sendto(data, addr)
            return
        self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, ttl)
        try:
            self._sendto(data, addr)
        finally:
            self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, self._default_ttl)

    # ------------------------------------------------------------ receiving

    def _receive(self, timeout_s: float) -> None:
        """Handle datagrams for up to timeout_s (returns after the first batch)."""
        self.sock.settimeout(max(timeout_s, 0.001))
        try:
            data, addr = self.sock.recvfrom(4096)
        except (TimeoutError, BlockingIOError):
            return
        except OSError as exc:  # ICMP errors can surface here; they carry no data
            log.debug("recvfrom: %s", exc)
            return
        self.sock.setblocking(False)
        while True:
            self._handle(data, (addr[0], addr[1]))
            try:
                data, addr = self.sock.recvfrom(4096)
            except (BlockingIOError, OSError):
                return

    def _handle(self, data: bytes, addr: Endpoint) -> None:
        try:
            msg = parse(data)
            if msg["s"] != self.cfg.session:
                raise ProtocolError("another session")
            servers = (self.cfg.server, self.probe_server, self.relay_server)
            if addr in servers and msg["t"] != "hello":
                verify(self.keys.server_key, msg)
                self._from_server(msg)
            elif msg["t"] == "hello":
                verify(self.keys.peer_key, msg)
                self._from_peer(msg, addr)
            else:
                raise ProtocolError(f"unexpected {msg['t']!r} from {addr}")
        except ProtocolError as exc:
            self.result.rejected_datagrams += 1
            log.debug("dropped datagram from %s: %s", addr, exc)
        except Exception as exc:  # anyone can send us anything: a bug costs one datagram
            self.result.rejected_datagrams += 1
            log.warning("internal error on a datagram from %s: %r", addr, exc)

    def _from_server(self, msg: dict[str, Any]) -> None:
        if msg["t"] == "reg_ok":
            if msg["probe"]:
                self.result.my_public_probe = tuple(msg["pub"])
            else:
                self.result.my_public = tuple(msg["pub"])
        elif msg["t"] == "peer":
            self.result.my_public = tuple(msg["pub"])
            o = msg["other"]
            # the server forwards the key; only the other peer (the peer key) can vouch for it
            expected = wg_mac(self.keys.peer_key, self.cfg.session, o["id"], o["wg"])
            if not hmac.compare_digest(o["wgmac"], expected):
                raise ProtocolError("the other's WireGuard key is not authenticated (wgmac)")
            other = OtherPeer(
                o["id"],
                tuple(o["pub"]),
                None if o["pub_probe"] is None else tuple(o["pub_probe"]),
                tuple(o["priv"]),
                o["wg"],
            )
            if self.other is not None and other.peer_id == self.other.peer_id:
                if other.wg != self.other.wg:  # one key pair per peer process
                    raise ProtocolError("the server changed the other's WireGuard key")
            elif self.other is not None:
                if self.confirmed_at is not None:  # the confirmed hellos vouched for this one
                    raise ProtocolError("another peer announced after the handshake")
                log.info("the other peer restarted (new id %s)", other.peer_id)
                self._last_from_other = ""
            self.other = other
        elif msg["t"] == "relay_ok":
            self.relay_ready = msg["ready"]
        elif msg["t"] == "err":
            self.server_error = msg["reason"]

    def _from_peer(self, msg: dict[str, Any], addr: Endpoint) -> None:
        other = self.other
        if msg["id"] == self.peer_id:
            raise ProtocolError("my own hello came back (same private address on both LANs?)")
        if other is None:
            return  # the other side punches already; we answer once the server told us
        if msg["id"] != other.peer_id or msg["to"] != self.peer_id:
            raise ProtocolError("hello from/for a peer id this session did not announce")
        if msg["wgh"] != wg_hash(other.wg):
            raise ProtocolError("hello carries a WireGuard key other than the announced one")
        self.result.hellos_received += 1
        self._last_from_other = msg["n"]
        self.other_done = self.other_done or msg["done"]
        echoed = self._sent.get(msg["echo"])
        newly_confirmed = False
        if echoed is not None:
            self._rtts.append(time.monotonic() - echoed)
            if self.confirmed_at is None:
                self.confirmed_at = time.monotonic()
                self.result.endpoint = addr
                newly_confirmed = True
        # answer at once while the other has not heard us, and once when we confirm; never
        # answer an answer, so two peers cannot ping-pong at line rate
        if echoed is None or newly_confirmed:
            self._hello(addr)

    # ------------------------------------------------------------ phases

    def register(self) -> None:
        """Register (and probe) until the server announced the other peer."""
        deadline = time.monotonic() + self.cfg.register_timeout_s
        next_send = 0.0
        while self.other is None or self.result.my_public_probe is None:
            now = time.monotonic()
            if self.server_error:
                raise PunchFailed(f"the server refused the registration: {self.server_error}")
            if now > deadline:
                if self.other is not None:
                    break  # the probe port may be filtered; go on without that observation
                if self.result.my_public is None:
                    raise PunchFailed(
                        f"no answer from the rendezvous server {_ep(self.cfg.server)} within "
                        f"{self.cfg.register_timeout_s:.0f} s (wrong address or token, or "
                        "UDP to it is blocked)"
                    )
                raise PunchFailed(
                    f"the other peer did not register within {self.cfg.register_timeout_s:.0f} s"
                )
            if now >= next_send:
                self._register()
                next_send = now + 0.5
            self._receive(min(next_send, deadline) - now)

    def punch(self) -> None:
        """Send hellos to every candidate endpoint until the two-way exchange is confirmed."""
        assert self.other is not None
        deadline = time.monotonic() + self.cfg.punch_timeout_s
        start = time.monotonic()
        interval_s, next_hello, next_register = 0.05, 0.0, start + 1.0
        while True:
            now = time.monotonic()
            if self.confirmed_at is not None and (
                self.other_done or now - self.confirmed_at > self.cfg.linger_s
            ):
                break
            if now > deadline:
                raise PunchFailed(self.diagnose())
            if now >= next_register:  # keep the registration fresh; learn the other's probe
                self._register()
                next_register = now + 1.0
            if now >= next_hello:
                targets = [self.result.endpoint] if self.confirmed_at else self._candidates()
                # First open our own NAT's mapping with hellos that expire before the other
                # NAT: if the other's hello reached our NAT box first, a NAT box that accepts
                # unsolicited WAN input would record it as a flow to itself, and our mapping
                # would then clash with it and get a random port.
                # Once a hello of the other's arrived, both mappings exist: no need to wait.
                low_phase = now - start < self.cfg.low_ttl_phase_s and not self._last_from_other
                low = self.cfg.low_ttl if low_phase else None
                for addr in targets:
                    self._hello(addr, ttl=low or None)
                next_hello = now + interval_s
                interval_s = min(interval_s * 1.5, 0.5)
            self._receive(min(next_hello, next_register, deadline) - now)
        self.result.ok = True
        self.result.path = "direct"
        self.result.rtt_ms = round(min(self._rtts) * 1000.0, 3)
        self._classify()

    def relay(self) -> None:
        """Bind this socket at the server's relay port until the other peer is bound too."""
        deadline = time.monotonic() + self.cfg.relay_timeout_s
        next_send = 0.0
        t0 = time.monotonic()
        while not self.relay_ready:
            now = time.monotonic()
            if now > deadline:
                raise PunchFailed(
                    f"no relay: {_ep(self.relay_server)} did not confirm both peers within "
                    f"{self.cfg.relay_timeout_s:.0f} s (run the server with --relay-mbit-s and "
                    "both peers with --relay-fallback)"
                )
            if now >= next_send:
                data = encode(self.keys.server_key, "relay", self.cfg.session, self.peer_id)
                self._sendto(data, self.relay_server)
                next_send = now + 0.3
            self._receive(min(next_send, deadline) - now)
        self.result.ok = True
        self.result.path = "relay"
        self.result.endpoint = self.relay_server
        self.result.rtt_ms = None
        log.info("relay ready after %.2f s", time.monotonic() - t0)

    def _candidates(self) -> list[Endpoint]:
        assert self.other is not None
        out = [self.other.pub]
        if self.other.priv != self.other.pub:
            out.append(self.other.priv)
        return out

    def _classify(self) -> None:
        r = self.result
        r.my_mapping = mapping_behaviour(r.my_public, r.my_public_probe, self.priv)
        if self.other is not None:
            o = self.other
            r.other_mapping = mapping_behaviour(o.pub, o.pub_probe, o.priv)
            r.other = {"id": o.peer_id, "pub": o.pub, "pub_probe": o.pub_probe, "priv": o.priv}

    def diagnose(self) -> str:
        """Explain a failed punch from what was observed."""
        self._classify()
        r = self.result
        sides = []
        if r.my_mapping.startswith("endpoint-dependent"):
            sides.append(
                f"this side's NAT changes the public port per destination: server port "
                f"{self.cfg.server[1]} saw {_ep(r.my_public)}, port {self.probe_server[1]} saw "
                f"{_ep(r.my_public_probe)}"
            )
        if r.other_mapping.startswith("endpoint-dependent") and r.other:
            sides.append(
                f"the other side's NAT changes the public port per destination: "
                f"{_ep(r.other['pub'])} vs {_ep(r.other['pub_probe'])}"
            )
        if sides:
            return (
                "punching failed: symmetric NAT (endpoint-dependent mapping) detected; "
                + "; ".join(sides)
                + ". The port the other peer punches towards is not the one this NAT uses for "
                "it. Use a relay, or a NAT with endpoint-independent mapping."
            )
        heard = (
            f"{r.hellos_received} authenticated hello(s) arrived from the other peer but none "
            "echoed ours"
            if r.hellos_received
            else "no authenticated hello arrived from the other peer"
        )
        return (
            f"punching failed: {heard}; mappings: this side {r.my_mapping}, other side "
            f"{r.other_mapping}. Likely causes: a NAT box that accepts unsolicited WAN input "
            "and re-mapped our port for this one destination (a conntrack clash; keep "
            "--low-ttl on), a firewall that filters even solicited UDP, the other peer stopped, "
            f"or different tokens on the two peers ({r.rejected_datagrams} datagram(s) "
            "rejected)."
        )

    def close(self) -> None:
        """Close the socket (frees the local port for WireGuard)."""
        self.sock.close()


class PunchFailed(RuntimeError):
    """Registration or punching failed; the message is the diagnosis."""


class Stopped(BaseException):
    """SIGTERM/SIGINT before the tunnel was up (a BaseException: `except Exception` lets it by)."""


def _raise_stopped(signum: int, _frame: Any) -> None:
    """Signal handler until the tunnel is up: unwind, so that every `finally` cleans up."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # a second signal must not interrupt the clean-up
    raise Stopped(signum)


def _ep(ep: Endpoint | list | None) -> str:
    return "nothing" if ep is None else f"{ep[0]}:{ep[1]}"


def bring_up_tunnel(
    cfg: PeerConfig, puncher: Puncher, keypair: Any, hold_s: float, result_json: Path | None
) -> int:
    """Close the punched socket, start WireGuard on its port, report, hold, tear down."""
    from udp_hole_punching_test import wireguard as wg

    other = puncher.other
    assert other is not None and puncher.result.endpoint is not None
    role = "a" if puncher.peer_id < other.peer_id else "b"
    addr_a, addr_b = wg.tunnel_addresses(cfg.session)
    mine, theirs = (addr_a, addr_b) if role == "a" else (addr_b, addr_a)
    tunnel = wg.Tunnel(
        name=wg.interface_name(cfg.session, role),
        address=mine,
        peer_address=theirs,
        listen_port=puncher.local_port,
        endpoint=puncher.result.endpoint,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    puncher.close()  # WireGuard takes over the port and the NAT mapping behind it
    # `other.wg` is the key the confirmed hellos hashed (wgh) and the other peer vouched for
    # (wgmac); _from_server refuses any later change of it
    try:
        t_up = time.monotonic()
        tunnel.up(keypair, other.wg, initiate=role == "a")  # b answers (see Tunnel.up)
        t_listen = time.monotonic()
        ok = tunnel.wait_handshake(timeout_s=HANDSHAKE_TIMEOUT_S)
        if ok and role == "b":
            tunnel.keep_alive(other.wg)
        puncher.result.tunnel = _tunnel_record(tunnel, ok, role, t_up, t_listen)
        if not ok:  # what WireGuard saw, for the diagnosis
            puncher.result.tunnel["wg_status"] = tunnel.status()
        _report(puncher.result, result_json)
        if not ok:
            print("error: WireGuard handshake did not complete within "
                  f"{HANDSHAKE_TIMEOUT_S:g} s", file=sys.stderr)
            return EXIT_TUNNEL_FAILED
        print(
            f"tunnel up: {tunnel.name} ({tunnel.implementation}) {mine} <-> {theirs} "
            f"via {_ep(tunnel.endpoint)}; holding until SIGTERM/SIGINT"
            + (f" or {hold_s:.0f} s" if hold_s > 0 else ""),
            flush=True,
        )
        stop.wait(timeout=hold_s if hold_s > 0 else None)
        return 0
    finally:
        tunnel.down()


def _tunnel_record(tunnel: Any, ok: bool, role: str, t_up: float, t_listen: float
                   ) -> dict[str, Any]:
    """The result's `tunnel` entry: the interface, its addresses, and how long it took."""
    from udp_hole_punching_test import wireguard as wg

    return {
        "ok": ok,
        "interface": tunnel.name,
        "implementation": tunnel.implementation,
        "role": role,
        "address": tunnel.address,
        "peer_address": tunnel.peer_address,
        "listen_port": tunnel.listen_port,
        "endpoint": list(tunnel.endpoint),
        "keepalive_s": wg.KEEPALIVE_S,
        "up_s": round(t_listen - t_up, 3),
        "handshake_s": round(time.monotonic() - t_listen, 3),
        "wall_time": round(time.time(), 3),
    }


def _report(result: PunchResult, path: Path | None) -> None:
    line = json.dumps(asdict(result))
    print(line, flush=True)
    if path is not None:
        atomic_write_json(path, asdict(result))


def build_parser() -> argparse.ArgumentParser:
    """The peer's command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True, help="rendezvous server HOST:PORT")
    ap.add_argument("--session", required=True, help="session name shared by the two peers")
    ap.add_argument(
        "--token",
        default=os.environ.get("PUNCH_TOKEN"),
        help="secret shared by the two peers (default: $PUNCH_TOKEN, which keeps it out of ps)",
    )
    ap.add_argument("--local-port", type=int, default=0, help="UDP port to punch from (0: any)")
    ap.add_argument("--private-ip", type=argtypes.ipv4, default=None,
                    help="LAN address to announce (default: auto)")
    ap.add_argument("--register-timeout-s", type=argtypes.number(0, MAX_SECONDS, lo_open=True),
                    default=30.0)
    ap.add_argument("--punch-timeout-s", type=argtypes.number(0, MAX_SECONDS, lo_open=True),
                    default=15.0)
    ap.add_argument(
        "--low-ttl",
        type=int,
        default=2,
        help="TTL of the hellos sent in the first second of punching (or until the other's first "
        "hello arrives), which open our NAT's mapping without reaching the other NAT (0: off)",
    )
    ap.add_argument(
        "--relay-fallback",
        action="store_true",
        help="if punching fails, tunnel through the server's relay (server: --relay-mbit-s)",
    )
    ap.add_argument("--no-wireguard", action="store_true", help="punch and report only")
    ap.add_argument("--hold-s", type=argtypes.number(0, MAX_SECONDS), default=0.0,
                    help="tunnel lifetime (0: until signal)")
    ap.add_argument("--result-json", type=Path, default=None, help="also write the result here")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s peer %(message)s",
    )
    # from the start: a signal while registering or punching must still delete the private key
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_stopped)
    keypair = None
    puncher = None
    try:
        try:
            cfg, keys = _config(args)
            if not args.no_wireguard:
                from udp_hole_punching_test.wireguard import KeyPair

                keypair = KeyPair.generate()
                cfg.wg_public_key = keypair.public_key
            puncher = Puncher(cfg, keys)
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exc.exit_code
        return _run(args, cfg, puncher, keypair)
    except Stopped as exc:
        signum = exc.args[0]
        print(f"stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    finally:
        if puncher is not None:
            puncher.close()
        if keypair is not None:
            keypair.destroy()


def _config(args: argparse.Namespace) -> tuple[PeerConfig, SessionKeys]:
    """Check the command line; raise UserError saying what is wrong."""
    if not args.token:
        raise UserError("give the session's secret with --token T or PUNCH_TOKEN=T")
    if not 0 <= args.local_port <= 65535:
        raise UserError(f"--local-port {args.local_port} must be 0-65535")
    if not 0 <= args.low_ttl <= 255:
        raise UserError(f"--low-ttl {args.low_ttl} must be 0-255")
    if args.result_json is not None:
        check_output_path(args.result_json, "--result-json")
    host, port = host_port(args.server, "--server")
    if ":" in host:  # the peer's sockets, the hole and the tunnel are IPv4
        raise UserError(f"--server {args.server}: the peer speaks IPv4 only; give the "
                        "server's IPv4 address or a name with an A record")
    server = (resolve(host, "--server"), port)  # resolved once: the address every probe uses
    try:
        keys = derive_keys(args.token, args.session)
    except ProtocolError as exc:
        raise UserError(f"--session/--token: {exc}") from exc
    cfg = PeerConfig(
        server=server,
        session=args.session,
        token=args.token,
        local_port=args.local_port,
        private_ip=args.private_ip,
        register_timeout_s=args.register_timeout_s,
        punch_timeout_s=args.punch_timeout_s,
        low_ttl=args.low_ttl,
        relay_fallback=args.relay_fallback,
    )
    return cfg, keys


def _run(args: argparse.Namespace, cfg: PeerConfig, puncher: Puncher, keypair: Any) -> int:
    """Register, punch (or relay), then report or bring up the tunnel; return the exit status."""
    print(
        f"peer {puncher.peer_id}: local port {puncher.local_port}, private "
        f"{_ep(puncher.priv)}, server {_ep(cfg.server)}",
        flush=True,
    )
    try:
        puncher.register()
        assert puncher.other is not None
        print(
            f"registered: public {_ep(puncher.result.my_public)} (probe "
            f"{_ep(puncher.result.my_public_probe)}); other peer {puncher.other.peer_id} "
            f"public {_ep(puncher.other.pub)} private {_ep(puncher.other.priv)}",
            flush=True,
        )
        try:
            puncher.punch()
        except PunchFailed as exc:
            if not cfg.relay_fallback:
                raise
            puncher._classify()
            puncher.result.diagnosis = str(exc)
            print(f"warning: {exc}\nfalling back to the server's relay", flush=True)
            puncher.relay()
    except PunchFailed as exc:
        puncher._classify()
        puncher.result.diagnosis = "; ".join(d for d in (puncher.result.diagnosis, str(exc)) if d)
        _report(puncher.result, args.result_json)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_PUNCH_FAILED
    r = puncher.result
    if r.path == "direct":
        print(
            f"punched: direct path to {_ep(r.endpoint)} from local port {r.local_port}, "
            f"rtt {r.rtt_ms:.2f} ms; NAT mapping here {r.my_mapping}, there {r.other_mapping}",
            flush=True,
        )
    else:
        print(f"relayed: through {_ep(r.endpoint)} from local port {r.local_port}", flush=True)
    if keypair is None:
        _report(r, args.result_json)
        return 0
    try:
        return bring_up_tunnel(cfg, puncher, keypair, args.hold_s, args.result_json)
    except (RuntimeError, UserError) as exc:
        print(f"error: tunnel: {exc}", file=sys.stderr)
        return EXIT_TUNNEL_FAILED


if __name__ == "__main__":
    run_main(main)
