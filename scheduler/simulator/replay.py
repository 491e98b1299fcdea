"""The vectorised replay of a GPipe step: numpy max-plus recurrences (what the planner calls).

A few hundred times faster than the event engine (events.py), which makes the timeline and
checks this one: the tests assert that both give the same times.
"""

from __future__ import annotations

import numpy as np

from scheduler.simulator.kernel import StepInputs, StepTimes, step_times


def fast_replay(t_fwd: np.ndarray, t_bwd: np.ndarray, fwd_tx: np.ndarray, fwd_lat: np.ndarray,
                bwd_tx: np.ndarray, bwd_lat: np.ndarray,
                num_micro_batches: int) -> tuple[np.ndarray, np.ndarray]:
    """GPipe step of every replica at once -> (end of last forward, end of last backward), each
    (R, S). Max-plus recurrences solved with cumulative maxima:
    end[m] = max(ready[m], end[m-1]) + t  <=>  end[m] = (m+1) t + cummax_k<=m(ready[k] - k t),
    and the same for a FIFO link (start[m] = max(ready[m], start[m-1] + tx)). O(R S m)."""
    r, s_count = t_fwd.shape
    k = np.arange(num_micro_batches, dtype=float)
    k1 = k + 1.0
    cummax = np.maximum.accumulate
    arrive = np.zeros((r, num_micro_batches))
    f_done = np.empty((r, s_count))
    for s in range(s_count):
        tf = t_fwd[:, s, None]
        end = k1 * tf + cummax(arrive - k * tf, axis=1)
        f_done[:, s] = end[:, -1]
        if s < s_count - 1:
            tx = fwd_tx[:, s, None]
            arrive = k * tx + cummax(end - k * tx, axis=1) + tx + fwd_lat[:, s, None]
    # Backward: index j is micro-batch m-1-j; the last stage's loss is ready after its forwards.
    arrive = np.zeros((r, num_micro_batches))
    b_done = np.empty((r, s_count))
    for s in range(s_count - 1, -1, -1):
        tb = t_bwd[:, s, None]
        ready = np.maximum(arrive, f_done[:, s, None])
        end = k1 * tb + cummax(ready - k * tb, axis=1)
        b_done[:, s] = end[:, -1]
        if s > 0:
            tx = bwd_tx[:, s - 1, None]
            arrive = k * tx + cummax(end - k * tx, axis=1) + tx + bwd_lat[:, s - 1, None]
    return f_done, b_done


def replay_fast(inputs: StepInputs) -> StepTimes:
    """The step time of `inputs` by the vectorised recurrences."""
    _, b_done = fast_replay(inputs.t_fwd, inputs.t_bwd, inputs.fwd_tx, inputs.fwd_lat,
                            inputs.bwd_tx, inputs.bwd_lat, inputs.num_micro_batches)
    return step_times(b_done, inputs.dp_times(), inputs)
