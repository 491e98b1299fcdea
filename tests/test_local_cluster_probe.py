"""`local_cluster.py probe` ends with the right exit status and one clear line on every
outcome: all pairs within the target (0), a pair outside it (1, the measurement written), a
pair that cannot be measured (1, naming it and why, nothing written) or that never answers
(1, within the probe's bound). The namespace hosts are stood in for by loopback addresses
(127.0.0.1, 127.0.0.2: no root needed); the agents and the probe's code are the real ones."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from formats.cluster import Cluster, Device, load_cluster, save_cluster
from formats.errors import run_main
from scripts import local_cluster
from scripts.netemu import netns, probe
from scripts.netemu.netns import NetnsState


class LoopbackHosts(NetnsState):
    """Host i is 127.0.0.(i+1) in this namespace."""

    def exec_prefix(self, i: int) -> list[str]:
        return []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def hosts(tmp_path, monkeypatch):
    """Two loopback hosts with a 1 ms, `gbps` cluster; returns a setter for the rate."""
    monkeypatch.setattr(netns, "address", lambda i: f"127.0.0.{i + 1}")
    monkeypatch.setattr(probe, "PORT", free_port())
    monkeypatch.setattr(local_cluster, "require_root_tools", lambda cmd: None)

    def make(gbps: float) -> Path:
        lat, bw = np.array([[0.0, 0.0], [0.0, 0.0]]), np.array([[np.inf, gbps], [gbps, np.inf]])
        devs = [Device(i, f"d{i}", "r", f"127.0.0.{i + 1}", "T4-16GB", 65.0, 16.0)
                for i in range(2)]
        save_cluster(Cluster("lo", devs, lat, bw), tmp_path / "c.json")
        st = LoopbackHosts("lo", num_hosts=2, delay_mode="none",
                           cluster_file=str(tmp_path / "c.json"), out_dir=str(tmp_path),
                           groups=[[0], [1]])
        monkeypatch.setattr(netns, "load_state", lambda prefix: st)
        return tmp_path / "measured.json"
    return make


def run(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        run_main(local_cluster.main, ["probe", "--prefix", "lo", "--seconds", "0.3", *args])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.mark.timeout(120)
def test_pairs_outside_the_target_exit_1_with_the_measurement_written(hosts, capsys):
    measured = hosts(0.001)  # 1 Mbit/s configured; loopback moves far more
    code, out, err = run(capsys)
    assert code == 1 and "outside the target" in err and len(err.splitlines()) == 1, err
    assert "0->1" in out and "BW" in out and measured.exists()
    assert load_cluster(measured).bandwidth_gbps[0, 1] > 0.05


@pytest.mark.timeout(120)
def test_a_pair_that_cannot_be_measured_is_named_and_nothing_is_written(hosts, capsys,
                                                                       monkeypatch):
    measured = hosts(1000.0)
    real_start = netns.start_in_namespace

    def only_host_0(st, i, argv, log, *a, **k):
        if i == 0:
            return real_start(st, i, argv, log, *a, **k)
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(netns, "start_in_namespace", only_host_0)
    code, out, err = run(capsys)
    assert code == 1 and "Traceback" not in err, err
    assert "1 of 2 host pairs could not be measured" in err and "0->1: refused" in err, err
    assert len(err.strip().splitlines()) == 1 and not measured.exists()


@pytest.mark.timeout(120)
def test_a_pair_that_never_answers_fails_within_the_bound(hosts, capsys, monkeypatch):
    hosts(1000.0)
    monkeypatch.setattr(probe, "MIN_PAIR_LIMIT_S", 3.0)
    monkeypatch.setattr(probe, "CONNECT_TIMEOUT_S", 0.5)
    monkeypatch.setattr(probe, "PAIR_SLACK_S", 1.0)  # bound: max(3, 4 x 0.5 + 2 x 0.3 + 1) s
    silent = socket.create_server(("127.0.0.2", 0))  # accepts (the kernel does), never answers
    monkeypatch.setattr(netns, "address",
                        lambda i: "127.0.0.1" if i == 0 else "127.0.0.2")
    monkeypatch.setattr(probe, "PORT", silent.getsockname()[1])
    real_start = netns.start_in_namespace

    def only_host_0(st, i, argv, log, *a, **k):
        if i == 0:
            return real_start(st, i, argv, log, *a, **k)
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(netns, "start_in_namespace", only_host_0)
    try:
        code, _, err = run(capsys)
    finally:
        silent.close()
    assert code == 1 and "0->1" in err and "Traceback" not in err, err


def test_an_agent_failure_record_names_the_pair_and_why():
    line = json.dumps({"error": "timeout", "detail": "TimeoutError: timed out"})
    with pytest.raises(probe.ProbeError, match=r"probe 2->3: timeout \(TimeoutError"):
        probe.parse_measure(line, "2->3")
    assert probe.ProbeError.exit_code == 1
