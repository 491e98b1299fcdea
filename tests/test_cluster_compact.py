"""cluster/2, the compact form: exact links by hand, the same links and DT-FM costs as the full
form, round trips, and every bad field named (exit 2 from the CLI)."""

from __future__ import annotations

import copy
import hashlib
import json
import math

import numpy as np
import pytest
from conftest import run_entry
from test_cluster_formats import tiny_cluster_dict

from formats.cluster import (
    MAX_DENSE_DEVICES,
    Cluster,
    cluster_from_dict,
    load_cluster,
    save_cluster,
)
from formats.errors import UserError
from formats.models import get_model
from scheduler.cost_dtfm import DtfmObjective
from scheduler.scenarios import make_scenario

INF = math.inf
REGIONS = {0: "A", 1: "A", 2: "A", 3: "B", 4: "B", 5: "C"}


def compact_dict() -> dict:
    """Six devices in regions A (3), B (2), C (1); one asymmetric region pair, a device on a
    slow access line, an exact link both ways and one one way."""
    return {
        "format": "cluster/2", "name": "six",
        "devices": [{"id": i, "name": f"d{i}", "region": REGIONS[i], "host": f"h{i}",
                     "gpu": "V100-16GB", "tflops": 112.0, "memory_gb": 16.0}
                    for i in (5, 3, 0, 1, 4, 2)],  # any order in the file
        "region_links": [
            {"regions": ["A", "A"], "latency_ms": 2, "bandwidth_gbps": 10},
            {"regions": ["A", "B"], "latency_ms": 20, "bandwidth_gbps": 1},
            {"regions": ["C", "A"], "latency_ms": 50, "bandwidth_gbps": 0.5},
            {"regions": ["B", "B"], "latency_ms": 3, "bandwidth_gbps": 5},
            {"regions": ["B", "C"], "latency_ms": 30, "bandwidth_gbps": 0.8, "one_way": True},
            {"regions": ["C", "B"], "latency_ms": 35, "bandwidth_gbps": 0.4, "one_way": True},
        ],
        "device_links": [{"device": 1, "extra_latency_ms": 10, "max_bandwidth_gbps": 0.5}],
        "pair_links": [
            {"devices": [0, 4], "latency_ms": 15, "bandwidth_gbps": 2},
            {"devices": [2, 5], "latency_ms": 45, "bandwidth_gbps": 0.9, "one_way": True},
        ],
    }


# Worked out by hand from compact_dict (row = sender): region link + both devices' extra
# latency, bandwidth capped by both devices' lines, exact pair links over everything.
LATENCY = [[0, 12, 2, 20, 15, 50],
           [12, 0, 12, 30, 30, 60],
           [2, 12, 0, 20, 20, 45],
           [20, 30, 20, 0, 3, 30],
           [15, 30, 20, 3, 0, 30],
           [50, 60, 50, 35, 35, 0]]
BANDWIDTH = [[INF, .5, 10, 1, 2, .5],
             [.5, INF, .5, .5, .5, .5],
             [10, .5, INF, 1, 1, .9],
             [1, .5, 1, INF, 5, .8],
             [2, .5, 1, 5, INF, .8],
             [.5, .5, .5, .4, .4, INF]]


def test_compact_links_are_the_ones_worked_out_by_hand():
    c = cluster_from_dict(compact_dict())
    assert c.is_compact and [d.id for d in c.devices] == list(range(6))
    assert c.latency_ms.tolist() == LATENCY
    assert c.bandwidth_gbps.tolist() == BANDWIDTH
    classes = c.link_classes()
    assert classes.num_classes == 4  # A, A behind the slow line, B, C
    src, dst = np.nonzero(~np.eye(6, dtype=bool))
    lat, bw = classes.lookup(src, dst)
    assert lat.tolist() == np.array(LATENCY)[src, dst].tolist()
    assert bw.tolist() == np.array(BANDWIDTH)[src, dst].tolist()


def test_compact_round_trip_keeps_form_links_and_digest(tmp_path):
    c = cluster_from_dict(compact_dict())
    save_cluster(c, tmp_path / "c.json")
    raw = json.loads((tmp_path / "c.json").read_text())
    assert raw["format"] == "cluster/2" and "latency_ms" not in raw
    again = load_cluster(tmp_path / "c.json")
    assert again.sha256() == c.sha256()
    assert again.latency_ms.tolist() == LATENCY and again.bandwidth_gbps.tolist() == BANDWIDTH
    # The compact digest is the digest of the compact JSON.
    blob = json.dumps(c.to_dict(), sort_keys=True, separators=(",", ":")).encode()
    assert c.sha256() == hashlib.sha256(blob).hexdigest()


@pytest.mark.parametrize("name", ["mixed", "worldwide", "spot"])
def test_full_and_compact_forms_give_the_same_links_and_dtfm_costs(tmp_path, name):
    full = make_scenario(name, seed=4)
    save_cluster(full.to_compact(), tmp_path / "c.json")
    compact = load_cluster(tmp_path / "c.json")
    assert compact.is_compact
    assert np.array_equal(compact.latency_ms, full.latency_ms)
    assert np.array_equal(compact.bandwidth_gbps, full.bandwidth_gbps)
    model, rng = get_model("gpt3-xl"), np.random.default_rng(0)
    a, b = DtfmObjective(full, model, 8, 8), DtfmObjective(compact, model, 8, 8)
    by_class = DtfmObjective(compact, model, 8, 8, classes=True)
    for _ in range(20):
        plan = rng.permutation(64).reshape(8, 8)
        assert a.cost(plan) == b.cost(plan)  # dense on both: bit for bit
        assert by_class.cost(plan) == pytest.approx(a.cost(plan), rel=1e-12)


def test_random_scenario_compact_is_the_full_one_without_matrices():
    full = make_scenario("random", seed=2, num_devices=64, num_regions=4)
    compact = make_scenario("random", seed=2, num_devices=64, num_regions=4, compact=True)
    assert compact.is_compact and compact.name == full.name
    assert np.array_equal(compact.latency_ms, full.latency_ms)
    assert np.array_equal(compact.bandwidth_gbps, full.bandwidth_gbps)


def test_full_digest_is_the_canonical_json_of_rounded_values():
    rng = np.random.default_rng(3)
    devices = make_scenario("lab").devices
    lat, bw = rng.uniform(0, 100, (8, 8)), rng.uniform(0.01, 10, (8, 8))
    lat[1, 2], bw[3, 4], lat[5, 6] = 1e10 / 3, INF, -0.0  # off the fast paths
    c = Cluster("x", devices, lat, bw)
    rounded = {key: [[round(float(v), 6) for v in row] for row in m]
               for key, m in (("latency_ms", lat), ("bandwidth_gbps", bw))}
    for m in rounded.values():
        for i in range(8):
            m[i][i] = 0.0
    blob = json.dumps({**c.to_dict(), **rounded}, sort_keys=True, separators=(",", ":"))
    assert c.sha256() == hashlib.sha256(blob.encode()).hexdigest()


def test_a_huge_compact_cluster_is_never_expanded():
    c = make_scenario("random", seed=0, num_devices=MAX_DENSE_DEVICES + 1, num_regions=3,
                      compact=True)
    assert c.link_classes().num_classes == 3
    with pytest.raises(UserError, match=r"only for up to 4096 devices"):
        _ = c.latency_ms


def _without(key: str, index: int):
    return lambda d: d[key].pop(index)


def _set(key: str, index: int, field: str, value):
    return lambda d: d[key][index].__setitem__(field, value)


BAD_COMPACT = [
    (_without("region_links", 2), "region_links: no entry for regions 'A' -> 'C'"),
    (_set("region_links", 0, "bandwidth_gbps", 0),
     "region_links[0].bandwidth_gbps: must be a positive finite number, got 0"),
    (_set("region_links", 1, "latency_ms", -1),
     "region_links[1].latency_ms: must be a finite number >= 0, got -1"),
    (_set("region_links", 1, "regions", ["A", "Z"]), "region_links[1].regions[1]: unknown region"),
    (_set("region_links", 3, "latency", 3), "region_links[3]: unknown keys ['latency']"),
    (_set("region_links", 4, "one_way", "yes"), "region_links[4].one_way: expected true or false"),
    (lambda d: d["region_links"].append({"regions": ["B", "A"], "latency_ms": 1,
                                         "bandwidth_gbps": 1}),
     "region_links[6]: regions 'B' -> 'A' already given by region_links[1]"),
    (lambda d: d.pop("region_links"), "region_links: expected a non-empty list"),
    (_set("device_links", 0, "device", 9), "device_links[0].device: expected a device id 0..5"),
    (_set("device_links", 0, "extra_latency_ms", math.nan),
     "device_links[0].extra_latency_ms: must be a finite number >= 0"),
    (lambda d: d["device_links"][0].pop("device"), "device_links[0]: missing key 'device'"),
    (_set("pair_links", 0, "devices", [3, 3]), "pair_links[0].devices: a link joins two"),
    (_set("pair_links", 1, "latency_ms", "x"),
     "pair_links[1].latency_ms: must be a finite number >= 0, got 'x'"),
    (_set("pair_links", 1, "devices", [0, 4]),
     "pair_links[1]: devices 0 -> 4 already given by pair_links[0]"),
    (lambda d: d.__setitem__("latency_ms", [[0]]), "latency_ms: a cluster/2 (compact) file"),
]


@pytest.mark.parametrize("mutate,message", BAD_COMPACT)
def test_bad_compact_cluster_names_the_field(mutate, message):
    raw = copy.deepcopy(compact_dict())
    mutate(raw)
    with pytest.raises(UserError) as err:
        cluster_from_dict(raw)
    assert message in str(err.value)


@pytest.mark.parametrize("mutate,message", [BAD_COMPACT[0], BAD_COMPACT[12]])
def test_bad_compact_file_exits_2_naming_file_and_field(tmp_path, mutate, message):
    raw = copy.deepcopy(compact_dict())
    mutate(raw)
    cluster, out = tmp_path / "bad.json", tmp_path / "p.json"
    cluster.write_text(json.dumps(raw))
    r = run_entry("scheduler/scheduler.py", "plan", "--cluster", str(cluster), "--model",
                  "gpt-tiny", "--stages", "2", "--replicas", "3", "--out", str(out))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"error: {cluster}: ") and message in r.stderr
    assert not out.exists()


def test_scenario_exports_the_compact_form_and_plans_it(tmp_path):
    path, plan = tmp_path / "c.json", tmp_path / "p.json"
    r = run_entry("scheduler/scheduler.py", "scenario", "random", "--devices", "48",
                  "--regions", "3", "--compact", "--out", str(path))
    assert r.returncode == 0 and "compact form (cluster/2)" in r.stdout, r.stderr
    assert json.loads(path.read_text())["format"] == "cluster/2"
    r = run_entry("scheduler/scheduler.py", "plan", "--cluster", str(path), "--model",
                  "gpt3-xl", "--stages", "8", "--replicas", "6", "--objective", "dtfm",
                  "--budget", "300", "--out", str(plan), "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    assert json.loads(plan.read_text())["cluster_sha256"] == load_cluster(path).sha256()


@pytest.mark.parametrize("row,col,value,message", [
    (1, 2, True, "latency_ms[1][2]: expected a number, got True"),
    (0, 0, False, "latency_ms[0][0]: expected a number, got False"),
    (2, 1, "5", "latency_ms[2][1]: expected a number, got '5'"),
    (1, 0, None, "latency_ms[1][0]: expected a number, got None"),
])
def test_full_matrices_are_read_in_bulk_but_a_non_number_is_still_named(row, col, value,
                                                                        message):
    raw = tiny_cluster_dict()
    assert cluster_from_dict(raw).latency_ms.tolist() == [[0, 5, 5], [5, 0, 5], [5, 5, 0]]
    raw["latency_ms"][row][col] = value
    with pytest.raises(UserError) as err:
        cluster_from_dict(raw)
    assert message in str(err.value)
