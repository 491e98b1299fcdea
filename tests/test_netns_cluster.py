"""Local namespace cluster: real namespaces, tc shaping, delay line, probe, cleanup (root)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from itertools import count

import numpy as np
import pytest
from conftest import SHAPED_RATE_FLOOR, run_entry

from formats.cluster import Cluster, Device, load_cluster, save_cluster
from scripts.netemu import netns
from scripts.netemu.shell import missing_root_tools

pytestmark = pytest.mark.netns
_ids = count()


def _skip_reason() -> str | None:
    why = missing_root_tools(("ip", "tc", "iptables"))
    if why:
        return why
    probe = f"tcprobe{os.getpid()}"
    p = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if p.returncode != 0:
        return f"cannot create a network namespace: {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


_REASON = _skip_reason()
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)


def _has_nfqueue() -> bool:
    try:
        import netfilterqueue  # noqa: F401
    except ImportError:
        return False
    return True


def _cluster(path, lat_ms: float, rates_mbit: list[list[float]]) -> str:
    n = len(rates_mbit)
    bw = np.array(rates_mbit, dtype=float) / 1000.0
    np.fill_diagonal(bw, np.inf)
    lat = np.full((n, n), float(lat_ms))
    np.fill_diagonal(lat, 0.0)
    devs = [Device(i, f"d{i}", f"r{i % 2}", f"10.9.0.{i + 1}", "T4-16GB", 65.0, 16.0)
            for i in range(n)]
    save_cluster(Cluster("t", devs, lat, bw), path)
    return str(path)


@pytest.fixture
def prefix():
    """A unique prefix; everything of it is removed afterwards, also on failure."""
    p = f"t{os.getpid() % 100000}x{next(_ids)}"
    try:
        yield p
    finally:
        netns.destroy(p)


def _leftovers(prefix: str) -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [w for w in (ns + links).split() if w.startswith(prefix + "-")]


@pytest.mark.timeout(120)
def test_up_shapes_rates_probe_and_down(tmp_path, prefix) -> None:
    # 4 devices on 2 hosts (modulo): host links 40 vs 120 Mbit/s, no delay.
    rates = [[0, 40, 0, 40], [120, 0, 120, 0], [0, 40, 0, 40], [120, 0, 120, 0]]
    rates = [[v if v else 1000 for v in row] for row in rates]
    c = _cluster(tmp_path / "c.json", 0.0, rates)
    out = tmp_path / "out"
    up = run_entry("scripts/local_cluster.py", "up", "--cluster", c, "--hosts", "2",
                   "--prefix", prefix, "--out-dir", str(out), "--link-gbps", "1")
    assert up.returncode == 0, up.stderr
    assert f"host 0: netns {prefix}-0 198.18.0.1 devices [0, 2]" in up.stdout
    assert "delay: none" in up.stdout
    m = json.loads((out / "netns_map.json").read_text())
    assert m["format"] == "netns-map/1"
    assert m["ranks"]["3"] == {"netns": f"{prefix}-1", "address": "198.18.0.2",
                               "iface": "eth0", "host": 1}
    assert json.loads((out / "rank_netns.json").read_text()) == {
        "0": f"{prefix}-0", "1": f"{prefix}-1", "2": f"{prefix}-0", "3": f"{prefix}-1"}
    assert (out / "ip_list").read_text().splitlines()[1:] == ["root@198.18.0.1",
                                                             "root@198.18.0.2"]
    assert [d.host for d in load_cluster(out / "cluster.json").devices] == [
        "198.18.0.1", "198.18.0.2", "198.18.0.1", "198.18.0.2"]
    st = run_entry("scripts/local_cluster.py", "status", "--prefix", prefix)
    assert st.returncode == 0 and "MISMATCH" not in st.stdout, st.stdout
    probe = run_entry("scripts/local_cluster.py", "probe", "--prefix", prefix, "--seconds", "1")
    # exit 1 (said on stderr) only when a pair missed the 10 % target that the wider bounds
    # below still accept on a busy machine
    assert probe.returncode == 0 or (probe.returncode == 1 and "outside the target"
                                     in probe.stderr), probe.stderr
    meas = load_cluster(out / "measured.json")
    # htb gives a single TCP flow 92-96% of the rate on a quiet machine (floor: conftest's)
    bw = meas.bandwidth_gbps
    assert SHAPED_RATE_FLOOR * 0.040 <= bw[0, 1] <= 1.02 * 0.040, bw
    assert SHAPED_RATE_FLOOR * 0.120 <= bw[1, 0] <= 1.02 * 0.120, bw
    assert meas.bandwidth_gbps[0, 3] == meas.bandwidth_gbps[0, 1]  # same host pair
    assert meas.bandwidth_gbps[0, 2] == 1.0  # same host: configured value kept
    down = run_entry("scripts/local_cluster.py", "down", "--prefix", prefix)
    assert down.returncode == 0 and f"netns {prefix}-0" in down.stdout
    assert _leftovers(prefix) == []
    again = run_entry("scripts/local_cluster.py", "down", "--prefix", prefix)
    assert again.returncode == 0 and "nothing of prefix" in again.stdout


def test_jumbo_mtu_hosts_are_still_shaped(tmp_path, prefix) -> None:
    # --mtu 9000 (fewer packets for the userspace delay line): every interface at 9000 and
    # htb still holds a 40 Mbit/s link with 9000-byte packets.
    rates = [[1000, 40], [40, 1000]]
    c = _cluster(tmp_path / "c.json", 0.0, rates)
    out = tmp_path / "out"
    up = run_entry("scripts/local_cluster.py", "up", "--cluster", c, "--prefix", prefix,
                   "--out-dir", str(out), "--link-gbps", "1", "--mtu", "9000")
    assert up.returncode == 0, up.stderr
    for cmd in (["ip", "-n", f"{prefix}-0", "link", "show", "eth0"],
                ["ip", "link", "show", f"{prefix}-v1"]):
        assert " mtu 9000 " in subprocess.run(cmd, capture_output=True, text=True).stdout
    probe = run_entry("scripts/local_cluster.py", "probe", "--prefix", prefix, "--seconds", "1")
    assert probe.returncode in (0, 1), probe.stderr
    meas = load_cluster(out / "measured.json")
    bw = meas.bandwidth_gbps
    assert SHAPED_RATE_FLOOR * 0.040 <= bw[0, 1] <= 1.02 * 0.040, bw
    assert run_entry("scripts/local_cluster.py", "down", "--prefix", prefix).returncode == 0
    assert _leftovers(prefix) == []


@pytest.mark.timeout(120)
def test_delay_line_gives_configured_rtt(tmp_path, prefix) -> None:
    if not _has_nfqueue():
        pytest.skip("NetfilterQueue not installed (pip install NetfilterQueue), no delay line")
    c = _cluster(tmp_path / "c.json", 15.0, [[0, 100], [100, 0]])
    up = run_entry("scripts/local_cluster.py", "up", "--cluster", c, "--prefix", prefix,
                   "--out-dir", str(tmp_path / "o"), "--link-gbps", "1")
    assert up.returncode == 0, up.stderr
    assert "delay: netem" in up.stdout or "delay: delay-line" in up.stdout, up.stdout
    state = netns.load_state(prefix)
    pids = list(state.delay_pids.values())
    if state.delay_mode == "delay-line":
        assert len(pids) == 2 and "kernel has no sch_netem" in up.stdout
    probe = run_entry("scripts/local_cluster.py", "probe", "--prefix", prefix, "--seconds", "1")
    # exit 1 (said on stderr) only when a pair missed the 10 % target that the wider bounds
    # below still accept on a busy machine
    assert probe.returncode == 0 or (probe.returncode == 1 and "outside the target"
                                     in probe.stderr), probe.stderr
    meas = load_cluster(tmp_path / "o" / "measured.json")
    # 15 ms each way: RTT 30 ms (one-way estimate = RTT / 2). The 10% + 2 ms target is the
    # benchmark's; here a busy CI machine may add a few ms in the userspace delay line.
    assert 27.0 <= 2 * meas.latency_ms[0, 1] <= 40.0, probe.stdout
    # the rate is shaped (never above 100 Mbit/s); how close a 1 s probe through a userspace
    # delay line gets to it is a timing, and a loaded CI machine measured 0.78-0.85 of it
    assert 0.5 * 0.1 <= meas.bandwidth_gbps[0, 1] <= 1.2 * 0.1, probe.stdout
    # show reads the delay back from the running delay lines, not from --cluster
    c2 = _cluster(tmp_path / "c2.json", 25.0, [[0, 100], [100, 0]])
    other = run_entry("scripts/tc.py", "show", "--cluster", c2, "--local", prefix)
    assert other.returncode == 1 and "MISMATCH" in other.stdout, other.stdout
    if state.delay_mode == "delay-line":
        assert "25ms   15ms (delay-line)" in other.stdout, other.stdout
        # a SIGKILLed delay line leaves its NFQUEUE rules: --queue-bypass lets the traffic
        # through (not dropped), and reset removes the rules (delay_line.py --cleanup)
        os.kill(pids[1], 9)
        knock = subprocess.run(  # connection refused = the SYN got in (dropped: timeout)
            ["ip", "netns", "exec", f"{prefix}-0", sys.executable, "-c",
             "import socket; s = socket.socket(); s.settimeout(3); "
             f"print(s.connect_ex(('{netns.address(1)}', 9)))"], capture_output=True, text=True)
        assert knock.stdout.strip() == str(errno.ECONNREFUSED), knock.stdout + knock.stderr
        reset = run_entry("scripts/tc.py", "reset", "--cluster", c, "--local", prefix)
        assert reset.returncode == 0, reset.stdout + reset.stderr
        rules = subprocess.run(["ip", "netns", "exec", f"{prefix}-1", "iptables", "-S", "INPUT"],
                               capture_output=True, text=True).stdout
        assert "NFQUEUE" not in rules, rules
    netns.destroy(prefix)
    assert not any(netns.pid_alive(p, "delay_line.py") for p in pids)


def test_rate_above_link_is_error_and_leaves_nothing(tmp_path, prefix) -> None:
    c = _cluster(tmp_path / "c.json", 0.0, [[0, 500], [500, 0]])
    up = run_entry("scripts/local_cluster.py", "up", "--cluster", c, "--prefix", prefix,
                   "--link-gbps", "0.2", "--out-dir", str(tmp_path / "o"))
    assert up.returncode == 2 and "above the link capacity 200mbit" in up.stderr, up.stderr
    assert "Traceback" not in up.stderr
    assert _leftovers(prefix) == [] and not netns.state_path(prefix).exists()


def test_down_after_crash_without_state_file(prefix) -> None:
    netns.create(prefix, 2)  # as if `up` died right after creating the hosts
    netns.state_path(prefix).unlink()
    assert len(_leftovers(prefix)) >= 3
    removed = netns.destroy(prefix)
    assert f"netns {prefix}-1" in removed and f"link {prefix}-br" in removed
    assert _leftovers(prefix) == []


def test_down_removes_only_what_the_state_file_lists(prefix) -> None:
    netns.create(prefix, 1)
    foreign = f"{prefix}-7"  # named like ours, but not created by `up`
    subprocess.run(["ip", "netns", "add", foreign], check=True, capture_output=True)
    try:
        removed = netns.destroy(prefix)
        assert f"netns {prefix}-0" in removed and f"netns {foreign}" not in removed
        assert _leftovers(prefix) == [foreign]
    finally:
        subprocess.run(["ip", "netns", "del", foreign], capture_output=True)


def test_tc_show_detects_a_changed_class(tmp_path, prefix) -> None:
    c = _cluster(tmp_path / "c.json", 0.0, [[0, 50], [80, 0]])
    up = run_entry("scripts/local_cluster.py", "up", "--cluster", c, "--prefix", prefix,
                   "--out-dir", str(tmp_path / "o"), "--link-gbps", "1")
    assert up.returncode == 0, up.stderr
    ok = run_entry("scripts/tc.py", "show", "--cluster", c, "--local", prefix)
    assert ok.returncode == 0 and "50mbit  50mbit" in ok.stdout, ok.stdout
    subprocess.run(["ip", "netns", "exec", f"{prefix}-0", "tc", "class", "change", "dev",
                    "eth0", "parent", "1:1", "classid", "1:10", "htb", "rate", "70mbit",
                    "ceil", "70mbit"], check=True, capture_output=True)
    bad = run_entry("scripts/tc.py", "show", "--cluster", c, "--local", prefix)
    assert bad.returncode == 1 and "70mbit" in bad.stdout and "MISMATCH" in bad.stdout
    reset = run_entry("scripts/tc.py", "reset", "--cluster", c, "--local", prefix)
    assert reset.returncode == 0, reset.stderr
    q = subprocess.run(["ip", "netns", "exec", f"{prefix}-0", "tc", "qdisc", "show", "dev",
                        "eth0"], capture_output=True, text=True).stdout
    assert "htb" not in q


def test_delay_none_is_reported_not_silent(tmp_path, prefix) -> None:
    c = _cluster(tmp_path / "c.json", 25.0, [[0, 50], [50, 0]])
    up = run_entry("scripts/local_cluster.py", "up", "--cluster", c, "--prefix", prefix,
                   "--out-dir", str(tmp_path / "o"), "--link-gbps", "1", "--delay", "none")
    assert up.returncode == 0, up.stderr
    assert "WARNING: delay not applied (--delay none); only rates are shaped" in up.stdout
    assert json.loads((tmp_path / "o" / "netns_map.json").read_text())["delay_mode"] == (
        "not-applied: --delay none")
    st = run_entry("scripts/local_cluster.py", "status", "--prefix", prefix)
    assert st.returncode == 1 and "NOT APPLIED" in st.stdout, st.stdout


@pytest.mark.ssh
@pytest.mark.timeout(120)
def test_up_with_sshd_logs_in_by_key_and_down_stops_it(tmp_path, prefix) -> None:
    from scripts.netemu.sshd import sshd_missing
    if sshd_missing():
        pytest.skip(sshd_missing())
    key = tmp_path / "k"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    c = _cluster(tmp_path / "c.json", 0.0, [[1000, 1000], [1000, 1000]])
    out = tmp_path / "out"
    missing = run_entry("scripts/local_cluster.py", "up", "--cluster", c, "--prefix", prefix,
                        "--out-dir", str(out), "--sshd", str(tmp_path / "nokey.pub"))
    assert missing.returncode == 2 and "--sshd" in missing.stderr and _leftovers(prefix) == []
    up = run_entry("scripts/local_cluster.py", "up", "--cluster", c, "--prefix", prefix,
                   "--out-dir", str(out), "--sshd", f"{key}.pub")
    assert up.returncode == 0, up.stderr
    assert "host 1: sshd on 198.18.0.2:22" in up.stdout
    pids = netns.load_state(prefix).sshd_pids
    assert len(pids) == 2
    ssh = ["scripts/cluster_ssh.py", "--hosts", str(out / "ip_list"), "--known-hosts",
           str(out / "known_hosts"), "--key", str(key)]
    assert run_entry(*ssh, "accept-keys").returncode == 0
    r = run_entry(*ssh, "run", "--", "ip -o -4 addr show dev eth0")
    assert r.returncode == 0 and "198.18.0.2/24" in r.stdout, r.stdout + r.stderr
    down = run_entry("scripts/local_cluster.py", "down", "--prefix", prefix)
    assert down.returncode == 0 and "sshd" in down.stdout, down.stdout
    from scripts.netemu.shell import pid_alive
    assert not any(pid_alive(pid, "sshd") for pid in pids.values())
