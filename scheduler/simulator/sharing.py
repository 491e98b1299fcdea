"""Ranks that share a host's cores (the CPU lab): processor sharing over whoever computes.

On the CPU lab every rank is a single-thread process on one machine of C cores. A rank that
computes alone runs at its own speed (the cluster's tflops: what one process measures alone);
when n ranks compute at once and n > C, each gets C/n of a core (C/(n + L) when L tasks of
other work always run beside them: the kernel shares the cores between sessions, and each
rank is a session of its own, scripts/launch_local.py). How many compute at once
depends on the plan: in a 1 x 8 data-parallel step all 8 do, in a pipeline the fill and drain
leave some idle, waiting on a transfer (and a rank that waits on the network takes no CPU).

The model is a fixed point of the replay: replay the GPipe step with every compute stretched
by k, take its concurrency profile n(t) (how many forwards/backwards run at each instant, by a
sweep over their intervals), and set k to the slowdown the work saw in it, weighted by work:
k = sum n dt f(n) / sum n dt with f(n) = max(1, (n + L)/C) (1 + g (n - 1)), where g (the
calibration's core_contention) is what each other rank computing at once costs beyond its
share of the cores (cache refills between more runnable processes: fitted to the speeds of 1,
2 and all N at once). Repeat until k settles. A plan whose ranks all compute at once gets
k = f(N) exactly (what a calibration with all N processes at once measures); a pipeline whose
ranks take turns gets less. It is a mean-field model (one k for the whole
step, not one per instant), kept because the planner replays it thousands of times.
"""

from __future__ import annotations

import numpy as np

MAX_ROUNDS = 30
"""Fixed-point rounds at most (k settles in a handful on the lab's plans)."""
TOLERANCE = 1e-3
"""Relative change of k under which the fixed point has settled."""


def compute_intervals(t_fwd: np.ndarray, t_bwd: np.ndarray, fwd_tx: np.ndarray,
                      fwd_lat: np.ndarray, bwd_tx: np.ndarray, bwd_lat: np.ndarray,
                      num_micro_batches: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of every forward and backward of a GPipe step, flat arrays: the same
    max-plus recurrences as replay.fast_replay, keeping every micro-batch's end."""
    r, s_count = t_fwd.shape
    k = np.arange(num_micro_batches, dtype=float)
    k1 = k + 1.0
    cummax = np.maximum.accumulate
    starts, ends = [], []
    arrive = np.zeros((r, num_micro_batches))
    f_done = np.empty((r, s_count))
    for s in range(s_count):
        tf = t_fwd[:, s, None]
        end = k1 * tf + cummax(arrive - k * tf, axis=1)
        starts.append(end - tf)
        ends.append(end)
        f_done[:, s] = end[:, -1]
        if s < s_count - 1:
            tx = fwd_tx[:, s, None]
            arrive = k * tx + cummax(end - k * tx, axis=1) + tx + fwd_lat[:, s, None]
    arrive = np.zeros((r, num_micro_batches))
    for s in range(s_count - 1, -1, -1):
        tb = t_bwd[:, s, None]
        ready = np.maximum(arrive, f_done[:, s, None])
        end = k1 * tb + cummax(ready - k * tb, axis=1)
        starts.append(end - tb)
        ends.append(end)
        if s > 0:
            tx = bwd_tx[:, s - 1, None]
            arrive = k * tx + cummax(end - k * tx, axis=1) + tx + bwd_lat[:, s - 1, None]
    return np.concatenate([a.ravel() for a in starts]), np.concatenate([a.ravel() for a in ends])


def slowdown_at(n: np.ndarray | float, cores: float, load: float = 0.0,
                contention: float = 0.0) -> np.ndarray | float:
    """f(n): how much slower each of n ranks computing at once runs than one alone."""
    return np.maximum(1.0, (n + load) / cores) * (1.0 + contention * np.maximum(n - 1.0, 0.0))


def work_weighted_slowdown(starts: np.ndarray, ends: np.ndarray, cores: float,
                           load: float = 0.0, contention: float = 0.0) -> float:
    """The slowdown the work in these intervals sees when `cores` cores are shared equally by
    whoever runs at each instant, `load` other tasks always run and each rank computing at
    once costs the others `contention`: sum n dt f(n) / sum n dt over the sweep's pieces."""
    times = np.concatenate([starts, ends])
    steps = np.concatenate([np.ones_like(starts), -np.ones_like(ends)])
    order = np.lexsort((steps, times))  # at a tie, ends (-1) before starts: no false overlap
    n = np.cumsum(steps[order])[:-1]
    dt = np.diff(times[order])
    work = float(np.sum(n * dt))
    if work <= 0.0:
        return 1.0
    return float(np.sum(n * dt * slowdown_at(n, cores, load, contention))) / work


def core_slowdown(t_fwd: np.ndarray, t_bwd: np.ndarray, fwd_tx: np.ndarray, fwd_lat: np.ndarray,
                  bwd_tx: np.ndarray, bwd_lat: np.ndarray, num_micro_batches: int,
                  cores: float, load: float = 0.0, contention: float = 0.0) -> float:
    """The factor k >= 1 that stretches every compute of the step when its ranks share
    `cores` cores with `load` other always-running tasks and `contention` (the fixed point
    described in the module docstring)."""
    ranks = t_fwd.size
    # From everyone computing at once (the most k can be) downwards: stretching the compute
    # against fixed transfers overlaps the ranks more, so k's map is increasing and the
    # iterates fall monotonically to the largest fixed point (exact in one round when the
    # transfers are free: the profile then scales with k).
    slow = float(slowdown_at(float(ranks), cores, load, contention))
    for _ in range(MAX_ROUNDS):
        starts, ends = compute_intervals(t_fwd * slow, t_bwd * slow, fwd_tx, fwd_lat, bwd_tx,
                                         bwd_lat, num_micro_batches)
        new = work_weighted_slowdown(starts, ends, cores, load, contention)
        if abs(new - slow) <= TOLERANCE * slow:
            return new
        slow = new
    return slow
