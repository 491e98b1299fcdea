"""Plans to compare against: random, index order, exhaustive (tiny clusters), and our
re-implementation of the published DT-FM search (GCMA: a genetic algorithm with local search).

Every function is pure and seeded; each returns (pipelines (R, S), cost, evaluations).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from scheduler.errors import UserError
from scheduler.heuristic_evolutionary_solver.matching import PairCache
from scheduler.objective import Objective

Baseline = tuple[np.ndarray, float, int]


def index_order_plan(devices: np.ndarray, num_stages: int, num_replicas: int) -> np.ndarray:
    """What a Megatron-style launcher does: replica r gets devices r*S .. r*S+S-1 in id order."""
    return np.asarray(sorted(devices)[: num_stages * num_replicas]).reshape(num_replicas,
                                                                           num_stages)


def best_of_random(objective: Objective, devices: np.ndarray, num_stages: int,
                   num_replicas: int, samples: int = 1000, seed: int = 0) -> Baseline:
    """Best of `samples` uniformly random plans. O(samples) evaluations."""
    rng = np.random.default_rng(seed)
    best: tuple[float, np.ndarray] = (math.inf, np.empty(0))
    for _ in range(samples):
        plan = rng.permutation(devices)[: num_stages * num_replicas].reshape(num_replicas,
                                                                             num_stages)
        cost = float(objective.cost(plan))
        if cost < best[0]:
            best = (cost, plan)
    return best[1], best[0], samples


def exhaustive(objective: Objective, devices: np.ndarray, num_stages: int,
               num_replicas: int, max_plans: int = 50_000) -> Baseline:
    """The optimum over every assignment of devices to (replica, stage) slots.

    Enumerates all N! permutations (N = S x R), so only for tiny clusters (N <= 8).
    """
    n = num_stages * num_replicas
    if len(devices) != n or math.factorial(n) > max_plans:
        raise UserError(f"exhaustive: {n}! plans is too many; use it for at most "
                        f"8 devices (all of them in the plan)")
    best: tuple[float, np.ndarray] = (math.inf, np.empty(0))
    count = 0
    for perm in itertools.permutations(devices):
        plan = np.asarray(perm).reshape(num_replicas, num_stages)
        cost = float(objective.cost(plan))
        count += 1
        if cost < best[0] - 1e-12:
            best = (cost, plan)
    return best[1], best[0], count


def gcma(objective: Objective, t_act: np.ndarray, devices: np.ndarray, num_stages: int,
         num_replicas: int, population: int = 100, trials: int = 4900, seed: int = 0) -> Baseline:
    """The published DT-FM search, re-implemented: a genetic algorithm over balanced partitions
    (five-point crossover with size repair) whose offspring get one round of cyclic moves that
    follow the published pipeline-affinity gain; an offspring replaces the worse of its parents
    when it is better. Partitions are decoded by bottleneck matching and the exact group order.
    """
    rng = np.random.default_rng(seed)
    n, s, r = len(devices), num_stages, num_replicas
    devices = np.asarray(devices)
    pp = t_act[np.ix_(devices, devices)]
    cache = PairCache(t_act)

    def evaluate(labels: np.ndarray) -> float:
        groups = [tuple(sorted(int(devices[k]) for k in np.flatnonzero(labels == g)))
                  for g in range(s)]
        return float(objective.cost(cache.chains(cache.order(groups))))

    pop = [np.repeat(np.arange(s), r)[rng.permutation(n)] for _ in range(population)]
    scores = [evaluate(p) for p in pop]
    evaluations = population
    for _ in range(trials):
        i, j = rng.integers(population, size=2)
        child = _five_point_crossover(pop[i], pop[j], s, r, rng)
        child = _cyclic_moves(child, pp, s)
        score = evaluate(child)
        evaluations += 1
        worse = i if scores[i] >= scores[j] else j
        if score < scores[worse]:
            pop[worse], scores[worse] = child, score
    best = int(np.argmin(scores))
    groups = [tuple(sorted(int(devices[k]) for k in np.flatnonzero(pop[best] == g)))
              for g in range(s)]
    return cache.chains(cache.order(groups)), scores[best], evaluations


def _five_point_crossover(p1: np.ndarray, p2: np.ndarray, s: int, r: int,
                          rng: np.random.Generator) -> np.ndarray:
    """Copy five random devices' group labels from p1 into p2, then rebalance group sizes."""
    child = p2.copy()
    points = rng.permutation(len(child))[:5]
    child[points] = p1[points]
    sizes = np.bincount(child, minlength=s)
    for v in range(len(child)):
        if sizes[child[v]] > r:
            target = int(np.flatnonzero(sizes < r)[0])
            sizes[child[v]] -= 1
            sizes[target] += 1
            child[v] = target
    return child


def _cyclic_moves(labels: np.ndarray, pp: np.ndarray, s: int) -> np.ndarray:
    """One cycle of single-device moves S0 -> S1 -> ... -> S0 (sizes stay balanced).

    Gain of moving v from its group to group g (the published default gain): affinity to g
    (mean pipeline time to g's members, lower is better) against the time to v's closest peer
    in its own group. The cycle is kept only if its total gain is positive.
    """
    labels = labels.copy()
    n = len(labels)
    locked = np.zeros(n, dtype=bool)

    def gains() -> np.ndarray:
        onehot = np.eye(s, dtype=bool)[labels]  # (n, s)
        mean_to = (pp @ onehot) / onehot.sum(axis=0)  # (n, s) mean time to each group
        same = onehot @ onehot.T
        np.fill_diagonal(same, False)
        stay = np.where(same, pp, np.inf).min(axis=1)
        stay[~np.isfinite(stay)] = 0.0
        g = stay[:, None] - mean_to
        g[onehot] = -np.inf
        g[locked] = -np.inf
        return g

    g = gains()
    v0, _ = np.unravel_index(np.argmax(g), g.shape)
    start = cur = int(labels[v0])
    total, moves = 0.0, []
    for _ in range(n):
        members = np.flatnonzero((labels == cur) & ~locked)
        if len(members) == 0:
            break
        v, t = np.unravel_index(np.argmax(g[members]), (len(members), s))
        v = int(members[v])
        total += g[v, t]
        moves.append((v, int(labels[v])))
        labels[v], locked[v] = t, True
        cur = int(t)
        if cur == start:
            break
        g = gains()
    if cur != start or total <= 0:
        for v, old in reversed(moves):
            labels[v] = old
    return labels
