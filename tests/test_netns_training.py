"""A plan's ranks run in namespace hosts, so training really crosses the shaped links (slow)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import run_entry

from formats.cluster import Cluster, Device, save_cluster
from scripts.netemu import netns
from scripts.netemu.shell import missing_root_tools

pytestmark = [pytest.mark.netns, pytest.mark.slow]

_REASON = missing_root_tools(("ip", "tc", "iptables"))
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)


@pytest.mark.timeout(240)
def test_pipeline_ranks_in_namespaces_see_the_delay(tmp_path) -> None:
    try:
        import netfilterqueue  # noqa: F401
    except ImportError:
        pytest.skip("NetfilterQueue not installed: no delay line on this kernel without netem")
    prefix = f"tr{os.getpid() % 100000}"
    lat = np.array([[0.0, 60.0], [60.0, 0.0]])
    bw = np.array([[np.inf, 0.1], [0.1, np.inf]])
    devs = [Device(i, f"d{i}", f"r{i}", f"10.9.0.{i + 1}", "T4-16GB", 65.0, 16.0)
            for i in range(2)]
    cpath = tmp_path / "c.json"
    save_cluster(Cluster("two", devs, lat, bw), cpath)
    plan = tmp_path / "plan.json"
    p = run_entry("scheduler/scheduler.py", "plan", "--cluster", str(cpath), "--model",
                  "gpt-tiny", "--stages", "2", "--replicas", "1", "--micro-batches", "2",
                  "--out", str(plan), "--quiet", "--time-limit", "2")
    assert p.returncode == 0, p.stderr
    out = tmp_path / "o"
    try:
        up = run_entry("scripts/local_cluster.py", "up", "--cluster", str(cpath), "--prefix",
                       prefix, "--out-dir", str(out), "--link-gbps", "1")
        assert up.returncode == 0, up.stderr
        metrics = tmp_path / "m.jsonl"
        run = run_entry("scripts/launch_local.py", "--plan", str(plan), "--netns-map",
                        str(out / "rank_netns.json"), "--host", "198.18.0.1",
                        "--gloo-ifname", "eth0", "--", "--steps", "3", "--fake-data",
                        "--threads", "1", "--metrics", str(metrics), timeout=200)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        steps = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert len(steps) >= 1
        # Each step sends activations forward (60 ms one way) and gradients back (60 ms): the
        # communication of a step cannot take less than one 120 ms round trip (unshaped veth
        # traffic of this size takes a few ms; compute is ~0.05 s, not counted in comm_s).
        assert min(s["comm_s"] for s in steps) >= 0.12, steps
    finally:
        netns.destroy(prefix)
