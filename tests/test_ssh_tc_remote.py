"""tc.py over SSH: real sshd inside namespace hosts; apply/show/probe/reset remotely (root)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, SHAPED_RATE_FLOOR, run_entry
from test_ssh_helpers import keygen, sshd_missing, start_sshd

from formats.cluster import Cluster, Device, load_cluster, save_cluster
from scripts.netemu import netns
from scripts.netemu.shell import missing_root_tools

pytestmark = [pytest.mark.ssh, pytest.mark.netns]

_REASON = sshd_missing() or missing_root_tools(("ip", "tc", "iptables"))
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)


@pytest.fixture
def ns_fleet(tmp_path):
    """Two namespace hosts each running sshd on port 22 of its 198.18.0.x address; the root
    namespace reaches them through 198.18.0.254 on the bridge (removed with the bridge)."""
    prefix = f"s{os.getpid() % 100000}"
    servers = []
    try:
        st = netns.create(prefix, 2)
        subprocess.run(["ip", "addr", "add", "198.18.0.254/24", "dev", f"{prefix}-br"],
                       check=True, capture_output=True)
        key = keygen(tmp_path / "client_key")
        auth = tmp_path / "authorized_keys"
        auth.write_text((tmp_path / "client_key.pub").read_text())
        for i in range(2):
            servers.append(start_sshd(tmp_path, netns.address(i), auth,
                                      exec_prefix=st.exec_prefix(i), port=22))
        (tmp_path / "ip_list").write_text("root@198.18.0.1\nroot@198.18.0.2\n")
        n = 2
        bw = np.array([[np.inf, 0.06], [0.03, np.inf]])
        lat = np.array([[0.0, 10.0], [10.0, 0.0]])
        devs = [Device(i, f"d{i}", "r", f"10.9.0.{i + 1}", "T4-16GB", 65.0, 16.0)
                for i in range(n)]
        save_cluster(Cluster("t", devs, lat, bw), tmp_path / "c.json")
        yield {"dir": tmp_path, "key": str(key), "prefix": prefix, "st": st}
    finally:
        for s in servers:
            s.stop()
        netns.destroy(prefix)


def tc(f, *args: str, timeout: float = 120):
    """tc.py ACTION --hosts ... with the fleet's key and known_hosts."""
    d = f["dir"]
    return run_entry("scripts/tc.py", *args, "--cluster", str(d / "c.json"), "--hosts",
                     str(d / "ip_list"), "--known-hosts", str(d / "kh"), "--key", f["key"],
                     "--link-gbps", "1", timeout=timeout)


def aws(f, script: str, *args: str, timeout: float = 120):
    """scripts/aws_*.sh with the fleet in the environment (REMOTE_PY: this python)."""
    d = f["dir"]
    env = dict(os.environ, IP_LIST=str(d / "ip_list"), KNOWN_HOSTS=str(d / "kh"),
               SSH_KEY=f["key"], REMOTE_PY=sys.executable)
    return subprocess.run(["bash", str(ROOT / "scripts" / script), str(d / "c.json"),
                           "--link-gbps", "1", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _in_ns(f, i: int, *argv: str) -> str:
    return subprocess.run([*f["st"].exec_prefix(i), *argv], capture_output=True,
                          text=True).stdout


@pytest.mark.timeout(240)
def test_apply_show_probe_reset_over_ssh(ns_fleet) -> None:
    f = ns_fleet
    acc = run_entry("scripts/cluster_ssh.py", "--hosts", str(f["dir"] / "ip_list"),
                    "--known-hosts", str(f["dir"] / "kh"), "accept-keys")
    assert acc.returncode == 0, acc.stdout
    # system python3 has no NetfilterQueue: the delay must be reported as not applied.
    a = tc(f, "apply")
    assert "kernel has no sch_netem" in a.stdout or "delay netem" in a.stdout, a.stdout
    if "kernel has no sch_netem" in a.stdout:
        assert a.returncode == 1, a.stdout
        assert "delay NOT APPLIED on traffic into 198.18.0.2: python3 has no" in a.stdout
        show = tc(f, "show")
        assert show.returncode == 1 and "NOT APPLIED" in show.stdout
        assert "60mbit  60mbit" in show.stdout, show.stdout
        # NetfilterQueue there, but no iptables on its PATH: the delay line starts, fails, and
        # apply must say so (not "started pid" and exit 0)
        noipt = f["dir"] / "python_without_iptables"
        noipt.write_text(f'#!/bin/sh\nPATH=/nonexistent exec {sys.executable} "$@"\n')
        noipt.chmod(0o755)
        bad = tc(f, "apply", "--remote-python", str(noipt))
        assert bad.returncode == 1, bad.stdout + bad.stderr
        assert ("delay NOT APPLIED on traffic into 198.18.0.2: it exited: error: `iptables` "
                "not found") in bad.stdout, bad.stdout
        # with a python that has NetfilterQueue the delay line is started over SSH;
        # aws_start_tc.sh = apply + show
        b = aws(f, "aws_start_tc.sh")
        assert b.returncode == 0, b.stdout + b.stderr
        assert "started pid" in b.stdout and "10ms (delay-line)" in b.stdout, b.stdout
        assert "MISMATCH" not in b.stdout, b.stdout
        # show reads the delays back from the running delay lines: same rates, other latency
        lat2 = f["dir"] / "c2.json"
        c = load_cluster(f["dir"] / "c.json")
        save_cluster(Cluster("t2", c.devices, c.latency_ms * 2, c.bandwidth_gbps), lat2)
        other = run_entry("scripts/tc.py", "show", "--cluster", str(lat2), "--hosts",
                          str(f["dir"] / "ip_list"), "--known-hosts", str(f["dir"] / "kh"),
                          "--key", f["key"], "--link-gbps", "1")
        assert other.returncode == 1 and "20ms   10ms (delay-line)  MISMATCH" in other.stdout, \
            other.stdout
    show = tc(f, "show")
    assert show.returncode == 0 and "MISMATCH" not in show.stdout, show.stdout
    out = f["dir"] / "measured.json"
    p = tc(f, "probe", "--out", str(out), "--seconds", "1")
    # exit 1 (said on stderr) only when a pair missed the 10 % target that the wider bounds
    # below still accept on a busy machine
    assert p.returncode == 0 or (p.returncode == 1 and "outside the target" in p.stderr), \
        p.stdout + p.stderr
    assert "delay not applied" not in p.stdout, p.stdout
    m = load_cluster(out)
    assert SHAPED_RATE_FLOOR * 0.06 <= m.bandwidth_gbps[0, 1] <= 1.02 * 0.06, p.stdout
    assert SHAPED_RATE_FLOOR * 0.03 <= m.bandwidth_gbps[1, 0] <= 1.02 * 0.03, p.stdout
    assert 18.0 <= 2 * m.latency_ms[0, 1] <= 30.0, p.stdout  # 10 ms each way (+ busy CPU)
    if "kernel has no sch_netem" in a.stdout:
        # SIGKILL host 1's delay line: its NFQUEUE rules stay, --queue-bypass keeps the traffic
        # flowing, and reset (aws_clear_tc.sh) removes them with delay_line.py --cleanup
        pidfile = Path.home() / ".scattered/netemu/delay-line@198.18.0.2_22.pid"
        os.killpg(int(pidfile.read_text()), signal.SIGKILL)
        assert "NFQUEUE" in _in_ns(f, 1, "iptables", "-S", "INPUT")
        knock = _in_ns(f, 0, sys.executable, "-c", "import socket; s = socket.socket(); "
                       "s.settimeout(3); print(s.connect_ex(('198.18.0.2', 9)))")
        assert knock.strip() == str(errno.ECONNREFUSED), knock  # got in, not dropped
    r = aws(f, "aws_clear_tc.sh")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "htb" not in _in_ns(f, 0, "tc", "qdisc", "show", "dev", "eth0")
    assert "NFQUEUE" not in _in_ns(f, 1, "iptables", "-S", "INPUT")
