"""Seconds per message on every link: as an (N, N) matrix, or by link class for large swarms.

The DT-FM cost and the search need, for one message size, the time t(i, j) to send it from
device i to device j. `DenseCosts` keeps t as an (N, N) matrix (the full form, and compact
clusters up to DENSE_LIMIT devices). `ClassCosts` keeps it as a (K, K) table between link
classes plus exceptions by pair (formats/links.py), so that a 10,000-device swarm in a few
regions never needs its 10^8 links: each lookup, group sum and mean below is computed from
class counts. Both answer the same questions with the same numbers (up to float rounding).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from formats.cluster import Cluster
from formats.links import LinkClasses, find_pairs

DENSE_LIMIT = 512
"""Compact clusters with more devices than this are planned by link class (ClassCosts): the
matching of two big stage groups costs O(K^2) there instead of O(R^3)."""

MessageTime = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""(latency_ms, bandwidth_gbps) -> seconds per message, elementwise."""


def by_class(cluster: Cluster) -> bool:
    """Whether the planner works on `cluster` by link class instead of N x N matrices."""
    return cluster.is_compact and cluster.num_devices > DENSE_LIMIT


class DenseCosts:
    """t(i, j) as an (N, N) matrix with a zero diagonal."""

    def __init__(self, matrix: np.ndarray) -> None:
        self.matrix = matrix

    @property
    def num_devices(self) -> int:
        """N."""
        return len(self.matrix)

    def at(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """t(src, dst) elementwise."""
        return self.matrix[src, dst]

    def block(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """(len(rows), len(cols)) times from every row device to every col device."""
        return self.matrix[np.asarray(rows)[:, None], np.asarray(cols)]

    def member_sums(self, groups: np.ndarray) -> np.ndarray:
        """(G, R): for each member of each group, the sum of t to the other members."""
        return self.matrix[groups[:, :, None], groups[:, None, :]].sum(axis=2)

    def group_mean(self, groups: np.ndarray) -> float:
        """Mean of t over all (i, j) in the same group, i == j (0) included."""
        return float(self.matrix[groups[:, :, None], groups[:, None, :]].mean())

    def block_mean(self, rows: np.ndarray, cols: np.ndarray) -> float:
        """Mean of t from the row devices to the (disjoint) col devices."""
        return float(self.matrix[np.ix_(rows, cols)].mean())

    def round_trip(self) -> DenseCosts:
        """t(i, j) + t(j, i)."""
        return DenseCosts(self.matrix + self.matrix.T)

    def classes(self) -> tuple[np.ndarray, np.ndarray]:
        """(link class of each device, (K, K) times between classes): here one per device."""
        return np.arange(self.num_devices), self.matrix

    def dense(self) -> np.ndarray:
        """The (N, N) matrix."""
        return self.matrix


class ClassCosts:
    """t(i, j) = table[cls[i], cls[j]] for i != j, except the listed pairs."""

    def __init__(self, link_class: np.ndarray, table: np.ndarray, pair_src: np.ndarray,
                 pair_dst: np.ndarray, pair_time: np.ndarray) -> None:
        self.link_class, self.table = link_class, table
        self.pair_src, self.pair_dst, self.pair_time = pair_src, pair_dst, pair_time
        self.keys = pair_src.astype(np.int64) * len(link_class) + pair_dst
        self.diag = np.diag(table).copy()
        # What an exception changes against its class entry, for the group sums.
        self.pair_delta = pair_time - table[link_class[pair_src], link_class[pair_dst]]

    @property
    def num_devices(self) -> int:
        """N."""
        return len(self.link_class)

    @property
    def num_classes(self) -> int:
        """K."""
        return len(self.table)

    def at(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """t(src, dst) elementwise (src != dst)."""
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        out = self.table[self.link_class[src], self.link_class[dst]]
        if len(self.keys):
            hit, where = find_pairs(self.keys, src * self.num_devices + dst)
            out[hit] = self.pair_time[where]
        return out

    def block(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """(len(rows), len(cols)) times from every row device to every (other) col device."""
        rows, cols = np.asarray(rows), np.asarray(cols)
        return self.at(np.repeat(rows[:, None], len(cols), axis=1),
                       np.repeat(cols[None, :], len(rows), axis=0))

    def counts(self, groups: np.ndarray) -> np.ndarray:
        """(G, K) how many members of each group are in each class."""
        g, k = groups.shape[0], self.num_classes
        flat = (np.arange(g)[:, None] * k + self.link_class[groups]).ravel()
        return np.bincount(flat, minlength=g * k).reshape(g, k).astype(float)

    def member_sums(self, groups: np.ndarray) -> np.ndarray:
        """(G, R): for each member of each group, the sum of t to the other members."""
        groups = np.asarray(groups, dtype=np.int64)
        cls = self.link_class[groups]
        per_class = self.counts(groups) @ self.table.T  # [g, k]: sum over members of t(k, .)
        sums = per_class[np.arange(len(groups))[:, None], cls] - self.diag[cls]
        if len(self.keys):
            slot = np.full(self.num_devices, -1)
            slot[groups.ravel()] = np.arange(groups.size)
            a, b = slot[self.pair_src], slot[self.pair_dst]
            width = groups.shape[1]
            same = (a >= 0) & (b >= 0) & (a // width == b // width)
            np.add.at(sums.reshape(-1), a[same], self.pair_delta[same])
        return sums

    def group_mean(self, groups: np.ndarray) -> float:
        """Mean of t over all (i, j) in the same group, i == j (0) included."""
        groups = np.asarray(groups)
        return float(self.member_sums(groups).sum() / (groups.size * groups.shape[1]))

    def block_mean(self, rows: np.ndarray, cols: np.ndarray) -> float:
        """Mean of t from the row devices to the (disjoint) col devices."""
        rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
        k = self.num_classes
        a = np.bincount(self.link_class[rows], minlength=k).astype(float)
        b = np.bincount(self.link_class[cols], minlength=k).astype(float)
        total = float(a @ self.table @ b)
        if len(self.keys):
            in_rows = np.zeros(self.num_devices, dtype=bool)
            in_cols = np.zeros(self.num_devices, dtype=bool)
            in_rows[rows], in_cols[cols] = True, True
            total += float(self.pair_delta[in_rows[self.pair_src] & in_cols[self.pair_dst]].sum())
        return total / (len(rows) * len(cols))

    def round_trip(self) -> ClassCosts:
        """t(i, j) + t(j, i)."""
        src = np.concatenate([self.pair_src, self.pair_dst])
        dst = np.concatenate([self.pair_dst, self.pair_src])
        _, first = np.unique(src * self.num_devices + dst, return_index=True)
        src, dst = src[first], dst[first]
        both = self.at(src, dst) + self.at(dst, src)
        return ClassCosts(self.link_class, self.table + self.table.T, src, dst, both)

    def classes(self) -> tuple[np.ndarray, np.ndarray]:
        """(link class of each device, (K, K) times between classes); exceptions left out."""
        return self.link_class, self.table

    def dense(self) -> np.ndarray:
        """The (N, N) matrix (large: for tests and small clusters)."""
        c = self.link_class
        out = self.table[np.ix_(c, c)]
        out[self.pair_src, self.pair_dst] = self.pair_time
        np.fill_diagonal(out, 0.0)
        return out


LinkCosts = DenseCosts | ClassCosts
"""Either representation; the search and the DT-FM cost accept both."""


def class_costs(classes: LinkClasses, time: MessageTime) -> ClassCosts:
    """ClassCosts of a message whose time on a link is time(latency_ms, bandwidth_gbps)."""
    with np.errstate(divide="ignore"):
        table = time(classes.latency_ms, classes.bandwidth_gbps)
        pairs = time(classes.pair_latency_ms, classes.pair_bandwidth_gbps)
    return ClassCosts(classes.link_class, table, classes.pair_src, classes.pair_dst, pairs)


def as_link_costs(costs: np.ndarray | LinkCosts) -> LinkCosts:
    """A matrix becomes DenseCosts; LinkCosts stay as they are."""
    if isinstance(costs, (DenseCosts, ClassCosts)):
        return costs
    return DenseCosts(np.asarray(costs))
