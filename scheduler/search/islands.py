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

from scheduler.link_costs import ClassCosts, LinkCosts, as_link_costs

Groups = list[tuple[int, ...]]


def leaf_orders(link_costs: list[np.ndarray | LinkCosts], devices: np.ndarray
                ) -> list[np.ndarray]:
    """Device orders from average/complete/single linkage of each link-cost matrix (or
    LinkCosts). By link class (ClassCosts) the classes are clustered, each class standing for
    its devices, which follow one another in id order."""
    devices = np.asarray(devices)
    orders = [np.array(devices)]
    for cost in link_costs:
        points, members, table = _points(as_link_costs(cost), devices)
        if len(points) < 2:
            continue
        weights = np.array([len(m) for m in members], dtype=float) if members else \
            np.ones(len(points))
        sym = table + table.T
        sym = sym / max(float(sym.max()), 1e-30)
        np.fill_diagonal(sym, 0.0)
        condensed = squareform(sym, checks=False)
        for method in ("average", "complete", "single"):
            tree = linkage(condensed, method)
            leaves = leaves_list(tree)
            orders.append(_expand(leaves, points, members))
            orders.extend(_expand(o, points, members)
                          for o in _islands_by_size(tree, leaves, weights))
    return orders


def _points(cost: LinkCosts, devices: np.ndarray
            ) -> tuple[np.ndarray, list[np.ndarray] | None, np.ndarray]:
    """What gets clustered: (points, the devices each stands for, (P, P) costs between them);
    a point is a device (members None), or with ClassCosts a link class."""
    if isinstance(cost, ClassCosts):
        classes, table = cost.classes()
        points, which = np.unique(classes[devices], return_inverse=True)
        members = [devices[which.reshape(-1) == k] for k in range(len(points))]
        return points, members, table[np.ix_(points, points)]
    matrix = cost.dense()
    if len(devices) == len(matrix) and (devices == np.arange(len(matrix))).all():
        return devices, None, matrix  # all of them in id order: no copy of N^2 entries
    return devices, None, matrix[np.ix_(devices, devices)]


def _expand(order: np.ndarray, points: np.ndarray, members: list[np.ndarray] | None
            ) -> np.ndarray:
    """A device order from an order of point indices."""
    if members is None:
        return points[order]
    return np.concatenate([members[k] for k in order])


def _islands_by_size(tree: np.ndarray, leaves: np.ndarray, weights: np.ndarray,
                     cuts: int = 4) -> list[np.ndarray]:
    """Leaf order (of point indices) regrouped so that bigger islands (more devices) come
    first, at a few cut heights."""
    out = []
    heights = np.unique(tree[:, 2])
    position = np.empty(len(leaves), dtype=np.int64)
    position[leaves] = np.arange(len(leaves))
    for h in np.quantile(heights, np.linspace(0.1, 0.9, cuts)):
        label = fcluster(tree, h, criterion="distance")
        size = np.bincount(label, weights=weights)
        out.append(np.lexsort((position, label, -size[label])))
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
    return stage_groups(chains)


def stage_groups(chains: np.ndarray) -> Groups:
    """The stage groups (sorted device tuples) of (R, S) chains: column s is group s."""
    return [tuple(col) for col in np.sort(np.asarray(chains), axis=0).T.tolist()]


def structured_partitions(orders: list[np.ndarray], num_stages: int,
                          num_replicas: int) -> list[tuple[str, Groups]]:
    """Named structured partitions: every order cut with every block size."""
    out = []
    for k, order in enumerate(orders):
        for block in range(1, num_stages + 1):
            out.append((f"islands/order{k}/block{block}",
                        groups_from_blocks(order, num_stages, num_replicas, block)))
    return out
