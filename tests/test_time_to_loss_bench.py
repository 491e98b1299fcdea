"""benchmarks/time_to_loss.py's pure parts: the regimes' links and the verdicts on a results
file (the benchmark itself trains for minutes: benchmarks are run, not tested)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import time_to_loss as ttl
from formats.cluster import load_cluster, save_cluster
from scheduler.scenarios import make_scenario


def test_regimes_scale_the_lab_links(tmp_path):
    save_cluster(make_scenario("lab", 0), tmp_path / "lab.json")
    base = load_cluster(tmp_path / "lab.json")
    for regime in ttl.REGIMES:
        ttl.regime_cluster(tmp_path / "lab.json", regime, tmp_path / f"{regime.name}.json")
        c = load_cluster(tmp_path / f"{regime.name}.json")
        off = ~np.eye(c.num_devices, dtype=bool)
        assert np.allclose(c.bandwidth_gbps[off], base.bandwidth_gbps[off] * regime.bandwidth_scale)
        assert np.allclose(c.latency_ms, base.latency_ms * regime.latency_scale)
        assert [d.tflops for d in c.devices] == [d.tflops for d in base.devices]
    assert [r.name for r in ttl.REGIMES] == ["fast", "lab", "wan"]


def row(name, seconds, predicted, chosen=False):
    return {"name": name, "chosen_by_planner": chosen, "seconds_to_target": seconds,
            "predicted_seconds_to_target": predicted, "tokens_to_target": 100}


def test_verdicts_check_the_issue_targets():
    regimes = [{"name": "wan", "allreduce_comm_share": 0.85, "rows": [
                   row("allreduce (1x8)", 300.0, 280.0), row("planner", 90.0, 120.0, True)]},
               {"name": "lab", "allreduce_comm_share": 0.5, "rows": [
                   row("allreduce (1x8)", 100.0, 100.0), row("planner", None, 50.0, True)]}]
    got = ttl.verdicts(regimes)
    assert got[0] == "PASS wan: planner's time to the target 0.30x allreduce's (target <= 0.33)"
    assert got[1].startswith("PASS wan allreduce (1x8): predicted time to target -7%")
    assert got[2].startswith("MISS wan planner: predicted time to target +33%")
    assert got[3] == "PASS wan: allreduce's step 85% communication"
    assert got[4] == "MISS lab: the planner's row did not reach the target"


def test_unknown_regimes_are_refused_by_name():
    with pytest.raises(Exception, match="--regimes: unknown moon"):
        ttl.parse_args(["--out-dir", "x", "--regimes", "lab,moon"])


def test_a_planner_row_that_is_the_allreduce_plan_is_not_trained_twice(tmp_path):
    """Same placement, shape and sync: one plan (predictions and search record aside); a
    different sync is another plan."""
    from dataclasses import replace

    from formats.plan import Plan, SyncConfig, save_plan
    from testkit.lab import Run

    base = Plan("t", "", "gpt-tiny", [(0, 4)], [[0], [1]], 1, 1, SyncConfig())
    save_plan(base, tmp_path / "ar.json")
    save_plan(replace(base, predicted={"to_target": {"seconds": 1.0}}), tmp_path / "auto.json")
    save_plan(replace(base, sync=SyncConfig("diloco", 8)), tmp_path / "dl.json")
    ar, auto, dl = (Run(n, tmp_path / f"{n}.json") for n in ("ar", "auto", "dl"))
    assert ttl.same_plan(ar, auto)
    assert not ttl.same_plan(ar, dl)
