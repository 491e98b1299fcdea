"""Plans to compare against: random, index order, exhaustive (tiny clusters), plans built by
hand from the cluster's regions, and our step-by-step re-implementation of the published DT-FM
search (GCMA: a genetic algorithm with cyclic-move local search, Yuan et al. 2022).

Every function is pure and seeded; the searches return (pipelines (R, S), cost, evaluations).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable

import numpy as np

from formats.errors import UserError
from scheduler.link_costs import LinkCosts, as_link_costs
from scheduler.objective import Objective, batch_costs, vectorised
from scheduler.search.islands import chains_from_blocks, stage_groups
from scheduler.search.matching import PairCache, best_path

Baseline = tuple[np.ndarray, float, int]


RANDOM_BATCH = 100
"""Random plans a vectorised objective scores per call (between checks of the clock)."""


def index_order_plan(devices: np.ndarray, num_stages: int, num_replicas: int) -> np.ndarray:
    """What a Megatron-style launcher does: replica r gets devices r*S .. r*S+S-1 in id order."""
    return np.asarray(sorted(devices)[: num_stages * num_replicas]).reshape(num_replicas,
                                                                           num_stages)


def best_of_random(objective: Objective, devices: np.ndarray, num_stages: int,
                   num_replicas: int, samples: int = 1000, seed: int = 0,
                   deadline: float = math.inf) -> Baseline:
    """Best of `samples` uniformly random plans, or of those scored before time.perf_counter()
    passes `deadline` (at least one). Returns (plan, cost, plans scored). A vectorised
    objective scores RANDOM_BATCH plans per call (the same plans and result)."""
    rng = np.random.default_rng(seed)
    best: tuple[float, np.ndarray] = (math.inf, np.empty(0))
    chunk = RANDOM_BATCH if vectorised(objective) else 1
    k = 0
    while k < samples:
        if k and time.perf_counter() > deadline:
            return best[1], best[0], k
        m = min(chunk if time.perf_counter() <= deadline else 1, samples - k)  # late: one
        plans = np.stack([rng.permutation(devices)[: num_stages * num_replicas]
                          .reshape(num_replicas, num_stages) for _ in range(m)])
        costs = batch_costs(objective, plans)
        i = int(np.argmin(costs))  # the first of equal costs, as one plan at a time would
        if costs[i] < best[0]:
            best = (float(costs[i]), plans[i])
        k += m
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


def region_orders(regions: list[str], devices: np.ndarray,
                  t_act: np.ndarray | LinkCosts) -> list[tuple[str, np.ndarray]]:
    """Devices grouped by their cluster-file region (the islands a person would read off the
    network description), regions in a few hand-picked orders: biggest first; along the cheapest
    path between regions (mean link time, up to 10 regions); and that path with big regions
    first. Inside a region, devices keep id order."""
    devices = np.asarray(devices)
    of_device = [regions[int(d)] for d in devices]
    names = sorted(set(of_device))
    members: dict[str, list[int]] = {g: [] for g in names}
    for d, g in zip(devices, of_device):
        members[g].append(int(d))
    by_size = sorted(names, key=lambda g: (-len(members[g]), g))
    orders = [("regions by size", by_size)]
    if 2 < len(names) <= 10:
        costs = as_link_costs(t_act)
        mean = np.array([[costs.block_mean(members[a], members[b]) if a != b else 0.0
                          for b in names] for a in names])
        path = [names[k] for k in best_path((mean + mean.T) / 2)]
        orders.append(("regions along the cheapest path", path))
        orders.append(("regions by size, then path",
                       sorted(path, key=lambda g: -len(members[g]))))
    return [(name, np.array([d for g in order for d in members[g]])) for name, order in orders]


def structured_plans(regions: list[str], t_act: np.ndarray | LinkCosts, devices: np.ndarray,
                     num_stages: int, num_replicas: int) -> list[tuple[str, np.ndarray]]:
    """Plans a person would build from the regions: every order of `region_orders` cut into
    whole chains per region (block S), whole stage groups per region (block 1), or region-sized
    pieces of chains aligned across replicas (blocks in between). Named (R, S) plans."""
    return [(f"{name}, blocks of {block} stages",
             chains_from_blocks(order, num_stages, num_replicas, block))
            for name, order in region_orders(regions, devices, t_act)
            for block in range(1, num_stages + 1)]


def hand_structured(objective: Objective, regions: list[str], t_act: np.ndarray | LinkCosts,
                    devices: np.ndarray, num_stages: int, num_replicas: int,
                    deadline: float = math.inf, cache: PairCache | None = None
                    ) -> tuple[str, np.ndarray, float]:
    """The best of `structured_plans`, each taken as built and with its stage groups re-matched
    and re-ordered (bottleneck matching, exact order), or of those scored before
    time.perf_counter() passes `deadline` (at least one). `cache`: matchings already made for
    these link costs (e.g. by the search). Returns (description, pipelines, cost)."""
    cache = cache or PairCache(t_act)
    best: tuple[str, np.ndarray, float] = ("", np.empty(0), math.inf)
    scored = 0
    for name, chains in structured_plans(regions, t_act, devices, num_stages, num_replicas):
        groups = stage_groups(chains)
        for how in ("as built", "matched"):
            if scored and time.perf_counter() > deadline:
                return best
            plan = chains if how == "as built" else cache.chains(cache.order(groups))
            cost = float(objective.cost(plan))
            scored += 1
            if cost < best[2]:
                best = (f"{name}, {how}", plan, cost)
    return best


def gcma(objective: Objective, t_act: np.ndarray, devices: np.ndarray, num_stages: int,
         num_replicas: int, population: int = 100, trials: int = 4900, seed: int = 0,
         progress: Callable[[int, float], None] | None = None) -> Baseline:
    """The published DT-FM search (GCMA), re-implemented step by step as published.

    A genetic algorithm over balanced partitions of the devices into S stage groups of R:
    `population` random partitions; each of `trials` offspring takes five random devices'
    group labels from one random parent into the other (then the first over-full groups give
    devices to the first under-full ones), gets one pass of cyclic moves driven by the
    published default gain (`_move_cycles`), and is scored by the objective after bottleneck
    matching and the exact group order. Replacement follows the published rule, comparison
    quirk included (see `_replaces_parent`). Returns the best partition ever scored.
    Seeded (the published code seeds nothing; its `random.seed = i` assigns, not calls).
    """
    rng = np.random.default_rng(seed)
    n, s, r = len(devices), num_stages, num_replicas
    devices = np.asarray(devices)
    # The gain uses one-way activation time between devices (local indices), as published.
    pp = t_act[np.ix_(devices, devices)]
    cache = PairCache(t_act)
    scored: dict[tuple[tuple[int, ...], ...], float] = {}

    def groups_of(labels: np.ndarray) -> list[tuple[int, ...]]:
        return [tuple(sorted(int(devices[k]) for k in np.flatnonzero(labels == g)))
                for g in range(s)]

    def evaluate(labels: np.ndarray) -> float:
        groups = groups_of(labels)
        key = tuple(sorted(groups))
        if key not in scored:
            scored[key] = float(objective.cost(cache.chains(cache.order(groups))))
        return scored[key]

    pool = []
    for _ in range(population):
        labels = np.empty(n, dtype=np.int64)
        labels[rng.permutation(n)] = np.arange(n) // r  # partition k = shuffled slice k
        pool.append(labels)
    scores = [evaluate(p) for p in pool]
    best = min(zip(scores, range(population)))
    best_labels = pool[best[1]]
    best_score = best[0]
    for trial in range(trials):
        i, j = (int(x) for x in rng.integers(population, size=2))
        child = _five_point_crossover(pool[i], pool[j], s, r, rng)
        child = _move_cycles(child, pp, s)
        score = evaluate(child)
        if score < best_score:
            best_score, best_labels = score, child
        if _replaces_parent(score, scores[i], scores[j]):
            worse = i if scores[i] > scores[j] else j
            pool[worse], scores[worse] = child, score
        if progress and trial % 100 == 0:
            progress(population + trial + 1, best_score)
    return cache.chains(cache.order(groups_of(best_labels))), best_score, population + trials


def _replaces_parent(child: float, parent1: float, parent2: float) -> bool:
    """The published replacement test: an offspring replaces the worse parent unless
    `child > max(parent1, child > parent2)`; the boolean inside max() is a slip that makes
    the test `child <= parent1` for costs above 1 s. Reproduced as written."""
    return not child > max(parent1, float(child > parent2))


def _five_point_crossover(p1: np.ndarray, p2: np.ndarray, s: int, r: int,
                          rng: np.random.Generator) -> np.ndarray:
    """Copy five random devices' group labels from p1 into p2, then rebalance: scanning devices
    in index order, a device in an over-full group moves to the first group with room."""
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


def _gains(labels: np.ndarray, locked: np.ndarray, pp: np.ndarray,
           s: int) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int] | None]]:
    """The published default gain (G_ij, G_i and the move behind each G_i).

    gain[v, q] = mean one-way activation time from v to group q's members (q != v's group) and
    gain[v, p] = time to v's nearest peer in its own group p. Group p nominates its unlocked
    device of least gain[v, p] (first by index on ties); its move to q is worth
    gain[v, q] - gain[v, p], G_ij[p, q]; G_i[p] is the best of those. Groups with nothing to
    nominate get -inf. (Larger is taken as better, as published.)
    """
    n = len(labels)
    onehot = np.zeros((n, s))
    onehot[np.arange(n), labels] = 1.0
    sizes = onehot.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        gain = (pp @ onehot) / sizes  # (n, s) mean time to every group
    gain[:, sizes == 0] = 0.0  # an empty group has no members to average (published: 0)
    same = labels[:, None] == labels[None, :]
    np.fill_diagonal(same, False)
    own = np.where(same, pp, np.inf).min(axis=1)  # nearest peer in own group
    g_ij = np.full((s, s), -np.inf)
    g_i = np.full(s, -np.inf)
    moves: list[tuple[int, int] | None] = [None] * s
    for p in range(s):
        cand = np.flatnonzero((labels == p) & ~locked & np.isfinite(own))
        if len(cand) == 0:
            continue
        v = int(cand[np.argmin(own[cand])])  # argmin takes the first on ties
        row = gain[v] - own[v]
        row[p] = -np.inf
        g_ij[p] = row
        q = int(np.argmax(row))
        if np.isfinite(row[q]):
            g_i[p], moves[p] = row[q], (v, q)
    return g_ij, g_i, moves


def _move_cycles(labels: np.ndarray, pp: np.ndarray, s: int) -> np.ndarray:
    """One round of the published cyclic partitioning (up to S cycles of moves).

    A cycle starts at the group of largest G_i and follows each nominated move (v: Si -> Pv,
    then Si = Pv) until it comes back to the start group S0; every moved device is locked for
    the rest of the round. The cycle is cut after the prefix l maximising
    sum(epsilon[:l]) + tau[l] (epsilon = G_i of each step, tau = G_ij back to S0), whose last
    device goes to S0 instead, so group sizes stay equal. Of the offspring after each cycle,
    the one with the best positive prefix of cycle gains is kept (published indexing).
    """
    if s < 2:
        return labels
    n = len(labels)
    locked_v = np.zeros(n, dtype=bool)
    locked_groups = np.zeros(s, dtype=bool)
    offsprings, sums = [labels], [0.0]
    for _ in range(s):
        cur = offsprings[-1].copy()
        movements: list[tuple[int, int, int]] = []
        epsilon: list[float] = []
        tau: list[float] = []
        g_ij, g_i, moves = _gains(cur, locked_v, pp, s)
        s0 = si = int(np.argmax(g_i))
        for _ in range(n):
            move = moves[si]
            if move is None:
                if not movements:
                    break  # nothing left to move (the published code would fail here)
                move = (movements[-1][0], s0)
            v, pv = move
            cur[v] = pv
            locked_v[v] = True
            locked_groups[pv] = True
            movements.append((v, si, pv))
            epsilon.append(float(g_i[si]))
            tau.append(float(g_ij[si, s0]))
            si = pv
            if si == s0:
                break
            g_ij, g_i, moves = _gains(cur, locked_v, pp, s)
        if not movements:
            break
        max_sum, cut = 0.0, 0
        for k in range(1, len(epsilon)):
            value = sum(epsilon[:k]) + tau[k]
            if value > max_sum:
                max_sum, cut = value, k
        for k in range(len(movements) - 1, cut, -1):
            cur[movements[k][0]] = movements[k][1]
        cur[movements[cut][0]] = s0
        offsprings.append(cur)
        sums.append(max_sum)
        if locked_groups.all():
            break
    max_sum, keep = 0.0, 0
    for k in range(1, len(sums)):
        if sum(sums[:k]) > max_sum:
            max_sum, keep = sum(sums[:k]), k - 1
    return offsprings[keep]
