"""Search quality: exhaustive optimum on tiny clusters, valid and reproducible plans."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler.baselines import best_of_random, exhaustive, gcma, index_order_plan
from scheduler.cost_dtfm import DtfmObjective
from scheduler.heuristic_evolutionary_solver import SearchConfig, evolutionary_search
from scheduler.heuristic_evolutionary_solver.matching import best_path, bottleneck_matching
from scheduler.models import get_model
from scheduler.scenarios import make_scenario


def search(obj, n, s, r, seed=0, budget=4000):
    return evolutionary_search(obj, obj.t_act, np.arange(n), s, r,
                               SearchConfig(budget=budget, time_limit_s=60, seed=seed),
                               [obj.t_grad])


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_finds_the_exhaustive_optimum_on_8_devices(shape, seed):
    cluster = make_scenario("random", seed=seed, num_devices=8, num_regions=3)
    s, r = shape
    obj = DtfmObjective(cluster, get_model("gpt3-xl"), s, r)
    _, optimum, count = exhaustive(obj, np.arange(8), s, r)
    assert count == 40320
    found = search(obj, 8, s, r, seed=seed)
    assert found.cost == pytest.approx(optimum, rel=1e-9)


def test_plan_uses_every_device_once_and_is_reproducible():
    cluster = make_scenario("regional", seed=4)
    obj = DtfmObjective(cluster, get_model("gpt3-xl"), 8, 8)
    a = search(obj, 64, 8, 8, seed=7, budget=3000)
    b = search(obj, 64, 8, 8, seed=7, budget=3000)
    assert sorted(a.pipelines.ravel().tolist()) == list(range(64))
    assert np.array_equal(a.pipelines, b.pipelines) and a.cost == b.cost
    assert obj.cost(a.pipelines) == pytest.approx(a.cost)


@pytest.mark.parametrize("scenario", ["datacenter", "spot", "worldwide"])
def test_beats_random_index_order_and_published_search(scenario):
    cluster = make_scenario(scenario, seed=2)
    obj = DtfmObjective(cluster, get_model("gpt3-xl"), 8, 8)
    ours = search(obj, 64, 8, 8, budget=3000).cost
    _, rand, _ = best_of_random(obj, np.arange(64), 8, 8, 300, seed=0)
    index = obj.cost(index_order_plan(np.arange(64), 8, 8))
    _, published, _ = gcma(obj, obj.t_act, np.arange(64), 8, 8, population=20, trials=40)
    assert ours <= min(rand, index, published) + 1e-9
    assert ours < 0.8 * rand


def test_bottleneck_matching_is_optimal():
    import itertools
    rng = np.random.default_rng(0)
    for _ in range(50):
        cost = rng.integers(0, 9, size=(5, 5)).astype(float)
        value, cols = bottleneck_matching(cost)
        brute = min(max(cost[i, p[i]] for i in range(5)) for p in itertools.permutations(range(5)))
        assert value == brute == max(cost[i, cols[i]] for i in range(5))


def test_best_path_is_optimal():
    import itertools
    rng = np.random.default_rng(3)
    e = rng.random((7, 7))
    e = e + e.T
    path = best_path(e)
    cost = lambda p: sum(e[a, b] for a, b in zip(p, p[1:]))
    assert cost(path) == pytest.approx(min(cost(p) for p in itertools.permutations(range(7))))
