"""DiLoCo's warm-up (sync.warmup_steps W) in the cost of a whole run: its first W steps
all-reduce gradients (the allreduce step of the same assignment, payload and pipeline
compression), the other T - W are DiLoCo steps. The kernel replays one steady step of each;
this is their mix over the run. Pure: numbers in, numbers out.
"""

from __future__ import annotations

DEFAULT_TRAIN_STEPS = 1000
"""The run's length when nothing says otherwise: the runner's --steps default
(modules/config.DEFAULT_STEPS; the planner may not import the runtime)."""


def run_step_s(diloco_step_s: float, allreduce_step_s: float, warmup_steps: int,
               train_steps: int) -> float:
    """Mean step time over a run of `train_steps` whose first `warmup_steps` (at most all of
    them) take `allreduce_step_s` and the rest `diloco_step_s`."""
    if train_steps < 1:
        raise ValueError(f"train_steps must be >= 1, got {train_steps}")
    w = min(max(warmup_steps, 0), train_steps)
    return (w * allreduce_step_s + (train_steps - w) * diloco_step_s) / train_steps


def warmup_share(warmup_steps: int, train_steps: int) -> float:
    """Fraction of the run's steps spent in the warm-up (0..1)."""
    return min(max(warmup_steps, 0), train_steps) / max(train_steps, 1)
