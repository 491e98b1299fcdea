"""Evolutionary search with local search over stage-group partitions.

A candidate is a partition of the devices into S stage groups of R devices, kept in pipeline
order. It is decoded into pipelines by bottleneck matching between consecutive groups
(PairCache) and scored by any Objective. The population starts from given plans (e.g. built
from the cluster's regions) and topology-aware structured plans (islands.py) plus random ones;
children come from group-preserving crossover, swap and block mutations, a reorder of the
groups and a short local search (batches of random swaps, moving to the best); when no better
plan turns up for `patience` evaluations the evolution restarts from its first population, and
when none turns up for `window` evaluations it has converged and stops. Four fifths of the
budget and time at most go to evolution; the rest polishes the best plan: steepest descent over
all pairwise swaps between groups, then first-improvement swaps of any two slots scored without
re-matching. Candidates are scored in batches (one objective call each when the objective is
vectorised), and those whose floor (`lower_bounds`) is above the cost to beat are judged
undecoded.

Every run is reproducible from `seed` when `budget` (a hard cap on objective evaluations) or
convergence ends it rather than `time_limit_s` (wall).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from formats.settings import MAX_COUNT, MAX_SECONDS, MAX_SEED, check, setting
from scheduler.link_costs import LinkCosts, as_link_costs
from scheduler.objective import Objective, batch_costs, vectorised
from scheduler.search.islands import (
    Groups,
    leaf_orders,
    stage_groups,
    structured_partitions,
)
from scheduler.search.matching import PairCache

WINDOW = 1000
"""Default convergence window (SearchConfig.window): measured on the five DT-FM scenarios and
`random` (docs/planner.md, "When the search stops")."""


@dataclass
class SearchConfig:
    """Knobs of the evolutionary search."""

    budget: int = setting(20_000, lo=1, hi=MAX_COUNT)
    """max objective evaluations per searched shape"""
    time_limit_s: float = setting(10.0, flag="--time-limit", lo=0.0, lo_open=True,
                                  hi=MAX_SECONDS)
    """wall limit in s (the search stops at whichever limit comes first)"""
    population: int = setting(24, lo=1, hi=MAX_COUNT)
    """Candidates kept alive."""
    local_tries: int = setting(40, lo=0, hi=MAX_COUNT)
    """Swap proposals of the local search applied to each child."""
    patience: int = setting(3_000, lo=1, hi=MAX_COUNT)
    """Evaluations without a better plan after which the population restarts (or, without
    restarts, the evolution stops)."""
    restarts: bool = True
    """Restart from a fresh random population (plus the best plan) when stuck, until the
    evolution's share of the budget (four fifths) is spent or it has converged."""
    window: int = setting(WINDOW, lo=0, hi=MAX_COUNT)
    """evaluations without a better cost after which the search has converged and stops
    evolving (the polish follows); 0: only the budget or the clock end it"""
    seed: int = setting(0, flag="--search-seed", lo=0, hi=MAX_SEED)
    """seed of the search (of every random choice)"""

    def __post_init__(self) -> None:
        """UserError naming the first bad field (`SearchConfig.budget`)."""
        check(self)


@dataclass
class SearchResult:
    """The best plan found and how the search got there."""

    pipelines: np.ndarray
    """(R, S) device ids."""
    cost: float
    evaluations: int
    wall_s: float
    history: list[tuple[int, float]] = field(default_factory=list)
    """(evaluations so far, best cost so far) at every improvement."""
    best_structured: tuple[str, float] = ("", float("inf"))
    """Name and cost of the best hand-structured starting plan (before any search)."""
    stopped_by: str = "converged"
    """What ended the search: `budget`, `time` (the wall limit: not reproducible from the
    seed), `converged` (no better cost for `window` evaluations, or for `patience` ones
    without restarts, and the polish ended by itself) or
    `infeasible` (no plan of the first population had a finite cost)."""
    pairs: PairCache | None = None
    """The group matchings the search made, for reuse on the same link costs (baselines)."""


LOCAL_BATCH = 8
"""Swaps the local search scores at once before moving to the best of them."""
POLISH_BATCH = 256
"""Swaps the steepest descent decodes and scores at once (between checks of the clock) for a
vectorised objective (LOCAL_BATCH for others)."""
BOUND_MAX_REPLICAS = 64
"""Largest stage group whose candidates are judged by their floors first (a floor gathers
R x R link times per boundary: cheap for small groups, gigabytes for a batch of big ones)."""
STRUCTURED_BATCH = 32
"""Structured partitions whose group pairs are matched in one lockstep batch (between checks
of the clock and the budget)."""
CHAIN_BATCH = 512
"""Slot swaps the final chain polish scores at once (vectorised objectives) ..."""
CHAIN_BATCH_SLOTS = 1 << 15
"""... and at most this many device ids in all (a batch of copies of the plan)."""

Key = tuple[float, float]
"""(cost, tie-break): the tie-break ranks plans of equal cost by their mean link times, which
gives the search a slope to follow on the plateaus that bottleneck (max) costs create."""


class _Scorer:
    """Decodes and scores candidates, counting evaluations and tracking the best."""

    def __init__(self, objective: Objective, cache: PairCache, t_tie: LinkCosts, budget: int,
                 deadline: float, replicas: int = 1) -> None:
        self.objective, self.cache, self.t_tie = objective, cache, t_tie
        self.budget, self.deadline = budget, deadline
        self.evaluations = 0
        self.best: tuple[Key, Groups] = ((float("inf"), float("inf")), [])
        self.history: list[tuple[int, float]] = []
        self.timed_out = self.out_of_budget = False
        small = replicas <= BOUND_MAX_REPLICAS
        self.batch = LOCAL_BATCH if small else 1
        """Most candidates scored between two checks of the clock (1 for big groups, whose
        matchings take milliseconds each)."""
        self.bounds = getattr(objective, "lower_bounds", None) if small else None
        """Floors under the cost (None: every candidate is decoded; always for groups above
        BOUND_MAX_REPLICAS, whose floors cost O(S R^2) per candidate)."""

    def exhausted(self) -> bool:
        if self.evaluations >= self.budget:
            self.out_of_budget = True
            return True
        if time.perf_counter() > self.deadline:
            self.timed_out = True
            return True
        return False

    def stopped_by(self) -> str:
        """`time` if the wall limit ever cut a phase short, else `budget` or `converged`."""
        if self.timed_out:
            return "time"
        return "budget" if self.out_of_budget else "converged"

    def score(self, groups: Groups) -> Key:
        return self.score_batch([groups])[0]

    def score_batch(self, batch: list[Groups], above: float = float("inf")) -> list[Key]:
        """Decode each candidate (matchings, cached), then score them all with one objective
        call and one tie-break computation; counts len(batch) evaluations. When the objective
        gives floors under its cost (`lower_bounds`), a candidate whose floor is above `above`
        (it cannot beat that cost) is judged by its floor alone, undecoded: key (floor, inf)."""
        keys: list[Key] = [(float("inf"), float("inf"))] * len(batch)
        todo = list(range(len(batch)))
        if self.bounds is not None and above < float("inf") and batch:
            floor = self.bounds(np.array(batch)).tolist()
            limit = above + 1e-12 * max(1.0, abs(above))
            todo = [k for k in todo if floor[k] <= limit]
            keys = [(f, float("inf")) for f in floor]
        if todo:
            for k, key in zip(todo, self._decode_and_score([batch[k] for k in todo])):
                keys[k] = key
        for groups, key in zip(batch, keys):
            self.evaluations += 1
            if key < self.best[0]:
                if key[0] < self.best[0][0] - 1e-12:
                    self.history.append((self.evaluations, key[0]))
                self.best = (key, list(groups))
        return keys

    def _decode_and_score(self, batch: list[Groups]) -> list[Key]:
        """(cost, tie-break) of each candidate: chains by matching, one objective call."""
        self.cache.prefetch((g[k - 1], g[k]) for g in batch for k in range(1, len(g)))
        chains = np.stack([self.cache.chains(groups) for groups in batch])  # (B, R, S)
        b, r, s = chains.shape
        costs = batch_costs(self.objective, chains)
        tie = self.cache.costs.at(chains[:, :, :-1], chains[:, :, 1:]).mean(axis=(1, 2)) \
            if s > 1 else np.zeros(b)
        # mean link time inside the (S, R) stage groups, (i, i) = 0 included
        tie = tie + self.t_tie.member_sums(chains.transpose(0, 2, 1).reshape(b * s, r)) \
            .reshape(b, s * r).sum(axis=1) / (s * r * r)
        return list(zip(costs.tolist(), tie.tolist()))

    def room(self, wanted: int) -> int:
        """How many of `wanted` evaluations the budget still allows (0 when exhausted)."""
        return 0 if self.exhausted() else min(wanted, self.budget - self.evaluations)


def _swap(groups: Groups, a: int, i: int, b: int, j: int) -> Groups:
    ga, gb = list(groups[a]), list(groups[b])
    ga[i], gb[j] = gb[j], ga[i]
    out = list(groups)
    out[a], out[b] = tuple(sorted(ga)), tuple(sorted(gb))
    return out


def _random_partition(devices: np.ndarray, s: int, r: int, rng: np.random.Generator) -> Groups:
    perm = rng.permutation(devices)[: s * r].reshape(s, r)
    return stage_groups(perm.T)


def _crossover(p1: Groups, p2: Groups, rng: np.random.Generator) -> Groups:
    """Keep a random half of p1's groups intact, then p2's groups that still fit, then repair."""
    s = len(p1)
    keep = [p1[k] for k in rng.permutation(s)[: max(1, s // 2)]]
    used = {d for g in keep for d in g}
    for g in p2:
        if len(keep) < s and used.isdisjoint(g):
            keep.append(g)
            used.update(g)
    rest = [d for g in p2 for d in g if d not in used]
    r = len(p1[0])
    while len(keep) < s:
        keep.append(tuple(sorted(rest[:r])))
        rest = rest[r:]
    return keep


def _mutate(groups: Groups, rng: np.random.Generator) -> Groups:
    """One to three swaps, or a block move exchanging several devices between two groups."""
    s, r = len(groups), len(groups[0])
    if s < 2:
        return groups
    if rng.random() < 0.3 and r > 1:
        a, b = rng.choice(s, size=2, replace=False)
        k = int(rng.integers(1, r))
        ia, ib = rng.choice(r, size=k, replace=False), rng.choice(r, size=k, replace=False)
        ga, gb = list(groups[a]), list(groups[b])
        for i, j in zip(ia, ib):
            ga[i], gb[j] = gb[j], ga[i]
        out = list(groups)
        out[a], out[b] = tuple(sorted(ga)), tuple(sorted(gb))
        return out
    for _ in range(int(rng.integers(1, 4))):
        a, b = rng.choice(s, size=2, replace=False)
        groups = _swap(groups, a, int(rng.integers(r)), b, int(rng.integers(r)))
    return groups


def _local_search(groups: Groups, cost: Key, scorer: _Scorer, tries: int,
                  rng: np.random.Generator) -> tuple[Groups, Key]:
    """Random pairwise swaps in batches of LOCAL_BATCH, scored at once: move to the best of a
    batch when it improves."""
    s, r = len(groups), len(groups[0])
    while tries > 0 and s > 1:
        k = scorer.room(min(tries, scorer.batch))
        if k == 0:
            break
        tries -= k
        moves = [(*rng.choice(s, size=2, replace=False), rng.integers(r), rng.integers(r))
                 for _ in range(k)]
        batch = [_swap(groups, int(a), int(i), int(b), int(j)) for a, b, i, j in moves]
        keys = scorer.score_batch(batch, above=cost[0])
        best = min(range(k), key=keys.__getitem__)
        if keys[best] < cost:
            groups, cost = batch[best], keys[best]
    return groups, cost


def _swap_batches(s: int, r: int, size: int) -> Iterator[list[tuple[int, int, int, int]]]:
    """Every swap (a, i, b, j) of member i of group a with member j of group b, a < b, in
    lists of up to `size` (made lazily: S^2 R^2 / 2 swaps of big groups do not fit a list)."""
    swaps = ((a, i, b, j) for a in range(s) for b in range(a + 1, s)
             for i in range(r) for j in range(r))
    while batch := list(itertools.islice(swaps, size)):
        yield batch


def _polish(groups: Groups, cost: Key, scorer: _Scorer) -> tuple[Groups, Key]:
    """Steepest descent over all pairwise swaps (and a reorder) until no swap improves; each
    sweep is scored in batches of POLISH_BATCH (swaps whose floor is above the best cost are
    judged undecoded, see _Scorer.score_batch)."""
    s, r = len(groups), len(groups[0])
    # the clock is checked between batches: small ones for an objective scored plan by plan
    size = min(POLISH_BATCH if vectorised(scorer.objective) else LOCAL_BATCH,
               scorer.batch if scorer.batch < LOCAL_BATCH else POLISH_BATCH)
    improved = True
    while improved and s > 1:
        improved = False
        best = (cost, groups)
        for swaps in _swap_batches(s, r, size):
            k = scorer.room(len(swaps))
            if k == 0:
                return best[1], best[0]
            batch = [_swap(groups, *m) for m in swaps[:k]]
            for c, cand in zip(scorer.score_batch(batch, above=best[0][0]), batch):
                if c < best[0]:
                    best = (c, cand)
        if best[0] < cost:
            cost, groups = best
            if scorer.room(1):
                reordered = scorer.cache.order(groups)
                c = scorer.score(reordered)
                if c < cost:
                    groups, cost = reordered, c
            improved = True
    return groups, cost


def evolutionary_search(objective: Objective, t_act: np.ndarray | LinkCosts, devices: np.ndarray,
                        num_stages: int, num_replicas: int, config: SearchConfig | None = None,
                        extra_link_costs: list[np.ndarray | LinkCosts] | None = None,
                        progress: Callable[[int, float], None] | None = None,
                        initial_plans: list[tuple[str, np.ndarray]] | None = None,
                        seed_orders: list[np.ndarray] | None = None) -> SearchResult:
    """Search S x R plans over `devices` minimising `objective`.

    `t_act[i, j]` is the time to send one stage boundary's activations from i to j (it drives
    the matching between groups); `extra_link_costs` are more (N, N) link costs whose
    clustering seeds the population (e.g. the data-parallel gradient time); both may be
    LinkCosts (by link class for large swarms) instead of matrices; `initial_plans` are named
    (R, S) plans built elsewhere (e.g. from the cluster's regions): each is scored as given and
    its stage groups join the population, so the result is never worse than any of them.
    `seed_orders`: the device orders cut into structured plans, if already made (default:
    islands.leaf_orders of t_act and extra_link_costs).
    Cost: O(budget) evaluations, each O(S R^2) plus cached matchings.
    """
    config = config or SearchConfig()
    start = time.perf_counter()
    rng = np.random.default_rng(config.seed)
    cache = PairCache(t_act)
    t_tie = as_link_costs((extra_link_costs or [t_act])[0])
    # The last fifth of the budget and of the time is kept for the final polish.
    scorer = _Scorer(objective, cache, t_tie, config.budget - config.budget // 5,
                     start + 0.8 * config.time_limit_s, num_replicas)
    devices = np.asarray(devices, dtype=np.int64)
    s, r = num_stages, num_replicas

    given, given_history, structured = _score_given_plans(objective, scorer, initial_plans)
    orders = seed_orders or leaf_orders([t_act, *(extra_link_costs or [])], devices)
    structured += structured_partitions(orders, s, r)
    population, best_structured = _score_structured(structured, scorer, cache)
    target = config.population + len(population) // 2
    while len(population) < target and not scorer.exhausted():
        groups = cache.order(_random_partition(devices, s, r, rng))
        population.append((scorer.score(groups), groups))
    population = _select(population, config.population)
    if not np.isfinite(scorer.best[0][0]) and not np.isfinite(given[1]):
        # Nothing in a whole population fits (e.g. memory): every candidate costs inf, so the
        # search has no slope to follow; say so now instead of spending the budget on a plateau.
        return SearchResult(cache.chains(scorer.best[1]), float("inf"), scorer.evaluations,
                            time.perf_counter() - start, [], best_structured, "infeasible",
                            cache)
    _evolve(population, scorer, cache, config, rng, progress)
    _final_polish(scorer, config, start, progress)
    (best_cost, _), best_groups = scorer.best
    best_plan = cache.chains(best_groups)
    if given[1] < best_structured[1]:
        best_structured = (given[0], given[1])
    if given[1] < best_cost:  # a given plan as built beats everything the search decoded
        best_cost, best_plan = given[1], given[2]
    chain_history: list[tuple[int, float]] = []
    best_plan, best_cost = _polish_chains(best_plan, best_cost, scorer, chain_history)
    if progress:
        progress(scorer.evaluations, best_cost)
    return SearchResult(best_plan, best_cost, scorer.evaluations, time.perf_counter() - start,
                        _merge_history(given_history, scorer.history, chain_history),
                        best_structured, scorer.stopped_by(), cache)


def _final_polish(scorer: _Scorer, config: SearchConfig, start: float,
                  progress: Callable[[int, float], None] | None) -> None:
    """Polish the best groups with what is left of the whole budget and time."""
    # Polishing gets what is left of the budget and time, so that the best plan is a swap-local
    # optimum whenever they allow; `budget` stays a hard cap on evaluations.
    scorer.budget = config.budget
    scorer.deadline = start + config.time_limit_s
    _polish(scorer.best[1], scorer.best[0], scorer)
    if progress:
        progress(scorer.evaluations, scorer.best[0][0])


def _score_given_plans(objective: Objective, scorer: _Scorer,
                       initial_plans: list[tuple[str, np.ndarray]] | None
                       ) -> tuple[tuple[str, float, np.ndarray], list[tuple[int, float]],
                                  list[tuple[str, Groups]]]:
    """Score each named plan as given: (the best (name, cost, plan), its improvements as
    history, every plan's stage groups for the population)."""
    given: tuple[str, float, np.ndarray] = ("", float("inf"), np.empty(0))
    given_history: list[tuple[int, float]] = []
    structured: list[tuple[str, Groups]] = []
    for name, plan in initial_plans or []:
        plan = np.asarray(plan, dtype=np.int64)
        structured.append((name, stage_groups(plan)))
        if given_history and time.perf_counter() > scorer.deadline:
            scorer.timed_out = True  # out of time: its groups still join the population
            continue
        scorer.evaluations += 1
        cost = float(objective.cost(plan))
        if cost < given[1]:
            given = (name, cost, plan)
            given_history.append((scorer.evaluations, cost))
    return given, given_history, structured


def _score_structured(structured: list[tuple[str, Groups]], scorer: _Scorer, cache: PairCache
                      ) -> tuple[list[tuple[Key, Groups]], tuple[str, float]]:
    """Score each distinct structured partition: (the starting population, the best one's
    (name, cost))."""
    population: list[tuple[Key, Groups]] = []
    best_structured = ("", float("inf"))
    distinct: dict[tuple[tuple[int, ...], ...], tuple[str, Groups]] = {}
    for name, groups in structured:  # different cuts often give the same partition
        distinct.setdefault(tuple(sorted(groups)), (name, groups))
    todo = list(distinct.values())
    for first in range(0, len(todo), STRUCTURED_BATCH):
        if population and scorer.exhausted():
            break
        chunk = todo[first: first + STRUCTURED_BATCH]
        cache.prefetch((g[i], g[j]) for _, g in chunk
                       for i in range(len(g)) for j in range(i + 1, len(g)))
        for name, groups in chunk:
            if population and scorer.exhausted():
                return population, best_structured
            groups = cache.order(groups)
            c = scorer.score(groups)
            if c[0] < best_structured[1]:
                best_structured = (name, c[0])
            population.append((c, groups))
    return population, best_structured


def _evolve(population: list[tuple[Key, Groups]], scorer: _Scorer, cache: PairCache,
            config: SearchConfig, rng: np.random.Generator,
            progress: Callable[[int, float], None] | None) -> None:
    """Evolve `population` (crossover, mutation, local search) until the scorer's budget or
    deadline, restarting from it when stuck for `config.patience` evaluations."""
    first_population = list(population)
    last_report = 0.0
    epoch_start = scorer.evaluations
    while not scorer.exhausted():
        gain = scorer.history[-1][0] if scorer.history else 0
        if config.window and scorer.evaluations - gain > config.window:
            break  # converged: no better cost for a whole window (restarts included)
        last_gain = max(epoch_start, gain)
        if scorer.evaluations - last_gain > config.patience:
            if not config.restarts:
                break
            # Stuck: go back to the first population; the random choices from here on differ,
            # and on irregular networks different runs end in different basins.
            epoch_start = scorer.evaluations
            population = list(first_population)
            continue
        p1 = _tournament(population, rng)
        child = _crossover(p1, _tournament(population, rng), rng) if rng.random() < 0.5 else p1
        child = cache.order(_mutate(child, rng))
        cost = scorer.score(child)
        child, cost = _local_search(child, cost, scorer, config.local_tries, rng)
        if cost < population[-1][0] and all(g != child for _, g in population):
            population[-1] = (cost, child)
            population.sort(key=lambda x: x[0])
        if progress and time.perf_counter() - last_report > 0.5:
            progress(scorer.evaluations, scorer.best[0][0])
            last_report = time.perf_counter()


def _polish_chains(plan: np.ndarray, cost: float, scorer: _Scorer,
                   history: list[tuple[int, float]]) -> tuple[np.ndarray, float]:
    """First-improvement swaps of any two slots of the (R, S) plan, scored as given (no
    matching): sweeps until one finds nothing or the budget ends. The group search decodes
    chains by link-time matching only; an objective that also cares which devices share a chain
    (uneven GPUs, memory) needs these moves. For dtfm on symmetric links they rarely help.
    A vectorised objective scores the swaps CHAIN_BATCH at a time (every one counts as an
    evaluation), others one at a time."""
    plan = plan.copy()
    n = plan.size
    # batches of at most CHAIN_BATCH plans and CHAIN_BATCH_SLOTS ids (big plans: few at once,
    # so that the clock is checked often)
    chunk = max(1, min(CHAIN_BATCH, CHAIN_BATCH_SLOTS // n)) if vectorised(scorer.objective) \
        else 1
    improved = True
    while improved:
        improved = False
        for a in range(n - 1):
            b0 = a + 1
            while b0 < n:
                m = scorer.room(min(chunk, n - b0))
                if m == 0:
                    return plan, cost
                b = np.arange(b0, b0 + m)
                flat = np.repeat(plan.reshape(1, n), m, axis=0)
                rows = np.arange(m)
                flat[rows, a], flat[rows, b] = flat[rows, b], flat[rows, a]
                costs = batch_costs(scorer.objective, flat.reshape(m, *plan.shape))
                scorer.evaluations += m
                hits = np.flatnonzero(costs < cost - 1e-12 * max(1.0, abs(cost)))
                if not len(hits):
                    b0 += m
                    continue
                h = int(hits[0])
                plan, cost, improved = flat[h].reshape(plan.shape), float(costs[h]), True
                history.append((scorer.evaluations - m + h + 1, cost))
                b0 += h + 1
    return plan, cost


def _merge_history(*histories: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """One best-so-far curve from several (evaluation, cost) improvement lists."""
    out: list[tuple[int, float]] = []
    for ev, cost in sorted(p for h in histories for p in h):
        if not out or cost < out[-1][1]:
            out.append((ev, cost))
    return out


def _select(population: list[tuple[Key, Groups]], size: int) -> list[tuple[Key, Groups]]:
    unique: list[tuple[Key, Groups]] = []
    for item in sorted(population, key=lambda x: x[0]):
        if all(item[1] != g for _, g in unique):
            unique.append(item)
    return unique[:size]


def _tournament(population: list[tuple[Key, Groups]], rng: np.random.Generator) -> Groups:
    i, j = rng.integers(len(population), size=2)
    return population[min(i, j)][1]  # population is sorted: lower index = better
