"""Topology-aware starting points: find the fast islands of a network and build plans around them.

Devices are ordered by hierarchical clustering of a symmetric link-cost matrix (leaf order puts
each island's devices next to each other). Cutting that order into consecutive runs gives two
structured plans: runs of S devices as pipeline chains (pipeline traffic stays inside islands)
and runs of R devices as stage groups (data-parallel traffic stays inside islands).
"""

from __future__ import annotations

import numpy as np
from scipy.cluster.hierarchy import fcluster, leaves_list, linkage
from scipy.spatial.distance import squareform

Groups = list[tuple[int, ...]]


def leaf_orders(link_costs: list[np.ndarray], devices: np.ndarray) -> list[np.ndarray]:
    """Device orders from average/complete/single linkage of each (N, N) link-cost matrix."""
    orders = [np.array(devices)]
    sub = np.ix_(devices, devices)
    for cost in link_costs:
        sym = cost[sub] + cost[sub].T
        sym = sym / max(float(sym.max()), 1e-30)
        np.fill_diagonal(sym, 0.0)
        condensed = squareform(sym, checks=False)
        for method in ("average", "complete", "single"):
            tree = linkage(condensed, method)
            leaves = np.asarray(devices)[leaves_list(tree)]
            orders.append(leaves)
            orders.extend(_islands_by_size(tree, leaves, devices))
    return orders


def _islands_by_size(tree: np.ndarray, leaves: np.ndarray, devices: np.ndarray,
                     cuts: int = 4) -> list[np.ndarray]:
    """Leaf order regrouped so that bigger islands come first, at a few cut heights."""
    out = []
    heights = np.unique(tree[:, 2])
    position = {int(d): k for k, d in enumerate(leaves)}
    for h in np.quantile(heights, np.linspace(0.1, 0.9, cuts)):
        label = dict(zip((int(d) for d in devices), fcluster(tree, h, criterion="distance")))
        size = {lab: sum(1 for v in label.values() if v == lab) for lab in set(label.values())}
        out.append(np.array(sorted((int(d) for d in leaves),
                                   key=lambda d: (-size[label[d]], label[d], position[d]))))
    return out


def chains_from_blocks(order: np.ndarray, num_stages: int, num_replicas: int,
                       block: int) -> np.ndarray:
    """Cut the order into pipeline segments of `block` stages; in each segment every chain takes
    `block` consecutive devices. block = S: whole chains inside islands; block = 1: whole stage
    groups inside islands; in between: island-sized pieces of chains, aligned across replicas.
    Returns the (R, S) chains."""
    chains = np.empty((num_replicas, num_stages), dtype=np.int64)
    pos = 0
    for first in range(0, num_stages, block):
        width = min(block, num_stages - first)
        seg = np.asarray(order[pos: pos + width * num_replicas]).reshape(num_replicas, width)
        chains[:, first: first + width] = seg
        pos += width * num_replicas
    return chains


def groups_from_blocks(order: np.ndarray, num_stages: int, num_replicas: int,
                       block: int) -> Groups:
    """The stage groups (sorted device tuples) of `chains_from_blocks`."""
    chains = chains_from_blocks(order, num_stages, num_replicas, block)
    return [tuple(sorted(int(d) for d in chains[:, s])) for s in range(num_stages)]


def structured_partitions(orders: list[np.ndarray], num_stages: int,
                          num_replicas: int) -> list[tuple[str, Groups]]:
    """Named structured partitions: every order cut with every block size."""
    out = []
    for k, order in enumerate(orders):
        for block in range(1, num_stages + 1):
            out.append((f"islands/order{k}/block{block}",
                        groups_from_blocks(order, num_stages, num_replicas, block)))
    return out
