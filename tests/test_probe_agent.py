"""The probe agent's protocol on loopback (no root) and the measured-cluster mapping."""

from __future__ import annotations

import json
import select
import subprocess
import sys

import numpy as np
import pytest

from formats.cluster import Cluster, Device
from scripts.netemu.probe import AGENT, PairResult, comparison, measured_cluster, parse_measure
from scripts.netemu.tcrules import group_devices


@pytest.fixture
def agent():
    """A probe agent serving on 127.0.0.1 (port chosen free by the test)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(AGENT), "serve", "--bind", "127.0.0.1",
                             "--port", str(port)], stdout=subprocess.PIPE)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 10)
        assert ready and proc.stdout.readline().strip() == b"ready"
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.timeout(60)
def test_agent_measures_loopback(agent) -> None:
    out = subprocess.run([sys.executable, str(AGENT), "measure", "--to", f"127.0.0.1:{agent}",
                          "--seconds", "0.3", "--pings", "5"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    obj = json.loads(out)
    rtt, bps = parse_measure(out, "lo")
    assert 0 < rtt < 50 and rtt == obj["rtt_ms"]
    assert bps > 50e6  # loopback moves far more than 50 Mbit/s even on a busy machine
    assert obj["bytes"] * 8 / 0.5 > bps * 0.1  # rate and byte count are consistent


def test_parse_measure_rejects_garbage() -> None:
    from formats.errors import UserError
    with pytest.raises(UserError, match="unexpected agent output"):
        parse_measure("Traceback ...", "0->1")


def _cluster() -> Cluster:
    n = 4
    lat = np.full((n, n), 30.0)
    np.fill_diagonal(lat, 0)
    bw = np.full((n, n), 0.1)
    np.fill_diagonal(bw, np.inf)
    devs = [Device(i, f"d{i}", "r", "10.0.0.1", "T4-16GB", 65.0, 16.0) for i in range(n)]
    return Cluster("c", devs, lat, bw)


def test_measured_cluster_maps_host_pairs_to_devices() -> None:
    c = _cluster()
    groups = group_devices(c, "modulo", 2)  # hosts (0, 2) and (1, 3)
    res = [PairResult(0, 1, 62.0, 93e6), PairResult(1, 0, 64.0, 47e6)]
    m = measured_cluster(c, groups, res)
    assert m.latency_ms[0, 3] == 31.0 and m.latency_ms[3, 2] == 32.0
    assert m.bandwidth_gbps[2, 1] == pytest.approx(0.093)
    assert m.bandwidth_gbps[1, 0] == pytest.approx(0.047)
    assert m.latency_ms[0, 2] == 30.0  # same host: configured
    text, ok = comparison(c, groups, res, delay_applied=True)
    assert not ok  # 47 of 100 Mbit/s misses the 10% target
    assert "0->1  100          93.0      0.930  60      62.0      ok" in text
    assert "1->0  100          47.0      0.470  60      64.0      BW" in text
    text2, _ = comparison(c, groups, res, delay_applied=False)
    assert "delay not applied" in text2 and " RTT" in text2
    # per direction (remote probe: from the live rules): 0 -> 1 not delayed, 1 -> 0 delayed
    text3, _ = comparison(c, groups, res, delay_applied=np.array([[True, False], [True, True]]))
    assert "0->1  100          93.0      0.930  30      62.0      ok RTT" in text3, text3
    assert text3.endswith("(delay not applied on 0->1: not counted in the configured RTT)")
