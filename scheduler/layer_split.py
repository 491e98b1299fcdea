"""How many layers each pipeline stage holds: a contiguous split chosen by dynamic programming.

With GPipe, m micro-batches and per-micro-batch stage times c_s, a pipeline step takes about
(m - 1) * max_s c_s + sum_s c_s (plus transfers). So the split first minimises the largest
stage cost (min-max over contiguous splits, exact DP), then, among the splits that reach it,
the sum of stage costs (a second exact DP capped at that maximum). The caller fills
`stage_cost[s, a, b]` = cost of stage s holding layers [a, b): compute on the group's slowest
device, its share of the data-parallel sync, and inf where the stage does not fit in the group's
smallest memory. O(S L^2) numpy work for S stages and L layers (L = 24, S = 8: ~50 us).
"""

from __future__ import annotations

import numpy as np

from formats.errors import UserError
from formats.models import ModelSpec


def flops_table(model: ModelSpec) -> np.ndarray:
    """(L+1, L+1) forward FLOPs per token of a stage [a, b) at [a, b]; 0 where b <= a."""
    n = model.num_layers
    prefix = np.arange(n + 1, dtype=float) * model.layer_flops_per_token()
    table = prefix[None, :] - prefix[:, None]
    table[:, n] += model.head_flops_per_token()
    table[np.tril_indices(n + 1)] = 0.0
    return table


def params_table(model: ModelSpec) -> np.ndarray:
    """(L+1, L+1) parameters of a stage [a, b) at [a, b]; 0 where b <= a."""
    n = model.num_layers
    table = np.zeros((n + 1, n + 1))
    for a in range(n):
        for b in range(a + 1, n + 1):
            table[a, b] = model.stage_params(a, b)
    return table


def bounds_to_stages(bounds: list[int] | np.ndarray) -> list[tuple[int, int]]:
    """[0, b1, ..., L] -> [(0, b1), (b1, b2), ...]."""
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def split_layers(stage_cost: np.ndarray) -> tuple[list[tuple[int, int]], float]:
    """Best contiguous split for `stage_cost` (S, L+1, L+1): min-max, then min-sum among those.

    Returns (stages, max stage cost), or ([], inf) when no split keeps every stage finite
    (e.g. nothing fits in memory).
    """
    s_count, n1, _ = stage_cost.shape
    n = n1 - 1
    if s_count > n:
        raise UserError(f"stages: {s_count} stages cannot split {n} layers")
    cost = np.where(np.triu(np.ones((n1, n1), dtype=bool), 1)[None], stage_cost, np.inf)
    # Pass 1: best[b] = smallest possible max cost of stages 0..s covering layers [0, b).
    best = np.full(n1, np.inf)
    best[0] = 0.0
    for s in range(s_count):
        best = np.maximum(best[:, None], cost[s]).min(axis=0)
    worst = float(best[n])
    if not np.isfinite(worst):
        return [], np.inf
    # Pass 2: among splits whose every stage stays <= worst, the smallest sum; keep the argmin.
    capped = np.where(cost <= worst * (1 + 1e-9) + 1e-15, cost, np.inf)
    total = np.full(n1, np.inf)
    total[0] = 0.0
    choice = np.zeros((s_count, n1), dtype=np.int64)
    for s in range(s_count):
        cand = total[:, None] + capped[s]
        choice[s] = cand.argmin(axis=0)
        total = cand[choice[s], np.arange(n1)]
    bounds = [n]
    for s in range(s_count - 1, -1, -1):
        bounds.append(int(choice[s, bounds[-1]]))
    assert bounds[-1] == 0, "layer split backtrack must end at layer 0"
    return bounds_to_stages(bounds[::-1]), worst


def even_split(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Layers split as evenly as possible, earlier stages taking the remainder."""
    if not 1 <= num_stages <= num_layers:
        raise UserError(f"stages: {num_stages} stages cannot split {num_layers} layers "
                        f"(need 1 <= stages <= layers)")
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return bounds_to_stages(bounds)


def stage_replica_shapes(num_devices: int, num_layers: int) -> list[tuple[int, int]]:
    """Every (stages, replicas) with stages x replicas = num_devices and stages <= num_layers."""
    return [(s, num_devices // s) for s in range(1, min(num_devices, num_layers) + 1)
            if num_devices % s == 0]
