"""cluster/1 and plan/1: round trips, and every bad input named with its field."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from formats.cluster import cluster_from_dict, load_cluster, save_cluster
from formats.errors import UserError
from formats.models import get_model
from formats.plan import Plan, SyncConfig, load_plan, plan_from_dict, save_plan, validate_plan
from scheduler.scenarios import DTFM_SCENARIOS, make_scenario


def tiny_cluster_dict(n: int = 3) -> dict:
    return {
        "format": "cluster/1", "name": "tiny",
        "devices": [{"id": i, "name": f"d{i}", "region": "r", "host": f"h{i}", "gpu": "V100-16GB",
                     "tflops": 112.0, "memory_gb": 16.0} for i in range(n)],
        "latency_ms": [[0.0 if i == j else 5.0 for j in range(n)] for i in range(n)],
        "bandwidth_gbps": [[0.0 if i == j else 1.0 for j in range(n)] for i in range(n)],
    }


def test_round_trip_keeps_content_and_digest(tmp_path):
    cluster = make_scenario("worldwide", seed=3)
    save_cluster(cluster, tmp_path / "c.json")
    again = load_cluster(tmp_path / "c.json")
    assert again.sha256() == cluster.sha256()
    assert np.allclose(again.latency_ms, cluster.latency_ms)
    assert [d.region for d in again.devices] == [d.region for d in cluster.devices]


@pytest.mark.parametrize("name", DTFM_SCENARIOS)
def test_scenarios_have_64_v100s_and_seed_shuffles_ids(name):
    a, b = make_scenario(name, seed=0), make_scenario(name, seed=1)
    assert a.num_devices == 64 and {d.gpu for d in a.devices} == {"V100-16GB"}
    assert [d.region for d in a.devices] != [d.region for d in b.devices]
    assert sorted(d.region for d in a.devices) == sorted(d.region for d in b.devices)


def test_worldwide_links_are_the_published_figures():
    c = make_scenario("worldwide", seed=5)
    tokyo = next(d.id for d in c.devices if d.region == "Tokyo")
    seoul = next(d.id for d in c.devices if d.region == "Seoul")
    tokyo2 = next(d.id for d in c.devices if d.region == "Tokyo" and d.id != tokyo)
    assert (c.latency_ms[tokyo, seoul], c.bandwidth_gbps[tokyo, seoul]) == (34, 1.10)
    assert (c.latency_ms[tokyo, tokyo2], c.bandwidth_gbps[tokyo, tokyo2]) == (5.0, 2.0)


BAD_CLUSTERS = [
    (lambda d: d["latency_ms"].pop(), "latency_ms: expected 3 rows"),
    (lambda d: d["bandwidth_gbps"][1].pop(), "bandwidth_gbps[1]: expected 3 values"),
    (lambda d: d["bandwidth_gbps"][0].__setitem__(2, -1.0), "bandwidth_gbps[0][2]"),
    (lambda d: d["bandwidth_gbps"][2].__setitem__(0, 0.0), "bandwidth_gbps[2][0]"),
    (lambda d: d["bandwidth_gbps"][1].__setitem__(2, math.nan), "bandwidth_gbps[1][2]"),
    (lambda d: d.pop("latency_ms"), "missing key 'latency_ms'"),
    (lambda d: d["devices"][1].pop("tflops"), "devices[1]: missing key 'tflops'"),
    (lambda d: d["devices"][2].__setitem__("id", 0), "devices[2].id: duplicate id 0"),
    (lambda d: d.__setitem__("format", "cluster/9"), "cluster.format"),
]


@pytest.mark.parametrize("mutate,message", BAD_CLUSTERS)
def test_bad_cluster_names_the_field(mutate, message):
    raw = tiny_cluster_dict()
    mutate(raw)
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        cluster_from_dict(raw)


def test_bad_json_file_is_a_user_error(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"format": "cluster/1",')
    with pytest.raises(UserError, match="not valid JSON"):
        load_cluster(path)


def make_plan(pipelines, stages=((0, 2), (2, 4)), model="gpt-tiny") -> Plan:
    return Plan("tiny", "", model, list(stages), [list(c) for c in pipelines])


def test_plan_round_trip_and_validation(tmp_path):
    cluster = cluster_from_dict(tiny_cluster_dict(4))
    plan = make_plan([[0, 1], [2, 3]])
    save_plan(plan, tmp_path / "p.json")
    again = load_plan(tmp_path / "p.json", cluster)
    assert again.pipelines == [[0, 1], [2, 3]] and again.stages == [(0, 2), (2, 4)]
    assert again.stage_of(3) == (1, 1)


@pytest.mark.parametrize("pipelines,stages,message", [
    ([[0, 1], [1, 3]], ((0, 2), (2, 4)), "device 1 appears twice"),
    ([[0, 1], [2]], ((0, 2), (2, 4)), r"pipelines\[1\]: has 1 devices"),
    ([[0, 1], [2, 3]], ((0, 2), (2, 3)), "has 4 layers"),
    ([[0, 1], [2, 3]], ((0, 2), (3, 4)), "must start at 2"),
    ([[0, 1], [2, 9]], ((0, 2), (2, 4)), r"device ids \[9\] are not in cluster"),
    ([[0, 1], [2, 3]], ((0, 9), (9, 10)), r"stages\[0\].layers: \[0, 9\] ends past the 4"),
])
def test_bad_plans_are_named(pipelines, stages, message):
    cluster = cluster_from_dict(tiny_cluster_dict(4))
    with pytest.raises(UserError, match=message):
        validate_plan(make_plan(pipelines, stages), cluster, get_model("gpt-tiny"))


def test_bad_sync_is_named():
    with pytest.raises(UserError, match="sync.inner_steps"):
        SyncConfig("diloco", 0).validate()
    with pytest.raises(UserError, match="sync.compression"):
        SyncConfig("diloco", 5, "int4").validate()
    for bad in ({"outer_lr": "fast"}, {"outer_lr": -0.7}, {"outer_lr": float("nan")},
                {"outer_momentum": 1.0}, {"outer_momentum": True}):
        with pytest.raises(UserError, match=f"sync.{next(iter(bad))}"):
            SyncConfig("diloco", 5, **bad).validate()
    raw = make_plan([[0, 1]]).to_dict()
    for key in ("predicted", "search"):
        with pytest.raises(UserError, match=f"plan.{key}: expected an object"):
            plan_from_dict({**raw, key: [1]})
    raw["sync"]["bogus"] = 1
    with pytest.raises(UserError, match="unknown keys"):
        plan_from_dict(json.loads(json.dumps(raw)))


def test_lab_scenario_is_the_regional_setting_scaled_to_eight_cpu_ranks():
    c = make_scenario("lab", seed=0)
    assert c.num_devices == 8 and {d.gpu for d in c.devices} == {"CPU"}
    assert sorted(c.regions()) == sorted(["California", "Ohio", "Oregon", "Virginia"] * 2)
    region = {d.id: d.region for d in c.devices}
    for i in range(8):
        for j in range(8):
            if i == j:
                continue
            if region[i] == region[j]:
                assert (c.latency_ms[i, j], c.bandwidth_gbps[i, j]) == (2.0, 0.2)
    va, oh = [d.id for d in c.devices if d.region == "Virginia"], \
        [d.id for d in c.devices if d.region == "Ohio"]
    assert c.latency_ms[va[0], oh[0]] == 11.0
    assert c.bandwidth_gbps[va[0], oh[0]] == pytest.approx(1.12 * 0.04)
