"""Bottleneck matching between two stage groups by link class, for swarms of thousands.

Devices of one link class have the same links, so a perfect matching between two groups of R
devices is, up to which device of a class takes which slot, a transport plan between their
class counts: flow[k, l] devices of class k feed devices of class l. The bottleneck (the
slowest pair used) is found by binary search over the few distinct class-pair costs, each step
a max-flow feasibility test on a graph of K_a + K_b nodes; among the plans that reach it the
cheapest in total is a small linear programme (a transport problem: its optimal vertex is
integral). O(K_a K_b) work instead of the O(R^3) assignments of matching.py, whatever R is.
Exceptions by pair are left out here (the matching only proposes chains; the objective scores
them with every exception).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from scheduler.link_costs import ClassCosts


def _feasible(allowed: np.ndarray, supply: np.ndarray, demand: np.ndarray) -> bool:
    """Whether a transport plan using only `allowed` class pairs moves every unit."""
    a, b = allowed.shape
    src, dst = np.nonzero(allowed)
    total = int(supply.sum())
    sink = a + b + 1
    rows = np.concatenate([np.zeros(a, dtype=np.int64), 1 + src, 1 + a + np.arange(b)])
    cols = np.concatenate([1 + np.arange(a), 1 + a + dst, np.full(b, sink)])
    caps = np.concatenate([supply, np.full(len(src), total), demand]).astype(np.int32)
    graph = csr_matrix((caps, (rows, cols)), shape=(sink + 1, sink + 1))
    return int(maximum_flow(graph, 0, sink).flow_value) == total


def bottleneck_transport(cost: np.ndarray, supply: np.ndarray, demand: np.ndarray
                         ) -> tuple[float, np.ndarray]:
    """(bottleneck, allowed): the smallest limit such that every unit can move on class pairs
    of cost <= limit, and the (K_a, K_b) mask of those pairs. supply/demand: units per class,
    equal totals."""
    values = np.unique(cost)
    # No plan beats the largest row or column minimum; on clustered networks it is feasible.
    floor = max(cost.min(axis=1).max(), cost.min(axis=0).max())
    lo, hi = int(np.searchsorted(values, floor)), len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _feasible(cost <= values[mid], supply, demand):
            hi = mid
        else:
            lo = mid + 1
    return float(values[lo]), cost <= values[lo]


def cheapest_transport(cost: np.ndarray, allowed: np.ndarray, supply: np.ndarray,
                       demand: np.ndarray) -> np.ndarray:
    """(K_a, K_b) integral transport plan of least total cost using only `allowed` pairs."""
    a, b = cost.shape
    src, dst = np.nonzero(allowed)
    eq = np.zeros((a + b, len(src)))
    eq[src, np.arange(len(src))] = 1.0
    eq[a + dst, np.arange(len(src))] = 1.0
    result = linprog(cost[src, dst], A_eq=eq, b_eq=np.concatenate([supply, demand]),
                     bounds=(0, None), method="highs-ds")
    flow = np.zeros((a, b), dtype=np.int64)
    flow[src, dst] = np.rint(result.x).astype(np.int64)
    assert result.status == 0 and (flow.sum(axis=1) == supply).all() \
        and (flow.sum(axis=0) == demand).all(), "a transport vertex must be integral"
    return flow


def expand_flow(row_of_a: np.ndarray, col_of_b: np.ndarray, flow: np.ndarray) -> np.ndarray:
    """Device matching from a class plan: `row_of_a[i]` is the flow row of a's i-th device,
    `col_of_b[j]` the flow column of b's j-th; returns cols with a[i] feeding b[cols[i]]
    (inside a class, devices pair up in their order)."""
    rows, cols = np.nonzero(flow)  # row-major: unit rows come out sorted
    counts = flow[rows, cols]
    unit_row, unit_col = np.repeat(rows, counts), np.repeat(cols, counts)
    slot_a = np.argsort(row_of_a, kind="stable")  # a's devices in unit_row's order
    slot_b = np.empty(len(unit_col), dtype=np.int64)
    slot_b[np.argsort(unit_col, kind="stable")] = np.argsort(col_of_b, kind="stable")
    out = np.empty(len(row_of_a), dtype=np.int64)
    out[slot_a] = slot_b
    assert (row_of_a[slot_a] == unit_row).all() and (col_of_b[slot_b] == unit_col).all(), \
        "the class plan must move exactly the groups' class counts"
    return out


Signature = tuple[bytes, bytes, bytes, bytes]
"""Two groups' classes and counts: what a class plan depends on."""


class ClassPlans:
    """Class-level bottlenecks and transport plans between groups, cached by class counts."""

    def __init__(self, round_trip: ClassCosts, max_entries: int = 200_000) -> None:
        self.round_trip, self.max_entries = round_trip, max_entries
        self._bottlenecks: dict[Signature, tuple[float, np.ndarray]] = {}
        self._flows: dict[Signature, np.ndarray] = {}

    def _classes(self, a: np.ndarray, b: np.ndarray) -> tuple[Signature, tuple[np.ndarray, ...]]:
        ka, row_of_a = np.unique(self.round_trip.link_class[a], return_inverse=True)
        kb, col_of_b = np.unique(self.round_trip.link_class[b], return_inverse=True)
        supply, demand = np.bincount(row_of_a), np.bincount(col_of_b)
        key = (ka.tobytes(), supply.tobytes(), kb.tobytes(), demand.tobytes())
        return key, (ka, kb, supply, demand, row_of_a.reshape(-1), col_of_b.reshape(-1))

    def _bottleneck(self, key: Signature, ka: np.ndarray, kb: np.ndarray, supply: np.ndarray,
                    demand: np.ndarray) -> tuple[float, np.ndarray]:
        hit = self._bottlenecks.get(key)
        if hit is None:
            if len(self._bottlenecks) >= self.max_entries:
                self._bottlenecks.clear()
                self._flows.clear()
            hit = bottleneck_transport(self.round_trip.table[np.ix_(ka, kb)], supply, demand)
            self._bottlenecks[key] = hit
        return hit

    def bottleneck(self, a: np.ndarray, b: np.ndarray) -> float:
        """The bottleneck round trip of the best matching of group a to group b."""
        key, (ka, kb, supply, demand, _, _) = self._classes(a, b)
        return self._bottleneck(key, ka, kb, supply, demand)[0]

    def match(self, a: np.ndarray, b: np.ndarray) -> tuple[float, np.ndarray]:
        """(bottleneck, cols): a[i] feeds b[cols[i]], cheapest in total among the matchings
        that reach the bottleneck (as matching.bottleneck_matching, by class)."""
        key, (ka, kb, supply, demand, row_of_a, col_of_b) = self._classes(a, b)
        limit, allowed = self._bottleneck(key, ka, kb, supply, demand)
        flow = self._flows.get(key)
        if flow is None:
            flow = cheapest_transport(self.round_trip.table[np.ix_(ka, kb)], allowed, supply,
                                      demand)
            self._flows[key] = flow
        return limit, expand_flow(row_of_a, col_of_b, flow)
