"""Rendezvous server against replay, spoofing and junk (no root; the real server on loopback):

- no replayed or spoofed datagram, of any type, before or after expiry, from any address
  changes a session or gets anything sent to its sender;
- a registration that was rate-limited cannot be replayed from elsewhere once the budget refills;
- 10,000 junk datagrams from a peer's own address delay its registration by at most 1 s;
- in open mode the cost of a datagram does not grow with the number of (junk) sessions.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time

import pytest

from udp_hole_punching_test import protocol as P
from udp_hole_punching_test import registry as R
from udp_hole_punching_test.puncher import PeerConfig, Puncher
from udp_hole_punching_test.rendezvous_server import RendezvousServer

WG = "LMueet3LUb2IObBGg4oYl11JBGLPU7pHI1ufhbbN7Qw="
TOKEN, SESSION = "tok", "s1"
KEYS = P.derive_keys(TOKEN, SESSION)
WRONG = P.derive_keys("not-the-token", SESSION)


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _free_ports(n: int) -> int:
    """A port p with p .. p+n-1 free on 127.0.0.1 (UDP)."""
    rng = random.SystemRandom()
    for _ in range(200):
        p = rng.randrange(20000, 60000)
        socks = []
        try:
            for q in range(p, p + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                socks.append(s)
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free UDP ports")


@contextlib.contextmanager
def serving(**kwargs):
    """A RendezvousServer (with relay port) answering in a thread; yields (server, port)."""
    port = _free_ports(3)
    srv = RendezvousServer("127.0.0.1", port, relay_mbit_s=kwargs.pop("relay_mbit_s", 10),
                           **kwargs)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    try:
        yield srv, port
    finally:
        srv.stop()
        t.join(timeout=5)
        srv.close()


def _udp(ip: str = "127.0.0.1") -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((ip, 0))
    return s


def _drain(sock: socket.socket, wait_s: float = 0.0) -> list[bytes]:
    """Everything waiting on `sock` (after waiting up to wait_s for the first datagram)."""
    got = []
    sock.settimeout(wait_s if wait_s > 0 else 0.001)
    with contextlib.suppress(TimeoutError, BlockingIOError):
        while True:
            got.append(sock.recv(4096))
            sock.settimeout(0.001)
    return got


def _reg(pid: str, probe: bool = False, keys=KEYS, skey: bool = True, now=None,
         session=SESSION) -> bytes:
    fields = {"priv": ["192.168.1.2", 5000], "wg": WG, "probe": probe,
              "wgmac": P.wg_mac(keys.peer_key, session, pid, WG)}
    if skey and not probe:
        fields["skey"] = keys.server_key.hex()
    return P.encode(keys.server_key, "reg", session, pid, now=now, **fields)


def _state(srv: RendezvousServer) -> dict:
    """What a datagram could change: every registration's endpoints, key and relay binding."""
    return {name: {pid: (r.pub, r.pub_probe, r.priv, r.wg, r.wgmac, r.relay_addr)
                   for pid, r in s.peers.items()} for name, s in srv.registry.sessions.items()}


def _exchange(sock, data: bytes, port: int, want: int, timeout_s: float = 3.0) -> list[bytes]:
    sock.sendto(data, ("127.0.0.1", port))
    got: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += _drain(sock, 0.2)
    return got


def _session_exchange(port: int, open_mode: bool) -> tuple[dict, list[bytes]]:
    """Peers a and b register, probe and bind at the relay, c finds the session full: the
    sockets, and every datagram that went over the wire (both directions) plus two hellos."""
    a, b, c = _udp(), _udp(), _udp("127.0.0.3")
    ida, idb, idc = "a" * 16, "b" * 16, "c" * 16
    wire: list[bytes] = []

    def step(sock, data: bytes, to: int, want: int) -> None:
        wire.append(data)
        answers = _exchange(sock, data, to, want)
        assert len(answers) >= want, (P.parse(data)["t"], answers)
        wire.extend(answers)

    step(a, _reg(ida, skey=open_mode), port, 1)            # reg_ok
    step(a, _reg(ida, probe=True), port + 1, 1)            # reg_ok (probe)
    step(b, _reg(idb, skey=open_mode), port, 2)            # reg_ok, peer (and a gets peer)
    wire += _drain(a, 1.0)
    step(b, _reg(idb, probe=True), port + 1, 1)
    step(a, P.encode(KEYS.server_key, "relay", SESSION, ida), port + 2, 1)  # relay_ok
    step(b, P.encode(KEYS.server_key, "relay", SESSION, idb), port + 2, 1)
    step(c, _reg(idc, skey=open_mode), port, 1)            # err: session full
    for src, dst in ((ida, idb), (idb, ida)):
        wire.append(P.encode(KEYS.peer_key, "hello", SESSION, src, to=dst, echo="", done=False,
                             wgh=P.wg_hash(WG)))
    kinds = sorted({P.parse(d)["t"] for d in wire})
    assert kinds == ["err", "hello", "peer", "reg", "reg_ok", "relay", "relay_ok"], kinds
    return {"a": a, "b": b, "c": c}, wire


def _spoofs(wire: list[bytes]) -> list[bytes]:
    """Forged variants: fields or timestamps changed (MAC no longer matches), re-signed with a
    wrong token, server messages sent back to the server, a stranger's own registration."""
    out = []
    for data in wire:
        msg = json.loads(data)
        for change in ({"ts": round(time.time(), 3)}, {"n": P.new_nonce()},
                       {"mac": msg["mac"][::-1]}):
            out.append(json.dumps({**msg, **change}).encode())
        if msg["t"] == "reg" and not msg["probe"]:
            out.append(json.dumps({**msg, "priv": ["10.6.6.6", 666]}).encode())
            out.append(_reg(msg["id"], keys=WRONG))  # fresh, but not the session's token
            out.append(_reg("e" * 16, keys=WRONG))
    out.append(P.encode(KEYS.server_key, "reg_ok", SESSION, "a" * 16, pub=["10.6.6.6", 666],
                        probe=False))  # a server message, correctly signed, sent to the server
    return out


def _replay(srv, port: int, sources: list[socket.socket], datagrams: list[bytes]) -> int:
    """Send every datagram to every server port from every source; return how many went out
    (after waiting until the server has handled them all)."""
    before = sum(srv.stats.values())
    sent = 0
    for data in datagrams:
        for to in (port, port + 1, port + 2):
            for sock in sources:
                sock.sendto(data, ("127.0.0.1", to))
                sent += 1
        time.sleep(0.002)  # keep the server's receive buffer from overflowing
    deadline = time.monotonic() + 10
    while sum(srv.stats.values()) - before < sent and time.monotonic() < deadline:
        time.sleep(0.05)
    return sent


@pytest.mark.timeout(90)
@pytest.mark.parametrize("open_mode", [False, True], ids=["pinned-token", "open"])
def test_replayed_and_spoofed_datagrams_change_nothing_and_get_no_answer(open_mode):
    with serving(pinned_token=None if open_mode else TOKEN, rate_per_s=1000) as (srv, port):
        peers, wire = _session_exchange(port, open_mode)
        strangers = [_udp(), _udp("127.0.0.2")]  # the peers' own IP (their NAT), another IP
        sources = [*peers.values(), *strangers]
        for s in sources:
            _drain(s)
        datagrams = wire + _spoofs(wire)
        state, accepted = _state(srv), srv.stats["accepted"]
        assert set(state[SESSION]) == {"a" * 16, "b" * 16}
        trials = 0
        for phase in ("live", "expired"):
            rejected = srv.stats["rejected"]
            sent = _replay(srv, port, sources, datagrams)
            trials += sent
            assert srv.stats["rejected"] - rejected == sent, (phase, dict(srv.stats))
            answers = {i: _drain(s, 0.3 if i == 0 else 0) for i, s in enumerate(sources)}
            assert not any(answers.values()), (phase, answers)
            assert _state(srv) == state and srv.stats["accepted"] == accepted, phase
            if phase == "live":  # now let both registrations expire, and replay everything again
                srv.registry.ttl_s = 0.3
                deadline = time.monotonic() + 10
                while srv.registry.sessions and time.monotonic() < deadline:
                    time.sleep(0.1)
                state = {}
                assert _state(srv) == state
        print(f"{'open' if open_mode else 'pinned'}: replay and spoof trials {trials} "
              f"({len(datagrams)} datagrams x 3 ports x {len(sources)} source addresses x live "
              "and expired), sessions changed 0, answers to the sender 0")
        for s in sources:
            s.close()


@pytest.mark.timeout(60)
def test_a_rate_limited_registration_cannot_be_replayed_from_elsewhere():
    with serving(pinned_token=TOKEN, rate_per_s=1.0) as (srv, port):  # burst 2 per session
        a, b, attacker = _udp(), _udp(), _udp("127.0.0.2")
        assert _exchange(a, _reg("a" * 16), port, 1)
        assert len(_exchange(b, _reg("b" * 16), port, 2)) == 2
        assert [P.parse(d)["t"] for d in _drain(a, 1.0)] == ["peer"]  # told about b
        original = _reg("a" * 16)  # a's next registration finds the session's budget spent
        limited = srv.stats["rate_limited"]
        assert _exchange(a, original, port, 1, timeout_s=0.3) == []
        assert srv.stats["rate_limited"] == limited + 1, dict(srv.stats)
        time.sleep(1.5)  # the budget refills
        state = _state(srv)
        for sock in (attacker, a):
            assert _exchange(sock, original, port, 1, timeout_s=0.5) == []
        assert _state(srv) == state
        assert srv.registry.sessions[SESSION].peers["a" * 16].pub == a.getsockname()
        fresh = _exchange(a, _reg("a" * 16), port, 1)  # a's own next registration still works
        assert fresh and P.parse(fresh[0])["t"] in ("reg_ok", "peer")
        for s in (a, b, attacker):
            s.close()


def _flood(port: int, count: int, duration_s: float, done: threading.Event) -> None:
    """`count` junk datagrams from 127.0.0.1 (the peer's own address) over `duration_s`:
    registrations for its session signed with a wrong token, garbage and bare headers."""
    rng = random.Random(3)
    junk = [_reg(f"{i:016x}", keys=WRONG) for i in range(200)]
    junk += [rng.randbytes(rng.randint(1, 300)) for _ in range(50)] + [b"{}", b'{"v":1}']
    burst = 100
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        t0 = time.monotonic()
        for i in range(0, count, burst):
            for k in range(i, min(count, i + burst)):
                s.sendto(junk[k % len(junk)], ("127.0.0.1", port))
            pause = t0 + (i + burst) * duration_s / count - time.monotonic()
            if pause > 0:
                time.sleep(pause)
    done.set()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("open_mode", [False, True], ids=["pinned-token", "open"])
def test_junk_from_a_peers_own_address_delays_its_registration_by_at_most_1s(open_mode):
    with serving(pinned_token=None if open_mode else TOKEN, rate_per_s=50) as (srv, port):
        b = _udp()
        assert _exchange(b, _reg("b" * 16, skey=open_mode), port, 1)  # the other peer is in
        done = threading.Event()
        flood = threading.Thread(target=_flood, args=(port, 10_000, 3.0, done), daemon=True)
        t_flood = time.monotonic()
        flood.start()
        time.sleep(0.5)  # the flood is under way
        puncher = Puncher(PeerConfig(server=("127.0.0.1", port), session=SESSION, token=TOKEN,
                                     private_ip="127.0.0.1", register_timeout_s=20), KEYS)
        try:
            t0 = time.monotonic()
            puncher.register()  # the real peer: a registration and a probe every 0.5 s
            took = time.monotonic() - t0
        finally:
            puncher.close()
        flood.join(timeout=20)
        flood_s = time.monotonic() - t_flood
        print(f"{'open' if open_mode else 'pinned'}: registration took {took:.3f} s during a "
              f"flood of 10,000 junk datagrams from the peer's address lasting {flood_s:.1f} s "
              f"(server rejected {srv.stats['rejected']}, rate-limited "
              f"{srv.stats['rate_limited']})")
        assert puncher.other is not None and puncher.other.peer_id == "b" * 16
        assert took <= 1.0
        assert not done.is_set() or flood_s > 2.5  # it really overlapped the flood
        assert srv.stats["rejected"] >= 5_000  # the server saw (and refused) the junk


def test_open_mode_cost_per_datagram_does_not_grow_with_junk_sessions():
    port = _free_ports(2)
    srv = RendezvousServer("127.0.0.1", port, rate_per_s=1e9)  # open mode, no relay
    sink = _udp()  # the answers go here, unread
    addr = sink.getsockname()
    try:
        srv.handle(_reg("b" * 16), addr, srv.main_sock)
        t = [time.time()]

        def per_datagram_us() -> float:
            best = float("inf")
            for _ in range(3):
                batch = []
                for _ in range(300):
                    t[0] += 0.001
                    batch.append(_reg("a" * 16, now=t[0]))
                t0 = time.perf_counter()
                for data in batch:
                    srv.handle(data, addr, srv.main_sock)
                best = min(best, (time.perf_counter() - t0) / len(batch) * 1e6)
            return best

        alone = per_datagram_us()
        attacker = P.derive_keys("attacker", "x")  # any key: open mode takes the first one
        for i in range(5_000):
            srv.handle(_reg("f" * 16, keys=attacker, session=f"junk-{i}"), addr, srv.main_sock)
        assert len(srv.registry.sessions) == 5_001
        crowded = per_datagram_us()
        expire_us = min(_timed(srv.registry.expire) for _ in range(5)) * 1e6
        print(f"open mode: {alone:.1f} us per registration alone, {crowded:.1f} us beside 5,000 "
              f"junk sessions; expire() {expire_us:.1f} us")
        assert crowded < 3 * alone + 20
        assert expire_us < 1000
    finally:
        srv.close()
        sink.close()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------- the registry's replay guard


def _parsed(data: bytes) -> dict:
    return P.parse(data)


def test_guard_refuses_replays_after_expiry_and_accepts_fresh_registrations():
    clock = FakeClock(time.time())
    r = R.Registry(ttl_s=60, max_skew_s=120, clock=clock)
    a = _parsed(_reg("a" * 16, now=clock.t))
    r.register(a, r.authenticate(a), ("203.0.113.1", 4000))
    clock.t += 61
    assert r.expire() == 1 and r.sessions == {}
    with pytest.raises(P.ProtocolError, match="replayed"):
        r.authenticate(a)  # 61 s old: within the clock skew, but seen before
    older = _parsed(_reg("a" * 16, now=clock.t - 90))  # never seen, but older than a's newest
    with pytest.raises(P.ProtocolError, match="replayed"):
        r.authenticate(older)
    again = _parsed(_reg("a" * 16, now=clock.t))  # the peer itself registers again: fine
    r.register(again, r.authenticate(again), ("203.0.113.1", 4001))
    assert r.sessions[SESSION].peers["a" * 16].pub == ("203.0.113.1", 4001)


def test_open_mode_session_key_outlives_the_session_by_the_replay_window():
    clock = FakeClock(time.time())
    r = R.Registry(ttl_s=60, max_skew_s=120, clock=clock)
    a = _parsed(_reg("a" * 16, now=clock.t))
    r.register(a, r.authenticate(a), ("203.0.113.1", 4000))
    clock.t += 100
    r.expire()
    other_key = _parsed(_reg("b" * 16, keys=WRONG, now=clock.t))
    with pytest.raises(P.ProtocolError, match="bad MAC"):
        r.authenticate(other_key)  # the name is still bound to the first key
    clock.t += 200  # 300 s after the last datagram: nothing it saw could pass the skew check
    r.expire()
    assert SESSION not in r.guards
    claim = _parsed(_reg("b" * 16, keys=WRONG, now=clock.t))
    r.register(claim, r.authenticate(claim), ("198.51.100.1", 1))


def test_guard_channels_are_bounded_and_sessions_budgeted_separately():
    clock = FakeClock(time.time())
    r = R.Registry(pinned_token=TOKEN, clock=clock, session_rate_per_s=1, session_burst=2)
    first = _parsed(_reg("0" * 16, skey=False, now=clock.t))
    r.authenticate(first)
    for i in range(1, R.MAX_REPLAY_CHANNELS + 1):  # one id too many: the oldest is evicted
        r.authenticate(_parsed(_reg(f"{i:016x}", skey=False, now=clock.t + i * 0.001)))
    guard = r.guards[SESSION]
    assert len(guard.newest_ts) == R.MAX_REPLAY_CHANNELS and guard.floor_ts == first["ts"]
    with pytest.raises(P.ProtocolError, match="replayed"):
        r.authenticate(first)  # its channel is gone, the floor still refuses it
    assert [r.within_rate(SESSION) for _ in range(3)] == [True, True, False]
    other = P.derive_keys(TOKEN, "s2")
    r.authenticate(_parsed(_reg("a" * 16, keys=other, skey=False, now=clock.t, session="s2")))
    assert r.within_rate("s2")  # s1's spent budget is s1's alone
    assert not r.within_rate("never-authenticated")


def test_guards_are_capped_like_sessions():
    clock = FakeClock(time.time())
    r = R.Registry(clock=clock, max_sessions=3)
    for i in range(3):
        r.authenticate(_parsed(_reg("a" * 16, now=clock.t, session=f"s{i}")))
    with pytest.raises(P.ProtocolError, match="too many sessions"):
        r.authenticate(_parsed(_reg("a" * 16, now=clock.t, session="s3")))
    clock.t += r.guard_ttl_s + 1
    r.authenticate(_parsed(_reg("a" * 16, now=clock.t, session="s3")))
    assert list(r.guards) == ["s3"]
