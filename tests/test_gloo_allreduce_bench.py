"""benchmarks/gloo_allreduce.py: gloo's all-reduce on the lab's links against the simulator's
gloo model (real namespace hosts, real gloo), and the groups it times."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import run_entry

from benchmarks.gloo_allreduce import case_groups
from scheduler.scenarios import make_scenario
from scripts.netemu.shell import missing_root_tools

_REASON = missing_root_tools(("ip", "tc", "iptables"))


def test_the_groups_are_one_device_per_region_everyone_and_the_farthest_pair():
    cluster = make_scenario("lab", 0)
    (_, halves), (_, everyone), (_, pair) = case_groups(cluster)
    regions = cluster.regions()
    for group in halves:
        assert sorted(regions[d] for d in group) == sorted(set(regions))
    assert sorted(halves[0] + halves[1]) == everyone[0] == list(range(cluster.num_devices))
    a, b = pair[0]
    assert cluster.latency_ms[a][b] == max(max(row) for row in cluster.latency_ms)


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(bool(_REASON), reason=_REASON or "runs")
@pytest.mark.timeout(300)
def test_gloo_on_the_lab_takes_what_the_gloo_model_says(tmp_path):
    # a demo stage's fp32 gradients (429,568 values): the ring model over-predicted it by ~25%
    r = run_entry("benchmarks/gloo_allreduce.py", "--out-dir", str(tmp_path), "--sizes",
                  "429568", "--reps", "2", timeout=280)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [len(x["group"]) for x in rows] == [4, 4, 8, 2]
    for row in rows:
        assert row["measured_s"] > 0
        assert row["gloo_model_s"] / row["measured_s"] == pytest.approx(1.0, abs=0.12), row
    for row in rows[:2]:  # the 4-member groups: the ring model's surplus
        assert row["ring_model_s"] / row["measured_s"] > 1.15, row
    assert "| group | fp32 values | measured s |" in r.stdout
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "e2e" not in netns  # the hosts are gone
