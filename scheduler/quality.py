"""The quality side of `plan --sync auto`: the validation loss a sync configuration reaches,
relative to allreduce's after the same tokens, looked up in a small table measured on this
project's own convergence runs (benchmarks/diloco_convergence.py, from scratch). Pure.

What the table holds: LOSS_TABLE[H] = ((warm-up steps W, loss ratio), ...), the mean over seeds
of DiLoCo's final validation loss over allreduce's in runs of MEASURED_STEPS steps (4 replicas,
gpt-tiny, fp32 payload, blocking outer step, one fragment; see PROVENANCE and
docs/bad_links.md). The warm-up a run needs is a number of steps, not a share of the run: W = 80
closed the gap at 400 steps (H = 10: 1.000) and still at 1,200 (H = 10: 1.004), where a share
would have asked for 240. Its limits, which `loss_ratio` applies rather than hides:
- Runs of MEASURED_STEPS or more (to LONGEST_CHECKED = 1,200 steps checked; longer ones are
  assumed to need no more warm-up, not measured) take W as it is. A shorter run is still in
  the fast early part of training: its W counts as W x MEASURED_STEPS / T (the share rule,
  which the 30-step lab rows of docs/bad_links.md measured within 1%).
- H between measured values (and between allreduce, H = 1, ratio 1, and the smallest) is
  interpolated linearly; an H above the largest measured one has no prediction (None): the
  planner does not choose it.
- A warm-up between measured ones takes the next smaller measured one (the conservative side:
  a longer warm-up was never seen to hurt); one below every measured one has no prediction.
- The data-parallel payload, overlap and fragments are taken as the blocking fp32 value (the
  30-step lab rows of docs/bad_links.md show them within 1% of it; not measured from scratch),
  and the replica count as 4.
"""

from __future__ import annotations

import math
from bisect import bisect_right

from formats.plan import SyncConfig

MEASURED_STEPS = 400
"""Run length (steps) LOSS_TABLE was measured at."""
LONGEST_CHECKED = 1200
"""Longest run whose warm-up was checked against the table (H = 10, W = 80: 1.004, seed 0)."""
LOSS_TABLE: dict[int, tuple[tuple[int, float], ...]] = {
    10: ((0, 1.247), (40, 1.050), (60, 1.037), (80, 1.000)),
    20: ((0, 1.250), (40, 1.038), (80, 1.010)),
}
"""H -> ((warm-up steps W in a MEASURED_STEPS-step run, loss ratio to allreduce), ...), W
ascending. Means over seeds 0, 1, 2 at H = 10 W = 60 and 80 and H = 20 W = 80; seed 0
elsewhere (docs/bad_links.md has every row)."""
PROVENANCE = ("benchmarks/diloco_convergence.py --warm-start-steps 0 --steps 400 --replicas 4 "
              "(gpt-tiny on Debian fortunes, batch 8 x 64 per replica, AdamW lr 1e-3 cosine), "
              "and --steps 1200 for H 10 W 80; measured 2026-11-25 on the project's 2-core CPU "
              "box (docs/bad_links.md)")
"""Where LOSS_TABLE's numbers come from."""


def warmup_options(inner_steps: int, train_steps: int) -> tuple[int, ...]:
    """The warm-ups measured for this H (or for the next larger measured H), in steps of a run
    of `train_steps` (fewer in a run shorter than MEASURED_STEPS, rounded up; at most the run)."""
    larger = [h for h in sorted(LOSS_TABLE) if h >= inner_steps]
    if not larger:
        return ()
    scale = min(1.0, train_steps / MEASURED_STEPS)
    return tuple(sorted({min(math.ceil(w * scale - 1e-9), train_steps)
                         for w, _ in LOSS_TABLE[larger[0]]}))


def measured_warmup(warmup_steps: int, train_steps: int) -> float:
    """The warm-up of a run of `train_steps` in the table's terms: its steps, or for a run
    shorter than MEASURED_STEPS the same share of a MEASURED_STEPS-step run."""
    return max(warmup_steps, 0) * max(1.0, MEASURED_STEPS / max(train_steps, 1))


def _ratio_at(h: int, warmup: float) -> float | None:
    """The measured ratio of H = h at the largest measured warm-up <= `warmup` (None: below
    every measured one)."""
    rows = LOSS_TABLE[h]
    i = bisect_right([w for w, _ in rows], warmup + 1e-6) - 1
    return rows[i][1] if i >= 0 else None


def loss_ratio(sync: SyncConfig, train_steps: int) -> float | None:
    """Predicted final validation loss over allreduce's after the same tokens, for a run of
    `train_steps` steps under `sync` (1.0 for allreduce, never below it; None: outside the
    table)."""
    if sync.mode != "diloco":
        return 1.0
    if sync.warmup_steps >= train_steps:
        return 1.0  # the whole run is the warm-up: allreduce
    warmup = measured_warmup(sync.warmup_steps, train_steps)
    measured = sorted(LOSS_TABLE)
    h = sync.inner_steps
    if h > measured[-1]:
        return None
    hi = next(m for m in measured if m >= h)
    lo = max((m for m in measured if m < h), default=1)
    r_hi = _ratio_at(hi, warmup)
    r_lo = 1.0 if lo == 1 else _ratio_at(lo, warmup)
    if r_hi is None or r_lo is None:
        return None
    # never below allreduce's: a measured ratio under 1 is read as noise, so ties keep allreduce
    return max(1.0, r_lo + (r_hi - r_lo) * (h - lo) / (hi - lo))
