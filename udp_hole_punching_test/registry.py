"""Server-side state of the rendezvous server: sessions, their registrations, replay guards
and rate limits."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from udp_hole_punching_test.protocol import ProtocolError, server_key, server_master, verify


class SessionFull(ProtocolError):
    """An authenticated registration for a session that has two other peers already."""


@dataclass
class RateLimiter:
    """Token bucket per source IP; `allow` is False once a source exceeds its rate."""

    rate_per_s: float = 50.0
    burst: float = 100.0
    max_sources: int = 10_000
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict)

    def allow(self, source_ip: str, cost: float = 1.0) -> bool:
        """Take `cost` tokens from the source's bucket; False when it has too few."""
        now = self.clock()
        tokens, last = self._buckets.get(source_ip, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate_per_s)
        if len(self._buckets) >= self.max_sources and source_ip not in self._buckets:
            self._evict(now)
        if tokens < cost:
            self._buckets[source_ip] = (tokens, now)
            return False
        self._buckets[source_ip] = (tokens - cost, now)
        return True

    def _evict(self, now: float) -> None:
        # buckets that have refilled completely carry no information: drop them first
        full_after_s = self.burst / self.rate_per_s
        for ip in [ip for ip, (_, last) in self._buckets.items() if now - last > full_after_s]:
            del self._buckets[ip]
        if len(self._buckets) >= self.max_sources:  # still full: a flood of sources, start over
            self._buckets.clear()

    def __len__(self) -> int:
        return len(self._buckets)


@dataclass
class Registration:
    """What the server knows about one peer of a session."""

    peer_id: str
    pub: tuple[str, int]
    priv: tuple[str, int]
    wg: str
    wgmac: str
    last_seen: float
    pub_probe: tuple[str, int] | None = None
    relay_addr: tuple[str, int] | None = None  # where the relay port saw this peer

    def as_other(self) -> dict[str, Any]:
        """The record sent to the other peer."""
        return {
            "id": self.peer_id,
            "pub": list(self.pub),
            "pub_probe": None if self.pub_probe is None else list(self.pub_probe),
            "priv": list(self.priv),
            "wg": self.wg,
            "wgmac": self.wgmac,
        }


@dataclass
class Session:
    """One live session: its server key and up to two registered peers."""

    server_key: bytes
    peers: dict[str, Registration] = field(default_factory=dict)


@dataclass
class TokenBucket:
    """`rate_per_s` tokens a second, at most `burst`; `take` spends them."""

    rate_per_s: float
    burst: float
    tokens: float
    last: float

    def take(self, now: float, cost: float = 1.0) -> bool:
        """Spend `cost` tokens; False (nothing spent) when there are fewer."""
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.last) * self.rate_per_s)
        self.last = now
        if self.tokens < cost:
            return False
        self.tokens -= cost
        return True


MAX_REPLAY_CHANNELS = 32
"""Newest timestamps kept per session name (peer id x datagram kind); beyond, the oldest goes
and everything at or before its timestamp is refused for the session."""


def replay_channel(msg: dict[str, Any]) -> tuple[str, str]:
    """What a peer's timestamps must increase within: its id and the kind of datagram."""
    kind = "probe" if msg["t"] == "reg" and msg["probe"] else msg["t"]
    return msg["id"], kind


@dataclass
class ReplayGuard:
    """Replay state and datagram budget of one session name.

    Every authenticated datagram must carry a timestamp newer than the last one accepted on its
    channel (replay_channel), so a copy of any datagram the server has authenticated is
    refused, whatever address it comes from. It outlives the session (Registry keeps it until
    no datagram it saw could pass the clock-skew check any more), so a replay after expiry is
    refused too.
    """

    server_key: bytes
    bucket: TokenBucket
    newest_ts: dict[tuple[str, str], float] = field(default_factory=dict)
    floor_ts: float = -math.inf
    """Timestamps at or below it are refused on every channel (set when one was evicted)."""
    last_active: float = 0.0
    """Registry clock time of the last authenticated datagram or relayed packet."""

    def check(self, msg: dict[str, Any]) -> None:
        """Raise ProtocolError unless `msg` is newer than everything seen on its channel."""
        newest = max(self.floor_ts, self.newest_ts.get(replay_channel(msg), -math.inf))
        if msg["ts"] <= newest:
            raise ProtocolError("replayed datagram (timestamp not newer than the last one "
                                "accepted from this peer)")

    def record(self, msg: dict[str, Any], now: float) -> None:
        """Remember `msg`'s timestamp on its channel (evicting the oldest channel if full)."""
        channel = replay_channel(msg)
        self.newest_ts[channel] = msg["ts"]
        if len(self.newest_ts) > MAX_REPLAY_CHANNELS:
            oldest = min(self.newest_ts, key=self.newest_ts.__getitem__)
            self.floor_ts = max(self.floor_ts, self.newest_ts.pop(oldest))
        self.last_active = now


class Registry:
    """Sessions and their peers, with expiry of stale registrations and replay protection.

    Cost per datagram does not depend on how many sessions exist: registrations and replay
    guards sit in insertion-ordered maps, refreshed ones move to the end, and `expire` pops
    stale ones from the front.
    """

    def __init__(
        self,
        pinned_token: str | None = None,
        ttl_s: float = 60.0,
        max_skew_s: float = 120.0,
        max_sessions: int = 10_000,
        clock: Callable[[], float] = time.time,
        session_rate_per_s: float = 50.0,
        session_burst: float = 100.0,
    ) -> None:
        # stretched once here: per session only an HMAC, so junk session names cost nothing
        self.pinned_master = None if pinned_token is None else server_master(pinned_token)
        self.ttl_s = ttl_s
        self.max_skew_s = max_skew_s
        self.max_sessions = max_sessions
        self.clock = clock
        self.session_rate_per_s = session_rate_per_s
        self.session_burst = session_burst
        self.sessions: dict[str, Session] = {}
        # a datagram the server saw at time T has ts >= T - skew, so it fails the skew check
        # after T + 2 x skew: until then its session's guard must be kept
        self.guard_ttl_s = max(ttl_s, 2 * max_skew_s)
        self.guards: OrderedDict[str, ReplayGuard] = OrderedDict()  # oldest activity first
        self._live: OrderedDict[tuple[str, str], None] = OrderedDict()  # (session, id), LRU
        self._relay_index: dict[tuple[str, int], tuple[str, str]] = {}  # addr -> session, id

    def _server_key_for(self, msg: dict[str, Any]) -> bytes:
        name = msg["s"]
        if self.pinned_master is not None:  # `skey` is ignored: the token decides
            return server_key(self.pinned_master, name)
        if name in self.guards:
            return self.guards[name].server_key
        if "skey" not in msg:
            raise ProtocolError("unknown session")
        # open mode: the first registration of a session fixes its server key
        return bytes.fromhex(msg["skey"])

    def authenticate(self, msg: dict[str, Any]) -> bytes:
        """Check MAC, clock skew and replay of a parsed peer->server message; return its key.

        On success the message's timestamp is recorded before anything else happens to it
        (rate limit, registration), so no copy of it is ever accepted afterwards.
        """
        if msg["t"] not in ("reg", "relay"):
            raise ProtocolError(f"the server does not accept {msg['t']!r} messages")
        key = self._server_key_for(msg)
        verify(key, msg)
        now = self.clock()
        if abs(now - msg["ts"]) > self.max_skew_s:
            raise ProtocolError(f"timestamp off by {now - msg['ts']:.0f} s (replay or bad clock)")
        guard = self.guards.get(msg["s"])
        if guard is not None:
            if "skey" in msg and self.pinned_master is None and bytes.fromhex(msg["skey"]) != key:
                raise ProtocolError("server key differs from the session's")
            guard.check(msg)
        else:
            guard = self._new_guard(msg["s"], key, now)
        guard.record(msg, now)
        self.guards.move_to_end(msg["s"])
        return key

    def _new_guard(self, name: str, key: bytes, now: float) -> ReplayGuard:
        if len(self.guards) >= self.max_sessions:
            self.expire()
            if len(self.guards) >= self.max_sessions:
                raise ProtocolError("too many sessions")
        bucket = TokenBucket(self.session_rate_per_s, self.session_burst, self.session_burst, now)
        guard = self.guards[name] = ReplayGuard(server_key=key, bucket=bucket, last_active=now)
        return guard

    def within_rate(self, session_name: str) -> bool:
        """Charge one authenticated datagram to its session's budget; False when it is spent."""
        guard = self.guards.get(session_name)
        return guard is not None and guard.bucket.take(self.clock())

    def _touch(self, session_name: str, reg: Registration, now: float) -> None:
        reg.last_seen = now
        self._live[(session_name, reg.peer_id)] = None
        self._live.move_to_end((session_name, reg.peer_id))
        guard = self.guards.get(session_name)
        if guard is not None:  # a live session's guard is never older than its peers
            guard.last_active = now
            self.guards.move_to_end(session_name)

    def register(
        self, msg: dict[str, Any], key: bytes, observed: tuple[str, int]
    ) -> tuple[Session, Registration]:
        """Record an authenticated registration or probe; raise ProtocolError if refused."""
        now = self.clock()
        self.expire()
        name = msg["s"]
        session = self.sessions.get(name)
        if session is None:
            if len(self.sessions) >= self.max_sessions:
                raise ProtocolError("too many sessions")
            session = self.sessions[name] = Session(server_key=key)
        peer_id = msg["id"]
        reg = session.peers.get(peer_id)
        if reg is None:
            if len(session.peers) >= 2:
                raise SessionFull("session full: two other peers are registered already")
            if msg["probe"]:
                if not session.peers:
                    del self.sessions[name]
                raise ProtocolError("probe before registration")
            reg = Registration(peer_id, observed, tuple(msg["priv"]), msg["wg"], msg["wgmac"], now)
            session.peers[peer_id] = reg
        if msg["probe"]:
            reg.pub_probe = observed
        else:
            reg.pub = observed
            reg.priv = tuple(msg["priv"])
            reg.wg, reg.wgmac = msg["wg"], msg["wgmac"]
        self._touch(name, reg, now)
        return session, reg

    def bind_relay(self, msg: dict[str, Any], observed: tuple[str, int]) -> bool:
        """Record where the relay port sees an authenticated peer; True once both are bound."""
        session = self.sessions.get(msg["s"])
        reg = None if session is None else session.peers.get(msg["id"])
        if session is None or reg is None:
            raise ProtocolError("relay request before registration")
        if reg.relay_addr is not None:
            self._relay_index.pop(reg.relay_addr, None)
        reg.relay_addr = observed
        self._relay_index[observed] = (msg["s"], msg["id"])
        self._touch(msg["s"], reg, self.clock())
        other = self.other(msg["s"], msg["id"])
        return other is not None and other.relay_addr is not None

    def relay_target(self, source: tuple[str, int]) -> tuple[str, int] | None:
        """Where to forward a relayed datagram from `source` (None: not a bound peer)."""
        entry = self._relay_index.get(source)
        if entry is None:
            return None
        session = self.sessions.get(entry[0])
        reg = None if session is None else session.peers.get(entry[1])
        if reg is None or reg.relay_addr != source:
            self._relay_index.pop(source, None)
            return None
        self._touch(entry[0], reg, self.clock())  # relayed keep-alives keep it alive
        other = self.other(entry[0], entry[1])
        return None if other is None else other.relay_addr

    def other(self, session_name: str, peer_id: str) -> Registration | None:
        """The other peer of the session, if it has registered."""
        session = self.sessions.get(session_name)
        if session is None:
            return None
        others = [r for pid, r in session.peers.items() if pid != peer_id]
        return others[0] if others else None

    def expire(self) -> int:
        """Drop registrations not refreshed within ttl_s (and sessions left empty), then replay
        guards past their keeping time; return how many registrations were dropped."""
        now = self.clock()
        dropped = 0
        while self._live:
            name, pid = next(iter(self._live))
            session = self.sessions.get(name)
            reg = None if session is None else session.peers.get(pid)
            if reg is not None and now - reg.last_seen <= self.ttl_s:
                break  # the rest were refreshed later
            del self._live[(name, pid)]
            if reg is None:
                continue
            assert session is not None
            del session.peers[pid]
            if reg.relay_addr is not None:
                self._relay_index.pop(reg.relay_addr, None)
            dropped += 1
            if not session.peers:
                del self.sessions[name]
        self._expire_guards(now)
        return dropped

    def _expire_guards(self, now: float) -> None:
        while self.guards:
            name, guard = next(iter(self.guards.items()))
            if now - guard.last_active <= self.guard_ttl_s or name in self.sessions:
                break
            del self.guards[name]
