"""Registration and hole punching on one UDP socket: the peer's state machine.

`Puncher.register` learns our public endpoint from the server's two ports and the other peer's
endpoints; `Puncher.punch` exchanges authenticated hellos until each side saw one of its own
nonces echoed; `Puncher.relay` binds the socket at the server's relay port instead.
"""

from __future__ import annotations

import base64
import hmac
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from formats.errors import UserError
from udp_hole_punching_test.protocol import (
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
from udp_hole_punching_test.punch_result import (
    Endpoint,
    PunchResult,
    endpoint_text,
    explain_failure,
    mapping_behaviour,
)

log = logging.getLogger("peer")


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


def detect_private_ip(server: Endpoint) -> str:
    """The local address the kernel would use to reach the server (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(server)
        except OSError as exc:
            raise UserError(f"--server {server[0]}:{server[1]}: no route to it ({exc})") from exc
        return s.getsockname()[0]


class PunchFailed(RuntimeError):
    """Registration or punching failed; the message is the diagnosis."""


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
                        "no answer from the rendezvous server "
                        f"{endpoint_text(self.cfg.server)} within "
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
        self.classify()

    def relay(self) -> None:
        """Bind this socket at the server's relay port until the other peer is bound too."""
        deadline = time.monotonic() + self.cfg.relay_timeout_s
        next_send = 0.0
        t0 = time.monotonic()
        while not self.relay_ready:
            now = time.monotonic()
            if now > deadline:
                raise PunchFailed(
                    f"no relay: {endpoint_text(self.relay_server)} did not confirm both peers "
                    "within "
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

    def classify(self) -> None:
        """Record both NAT mappings and the other peer in the result."""
        r = self.result
        r.my_mapping = mapping_behaviour(r.my_public, r.my_public_probe, self.priv)
        if self.other is not None:
            o = self.other
            r.other_mapping = mapping_behaviour(o.pub, o.pub_probe, o.priv)
            r.other = {"id": o.peer_id, "pub": o.pub, "pub_probe": o.pub_probe, "priv": o.priv}

    def diagnose(self) -> str:
        """Explain a failed punch from what was observed."""
        self.classify()
        return explain_failure(self.result, self.cfg.server[1], self.probe_server[1])

    def close(self) -> None:
        """Close the socket (frees the local port for WireGuard)."""
        self.sock.close()

