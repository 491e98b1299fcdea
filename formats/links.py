"""Links by class: devices of one link class have the same links to every other device.

A large swarm has few kinds of links: one per pair of regions, changed for the few devices on a
slower access line and for a few measured pairs. `LinkClasses` holds that as arrays: the class of
each device, a (K, K) latency and bandwidth table between classes, and the exceptions by pair.
Link i -> j (i != j, row = sender) is the class table at (link_class[i], link_class[j]) unless
(i, j) is an exception. A full cluster/1 file is the case K = N (class i = device i) with no
exceptions, so code written against LinkClasses serves both forms; the N x N matrices are built
(`dense`) only when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LinkClasses:
    """Every link of N devices as K link classes plus exceptions by pair."""

    link_class: np.ndarray
    """(N,) int: the link class of each device, indexed by device id."""
    latency_ms: np.ndarray
    """(K, K) one-way latency in ms from a device of class row to another device of class col."""
    bandwidth_gbps: np.ndarray
    """(K, K) bandwidth in Gbit/s between classes, same indexing; inf where no two devices can
    use the entry (a class of one device, to itself)."""
    pair_src: np.ndarray
    """(P,) int: sender of each exception, sorted by (src, dst)."""
    pair_dst: np.ndarray
    """(P,) int: receiver of each exception."""
    pair_latency_ms: np.ndarray
    """(P,) latency of each exception in ms."""
    pair_bandwidth_gbps: np.ndarray
    """(P,) bandwidth of each exception in Gbit/s."""

    @property
    def num_devices(self) -> int:
        """N."""
        return len(self.link_class)

    @property
    def num_classes(self) -> int:
        """K."""
        return len(self.latency_ms)

    def pair_keys(self) -> np.ndarray:
        """(P,) sorted int64 keys src * N + dst of the exceptions (for searchsorted lookups)."""
        return self.pair_src.astype(np.int64) * self.num_devices + self.pair_dst

    def lookup(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(latency_ms, bandwidth_gbps) of the links src -> dst (arrays of device ids, src != dst
        elementwise), exceptions included."""
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        a, b = self.link_class[src], self.link_class[dst]
        lat, bw = self.latency_ms[a, b], self.bandwidth_gbps[a, b]
        hit, where = find_pairs(self.pair_keys(), src * self.num_devices + dst)
        if hit.any():
            lat, bw = lat.copy(), bw.copy()
            lat[hit], bw[hit] = self.pair_latency_ms[where], self.pair_bandwidth_gbps[where]
        return lat, bw

    def dense(self) -> tuple[np.ndarray, np.ndarray]:
        """The (N, N) latency (ms) and bandwidth (Gbit/s) matrices; diagonal 0 and inf."""
        c = self.link_class
        lat = self.latency_ms[np.ix_(c, c)]
        bw = self.bandwidth_gbps[np.ix_(c, c)]
        lat[self.pair_src, self.pair_dst] = self.pair_latency_ms
        bw[self.pair_src, self.pair_dst] = self.pair_bandwidth_gbps
        np.fill_diagonal(lat, 0.0)
        np.fill_diagonal(bw, np.inf)
        return lat, bw


def find_pairs(keys: np.ndarray, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which `query` keys are in the sorted `keys`: (mask shaped like query, index into keys of
    each hit, in query order)."""
    query = np.asarray(query, dtype=np.int64)
    if len(keys) == 0:
        return np.zeros(query.shape, dtype=bool), np.empty(0, dtype=np.int64)
    pos = np.minimum(np.searchsorted(keys, query), len(keys) - 1)
    hit = keys[pos] == query
    return hit, pos[hit]


def identity_classes(latency_ms: np.ndarray, bandwidth_gbps: np.ndarray) -> LinkClasses:
    """The full form as link classes: class i = device i, the matrices themselves (not copied)."""
    n = len(latency_ms)
    none_i, none_f = np.empty(0, dtype=np.int64), np.empty(0)
    return LinkClasses(np.arange(n), latency_ms, bandwidth_gbps, none_i, none_i, none_f, none_f)


def sorted_pairs(src: np.ndarray, dst: np.ndarray, latency_ms: np.ndarray,
                 bandwidth_gbps: np.ndarray, num_devices: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Exceptions sorted by (src, dst), as LinkClasses keeps them."""
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    order = np.argsort(src * num_devices + dst, kind="stable")
    return (src[order], dst[order], np.asarray(latency_ms, dtype=float)[order],
            np.asarray(bandwidth_gbps, dtype=float)[order])
