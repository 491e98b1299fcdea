"""The DT-FM objective against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from formats.cluster import cluster_from_dict
from formats.models import get_model
from scheduler.cost_dtfm import DtfmObjective, dtfm_constants, even_stages


def four_devices(bw: list[list[float]], lat_ms: float = 10.0):
    n = len(bw)
    return cluster_from_dict({
        "format": "cluster/1", "name": "four",
        "devices": [{"id": i, "name": f"d{i}", "region": "r", "host": f"h{i}", "gpu": "V100-16GB",
                     "tflops": 112.0, "memory_gb": 16.0} for i in range(n)],
        "latency_ms": [[0.0 if i == j else lat_ms for j in range(n)] for i in range(n)],
        "bandwidth_gbps": bw,
    })


def test_published_gpt3_xl_constants():
    c = dtfm_constants(get_model("gpt3-xl"), 8, 61)
    assert c.gradient_gb == pytest.approx(0.65)
    assert c.activation_gb == pytest.approx(0.47124, abs=1e-5)


def test_other_models_use_their_own_sizes():
    tiny = get_model("gpt-tiny")
    c = dtfm_constants(tiny, 2, 10)
    assert c.gradient_gb == pytest.approx(tiny.total_params() * 4 / 2 / 1e9)
    assert c.activation_gb == pytest.approx(64 * 128 * 2 * 10 / 2**30)


def test_two_by_two_by_hand():
    # 1 Gbps everywhere except 0 -> 1 at 2 Gbps; 10 ms everywhere.
    bw = [[0, 2, 1, 1], [1, 0, 1, 1], [1, 1, 0, 1], [1, 1, 1, 0]]
    obj = DtfmObjective(four_devices(bw), get_model("gpt3-xl"), 2, 2)
    grad, act = 1.3e9 * 4 / 2 / 1e9, 0.47124
    plan = np.array([[0, 1], [2, 3]])  # stage groups {0, 2} and {1, 3}
    dp = 2 * (0.010 + grad / 2 * 8 / 1.0)  # one peer each, all 1 Gbps inside both groups
    fwd = max(0.010 + act * 8 / 2.0, 0.010 + act * 8 / 1.0)  # 0->1 at 2 Gbps, 2->3 at 1
    bwd = 0.010 + act * 8 / 1.0
    got = obj.breakdown(plan)
    assert got.parts["dp_comm_s"] == pytest.approx(dp)
    assert got.parts["pp_comm_s"] == pytest.approx(fwd + bwd, rel=1e-4)
    assert obj.cost(plan) == pytest.approx(dp + fwd + bwd, rel=1e-4)


def test_symmetric_total_is_dp_plus_twice_pp():
    rng = np.random.default_rng(1)
    bw = rng.uniform(0.5, 3, size=(6, 6))
    bw = (bw + bw.T) / 2
    obj = DtfmObjective(four_devices(bw.tolist()), get_model("gpt3-xl"), 3, 2)
    plan = np.array([[0, 1, 2], [3, 4, 5]])
    fwd, bwd = obj.pp_edges(plan)
    assert np.allclose(fwd, bwd)
    assert obj.cost(plan) == pytest.approx(obj.breakdown(plan).parts["dp_comm_s"] + 2 * fwd.sum())


def test_dp_takes_the_worst_device_of_the_worst_group():
    bw = np.ones((4, 4))
    bw[0, 2] = bw[2, 0] = 0.5  # the slow pair lives in stage group {0, 2}
    obj = DtfmObjective(four_devices(bw.tolist(), lat_ms=0.0), get_model("gpt3-xl"), 2, 2)
    groups = np.array([[0, 2], [1, 3]])
    costs = obj.dp_group_costs(groups)
    assert costs[0] == pytest.approx(2 * 1.3 * 4 / 2 / 2 * 8 / 0.5)
    assert costs[0] == pytest.approx(2 * costs[1])


def test_even_stages():
    assert even_stages(24, 8) == [(3 * k, 3 * k + 3) for k in range(8)]
    assert even_stages(5, 2) == [(0, 3), (3, 5)]
