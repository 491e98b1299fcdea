"""scripts/measure.py: real sshd in namespace hosts, links shaped by tc htb, one pair blocked by
iptables; the cluster file it writes is planned on. Bad input exits 2 naming the problem."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import SHAPED_RATE_FLOOR, run_entry
from test_ssh_helpers import free_port, keygen, sshd_missing, start_sshd

from formats.cluster import load_cluster
from scripts.netemu import netns
from scripts.netemu.fleet import UNREACHABLE_GBPS
from scripts.netemu.rounds import pair_rounds
from scripts.netemu.shell import missing_root_tools

SHAPED_MBIT = 20.0
PORT = 47931
_REASON = sshd_missing() or missing_root_tools(("ip", "tc", "iptables"))


def test_rounds_are_disjoint_and_cover_every_pair_once() -> None:
    for n in range(1, 18):
        rounds = pair_rounds(n)
        pairs = [p for r in rounds for p in r]
        assert sorted(pairs) == [(i, j) for i in range(n) for j in range(i + 1, n)]
        assert all(len({h for p in r for h in p}) == 2 * len(r) for r in rounds)
        assert len(rounds) == (n - 1 if n % 2 == 0 else n if n > 1 else 0)


def measure(hosts, *args: str, known: str = "kh", timeout: float = 180):
    """scripts/measure.py over `hosts` with this python (it has torch) on the hosts."""
    d = hosts.parent
    return run_entry("scripts/measure.py", "--hosts", str(hosts), "--known-hosts",
                     str(d / known), "--model", "gpt-tiny", *args, timeout=timeout)


def test_bad_input_exits_2_naming_it(tmp_path) -> None:
    (tmp_path / "kh").write_text("")
    out = str(tmp_path / "c.json")
    r = measure(tmp_path / "missing", "--out", out)
    assert r.returncode == 2 and "missing" in r.stderr and "Traceback" not in r.stderr, r.stderr
    bad = tmp_path / "ip_list"
    bad.write_text("root@10.0.0.1\nno-user-here\n")
    r = measure(bad, "--out", out)
    assert r.returncode == 2 and f"{bad}:2: expected user@host" in r.stderr, r.stderr
    bad.write_text(f"root@127.0.0.1:{free_port('127.0.0.1')}\n")
    r = measure(bad, "--out", out, "--timeout", "3")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "1 of 1 host(s) could not be measured" in r.stderr and "unreachable" in r.stderr
    r = measure(bad, "--out", out, "--model", "gpt-huge")
    assert r.returncode == 2 and "unknown preset 'gpt-huge'" in r.stderr, r.stderr
    assert not os.path.exists(out)


def _in_ns(st, i: int, *argv: str) -> None:
    subprocess.run([*st.exec_prefix(i), *argv], check=True, capture_output=True)


@pytest.fixture(scope="module")
def ns_hosts(tmp_path_factory):
    """Four namespace hosts with sshd on port 22; 0<->1 shaped to SHAPED_MBIT each way by htb,
    2 -> 3 dropped by an iptables rule in host 3 (as a firewall/NAT would)."""
    if _REASON:
        pytest.skip(_REASON)
    tmp_path = tmp_path_factory.mktemp("lab")
    prefix = f"m{os.getpid() % 100000}"
    servers = []
    try:
        st = netns.create(prefix, 4)
        subprocess.run(["ip", "addr", "add", "198.18.0.254/24", "dev", f"{prefix}-br"],
                       check=True, capture_output=True)
        key = keygen(tmp_path / "client_key")
        auth = tmp_path / "authorized_keys"
        auth.write_text((tmp_path / "client_key.pub").read_text())
        for i in range(4):
            servers.append(start_sshd(tmp_path, netns.address(i), auth,
                                      exec_prefix=st.exec_prefix(i), port=22))
        for src, dst in ((0, 1), (1, 0)):
            _in_ns(st, src, "tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb",
                   "default", "10")
            _in_ns(st, src, "tc", "class", "add", "dev", "eth0", "parent", "1:", "classid",
                   "1:10", "htb", "rate", "10gbit")
            _in_ns(st, src, "tc", "class", "add", "dev", "eth0", "parent", "1:", "classid",
                   "1:20", "htb", "rate", f"{SHAPED_MBIT:g}mbit")
            _in_ns(st, src, "tc", "filter", "add", "dev", "eth0", "parent", "1:", "protocol",
                   "ip", "u32", "match", "ip", "dst", f"{netns.address(dst)}/32", "flowid",
                   "1:20")
        _in_ns(st, 3, "iptables", "-A", "INPUT", "-p", "tcp", "-s", netns.address(2),
               "--dport", str(PORT), "-j", "DROP")
        hosts = tmp_path / "ip_list"
        hosts.write_text("".join(f"root@{netns.address(i)}\n" for i in range(4)))
        acc = run_entry("scripts/cluster_ssh.py", "--hosts", str(hosts), "--known-hosts",
                        str(tmp_path / "kh"), "--key", str(key), "accept-keys")
        assert acc.returncode == 0, acc.stdout
        yield {"hosts": hosts, "key": str(key), "dir": tmp_path}
    finally:
        for s in servers:
            s.stop()
        netns.destroy(prefix)


@pytest.mark.ssh
@pytest.mark.netns
@pytest.mark.timeout(300)
def test_measure_shaped_and_blocked_pairs_then_plan(ns_hosts) -> None:
    f = ns_hosts
    out = f["dir"] / "cluster.json"
    r = measure(f["hosts"], "--key", f["key"], "--out", str(out), "--remote-python",
                sys.executable, "--port", str(PORT), "--seconds", "1", "--connect-timeout", "2",
                "--bench-seconds", "0.5")
    assert r.returncode == 1, r.stdout + r.stderr  # written, but a pair cannot connect
    assert "round 3/3" in r.stdout, r.stdout
    assert ("host 2 (198.18.0.3) -> host 3 (198.18.0.4) TCP port 47931: no answer within 2 s"
            in r.stdout), r.stdout
    assert "allow TCP port 47931 into 198.18.0.4 from 198.18.0.3" in r.stdout
    assert "udp_hole_punching_test/peer.py" in r.stdout
    assert "pair(s) cannot connect: [(2, 3)]" in r.stdout
    c = load_cluster(out)
    assert c.num_devices == 4 and all(d.tflops > 0 and d.memory_gb > 0 for d in c.devices)
    assert all(d.gpu.startswith("cpu: ") for d in c.devices)
    bw = c.bandwidth_gbps * 1e3  # Mbit/s
    # htb: the shaped pair measures below its rate, never far above (0.7 floor: loaded hosts)
    for i, j in ((0, 1), (1, 0)):
        assert SHAPED_RATE_FLOOR * SHAPED_MBIT <= bw[i, j] <= 1.05 * SHAPED_MBIT, r.stdout
    # unshaped veth pairs are far faster (a busy 2-core machine still moves > 100 Mbit/s)
    for i, j in ((0, 2), (2, 0), (0, 3), (1, 2), (1, 3), (3, 1)):
        assert bw[i, j] > 5 * SHAPED_MBIT, r.stdout
    assert (c.latency_ms[~(c.bandwidth_gbps == UNREACHABLE_GBPS)] >= 0).all()
    assert c.latency_ms[0, 1] > 0 and c.latency_ms[0, 2] > 0
    assert c.bandwidth_gbps[2, 3] == c.bandwidth_gbps[3, 2] == UNREACHABLE_GBPS
    plan = f["dir"] / "plan.json"
    p = run_entry("scheduler/scheduler.py", "plan", "--cluster", str(out), "--model",
                  "gpt-tiny", "--stages", "2", "--replicas", "2", "--budget", "200",
                  "--out", str(plan), "--quiet")
    assert p.returncode == 0, p.stdout + p.stderr
    pipelines = json.loads(plan.read_text())["pipelines"]
    # the planner keeps the blocked pair out of every pipeline and every stage group
    assert all({2, 3} - set(pipe) for pipe in pipelines), pipelines
    assert all({2, 3} - set(group) for group in zip(*pipelines)), pipelines
    # the probe servers were stopped: nothing listens on the port any more
    with socket.socket() as s:
        s.settimeout(5)
        assert s.connect_ex((netns.address(0), PORT)) == errno.ECONNREFUSED


@pytest.mark.ssh
@pytest.mark.netns
@pytest.mark.timeout(120)
def test_host_without_torch_or_python_is_named(ns_hosts) -> None:
    f = ns_hosts
    r = measure(f["hosts"], "--key", f["key"], "--out", str(f["dir"] / "c.json"),
                "--remote-python", "/usr/bin/python3", "--port", str(PORT))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "4 of 4 host(s) could not be measured" in r.stderr
    assert "host 0 root@198.18.0.1:22: /usr/bin/python3 has no torch" in r.stderr, r.stderr
    assert "--remote-python" in r.stderr and not (f["dir"] / "c.json").exists()
    r = measure(f["hosts"], "--key", f["key"], "--out", str(f["dir"] / "c.json"),
                "--remote-python", "/nonexistent/python3", "--port", str(PORT))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "host 3 root@198.18.0.4:22: /nonexistent/python3 not found on the host" in r.stderr


def test_cluster_from_results_gpus_and_blocked_pairs() -> None:
    from scripts.netemu.fleet import (
        INTRA_HOST_GBPS,
        HostInfo,
        blocked_pairs,
        build_cluster,
        fix_for,
        parse_host,
        parse_link,
    )
    from scripts.netemu.hostlist import HostEntry
    hosts = [HostEntry("u", f"10.0.0.{k + 1}") for k in range(3)]
    gpu = parse_host(json.dumps({"kind": "gpu", "flop_per_s": 4e14, "bench": "cuda bfloat16",
                                 "devices": [{"name": "H100", "memory_bytes": 80e9}] * 2}),
                     0, "", "host 0", "python3")
    cpu = HostInfo("cpu", ["EPYC"], [64_000_000_000], 1e11, "cpu float32")
    ok = '{"rtt_ms": 20.0, "bit_per_s": 1e8}'
    links = [parse_link(ok, 0, 1, 0, ""), parse_link(ok, 1, 0, 0, ""),
             parse_link(ok, 0, 2, 0, ""), parse_link(ok, 2, 0, 0, ""),
             parse_link('{"error": "refused", "detail": "x"}', 1, 2, 3, ""),
             parse_link(ok, 2, 1, 0, "")]
    c = build_cluster("t", hosts, [gpu, cpu, cpu], links)
    assert [d.host for d in c.devices] == ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.3"]
    assert c.devices[0].gpu == "H100" and c.devices[0].tflops == 400.0
    assert c.devices[2].gpu == "cpu: EPYC" and c.devices[2].memory_gb == 64.0
    assert c.bandwidth_gbps[0, 1] == INTRA_HOST_GBPS
    assert c.bandwidth_gbps[1, 2] == 0.1 and c.latency_ms[2, 0] == 10.0
    # one direction refused: the pair is unusable both ways
    assert c.bandwidth_gbps[2, 3] == c.bandwidth_gbps[3, 2] == UNREACHABLE_GBPS
    assert blocked_pairs(links) == [(1, 2)]
    text = fix_for(links[4], hosts, 47913, 5.0)
    assert "host 1 (10.0.0.2) -> host 2 (10.0.0.3) TCP port 47913: connection refused" in text
    assert "open TCP port 47913 on 10.0.0.3 to 10.0.0.2" in text and "WireGuard" in text
