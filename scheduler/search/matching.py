"""From stage groups to pipelines: bottleneck matching between groups and the order of groups.

A partition of the devices into S stage groups of R devices fixes the data-parallel traffic. The
pipeline traffic then depends on which device of group a feeds which device of group b (a perfect
matching, judged by its slowest pair: the bottleneck) and on the order of the groups along the
pipeline (an open path through all groups: a small travelling-salesman problem).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from itertools import combinations

import numpy as np
from scipy.optimize import linear_sum_assignment
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_bipartite_matching

from scheduler.link_costs import ClassCosts, LinkCosts, as_link_costs
from scheduler.search.class_matching import ClassPlans

_BIG = 1e18
HOPCROFT_KARP_FROM = 64
"""Groups bigger than this test for a perfect matching with Hopcroft-Karp, not an assignment."""


def bottleneck_matching(cost: np.ndarray) -> tuple[float, np.ndarray]:
    """Perfect matching of a square matrix minimising the largest chosen entry.

    Returns (bottleneck, cols) with row i matched to cols[i]; among matchings with the optimal
    bottleneck it picks one of least total cost. Binary search over the values, each step a
    perfect-matching test (a linear assignment, or Hopcroft-Karp for big matrices), then one
    linear assignment among the entries <= the bottleneck: O(R^3 log R).
    """
    return bottleneck_matchings(np.asarray(cost)[None])[0]


def bottleneck_matchings(costs: np.ndarray) -> list[tuple[float, np.ndarray]]:
    """`bottleneck_matching` of each matrix of a (P, R, R) stack. The binary searches run in
    lockstep, each step one batch of perfect-matching tests, then one assignment per matrix:
    a stack costs a few numpy calls per step instead of a few per matrix and step (a plan
    needs thousands of 8 x 8 matchings)."""
    floors = _floors(costs)
    todo = np.flatnonzero(~_fits(costs, floors))
    if len(todo):
        # No matching can beat the floor and one at the floor is the common case (tested
        # above); the others search the sorted entries above it, the largest always fitting.
        values, lo, hi = _distinct_above(costs[todo], floors[todo])
        while (active := np.flatnonzero(lo < hi)).size:
            mid = (lo[active] + hi[active]) // 2
            fits = _fits(costs[todo[active]], values[active, mid])
            hi[active[fits]] = mid[fits]
            lo[active[~fits]] = mid[~fits] + 1
        floors[todo] = values[np.arange(len(todo)), lo]
    # among the matchings within the bottleneck, the least total cost (the others priced out)
    priced = np.where(costs <= floors[:, None, None], costs, _BIG)
    return [(f, linear_sum_assignment(m)[1]) for f, m in zip(floors.tolist(), priced)]


def _distinct_above(costs: np.ndarray, floors: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each matrix's distinct entries, ascending, padded with its largest: (P, R^2) values, and
    (P,) the index of the first above its floor and of its largest (links by region: few
    distinct values, so few search steps)."""
    p = len(costs)
    flat = np.sort(costs.reshape(p, -1), axis=1)
    new = np.ones(flat.shape, dtype=bool)
    new[:, 1:] = flat[:, 1:] > flat[:, :-1]
    rank = np.cumsum(new, axis=1) - 1  # index of each entry's value among the distinct ones
    values = np.repeat(flat[:, -1:], flat.shape[1], axis=1)
    values[np.nonzero(new)[0], rank[new]] = flat[new]
    return values, (new & (flat <= floors[:, None])).sum(axis=1), rank[:, -1]


def _floors(costs: np.ndarray) -> np.ndarray:
    """(P,) max(largest row minimum, largest column minimum) of each (R, R) matrix: no perfect
    matching can beat it, and on clustered networks it is usually feasible."""
    return np.maximum(costs.min(axis=2).max(axis=1), costs.min(axis=1).max(axis=1))


def _fits(costs: np.ndarray, limits: np.ndarray) -> np.ndarray:
    """(P,) whether each (R, R) matrix has a perfect matching using only entries <= its
    limit: by Hall's condition for small R, Hopcroft-Karp for big R (O(E sqrt(R)) each), else
    by one linear assignment each with the other entries priced out (there is one iff no
    priced-out entry is chosen)."""
    p, r, _ = costs.shape
    allowed = costs <= limits[:, None, None]
    if r <= HALL_UP_TO:
        return _hall(allowed)
    if r > HOPCROFT_KARP_FROM:
        return np.array([(maximum_bipartite_matching(csr_matrix(a), perm_type="column") >= 0)
                         .all() for a in allowed], dtype=bool)
    cols = np.stack([linear_sum_assignment(m)[1]
                     for m in np.where(allowed, costs, _BIG)])  # (P, R): rows are 0..R-1
    return allowed[np.arange(p)[:, None], np.arange(r), cols].all(axis=1)


PREFETCH_ENTRIES = 1 << 21
"""Pairs matched in one lockstep batch hold at most about this many entries (8 bytes each)."""
HALL_UP_TO = 10
"""Up to this many rows, perfect-matching tests check Hall's condition on all 2^R row sets."""


def _hall(allowed: np.ndarray) -> np.ndarray:
    """(P,) whether each (R, R) boolean matrix has a perfect matching: every set of rows
    reaches at least as many columns (Hall), all 2^R sets of all P matrices at once."""
    p, r, _ = allowed.shape
    row_cols = (allowed.astype(np.int64) << np.arange(r)).sum(axis=2)  # (P, R) column bits
    reach = np.zeros((p, 1), dtype=np.int64)  # column bits reached by each set of rows
    for i in range(r):  # set k holds row i iff bit i of k: the sets without it, then with it
        reach = np.concatenate([reach, reach | row_cols[:, i:i + 1]], axis=1)
    count = _popcounts(r)
    return (count[reach] >= count).all(axis=1)


@lru_cache(maxsize=4)
def _popcounts(r: int) -> np.ndarray:
    """(2^R,) the number of set bits of 0 .. 2^R - 1 (a set's size, a column set's count)."""
    return np.array([bin(k).count("1") for k in range(1 << r)], dtype=np.int64)


def best_path(edge: np.ndarray) -> list[int]:
    """Open path through all nodes minimising the sum of symmetric `edge` costs.

    Exact (Held-Karp, O(2^S S^2)) for S <= 10; nearest-neighbour from every start plus 2-opt
    beyond that.
    """
    n = len(edge)
    if n <= 2:
        return list(range(n))
    if n <= 10:
        return _held_karp_path(edge)
    return _two_opt_path(edge)


@lru_cache(maxsize=16)
def _held_karp_layers(n: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """For each subset size k >= 2: every (subset mask, last node j in it, mask without j)."""
    layers = []
    for k in range(2, n + 1):
        masks, ends = [], []
        for combo in combinations(range(n), k):
            mask = sum(1 << j for j in combo)
            masks.extend([mask] * k)
            ends.extend(combo)
        m, j = np.array(masks), np.array(ends)
        layers.append((m, j, m ^ (1 << j)))
    return layers


def _held_karp_path(edge: np.ndarray) -> list[int]:
    """Exact open path by dynamic programming over subsets, one numpy step per subset size."""
    n = len(edge)
    full = 1 << n
    dp = np.full((full, n), np.inf)
    parent = np.full((full, n), -1, dtype=np.int64)
    dp[1 << np.arange(n), np.arange(n)] = 0.0
    for masks, ends, prevs in _held_karp_layers(n):
        cand = dp[prevs] + edge[:, ends].T  # (pairs, n): come to `end` from each node
        k = np.argmin(cand, axis=1)
        dp[masks, ends] = cand[np.arange(len(k)), k]
        parent[masks, ends] = k
    mask, j = full - 1, int(np.argmin(dp[full - 1]))
    path = []
    while j >= 0:
        path.append(j)
        mask, j = mask ^ (1 << j), int(parent[mask, j])
    return path[::-1]


def _path_cost(edge: np.ndarray, path: list[int]) -> float:
    return float(sum(edge[a, b] for a, b in zip(path, path[1:])))


def _two_opt_path(edge: np.ndarray) -> list[int]:
    n = len(edge)
    best, best_cost = list(range(n)), np.inf
    for start in range(n):
        path, left = [start], set(range(n)) - {start}
        while left:
            nxt = min(left, key=lambda k: edge[path[-1], k])
            path.append(nxt)
            left.remove(nxt)
        path = _two_opt(edge, path)
        cost = _path_cost(edge, path)
        if cost < best_cost:
            best, best_cost = path, cost
    return best


@lru_cache(maxsize=16)
def _segment_pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Every segment [i, j] that 2-opt may reverse, 1 <= i < j <= n-1, in sweep order."""
    i, j = np.triu_indices(n, 1)
    keep = i >= 1
    return i[keep], j[keep]


def _two_opt(edge: np.ndarray, path: list[int]) -> list[int]:
    """First-improvement 2-opt on an open path with symmetric costs: sweep the segments in
    order, reverse the first one that shortens the path (only its two end edges change), go on
    from the next segment; sweep again until a sweep finds nothing. Each step scores every
    remaining segment at once."""
    p = np.array(path)
    n = len(p)
    seg_i, seg_j = _segment_pairs(n)
    improved = True
    while improved:
        improved = False
        k = 0
        while k < len(seg_i):
            i, j = seg_i[k:], seg_j[k:]
            after = np.minimum(j + 1, n - 1)
            delta = edge[p[i - 1], p[j]] - edge[p[i - 1], p[i]] + np.where(
                j + 1 < n, edge[p[i], p[after]] - edge[p[j], p[after]], 0.0)
            hits = np.flatnonzero(delta < -1e-12)
            if not len(hits):
                break
            k += int(hits[0])
            a, b = int(seg_i[k]), int(seg_j[k])
            p[a:b + 1] = p[a:b + 1][::-1].copy()
            improved = True
            k += 1
    return [int(x) for x in p]


class PairCache:
    """Bottleneck matchings between stage groups, cached by the groups' device sets.

    `t_act` gives the time to send one boundary's activations from row to column (an (N, N)
    matrix or LinkCosts). The cost of putting group b after group a is the bottleneck over the
    matching of the round trip t_act[a_i, b_j] + t_act[b_j, a_i] (forward activations plus
    backward gradients). With ClassCosts (large swarms) the matching is a transport plan
    between the groups' link-class counts (class_matching.py), cached by those counts.
    """

    def __init__(self, t_act: np.ndarray | LinkCosts, max_entries: int = 200_000) -> None:
        self.costs = as_link_costs(t_act)
        self._round_trip = self.costs.round_trip()  # forward activations + backward gradients
        self.max_entries = max_entries
        self._cache: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[float, np.ndarray]] = {}
        self._classes = ClassPlans(self._round_trip) \
            if isinstance(self._round_trip, ClassCosts) else None

    @property
    def t_act(self) -> np.ndarray:
        """The (N, N) activation times (built from classes when the costs are by class)."""
        return self.costs.dense()

    def pair(self, a: tuple[int, ...], b: tuple[int, ...]) -> tuple[float, np.ndarray]:
        """(cost, cols): a[i] feeds b[cols[i]]; `a` and `b` are sorted device tuples."""
        flip = b < a
        key = (b, a) if flip else (a, b)
        hit = self._cache.get(key)
        if hit is None:
            rows, cols = np.array(key[0]), np.array(key[1])
            hit = self._classes.match(rows, cols) if self._classes is not None else \
                bottleneck_matching(self._round_trip.block(rows, cols))
            self._keep(key, hit)
        if not flip:
            return hit
        inverse = np.empty_like(hit[1])
        inverse[hit[1]] = np.arange(len(hit[1]))
        return hit[0], inverse

    def _keep(self, key: tuple[tuple[int, ...], tuple[int, ...]],
              hit: tuple[float, np.ndarray]) -> None:
        if len(self._cache) >= self.max_entries:
            self._cache.clear()
        self._cache[key] = hit

    def prefetch(self, pairs: Iterable[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        """Match every pair of (equal-sized) groups not cached yet, all at once: the same
        results as `pair` one by one, in fewer numpy calls (by class: nothing to do here)."""
        if self._classes is not None:
            return
        keys = list(dict.fromkeys((b, a) if b < a else (a, b) for a, b in pairs))
        keys = [k for k in keys if k not in self._cache]
        if len(keys) < 2:
            return
        r = len(keys[0][0])
        step = max(1, PREFETCH_ENTRIES // (r * max(r, 1 << min(r, HALL_UP_TO))))
        for first in range(0, len(keys), step):  # bounded memory: P x R x max(R, 2^R)
            chunk = keys[first: first + step]
            rows, cols = np.array([k[0] for k in chunk]), np.array([k[1] for k in chunk])
            costs = self._round_trip.at(rows[:, :, None], cols[:, None, :])  # (P, R, R)
            for key, hit in zip(chunk, bottleneck_matchings(costs)):
                self._keep(key, hit)

    def pair_cost(self, a: tuple[int, ...], b: tuple[int, ...]) -> float:
        """The bottleneck of `pair(a, b)` (by class: without matching the devices)."""
        if self._classes is None or (a, b) in self._cache or (b, a) in self._cache:
            return self.pair(a, b)[0]
        return self._classes.bottleneck(np.array(a), np.array(b))

    def edge_matrix(self, groups: list[tuple[int, ...]]) -> np.ndarray:
        """(S, S) symmetric matrix of pair costs between all groups."""
        s = len(groups)
        self.prefetch((groups[i], groups[j]) for i in range(s) for j in range(i + 1, s))
        edge = np.zeros((s, s))
        for i in range(s):
            for j in range(i + 1, s):
                edge[i, j] = edge[j, i] = self.pair_cost(groups[i], groups[j])
        return edge

    def chains(self, groups: list[tuple[int, ...]]) -> np.ndarray:
        """(R, S) pipelines for groups already in stage order, following the matchings."""
        r = len(groups[0])
        out = np.empty((r, len(groups)), dtype=np.int64)
        pos = np.arange(r)  # index into the current group held by each replica
        out[:, 0] = groups[0]
        for s in range(1, len(groups)):
            _, cols = self.pair(groups[s - 1], groups[s])
            pos = cols[pos]
            out[:, s] = np.array(groups[s])[pos]
        return out

    def order(self, groups: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """The groups reordered along the cheapest open path."""
        if len(groups) <= 2:
            return list(groups)
        return [groups[k] for k in best_path(self.edge_matrix(groups))]
