"""NAT traversal without root: wire protocol, HMAC, rate limiting, expiry, server and peers on
loopback (with garbage and spoofed datagrams), and the send/recv benchmark over gloo."""

from __future__ import annotations

import ipaddress
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from udp_hole_punching_test import protocol as P
from udp_hole_punching_test import registry as R
from udp_hole_punching_test.punch_result import mapping_behaviour
from udp_hole_punching_test.puncher import PeerConfig, Puncher
from udp_hole_punching_test.rendezvous_server import RendezvousServer
from udp_hole_punching_test.wireguard import interface_name, tunnel_addresses

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
WG = "LMueet3LUb2IObBGg4oYl11JBGLPU7pHI1ufhbbN7Qw="
KEYS = P.derive_keys("tok", "s1")
HUGE = 10**400  # a JSON integer no float can hold


def wgmac(pid: str, keys=KEYS, session="s1", wg=WG) -> str:
    """The wgmac a peer with id `pid` would send."""
    return P.wg_mac(keys.peer_key, session, pid, wg)


def reg(keys=KEYS, session="s1", pid="a" * 16, probe=False, now=None, skey=True, **over):
    """A registration datagram, parsed."""
    fields = {"priv": ["192.168.1.2", 5000], "wg": WG, "wgmac": wgmac(pid, keys, session),
              "probe": probe}  # fmt: skip
    if skey:
        fields["skey"] = keys.server_key.hex()
    fields.update(over)
    return P.parse(P.encode(keys.server_key, "reg", session, pid, now=now, **fields))


# ---------------------------------------------------------------- messages


def test_roundtrip_and_mac():
    data = P.encode(KEYS.peer_key, "hello", "s1", "b" * 16, to="a" * 16, echo="", done=False,
                    wgh=P.wg_hash(WG))  # fmt: skip
    msg = P.parse(data)
    P.verify(KEYS.peer_key, msg)
    with pytest.raises(P.ProtocolError, match="bad MAC"):
        P.verify(KEYS.server_key, msg)  # the server key cannot authenticate a hello
    with pytest.raises(P.ProtocolError, match="bad MAC"):
        P.verify(P.derive_keys("other-token", "s1").peer_key, msg)
    tampered = json.loads(data)
    tampered["done"] = True
    with pytest.raises(P.ProtocolError, match="bad MAC"):
        P.verify(KEYS.peer_key, P.parse(json.dumps(tampered).encode()))


def test_keys_depend_on_token_and_session():
    assert KEYS.server_key != KEYS.peer_key
    assert P.derive_keys("tok", "s2").peer_key != KEYS.peer_key
    assert P.derive_keys("tok2", "s1").server_key != KEYS.server_key
    assert P.derive_keys("tok", "s1") == KEYS  # deterministic
    # what a server pinning the token computes is what the peers compute
    assert P.server_key(P.server_master("tok"), "s1") == KEYS.server_key
    for bad_session in ("", "a b", "x" * 65, "é"):
        with pytest.raises(P.ProtocolError, match="session"):
            P.derive_keys("tok", bad_session)
    with pytest.raises(P.ProtocolError, match="token"):
        P.derive_keys("", "s1")


def _mutate(msg: dict, **changes) -> bytes:
    m = dict(msg)
    for k, v in changes.items():
        if v is KeyError:
            m.pop(k)
        else:
            m[k] = v
    return json.dumps(m).encode()


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"v": 2}, "version"),
        ({"v": True}, "version"),
        ({"t": "pwn"}, "unknown message type"),
        ({"priv": KeyError}, "missing"),
        ({"extra": 1}, "unknown fields"),
        ({"priv": ["192.168.1.2", 0]}, "port"),
        ({"priv": ["192.168.1.2", True]}, "port"),
        ({"priv": ["not-an-ip", 5]}, "IP address"),
        ({"priv": "192.168.1.2:5"}, "endpoint"),
        ({"wg": "short="}, "WireGuard"),
        ({"probe": 1}, "flag"),
        ({"n": "zz"}, "nonce"),
        ({"id": "A" * 16}, "peer id"),
        ({"s": "bad session!"}, "session"),
        ({"ts": "now"}, "ts"),
        ({"ts": HUGE}, "ts"),
        ({"ts": -HUGE}, "ts"),
        ({"ts": float("nan")}, "ts"),
        ({"ts": float("inf")}, "ts"),
        ({"wgmac": "zz"}, "sha256"),
        ({"mac": "00"}, "mac"),
    ],
)
def test_parse_rejects_malformed(changes, match):
    with pytest.raises(P.ProtocolError, match=match):
        P.parse(_mutate(reg(), **changes))


def test_parse_rejects_size_encoding_and_shape():
    with pytest.raises(P.ProtocolError, match="exceeds"):
        P.parse(b"{" + b" " * P.MAX_DATAGRAM_BYTES + b"}")
    for junk in (b"\xff\xfe", b"not json", b"[1, 2]", b"null", b"[" * 1000 + b"]" * 1000):
        with pytest.raises(P.ProtocolError):
            P.parse(junk)
    with pytest.raises(P.ProtocolError, match="'other'"):
        P.parse(P.encode(KEYS.server_key, "peer", "s1", "0" * 16, pub=["1.2.3.4", 5],
                         other={"id": "a" * 16}))  # fmt: skip


def test_fuzzed_datagrams_only_raise_protocol_error():
    rng = random.Random(0)
    valid = P.encode(KEYS.server_key, "reg", "s1", "a" * 16, priv=["10.0.0.1", 9], wg=WG,
                     wgmac=wgmac("a" * 16), probe=False)  # fmt: skip
    for _ in range(3000):
        b = bytearray(valid)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        for data in (bytes(b), rng.randbytes(rng.randint(0, 1500))):
            try:
                msg = P.parse(data)
                P.verify(KEYS.server_key, msg)
            except P.ProtocolError:
                continue


# ---------------------------------------------------------------- rate limiting and registry


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_rate_limiter_burst_refill_and_bounded_memory():
    clock = FakeClock()
    rl = R.RateLimiter(rate_per_s=10, burst=5, max_sources=100, clock=clock)
    assert [rl.allow("1.1.1.1") for _ in range(7)] == [True] * 5 + [False] * 2
    assert rl.allow("2.2.2.2")  # other sources keep their own bucket
    clock.t += 0.2  # 2 tokens back
    assert [rl.allow("1.1.1.1") for _ in range(3)] == [True, True, False]
    for i in range(1000):
        rl.allow(f"10.0.{i // 256}.{i % 256}")
    assert len(rl) <= 100


def test_registry_open_mode_pins_first_key_and_rejects_wrong_token():
    clock = FakeClock(time.time())
    r = R.Registry(clock=clock)
    msg = reg(now=clock.t)
    r.register(msg, r.authenticate(msg), ("203.0.113.1", 4000))
    wrong = reg(keys=P.derive_keys("wrong", "s1"), pid="b" * 16, now=clock.t)
    with pytest.raises(P.ProtocolError, match="bad MAC"):
        r.authenticate(wrong)
    unknown = reg(session="nope", skey=False, now=clock.t)
    with pytest.raises(P.ProtocolError, match="unknown session"):
        r.authenticate(unknown)


def test_registry_pinned_token_mode():
    clock = FakeClock(time.time())
    r = R.Registry(pinned_token="tok", clock=clock)
    r.authenticate(reg(skey=False, now=clock.t))
    with pytest.raises(P.ProtocolError, match="bad MAC"):
        r.authenticate(reg(keys=P.derive_keys("nope", "s1"), now=clock.t))


def test_pinned_registry_stretches_the_token_once_not_per_session(monkeypatch):
    calls = [0]
    real = P.hashlib.pbkdf2_hmac

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(P.hashlib, "pbkdf2_hmac", counting)
    clock = FakeClock(time.time())
    r = R.Registry(pinned_token="tok", clock=clock)
    assert calls[0] == 1
    junk = [P.parse(P.encode(b"x" * 32, "reg", f"junk{i}", "b" * 16, now=clock.t,
                             priv=["10.0.0.1", 9], wg=WG, wgmac="0" * 64, probe=False))
            for i in range(50)]  # fmt: skip
    t0 = time.perf_counter()
    for msg in junk:
        with pytest.raises(P.ProtocolError, match="bad MAC"):
            r.authenticate(msg)
    assert calls[0] == 1, "a session name must not cost a PBKDF2"
    assert time.perf_counter() - t0 < 1.0
    r.authenticate(reg(skey=False, now=clock.t))  # and the peers' key is the server's


def test_registry_replay_skew_full_probe_and_expiry():
    clock = FakeClock(time.time())
    r = R.Registry(ttl_s=60, max_skew_s=120, clock=clock)
    a = reg(pid="a" * 16, now=clock.t)
    r.register(a, r.authenticate(a), ("203.0.113.1", 4000))
    with pytest.raises(P.ProtocolError, match="replayed"):
        r.authenticate(a)
    with pytest.raises(P.ProtocolError, match="timestamp"):
        r.authenticate(reg(pid="a" * 16, now=clock.t - 500))
    probe_first = reg(pid="c" * 16, probe=True, now=clock.t)
    with pytest.raises(P.ProtocolError, match="probe before"):
        r.register(probe_first, r.authenticate(probe_first), ("203.0.113.3", 1))
    probe = reg(pid="a" * 16, probe=True, now=clock.t)
    r.register(probe, r.authenticate(probe), ("203.0.113.1", 4999))
    assert r.sessions["s1"].peers["a" * 16].pub_probe == ("203.0.113.1", 4999)
    assert r.sessions["s1"].peers["a" * 16].pub == ("203.0.113.1", 4000)
    b = reg(pid="b" * 16, now=clock.t)
    r.register(b, r.authenticate(b), ("198.51.100.7", 6000))
    assert r.other("s1", "a" * 16).pub == ("198.51.100.7", 6000)
    c = reg(pid="c" * 16, now=clock.t)
    with pytest.raises(R.SessionFull):
        r.register(c, r.authenticate(c), ("192.0.2.9", 1))
    clock.t += 30
    b2 = reg(pid="b" * 16, now=clock.t)
    r.register(b2, r.authenticate(b2), ("198.51.100.7", 6000))  # b refreshes, a does not
    clock.t += 45
    assert r.expire() == 1
    assert list(r.sessions["s1"].peers) == ["b" * 16]
    clock.t += 61
    assert r.expire() == 1 and "s1" not in r.sessions


def test_relay_binds_only_registered_peers_and_forwards_between_them():
    clock = FakeClock(time.time())
    r = R.Registry(ttl_s=60, clock=clock)

    def relay_msg(pid):
        return P.parse(P.encode(KEYS.server_key, "relay", "s1", pid, now=clock.t))

    with pytest.raises(P.ProtocolError, match="unknown session"):
        r.authenticate(relay_msg("a" * 16))  # open mode: relay cannot create a session
    for pid, addr in (("a" * 16, ("203.0.113.1", 4000)), ("b" * 16, ("198.51.100.7", 6000))):
        m = reg(pid=pid, now=clock.t)
        r.register(m, r.authenticate(m), addr)
    stranger = P.parse(P.encode(KEYS.server_key, "relay", "s1", "c" * 16, now=clock.t))
    with pytest.raises(P.ProtocolError, match="before registration"):
        r.bind_relay(stranger, ("192.0.2.1", 1))
    assert r.bind_relay(relay_msg("a" * 16), ("203.0.113.1", 5555)) is False  # b not bound yet
    assert r.relay_target(("203.0.113.1", 5555)) is None
    assert r.bind_relay(relay_msg("b" * 16), ("198.51.100.7", 6001)) is True
    assert r.relay_target(("203.0.113.1", 5555)) == ("198.51.100.7", 6001)
    assert r.relay_target(("198.51.100.7", 6001)) == ("203.0.113.1", 5555)
    assert r.relay_target(("203.0.113.1", 5556)) is None  # same IP, other port: not bound
    clock.t += 50
    r.relay_target(("203.0.113.1", 5555))  # a's relayed traffic keeps a alive, b stays silent
    clock.t += 20
    assert r.expire() == 1
    assert r.relay_target(("198.51.100.7", 6001)) is None
    assert r.relay_target(("203.0.113.1", 5555)) is None  # its other side is gone


def test_rate_limiter_by_cost():
    clock = FakeClock()
    rl = R.RateLimiter(rate_per_s=1000, burst=1000, clock=clock)
    assert rl.allow("x", cost=600) and not rl.allow("x", cost=600)
    clock.t += 0.2
    assert rl.allow("x", cost=600)


def test_mapping_behaviour_and_names():
    assert mapping_behaviour(("1.1.1.1", 5), ("1.1.1.1", 5), ("10.0.0.2", 5)) == (
        "endpoint-independent"
    )
    assert mapping_behaviour(("1.1.1.1", 5), ("1.1.1.1", 6), None).startswith(
        "endpoint-dependent"
    )
    assert mapping_behaviour(("1.1.1.1", 5), ("1.1.1.1", 5), ("1.1.1.1", 5)) == "no NAT"
    assert mapping_behaviour(("1.1.1.1", 5), None, None) == "unknown"
    a, b = interface_name("s1", "a"), interface_name("s1", "b")
    assert a != b and len(a) <= 15 and a != interface_name("s2", "a")
    ip_a, ip_b = tunnel_addresses("s1")
    net_a = ipaddress.ip_interface(f"{ip_a}/30").network
    assert net_a.subnet_of(ipaddress.ip_network("10.77.0.0/16"))
    assert ipaddress.ip_address(ip_b) in net_a
    assert ipaddress.ip_address(ip_a) < ipaddress.ip_address(ip_b)  # a: the lower host
    blocks = {ipaddress.ip_interface(f"{tunnel_addresses(f'run-{i}')[0]}/30").network
              for i in range(40)}  # fmt: skip
    assert len(blocks) >= 39  # 14 bits: 40 sessions collide with odds of about 5 %


# ---------------------------------------------------------------- server and peers on loopback


def _free_port_pair() -> int:
    """A port p with p and p+1 free on 127.0.0.1 (UDP)."""
    rng = random.SystemRandom()  # not seeded: two calls must not start at the same port
    for _ in range(100):
        p = rng.randrange(20000, 60000)
        socks = []
        try:
            for q in (p, p + 1):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                socks.append(s)
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free UDP port pair")


@pytest.fixture
def server():
    port = _free_port_pair()
    srv = RendezvousServer("127.0.0.1", port, rate_per_s=200)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    try:
        yield srv, port
    finally:
        srv.stop()
        t.join(timeout=5)
        srv.close()


def _udp_exchange(port: int, data: bytes, timeout_s: float = 0.5) -> bytes | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout_s)
        s.sendto(data, ("127.0.0.1", port))
        try:
            return s.recv(4096)
        except TimeoutError:
            return None


def test_server_survives_garbage_and_ignores_wrong_token(server):
    srv, port = server
    rng = random.Random(1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(150):
            s.sendto(rng.randbytes(rng.randint(0, 1400)), ("127.0.0.1", port))
        s.sendto(b"x" * 9000, ("127.0.0.1", port + 1))
    answer = None
    for _ in range(5):  # like a real peer, retry: the garbage may still fill the socket buffer
        ok = P.encode(KEYS.server_key, "reg", "s1", "a" * 16, priv=["127.0.0.1", 1], wg=WG,
                      wgmac=wgmac("a" * 16), probe=False, skey=KEYS.server_key.hex())  # fmt: skip
        answer = _udp_exchange(port, ok)
        if answer is not None:
            break
    assert answer is not None, "server stopped answering after garbage"
    msg = P.parse(answer)
    P.verify(KEYS.server_key, msg)
    assert msg["t"] == "reg_ok" and msg["pub"][0] == "127.0.0.1"
    bad = P.derive_keys("wrong-token", "s1")
    wrong = P.encode(bad.server_key, "reg", "s1", "b" * 16, priv=["127.0.0.1", 1], wg=WG,
                     wgmac=wgmac("b" * 16, bad), probe=False,
                     skey=bad.server_key.hex())  # fmt: skip
    assert _udp_exchange(port, wrong) is None  # no answer, no registration
    assert list(srv.registry.sessions["s1"].peers) == ["a" * 16]
    # the kernel may drop some of the burst before the server reads it
    assert srv.stats["rejected"] >= 50 and srv.stats["accepted"] == 1


def test_server_survives_huge_numbers_and_internal_errors(server, monkeypatch):
    srv, port = server

    def register(pid: str) -> bytes | None:
        return _udp_exchange(port, P.encode(KEYS.server_key, "reg", "s1", pid, wg=WG,
                                            priv=["127.0.0.1", 1], wgmac=wgmac(pid),
                                            probe=False, skey=KEYS.server_key.hex()))  # fmt: skip

    huge = _with_ts(P.encode(KEYS.server_key, "reg", "s1", "a" * 16, priv=["127.0.0.1", 1],
                             wg=WG, wgmac=wgmac("a" * 16), probe=False), HUGE)  # fmt: skip
    with pytest.raises(P.ProtocolError, match="ts"):
        P.parse(huge)
    assert _udp_exchange(port, huge) is None
    real = srv.registry.authenticate

    def buggy(msg):  # a bug the input triggers, once
        monkeypatch.setattr(srv.registry, "authenticate", real)
        raise RuntimeError("boom")

    monkeypatch.setattr(srv.registry, "authenticate", buggy)
    assert register("a" * 16) is None
    answer = register("b" * 16)
    assert answer is not None, "the server stopped answering"
    assert P.parse(answer)["t"] == "reg_ok"
    assert srv.stats["internal_error"] == 1 and srv.stats["rejected"] == 1, srv.stats


def test_server_rate_limits_a_flooding_source(server):
    srv, port = server
    # a peer flooding authenticated registrations (each with a newer timestamp, or they would
    # be replays), far above its session's 200/s, burst 400; the budget is charged only after
    # authentication, so junk charges nobody (tests/test_nat_replay.py). Bursts of 50: one
    # burst fits the socket's receive buffer, 1500 at once need not
    deadline = time.monotonic() + 10
    t0, i = time.time(), 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        while srv.stats["rate_limited"] == 0 and time.monotonic() < deadline:
            for _ in range(50):
                i += 1
                s.sendto(P.encode(KEYS.server_key, "reg", "s1", "a" * 16, now=t0 + i * 1e-3,
                                  priv=["127.0.0.1", 1], wg=WG, wgmac=wgmac("a" * 16),
                                  probe=False, skey=KEYS.server_key.hex()),
                         ("127.0.0.1", port))
            time.sleep(0.005)
    assert srv.stats["rate_limited"] > 0


def _peer_cmd(port: int, *extra: str) -> list[str]:
    return [PY, str(ROOT / "udp_hole_punching_test/peer.py"), "--server", f"127.0.0.1:{port}",
            "--session", "lo1", "--no-wireguard", *extra]  # fmt: skip


def _with_ts(data: bytes, ts: object) -> bytes:
    """The datagram with its `ts` replaced (the MAC no longer matches; parse must reject first)."""
    msg = json.loads(data)
    msg["ts"] = ts
    return json.dumps(msg).encode()


def _spam_peer(target_port: int, stop: threading.Event, sent: list[int]) -> None:
    """Garbage, wrong-token hellos and bare headers to a peer's port; counts what it sent."""
    wrong = P.derive_keys("wrong-token", "lo1")
    rng = random.Random(2)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        while not stop.is_set():
            hello = P.encode(wrong.peer_key, "hello", "lo1", "c" * 16, to="d" * 16, echo="",
                             done=True, wgh=P.wg_hash(WG))  # fmt: skip
            for data in (rng.randbytes(64), hello, b'{"v":1}', _with_ts(hello, HUGE)):
                s.sendto(data, ("127.0.0.1", target_port))
                sent[0] += 1
            stop.wait(0.01)


@pytest.mark.timeout(60)
def test_peers_punch_on_loopback_despite_spoofed_datagrams(server, tmp_path):
    _, port = server
    pa = _free_port_pair()
    pb = pa + 1
    stop, sent = threading.Event(), [0]
    a = subprocess.Popen(_peer_cmd(port, "--token", "tt", "--local-port", str(pa),
                                   "--result-json", str(tmp_path / "a.json")),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert a.stdout.readline().startswith("peer "), "peer a did not start"  # bound now
        spam = threading.Thread(target=_spam_peer, args=(pa, stop, sent), daemon=True)
        spam.start()
        deadline = time.monotonic() + 20
        while sent[0] < 30 and time.monotonic() < deadline:  # a is waiting for b meanwhile
            time.sleep(0.02)
        b = subprocess.run(_peer_cmd(port, "--token", "tt", "--local-port", str(pb),
                                     "--result-json", str(tmp_path / "b.json")),
                           capture_output=True, text=True, timeout=40)  # fmt: skip
        out_a, err_a = a.communicate(timeout=40)
    finally:
        stop.set()
        if a.poll() is None:
            a.kill()
    assert a.returncode == 0, out_a + err_a
    assert b.returncode == 0, b.stdout + b.stderr
    ra = json.loads((tmp_path / "a.json").read_text())
    rb = json.loads((tmp_path / "b.json").read_text())
    assert ra["ok"] and rb["ok"], (ra, rb)
    assert ra["endpoint"] == ["127.0.0.1", pb] and rb["endpoint"] == ["127.0.0.1", pa], (ra, rb)
    assert ra["rejected_datagrams"] >= 20, ra  # the spam reached a and was refused
    assert 0 < ra["rtt_ms"] < 1000, ra
    assert "punched: direct path to 127.0.0.1:" in out_a


@pytest.mark.timeout(60)
def test_peer_with_wrong_token_is_not_answered(server):
    srv, port = server
    ok = subprocess.Popen(_peer_cmd(port, "--token", "right", "--register-timeout-s", "6"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        # open mode: the first registration fixes the session key, so let the right one go first
        deadline = time.monotonic() + 20
        while "lo1" not in srv.registry.sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        bad = subprocess.run(_peer_cmd(port, "--token", "wrong", "--register-timeout-s", "3"),
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        _, err_ok = ok.communicate(timeout=30)
    finally:
        if ok.poll() is None:
            ok.kill()
    assert bad.returncode == 3
    assert "no answer from the rendezvous server" in bad.stderr
    assert ok.returncode == 3 and "did not register" in err_ok
    assert "Traceback" not in bad.stderr + err_ok


@pytest.mark.parametrize(
    "script, args, match",
    [
        ("peer.py", ["--server", "nohost", "--session", "s", "--token", "t"], "--server"),
        ("peer.py", ["--server", "127.0.0.1:9", "--session", "a b", "--token", "t"], "session"),
        ("peer.py", ["--server", "[::1]:9", "--session", "s", "--token", "t"], "IPv4 only"),
        ("rendezvous_server.py", ["--bind", "127.0.0.1:99999"], "--bind"),
        ("send_recv_test.py", ["--dist-url", "127.0.0.1:1", "--rank", "0"], "--dist-url"),
    ],
)
def test_cli_user_errors_exit_2_without_traceback(script, args, match):
    proc = subprocess.run([PY, str(ROOT / "udp_hole_punching_test" / script), *args],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and match in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture
def puncher():
    """A Puncher on loopback whose 'server' is two sockets of this test (returned too)."""
    port = _free_port_pair()
    socks = []
    for q in (port, port + 1):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", q))
        s.settimeout(2)
        socks.append(s)
    cfg = PeerConfig(server=("127.0.0.1", port), session="s1", token="tok",
                     private_ip="127.0.0.1")  # fmt: skip
    pu = Puncher(cfg, KEYS)
    try:
        yield pu, socks
    finally:
        pu.close()
        for s in socks:
            s.close()


def _peer_msg(pid: str, wg: str = WG, mac: str | None = None) -> bytes:
    other = {"id": pid, "pub": ["127.0.0.1", 7000], "pub_probe": None,
             "priv": ["127.0.0.1", 7000], "wg": wg, "wgmac": mac or wgmac(pid, wg=wg)}  # fmt: skip
    return P.encode(KEYS.server_key, "peer", "s1", "0" * 16, pub=["127.0.0.1", 1], other=other)


def test_peer_counts_what_would_crash_it(puncher, monkeypatch):
    pu, _ = puncher
    hello = P.encode(KEYS.peer_key, "hello", "s1", "b" * 16, to=pu.peer_id, echo="",
                     done=False, wgh=P.wg_hash(WG))  # fmt: skip
    pu._handle(_with_ts(hello, HUGE), ("127.0.0.1", 7000))
    assert pu.result.rejected_datagrams == 1

    def buggy(msg, addr):
        raise RuntimeError("boom")

    monkeypatch.setattr(pu, "_from_peer", buggy)
    pu._handle(hello, ("127.0.0.1", 7000))
    assert pu.result.rejected_datagrams == 2


def test_peer_takes_only_wireguard_keys_the_other_peer_authenticated(puncher):
    pu, _ = puncher
    server = pu.cfg.server
    other_wg = "A" * 42 + "E="
    pu._handle(_peer_msg("b" * 16, mac="0" * 64), server)  # the server (key) forged the key
    assert pu.other is None and pu.result.rejected_datagrams == 1
    pu._handle(_peer_msg("b" * 16, wg=other_wg, mac=wgmac("b" * 16)), server)  # b's mac, not key
    assert pu.other is None
    pu._handle(_peer_msg("b" * 16), server)
    assert pu.other is not None and pu.other.wg == WG
    pu._handle(_peer_msg("b" * 16, wg=other_wg), server)  # even validly mac'd: same id, new key
    assert pu.other.wg == WG and pu.result.rejected_datagrams == 3
    # a hello must hash the announced key
    bad = P.encode(KEYS.peer_key, "hello", "s1", "b" * 16, to=pu.peer_id, echo="", done=False,
                   wgh=P.wg_hash(other_wg))  # fmt: skip
    pu._handle(bad, ("127.0.0.1", 7000))
    assert pu.result.rejected_datagrams == 4 and pu.result.hellos_received == 0
    # once confirmed, the server cannot swap in another peer (and with it another key)
    pu.confirmed_at = time.monotonic()
    pu._handle(_peer_msg("c" * 16, wg=other_wg), server)
    assert pu.other.peer_id == "b" * 16 and pu.other.wg == WG


def test_peer_sends_the_server_key_only_when_unanswered(puncher):
    pu, (main, probe) = puncher

    def sent_skey() -> tuple[bool, bool]:
        return tuple("skey" in P.parse(s.recv(4096)) for s in (main, probe))

    pu._register()
    pu._register()
    assert sent_skey() == sent_skey() == (False, False)  # a pinned server answers these
    pu._register()  # an open-mode server needs it to create the session
    assert sent_skey() == (True, False)
    pu.result.my_public = ("127.0.0.1", 1)  # answered: the session exists
    pu._register()
    assert sent_skey() == (False, False)


@pytest.mark.skipif(shutil.which("wg") is None, reason="`wg` missing (Debian wireguard-tools)")
@pytest.mark.timeout(60)
def test_sigterm_while_registering_deletes_the_private_key(server, tmp_path):
    _, port = server
    cmd = [PY, str(ROOT / "udp_hole_punching_test/peer.py"), "--server", f"127.0.0.1:{port}",
           "--session", "alone", "--token", "t"]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where KeyPair.generate puts the key
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().startswith("peer "), p.stderr.read()  # keys exist now
        assert list(tmp_path.glob("wg-session-*/private.key"))
        time.sleep(2)  # registered, waiting for a peer that never comes
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err and "Traceback" not in err
    assert not list(tmp_path.glob("wg-session-*"))


# ---------------------------------------------------------------- send/recv benchmark


def _bench(port: int, rank: int, *extra: str) -> subprocess.Popen:
    cmd = [PY, str(ROOT / "udp_hole_punching_test/send_recv_test.py"),
           "--dist-url", f"tcp://127.0.0.1:{port}", "--world-size", "2", "--rank", str(rank),
           "--size-mb", "1", "--iters", "2", "--timeout-s", "30", *extra]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip


@pytest.mark.timeout(90)
def test_send_recv_benchmark_gloo_verifies_bytes():
    # Known flake, not understood yet: about 1 run in 10 on a 2-core AMD EPYC (at 2026-11-27's
    # main and before), gloo's pair between the two ranks on loopback is reset right after
    # rank 0 finished init_process_group while rank 1 is still in it; both exit 1 within ~3 s
    # ("Connection reset by peer"). One more try on a fresh port for exactly that failure.
    for attempt in (1, 2):
        port = _free_port_pair()
        r1 = _bench(port, 1)
        r0 = _bench(port, 0)
        out0, err0 = r0.communicate(timeout=80)
        _, err1 = r1.communicate(timeout=80)
        reset = r0.returncode and r1.returncode and "Connection reset by peer" in err0
        if not (reset and attempt == 1):
            break
    assert r0.returncode == 0 and r1.returncode == 0, err0 + err1
    result = json.loads(out0.strip().splitlines()[-1])
    assert result["verified"] is True and result["backend"] == "gloo"
    assert result["bandwidth_mbit_s"] > 0 and result["latency_ms"] > 0


def test_cupy_nccl_backend_errors_clearly_without_cuda():
    try:
        import cupy

        if cupy.cuda.is_available():
            pytest.skip("a CUDA device is present: the clear-error path is not reachable")
    except ImportError:
        pass
    proc = subprocess.run([PY, str(ROOT / "udp_hole_punching_test/send_recv_test.py"),
                           "--dist-url", "tcp://127.0.0.1:1", "--rank", "0",
                           "--backend", "cupy_nccl"], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert "cupy_nccl" in proc.stderr and "gloo" in proc.stderr
    assert "Traceback" not in proc.stderr
