"""The quality side of `plan --sync auto`: the validation loss a sync configuration reaches,
relative to allreduce's after the same tokens, looked up in a small table measured on this
project's own convergence runs (benchmarks/diloco_convergence.py, from scratch). Pure.

What the table holds: LOSS_TABLE[H] = ((warm-up share of the run, loss ratio), ...), the mean
over seeds of DiLoCo's final validation loss over allreduce's (4 replicas, gpt-tiny, fp32
payload, blocking outer step, one fragment; see PROVENANCE and docs/bad_links.md). Its limits,
which `loss_ratio` applies rather than hides:
- H between measured values (and between allreduce, H = 1, ratio 1, and the smallest) is
  interpolated linearly; an H above the largest measured one has no prediction (None): the
  planner does not choose it.
- A warm-up share between measured ones takes the next smaller measured share (the
  conservative side: a longer warm-up was never seen to hurt); one below every measured
  share has no prediction.
- The data-parallel payload, overlap and fragments are taken as the blocking fp32 value (the
  30-step lab rows of docs/bad_links.md show them within 1% of it; not measured from scratch),
  and the replica count as 4.
"""

from __future__ import annotations

from bisect import bisect_right

from formats.plan import SyncConfig
from scheduler.simulator.warmup import warmup_share

LOSS_TABLE: dict[int, tuple[tuple[float, float], ...]] = {
    10: ((0.0, 1.247), (0.1, 1.050), (0.15, 1.037), (0.2, 1.000)),
    20: ((0.0, 1.250), (0.1, 1.038), (0.2, 1.010)),
}
"""H -> ((warm-up share of the run, loss ratio to allreduce), ...), shares ascending. Means
over seeds 0, 1, 2 at H = 10 shares 0.15 and 0.2 and H = 20 share 0.2; seed 0 elsewhere
(docs/bad_links.md has every row)."""
PROVENANCE = ("benchmarks/diloco_convergence.py --warm-start-steps 0 --steps 400 --replicas 4 "
              "(gpt-tiny on Debian fortunes, batch 8 x 64 per replica, AdamW lr 1e-3 cosine); "
              "measured 2026-11-25 on the project's 2-core CPU box (docs/bad_links.md)")
"""Where LOSS_TABLE's numbers come from."""


def warmup_shares(inner_steps: int) -> tuple[float, ...]:
    """The warm-up shares measured for this H (or for the next larger measured H)."""
    larger = [h for h in sorted(LOSS_TABLE) if h >= inner_steps]
    return tuple(share for share, _ in LOSS_TABLE[larger[0]]) if larger else ()


def _ratio_at(h: int, share: float) -> float | None:
    """The measured ratio of H = h at the largest measured share <= `share` (None: `share` is
    below every measured one)."""
    rows = LOSS_TABLE[h]
    i = bisect_right([s for s, _ in rows], share + 1e-9) - 1
    return rows[i][1] if i >= 0 else None


def loss_ratio(sync: SyncConfig, train_steps: int) -> float | None:
    """Predicted final validation loss over allreduce's after the same tokens, for a run of
    `train_steps` steps under `sync` (1.0 for allreduce, never below it; None: outside the
    table)."""
    if sync.mode != "diloco":
        return 1.0
    share = warmup_share(sync.warmup_steps, train_steps)
    if share >= 1.0:
        return 1.0  # the whole run is the warm-up: allreduce
    measured = sorted(LOSS_TABLE)
    h = sync.inner_steps
    if h > measured[-1]:
        return None
    hi = next(m for m in measured if m >= h)
    lo = max((m for m in measured if m < h), default=1)
    r_hi = _ratio_at(hi, share)
    r_lo = 1.0 if lo == 1 else _ratio_at(lo, share)
    if r_hi is None or r_lo is None:
        return None
    # never below allreduce's: a measured ratio under 1 is read as noise, so ties keep allreduce
    return max(1.0, r_lo + (r_hi - r_lo) * (h - lo) / (hi - lo))
