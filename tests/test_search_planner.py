"""Search quality: exhaustive optimum on tiny clusters, valid and reproducible plans."""

from __future__ import annotations

import numpy as np
import pytest

from formats.models import get_model
from scheduler.baselines import (
    _five_point_crossover,
    _gains,
    _move_cycles,
    _replaces_parent,
    best_of_random,
    exhaustive,
    gcma,
    hand_structured,
    index_order_plan,
)
from scheduler.cost_dtfm import DtfmObjective
from scheduler.scenarios import make_scenario
from scheduler.search import SearchConfig, evolutionary_search
from scheduler.search.matching import best_path, bottleneck_matching


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
    """The least bottleneck, and among matchings with it the least total (brute force over
    every permutation; ties in the values included), with the floor feasible or not."""
    import itertools
    rng = np.random.default_rng(0)
    for k in range(120):
        cost = rng.integers(0, 9, size=(5, 5)).astype(float) if k % 2 else rng.random((5, 5))
        value, cols = bottleneck_matching(cost)
        perms = [(max(cost[i, p[i]] for i in range(5)), sum(cost[i, p[i]] for i in range(5)))
                 for p in itertools.permutations(range(5))]
        brute = min(perms)
        assert value == brute[0] == max(cost[i, cols[i]] for i in range(5))
        assert sum(cost[i, cols[i]] for i in range(5)) == pytest.approx(brute[1])


def test_a_stack_of_matchings_equals_them_one_by_one_with_halls_and_assignment_tests():
    """bottleneck_matchings (lockstep search, Hall's condition for <= HALL_UP_TO rows, the
    assignment test above) gives each matrix of a stack what bottleneck_matching gives it
    alone, and Hall's test agrees with brute force over permutations on every 0/1 matrix."""
    import itertools

    import scheduler.search.matching as matching
    from scheduler.search.matching import bottleneck_matchings
    rng = np.random.default_rng(5)
    for r in (1, 2, 4, 6):
        allowed = rng.random((300, r, r)) < 0.45
        brute = [any(all(a[i, p[i]] for i in range(r)) for p in itertools.permutations(range(r)))
                 for a in allowed]
        assert matching._hall(allowed).tolist() == brute
    for r in (3, 8, 12):  # 12 > HALL_UP_TO: assignment tests
        stack = rng.integers(0, 5, size=(40, r, r)).astype(float)
        for (value, cols), cost in zip(bottleneck_matchings(stack), stack):
            alone = bottleneck_matching(cost)
            assert value == alone[0] == max(cost[np.arange(r), cols])
            assert np.array_equal(cols, alone[1])
    assert matching.HALL_UP_TO < 12


def test_bottleneck_matching_of_big_groups_tests_with_hopcroft_karp():
    """Above HOPCROFT_KARP_FROM rows the tests are Hopcroft-Karp's, the assignment made once:
    the same bottleneck as the assignment-tested path on the same matrix."""
    import scheduler.search.matching as matching
    rng = np.random.default_rng(1)
    cost = rng.integers(0, 40, size=(70, 70)).astype(float)
    big = bottleneck_matching(cost)
    saved, matching.HOPCROFT_KARP_FROM = matching.HOPCROFT_KARP_FROM, 100
    try:
        small = bottleneck_matching(cost)
    finally:
        matching.HOPCROFT_KARP_FROM = saved
    assert big[0] == small[0] == max(cost[np.arange(70), big[1]])
    assert sorted(big[1]) == list(range(70)) and np.array_equal(big[1], small[1])


def test_best_path_is_optimal():
    import itertools
    rng = np.random.default_rng(3)
    e = rng.random((7, 7))
    e = e + e.T
    path = best_path(e)
    cost = lambda p: sum(e[a, b] for a, b in zip(p, p[1:]))
    assert cost(path) == pytest.approx(min(cost(p) for p in itertools.permutations(range(7))))


def test_hand_structured_keeps_chains_inside_datacenter_instances():
    # 8 instances of 8 GPUs: one chain per instance is the plan a person would write down.
    cluster = make_scenario("datacenter", seed=3)
    obj = DtfmObjective(cluster, get_model("gpt3-xl"), 8, 8)
    how, plan, cost = hand_structured(obj, cluster.regions(), obj.t_act, np.arange(64), 8, 8)
    regions = np.array(cluster.regions())
    assert all(len(set(regions[chain])) == 1 for chain in plan)
    assert cost == pytest.approx(obj.cost(plan)) and "blocks of 8 stages" in how
    # By hand: PP 7 boundaries x 2 directions inside an instance, DP 7 peers across instances.
    pp = 7 * 2 * (0.47124 * 8 / 100.0)
    dp = 7 * 2 * (0.65 / 8 * 8 / 3.125)
    assert cost == pytest.approx(pp + dp, rel=1e-4)


def test_published_replacement_rule_quirk():
    # child <= parent1 replaces the worse parent, whatever parent2 is ...
    assert _replaces_parent(3.0, 4.0, 10.0) and _replaces_parent(4.0, 4.0, 1.0)
    # ... and a child between the parents does not when parent1 is the better one.
    assert not _replaces_parent(5.0, 4.0, 10.0)


def test_crossover_and_cyclic_moves_keep_groups_balanced():
    rng = np.random.default_rng(0)
    s, r = 4, 3
    pp = rng.uniform(0.1, 2.0, size=(12, 12))
    for _ in range(50):
        p1, p2 = (np.repeat(np.arange(s), r)[rng.permutation(12)] for _ in range(2))
        child = _five_point_crossover(p1, p2, s, r, rng)
        assert np.bincount(child, minlength=s).tolist() == [r] * s
        moved = _move_cycles(child, pp, s)
        assert np.bincount(moved, minlength=s).tolist() == [r] * s


def test_published_gain_by_hand():
    # Groups {0, 1} and {2, 3}; one-way activation times chosen so each entry is distinct.
    pp = np.array([[0, 1, 4, 6],
                   [2, 0, 3, 5],
                   [7, 8, 0, 9],
                   [1, 2, 3, 0]], dtype=float)
    labels = np.array([0, 0, 1, 1])
    g_ij, g_i, moves = _gains(labels, np.zeros(4, dtype=bool), pp, 2)
    # Group 0 nominates device 0 (nearest own peer 1 < device 1's 2): mean to group 1 is
    # (4 + 6) / 2 = 5, gain 5 - 1 = 4. Group 1 nominates device 3 (own 3 < device 2's 9):
    # mean to group 0 is (1 + 2) / 2 = 1.5, gain 1.5 - 3 = -1.5.
    assert moves == [(0, 1), (3, 0)]
    assert g_i.tolist() == [4.0, -1.5] and g_ij[0, 1] == 4.0 and g_ij[1, 0] == -1.5
    # A locked device is never nominated.
    _, _, moves = _gains(labels, np.array([True, False, False, False]), pp, 2)
    assert moves[0] == (1, 1)


def test_published_search_is_valid_reproducible_and_improves_on_its_start():
    cluster = make_scenario("regional", seed=1)
    obj = DtfmObjective(cluster, get_model("gpt3-xl"), 8, 8)
    a = gcma(obj, obj.t_act, np.arange(64), 8, 8, population=10, trials=30, seed=5)
    b = gcma(obj, obj.t_act, np.arange(64), 8, 8, population=10, trials=30, seed=5)
    start = gcma(obj, obj.t_act, np.arange(64), 8, 8, population=10, trials=0, seed=5)
    assert sorted(a[0].ravel().tolist()) == list(range(64)) and a[2] == 40
    assert np.array_equal(a[0], b[0]) and a[1] == b[1] == pytest.approx(obj.cost(a[0]))
    assert a[1] <= start[1]


def test_given_plans_are_a_floor_and_the_budget_a_cap():
    cluster = make_scenario("spot", seed=1)
    obj = DtfmObjective(cluster, get_model("gpt3-xl"), 8, 8)
    _, plan, cost = hand_structured(obj, cluster.regions(), obj.t_act, np.arange(64), 8, 8)
    res = evolutionary_search(obj, obj.t_act, np.arange(64), 8, 8,
                              SearchConfig(budget=5, seed=0), [obj.t_grad],
                              initial_plans=[("by hand", plan)])
    assert res.evaluations <= 5
    assert res.cost <= cost and obj.cost(res.pipelines) == pytest.approx(res.cost)
    assert res.history[0] == (1, pytest.approx(cost))


class ChainSpeedObjective:
    """A generic objective that is not DT-FM: the slowest chain's summed device time, plus a
    little DT-FM so that links still matter. Which devices share a chain decides it."""

    name = "chain-speed"

    def __init__(self, dtfm: DtfmObjective, speed: np.ndarray) -> None:
        self.dtfm, self.speed = dtfm, speed

    def cost(self, pipelines: np.ndarray) -> float:
        return float(self.speed[pipelines].sum(axis=1).max()) + 0.01 * self.dtfm.cost(pipelines)


@pytest.mark.parametrize("seed", [0, 1])
def test_generic_objective_reaches_the_exhaustive_optimum(seed):
    cluster = make_scenario("random", seed=seed, num_devices=8, num_regions=2)
    dtfm = DtfmObjective(cluster, get_model("gpt3-xl"), 2, 4)
    speed = np.random.default_rng(seed).uniform(1.0, 10.0, size=8)
    obj = ChainSpeedObjective(dtfm, speed)
    _, optimum, _ = exhaustive(obj, np.arange(8), 2, 4)
    found = evolutionary_search(obj, dtfm.t_act, np.arange(8), 2, 4,
                                SearchConfig(budget=4000, time_limit_s=60, seed=seed),
                                [dtfm.t_grad])
    assert found.cost == pytest.approx(optimum, rel=1e-9)
    assert obj.cost(found.pipelines) == pytest.approx(found.cost)


class PlanByPlan:
    """The DT-FM cost with neither `costs` (vectorised) nor `lower_bounds` (floors): how any
    other objective is searched, plan by plan, every candidate decoded."""

    name = "dtfm-plan-by-plan"

    def __init__(self, dtfm: DtfmObjective) -> None:
        self.dtfm = dtfm

    def cost(self, pipelines: np.ndarray) -> float:
        return self.dtfm.cost(pipelines)


@pytest.mark.parametrize("classes", [False, True])
def test_batch_costs_and_floors_agree_with_the_cost_plan_by_plan(classes):
    from scheduler.search.islands import stage_groups
    from scheduler.search.matching import PairCache

    cluster = make_scenario("random", seed=3, num_devices=64, num_regions=4)
    obj = DtfmObjective(cluster, get_model("gpt3-xl"), 8, 8, classes=classes)
    rng = np.random.default_rng(0)
    plans = np.stack([rng.permutation(64).reshape(8, 8) for _ in range(50)])
    assert obj.costs(plans) == pytest.approx([obj.cost(p) for p in plans], rel=1e-12)
    cache = PairCache(obj.act)
    groups = [cache.order(stage_groups(p)) for p in plans]
    decoded = np.array([obj.cost(cache.chains(g)) for g in groups])
    floors = obj.lower_bounds(np.array(groups))
    assert (floors <= decoded * (1 + 1e-12)).all()  # a floor, never above the cost ...
    assert (floors >= 0.7 * decoded).all()  # ... and not a trivial one


def test_floors_and_batches_change_nothing_but_the_time():
    # Skipping candidates by their floor and scoring in vectorised batches find a plan of the
    # same cost as scoring every candidate, decoded, one call each (not always the same plan:
    # the vectorised sums differ in the last bit, which can swap two plans of equal cost in
    # the tie-break; nor the same evaluations: the chain polish counts whole batches).
    cluster = make_scenario("random", seed=5, num_devices=32, num_regions=3)
    obj = DtfmObjective(cluster, get_model("gpt3-xl"), 4, 8)
    config = SearchConfig(budget=3000, time_limit_s=60, seed=1)
    fast = evolutionary_search(obj, obj.t_act, np.arange(32), 4, 8, config, [obj.t_grad])
    slow = evolutionary_search(PlanByPlan(obj), obj.t_act, np.arange(32), 4, 8, config,
                               [obj.t_grad])
    assert fast.cost == pytest.approx(slow.cost, rel=1e-12)


def test_search_stops_when_converged_with_the_structured_optimum():
    # spot: the best plan is a structured start (docs/planner.md); the search used to spend
    # its whole 20,000-evaluation budget confirming it.
    cluster = make_scenario("spot", seed=5)
    obj = DtfmObjective(cluster, get_model("gpt3-xl"), 8, 8)
    _, _, hand = hand_structured(obj, cluster.regions(), obj.t_act, np.arange(64), 8, 8)
    from scheduler.baselines import structured_plans
    seeds = structured_plans(cluster.regions(), obj.act, np.arange(64), 8, 8)
    res = evolutionary_search(obj, obj.t_act, np.arange(64), 8, 8,
                              SearchConfig(budget=20_000, time_limit_s=60), [obj.t_grad],
                              initial_plans=seeds)
    assert res.stopped_by == "converged" and res.evaluations < 8_000
    assert res.cost == pytest.approx(hand, rel=1e-9) and hand == pytest.approx(31.634, abs=1e-3)
    # no better cost for a whole window after the last gain, then the polish
    assert res.evaluations - res.history[-1][0] > SearchConfig().window
    capped = evolutionary_search(obj, obj.t_act, np.arange(64), 8, 8,
                                 SearchConfig(budget=3_000, time_limit_s=60, window=0),
                                 [obj.t_grad], initial_plans=seeds)
    assert capped.stopped_by == "budget" and capped.evaluations == 3_000
