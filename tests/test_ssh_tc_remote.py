"""tc.py over SSH: real sshd inside namespace hosts; apply/show/probe/reset remotely (root)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import run_entry
from test_ssh_helpers import keygen, sshd_missing, start_sshd

from scheduler.cluster import Cluster, Device, load_cluster, save_cluster
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


@pytest.mark.timeout(180)
def test_apply_show_probe_reset_over_ssh(ns_fleet) -> None:
    f = ns_fleet
    acc = run_entry("scripts/cluster_ssh.py", "--hosts", str(f["dir"] / "ip_list"),
                    "--known-hosts", str(f["dir"] / "kh"), "accept-keys")
    assert acc.returncode == 0, acc.stdout
    # system python3 has no NetfilterQueue: the delay must be reported as not applied.
    a = tc(f, "apply")
    assert "kernel has no sch_netem" in a.stdout or "delay netem" in a.stdout, a.stdout
    if "kernel has no sch_netem" in a.stdout:
        assert a.returncode == 1 and "delay NOT APPLIED on traffic into this host" in a.stdout
        show = tc(f, "show")
        assert show.returncode == 1 and "NOT APPLIED" in show.stdout
        assert "60mbit  60mbit" in show.stdout, show.stdout
        # with a python that has NetfilterQueue the delay line is started over SSH
        b = tc(f, "apply", "--remote-python", sys.executable)
        assert b.returncode == 0, b.stdout + b.stderr
        assert "started pid" in b.stdout
    show = tc(f, "show")
    assert show.returncode == 0 and "MISMATCH" not in show.stdout, show.stdout
    out = f["dir"] / "measured.json"
    p = tc(f, "probe", "--out", str(out), "--seconds", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    m = load_cluster(out)
    assert 0.85 * 0.06 <= m.bandwidth_gbps[0, 1] <= 1.02 * 0.06, p.stdout
    assert 0.85 * 0.03 <= m.bandwidth_gbps[1, 0] <= 1.02 * 0.03, p.stdout
    assert 18.0 <= 2 * m.latency_ms[0, 1] <= 30.0, p.stdout  # 10 ms each way (+ busy CPU)
    r = tc(f, "reset")
    assert r.returncode == 0, r.stdout
    q = subprocess.run([*f["st"].exec_prefix(0), "tc", "qdisc", "show", "dev", "eth0"],
                       capture_output=True, text=True).stdout
    assert "htb" not in q
    lines = subprocess.run([*f["st"].exec_prefix(1), "iptables", "-S", "INPUT"],
                           capture_output=True, text=True).stdout
    assert "NFQUEUE" not in lines  # the delay line removed its rules when killed
