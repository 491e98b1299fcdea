"""NAT traversal on real Linux NATs: network namespaces, iptables MASQUERADE with a router-style
firewall, hole punching, a WireGuard tunnel through the hole and gloo send/recv across it."""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from udp_hole_punching_test.netns_lab import CLIENT_IPS, NAT_WAN_IPS, SERVER_IP, Lab
from udp_hole_punching_test.netns_lab import missing_requirements as lab_missing

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
SCRIPTS = ROOT / "udp_hole_punching_test"
SERVER_PORT = 3478
_counter = itertools.count()

pytestmark = pytest.mark.netns


_REASON = lab_missing()  # root, tools, a namespace with a NAT table
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)


def _wireguard_missing() -> str | None:
    if shutil.which("wg") is None:
        return "`wg` missing (Debian wireguard-tools)"
    if shutil.which("wireguard-go") is None and not Path("/sys/module/wireguard").exists():
        return "neither kernel WireGuard nor wireguard-go (Debian wireguard-go) available"
    if not Path("/dev/net/tun").exists():
        return "/dev/net/tun missing (wireguard-go needs TUN)"
    return None


@contextmanager
def lab_and_server(
    random_fully_a: bool = False,
    token: str | None = None,
    router_firewall: bool = True,
    relay_mbit_s: float = 0.0,
):
    """A fresh two-NAT lab with the rendezvous server running in its public namespace."""
    prefix = f"n{os.getpid() % 100000}{next(_counter)}"
    lab = Lab(prefix, {"a": random_fully_a, "b": False}, router_firewall=router_firewall)
    procs: list[subprocess.Popen] = []
    try:
        lab.up()
        cmd = [*lab.exec_prefix("pub"), PY, str(SCRIPTS / "rendezvous_server.py"),
               "--bind", f"{SERVER_IP}:{SERVER_PORT}"]  # fmt: skip
        if token:
            cmd += ["--token", token]
        if relay_mbit_s:
            cmd += ["--relay-mbit-s", str(relay_mbit_s)]
        srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(srv)
        line = srv.stdout.readline()  # printed once both sockets are bound
        assert line.startswith("listening on"), line
        yield lab, procs
    finally:
        for p in procs:  # peers first (they tear their tunnels down on SIGTERM), server last
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        lab.close()


def _test_session() -> str:
    """A session name of this test's own. The WireGuard interface, and its control socket in
    /var/run/wireguard (shared by every namespace), are named by the session: a previous
    test's wireguard-go still exiting on a loaded host must not hold this test's name."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "nat").split(" ")[0]
    return "nat-" + hashlib.sha256(test.encode()).hexdigest()[:10]


def start_peer(lab: Lab, procs: list, side: str, result: Path, *extra: str,
               session: str | None = None, token: str = "tok") -> subprocess.Popen:  # fmt: skip
    """Start peer.py in client namespace `side` ('a' or 'b'), in this test's session unless
    one is given."""
    session = session or _test_session()
    cmd = [*lab.exec_prefix(f"cli{side}"), PY, str(SCRIPTS / "peer.py"),
           "--server", f"{SERVER_IP}:{SERVER_PORT}", "--session", session, "--token", token,
           "--result-json", str(result), *extra]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(p)
    return p


def finish(p: subprocess.Popen, timeout_s: float = 60) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout_s)
    return p.returncode, out, err


def wait_for_file(path: Path, proc: subprocess.Popen, timeout_s: float) -> dict:
    """Wait until a running peer wrote its result (it keeps running to hold the tunnel)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"peer exited {proc.returncode}: {out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no result from the peer within {timeout_s} s")
        time.sleep(0.1)
    return json.loads(path.read_text())


def run_benchmark(lab: Lab, procs: list, ra: dict, rb: dict, size_mb: float) -> int:
    """send_recv_test.py across the tunnel (rank 0 on role a); bytes rank 1's WireGuard got."""
    rank0, rank1 = (("a", ra), ("b", rb)) if ra["tunnel"]["role"] == "a" else (
        ("b", rb), ("a", ra))  # fmt: skip
    url = f"tcp://{rank0[1]['tunnel']['address']}:29500"
    runs = []
    for rank, (side, r) in enumerate((rank0, rank1)):
        env = {**os.environ, "GLOO_SOCKET_IFNAME": r["tunnel"]["interface"]}
        cmd = [*lab.exec_prefix(f"cli{side}"), PY, str(SCRIPTS / "send_recv_test.py"),
               "--dist-url", url, "--world-size", "2", "--rank", str(rank),
               "--size-mb", str(size_mb), "--iters", "3", "--timeout-s", "60"]  # fmt: skip
        runs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env))  # fmt: skip
    procs.extend(runs)
    code0, out0, err0 = finish(runs[0], 90)
    code1, _, err1 = finish(runs[1], 90)
    assert code0 == 0 and code1 == 0, err0 + err1
    bench = json.loads(out0.strip().splitlines()[-1])
    assert bench["verified"] is True and bench["size_mb"] == size_mb
    assert bench["bandwidth_mbit_s"] > 1
    wg = lab.run(f"cli{rank1[0]}", "wg", "show", rank1[1]["tunnel"]["interface"], "transfer")
    return int(wg.stdout.split()[1])


REACH = r"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=1.5)
    print("open")
except ConnectionRefusedError:
    print("reachable")  # a RST came back: the path works both ways
except OSError as exc:
    print("blocked", exc)
"""


def reach(lab: Lab, role: str, ip: str) -> str:
    """'reachable' if a TCP SYN from namespace `role` to ip gets an answer, else 'blocked ...'."""
    return lab.run(role, PY, "-c", REACH, ip).stdout.strip()


def test_lans_cannot_reach_each_other_directly():
    with lab_and_server() as (lab, _):
        assert reach(lab, "clia", SERVER_IP) == "reachable"
        assert reach(lab, "clib", SERVER_IP) == "reachable"
        assert reach(lab, "clia", CLIENT_IPS["b"]).startswith("blocked")  # no route
        # the router firewall drops unsolicited input on the WAN side
        assert reach(lab, "clia", NAT_WAN_IPS["b"]).startswith("blocked")
        assert reach(lab, "pub", NAT_WAN_IPS["a"]).startswith("blocked")


@pytest.mark.timeout(150)
def test_tunnel_through_punched_hole_carries_gloo_send_recv(tmp_path):
    why = _wireguard_missing()
    if why:
        pytest.skip(why)
    with lab_and_server() as (lab, procs):
        pa = start_peer(lab, procs, "a", tmp_path / "a.json")
        pb = start_peer(lab, procs, "b", tmp_path / "b.json")
        ra = wait_for_file(tmp_path / "a.json", pa, 60)
        rb = wait_for_file(tmp_path / "b.json", pb, 60)
        for r, me, other in ((ra, "a", "b"), (rb, "b", "a")):
            if not (r["ok"] and r["tunnel"]["ok"] and r["path"] == "direct"):
                pa.terminate()
                pb.terminate()
                raise AssertionError(f"peer {me}: {r}\na: {finish(pa, 20)}\nb: {finish(pb, 20)}")
            assert r["my_mapping"] == "endpoint-independent"
            assert r["my_public"][0] == NAT_WAN_IPS[me]  # seen through the NAT
            assert r["endpoint"][0] == NAT_WAN_IPS[other]  # the direct path, not a relay
            assert r["tunnel"]["listen_port"] == r["local_port"]
        assert ra["endpoint"][1] == rb["my_public"][1]
        rx = run_benchmark(lab, procs, ra, rb, size_mb=2)
        assert rx > 2e6 * 4  # the bytes went through WireGuard: 1 warm-up + 3 timed messages
        pa.terminate()
        pb.terminate()
        assert finish(pa, 20)[0] == 0 and finish(pb, 20)[0] == 0
        for r in (ra, rb):  # interfaces and wireguard-go sockets are gone
            name = r["tunnel"]["interface"]
            assert not Path(f"/var/run/wireguard/{name}.sock").exists()


@pytest.mark.timeout(90)
def test_late_second_peer_and_distinct_local_ports(tmp_path):
    with lab_and_server() as (lab, procs):
        # --low-ttl 0: behind router-style firewalls plain hellos are enough
        pa = start_peer(lab, procs, "a", tmp_path / "a.json", "--no-wireguard",
                        "--local-port", "40001", "--low-ttl", "0")  # fmt: skip
        wait_deadline = time.monotonic() + 3.0  # the second peer starts ~3 s later
        assert pa.poll() is None
        while time.monotonic() < wait_deadline:
            assert pa.poll() is None, finish(pa)
            time.sleep(0.2)
        pb = start_peer(lab, procs, "b", tmp_path / "b.json", "--no-wireguard",
                        "--local-port", "50002", "--low-ttl", "0")  # fmt: skip
        code_b, out_b, err_b = finish(pb)
        code_a, out_a, err_a = finish(pa)
        assert code_a == 0 and code_b == 0, err_a + err_b
        ra = json.loads((tmp_path / "a.json").read_text())
        rb = json.loads((tmp_path / "b.json").read_text())
        assert ra["local_port"] == 40001 and rb["local_port"] == 50002
        assert ra["endpoint"] == [NAT_WAN_IPS["b"], 50002]  # MASQUERADE kept the port
        assert rb["endpoint"] == [NAT_WAN_IPS["a"], 40001]
        assert "punched: direct path" in out_a and "punched: direct path" in out_b


@pytest.mark.timeout(90)
def test_random_fully_nat_fails_with_symmetric_diagnosis(tmp_path):
    with lab_and_server(random_fully_a=True) as (lab, procs):
        args = ("--no-wireguard", "--punch-timeout-s", "5")
        pa = start_peer(lab, procs, "a", tmp_path / "a.json", *args)
        pb = start_peer(lab, procs, "b", tmp_path / "b.json", *args)
        code_a, _, err_a = finish(pa)
        code_b, _, err_b = finish(pb)
        assert code_a == 3 and code_b == 3
        ra = json.loads((tmp_path / "a.json").read_text())
        rb = json.loads((tmp_path / "b.json").read_text())
        assert not ra["ok"] and not rb["ok"]
        assert ra["my_mapping"].startswith("endpoint-dependent")
        assert ra["my_public"][1] != ra["my_public_probe"][1]  # new port per destination
        assert rb["my_mapping"] == "endpoint-independent"
        assert rb["other_mapping"].startswith("endpoint-dependent")
        assert "symmetric NAT" in err_a and "this side's NAT" in err_a
        assert "symmetric NAT" in err_b and "other side's NAT" in err_b
        assert "Traceback" not in err_a + err_b


def _wait_for_conntrack(lab: Lab, box: str, src_ip: str, timeout_s: float) -> None:
    """Wait until the NAT box `box` tracks a UDP flow that came from `src_ip`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listing = lab.run(box, "conntrack", "-L", "-p", "udp", "-s", src_ip, check=False)
        if f"src={src_ip}" in listing.stdout:
            return
        time.sleep(0.05)
    raise AssertionError(f"no UDP flow from {src_ip} reached {box} within {timeout_s} s")


@pytest.mark.timeout(90)
def test_accept_all_nat_box_needs_low_ttl_first_hellos(tmp_path):
    """NAT boxes that accept unsolicited WAN input: the other's first hello becomes a conntrack
    entry on our NAT box, our own mapping clashes with it and gets a random port. Opening our
    mapping first with hellos that expire before the other NAT avoids that."""
    with lab_and_server(router_firewall=False) as (lab, procs):
        plain = ("--no-wireguard", "--punch-timeout-s", "3", "--low-ttl", "0")
        # Without netem both peers' first hellos can cross on the wire before either reaches the
        # other NAT, and then plain punching works (a CI run saw it). Hold b's hellos at its NAT
        # until a's first hello has arrived there: the order the clash needs, every time.
        hold = ["-s", CLIENT_IPS["b"], "-d", NAT_WAN_IPS["a"], "-p", "udp", "-j", "DROP"]
        lab.run("natb", "iptables", "-I", "FORWARD", *hold)
        pa = start_peer(lab, procs, "a", tmp_path / "a0.json", *plain, session="plain")
        pb = start_peer(lab, procs, "b", tmp_path / "b0.json", *plain, session="plain")
        _wait_for_conntrack(lab, "natb", NAT_WAN_IPS["a"], timeout_s=30)
        lab.run("natb", "iptables", "-D", "FORWARD", *hold)
        (code_a, _, err_a), (code_b, _, err_b) = finish(pa), finish(pb)
        assert code_a == 3 and code_b == 3, "plain punching unexpectedly worked"
        assert "conntrack clash" in err_a
        conntrack = lab.run("nata", "conntrack", "-L", "-p", "udp", check=False).stdout
        for box in ("nata", "natb"):  # the second attempt starts from fresh NAT boxes too: the
            # first one's UNREPLIED entries (29 s) must not decide it (a CI run failed so, once)
            lab.run(box, "conntrack", "-F", check=False)
        pa = start_peer(lab, procs, "a", tmp_path / "a.json", "--no-wireguard", session="ttl")
        pb = start_peer(lab, procs, "b", tmp_path / "b.json", "--no-wireguard", session="ttl")
        (code_a, _, err_a), (code_b, _, err_b) = finish(pa), finish(pb)
        if code_a or code_b:  # the state the failed attempt left on both boxes says why
            boxes = {box: lab.run(box, "conntrack", "-L", "-p", "udp", check=False).stdout
                     for box in ("nata", "natb")}  # fmt: skip
            pytest.fail(f"a: {err_a}\nb: {err_b}\nfirst attempt's nata: {conntrack}\n{boxes}")
        ra = json.loads((tmp_path / "a.json").read_text())
        assert ra["endpoint"][0] == NAT_WAN_IPS["b"]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_symmetric_nat_falls_back_to_the_relay_and_carries_gloo(tmp_path):
    why = _wireguard_missing()
    if why:
        pytest.skip(why)
    with lab_and_server(random_fully_a=True, relay_mbit_s=200) as (lab, procs):
        args = ("--relay-fallback", "--punch-timeout-s", "3")
        pa = start_peer(lab, procs, "a", tmp_path / "a.json", *args)
        pb = start_peer(lab, procs, "b", tmp_path / "b.json", *args)
        ra = wait_for_file(tmp_path / "a.json", pa, 60)
        rb = wait_for_file(tmp_path / "b.json", pb, 60)
        for r in (ra, rb):
            assert r["ok"] and r["path"] == "relay" and r["tunnel"]["ok"], r
            assert r["endpoint"] == [SERVER_IP, SERVER_PORT + 2]
            assert "symmetric NAT" in r["diagnosis"]
        rx = run_benchmark(lab, procs, ra, rb, size_mb=1)
        assert rx > 1e6 * 4
        srv = procs[0]
        srv.terminate()
        out, _ = srv.communicate(timeout=10)
        stats = ast.literal_eval(out.strip().splitlines()[-1].split("datagrams ", 1)[1])
        assert stats.get("relayed", 0) > 1000, stats  # the traffic really went via the server


ATTACKER = r"""
import json, random, socket, sys, time
sys.path.insert(0, sys.argv[1])
from udp_hole_punching_test import protocol as P
target, port, seconds = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
wrong = P.derive_keys("wrong-token", "nat1")
wg = "LMueet3LUb2IObBGg4oYl11JBGLPU7pHI1ufhbbN7Qw="
rng = random.Random(3)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
end = time.monotonic() + seconds
sent = 0
while time.monotonic() < end:
    hello = P.encode(wrong.peer_key, "hello", "nat1", "e" * 16, to="f" * 16, echo="",
                     done=True, wgh=P.wg_hash(wg))
    reg = P.encode(wrong.server_key, "reg", "nat1", "e" * 16, priv=["10.0.0.1", 9], wg=wg,
                   wgmac=P.wg_mac(wrong.peer_key, "nat1", "e" * 16, wg), probe=False,
                   skey=wrong.server_key.hex())
    huge = json.dumps({**json.loads(reg), "ts": 10**400}).encode()  # once crashed the server
    for data in (rng.randbytes(rng.randint(0, 1500)), hello, reg, huge, b"\x00" * 2000):
        try:
            s.sendto(data, (target, port))
            sent += 1
        except OSError:
            pass
    time.sleep(0.02)
print(sent)
"""


@pytest.mark.timeout(90)
def test_garbage_and_wrong_token_to_server_and_peer(tmp_path):
    # pinned token: in open mode the attacker's wrong-token registration could claim the session
    with lab_and_server(token="tok") as (lab, procs):
        pa = start_peer(lab, procs, "a", tmp_path / "a.json", "--no-wireguard",
                        "--local-port", "40011", session="nat1")  # the attacker's session
        assert pa.stdout.readline().startswith("peer "), "peer a did not start"  # a is bound
        # while a waits for b: a host on the internet floods the server, and a LAN neighbour
        # of a sends garbage and wrong-token hellos to a's port
        to_server = subprocess.Popen([*lab.exec_prefix("natb"), PY, "-c", ATTACKER, str(ROOT),
                                      SERVER_IP, str(SERVER_PORT), "2"],
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        to_peer = subprocess.Popen([*lab.exec_prefix("clia"), PY, "-c", ATTACKER, str(ROOT),
                                    CLIENT_IPS["a"], "40011", "2"],
                                   stdout=subprocess.PIPE, text=True)  # fmt: skip
        procs += [to_server, to_peer]
        assert int(finish(to_server)[1]) > 0 and int(finish(to_peer)[1]) > 0
        assert pa.poll() is None, finish(pa)
        pb = start_peer(lab, procs, "b", tmp_path / "b.json", "--no-wireguard", session="nat1")
        code_a, _, err_a = finish(pa)
        code_b, _, err_b = finish(pb)
        assert code_a == 0 and code_b == 0, err_a + err_b
        ra = json.loads((tmp_path / "a.json").read_text())
        assert ra["endpoint"][0] == NAT_WAN_IPS["b"]  # not hijacked by the neighbour
        assert ra["rejected_datagrams"] >= 20, ra
        srv = procs[0]
        srv.terminate()
        out, _ = srv.communicate(timeout=10)
        assert srv.returncode == 0
        stats = ast.literal_eval(out.strip().splitlines()[-1].split("datagrams ", 1)[1])
        assert stats.get("rejected", 0) >= 20, stats  # the flood: garbage and wrong token
        assert stats.get("internal_error", 0) == 0, stats
        assert stats.get("accepted", 0) >= 4, stats  # two registrations + two probes at least
