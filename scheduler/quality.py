"""The quality side of `plan --sync auto`: how many steps a configuration needs to reach a
target loss. Pure: numbers and curves in, numbers out (the fitted model ships in
scheduler/quality_fitted.py; benchmarks/quality_sweep.py measures the curves and writes it).

Two parts, each fitted on loss curves the project measured from scratch (gpt-tiny, the lab's
recipe; docs/results/quality_model.md has the fit, its provenance and its check on held-out
runs):

1. All-reduce, steps against global batch B (sequences per step over all replicas): at every
   target loss L of a grid, S_ar(B, L) = S_min(L) x (1 + B_noise(L) / B) (the empirical model
   of large-batch training, McCandlish et al. 2018), fitted over the all-reduce runs' batches.
2. DiLoCo, as a slower rate of progress after its all-reduce warm-up of W steps:
       S = W + (S_ar(B, L) - W) x I,   I = max(1, exp(theta . x))
   x holds log2 M (replicas), log2 H, their product, log2 of the per-replica batch over 16,
   log((S_ar - W) / 100) (how far into training the target is), log(1 + W), int8, fp16,
   overlap, log2 F (fragments) and log2 of the outer step's gain lr / (1 - momentum) (alone
   and times log2 H: DiLoCo's default Nesterov 0.7 / 0.9 costs far more steps at small H from
   scratch than plain averaging, 1.0 / 0).
   theta is a least-squares fit over every (run, target) pair whose run reached the target.

A configuration outside the fitted ranges (RANGE_FIELDS) is flagged in the plan and priced
conservatively (I x (1 + OUT_OF_RANGE_MARGIN)), never assumed free. A target below the losses
the all-reduce curves reach cannot be predicted and is refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from formats.errors import UserError
from formats.plan import SyncConfig
from formats.sync_rules import DILOCO

FEATURES = ("const", "log2_m", "log2_h", "log2_m_x_log2_h", "log2_batch", "progress",
            "warmup", "int8", "fp16", "overlap", "log2_fragments", "log2_outer_gain",
            "log2_outer_gain_x_log2_h")
"""The inputs x of DiLoCo's step inflation, in theta's order."""
OUT_OF_RANGE_MARGIN = 0.15
"""Extra steps charged (a fraction of DiLoCo's inflated steps) to a configuration or target
outside what the model was fitted on."""
RIDGE = 1e-3
"""Ridge penalty of the DiLoCo fit (keeps coefficients of barely varied inputs near 0)."""
LOSS_GRID_STEP = 0.02
"""Spacing of the target-loss grid the all-reduce model is fitted at."""
REFERENCE_BATCH = 16
"""Per-replica batch (sequences) the batch feature is relative to: the lab recipe's."""
RANGE_FIELDS = ("replicas", "inner_steps", "batch_per_replica", "global_batch", "warmup_steps",
                "fragments", "outer_gain", "int8", "fp16", "overlap")
"""Configuration fields whose fitted range is checked."""


@dataclass(frozen=True)
class ArPoint:
    """All-reduce's steps to one target loss: S_min x (1 + b_noise / B)."""

    loss: float
    s_min: float
    b_noise: float
    """Noise scale in sequences per step."""

    def steps(self, global_batch: float) -> float:
        """Steps all-reduce needs at this global batch."""
        return self.s_min * (1.0 + self.b_noise / global_batch)


@dataclass(frozen=True)
class QualityModel:
    """A fitted quality model: all-reduce's steps per target loss and DiLoCo's inflation."""

    ar: tuple[ArPoint, ...]
    """Target losses, highest (easiest) first."""
    theta: tuple[float, ...]
    """DiLoCo's log inflation coefficients, in FEATURES order."""
    ranges: dict[str, tuple[float, float]]
    """Fitted range of each RANGE_FIELDS field (and `ar_steps`: of S_ar at the targets)."""
    model: str
    """The model preset the curves were measured on (a --target-loss is on its scale)."""
    provenance: str
    residual_sd: float = 0.0
    """Standard deviation of the fit's residuals in log steps."""
    observations: int = 0


@dataclass(frozen=True)
class Target:
    """What `--sync auto` ranks plans by the time to."""

    loss: float | None
    """Target loss on the fitted model's scale (None: beyond the fitted curves)."""
    ar_steps: float
    """Steps the reference all-reduce plan needs to reach it."""
    ar_batch: float
    """Global batch (sequences per step) of that reference plan."""
    label: str
    """How the user set it, in words."""
    flags: tuple[str, ...] = ()
    """Why the prediction is uncertain (beyond the fitted curves, another model)."""
    b_noise: float = 0.0
    """The all-reduce noise scale used to carry the target to other batches."""


@dataclass(frozen=True)
class StepsPrediction:
    """Predicted steps to a target for one configuration."""

    steps: float
    ar_steps: float
    """All-reduce's steps to the same target at the same global batch."""
    inflation: float
    """DiLoCo's step inflation I after its warm-up (1 for all-reduce)."""
    flags: tuple[str, ...] = field(default_factory=tuple)


def steps_to_loss(curve: list[tuple[float, float]], loss: float) -> float | None:
    """First step at which a (step, loss) curve reaches `loss`, linearly interpolated between
    evaluations of its smoothed running minimum (None: never)."""
    if not curve:
        return None
    steps = [s for s, _ in curve]
    vals = [v for _, v in curve]
    smooth = [float(np.mean(vals[max(0, i - 1):i + 2])) for i in range(len(vals))]
    best = np.minimum.accumulate(smooth)
    for i, v in enumerate(best):
        if v <= loss:
            if i == 0:
                return float(steps[0])
            prev = best[i - 1]
            frac = (prev - loss) / (prev - v) if prev > v else 1.0
            return float(steps[i - 1] + frac * (steps[i] - steps[i - 1]))
    return None


def outer_gain(outer_lr: float, outer_momentum: float) -> float:
    """The outer step's steady-state gain lr / (1 - momentum): 1 for plain averaging, 7 for
    DiLoCo's default Nesterov (0.7, 0.9)."""
    return outer_lr / max(1.0 - outer_momentum, 1e-3)


def features(replicas: int, inner_steps: int, batch_per_replica: float, ar_steps: float,
             warmup_steps: int, compression: str, overlap: bool, fragments: int,
             outer_lr: float = 0.7, outer_momentum: float = 0.9) -> np.ndarray:
    """x for one DiLoCo configuration and target (FEATURES order)."""
    m, h = math.log2(max(replicas, 1)), math.log2(max(inner_steps, 1))
    progress = math.log(max(ar_steps - warmup_steps, 1.0) / 100.0)
    gain = math.log2(outer_gain(outer_lr, outer_momentum))
    return np.array([1.0, m, h, m * h, math.log2(batch_per_replica / REFERENCE_BATCH), progress,
                     math.log1p(max(warmup_steps, 0)), float(compression == "int8"),
                     float(compression == "fp16"), float(overlap), math.log2(max(fragments, 1)),
                     gain, gain * h])


def ar_steps_at(qm: QualityModel, loss: float, global_batch: float) -> float | None:
    """All-reduce's steps to `loss` at `global_batch` (None: below the grid's lowest loss);
    above the highest grid loss, the highest's (the plateau: every plan gets there early)."""
    pts = qm.ar
    if loss >= pts[0].loss:
        return pts[0].steps(global_batch)
    for a, b in zip(pts, pts[1:]):
        if b.loss <= loss <= a.loss:
            t = (a.loss - loss) / (a.loss - b.loss)
            return a.steps(global_batch) + t * (b.steps(global_batch) - a.steps(global_batch))
    return None


def _noise_at(qm: QualityModel, loss: float | None) -> float:
    """B_noise at a target loss (the lowest grid point's beyond the grid)."""
    if loss is None or loss <= qm.ar[-1].loss:
        return qm.ar[-1].b_noise
    return min(qm.ar, key=lambda p: abs(p.loss - loss)).b_noise


def target_from_steps(qm: QualityModel, train_steps: int, ar_batch: float) -> Target:
    """The loss the reference all-reduce plan (global batch `ar_batch`) reaches after
    `train_steps` steps: its own steps are the target's by definition."""
    label = f"allreduce's loss after {train_steps} steps of {ar_batch:g} sequences"
    lo, hi = qm.ar[-1].steps(ar_batch), qm.ar[0].steps(ar_batch)
    if train_steps > lo:
        return Target(None, float(train_steps), ar_batch, label,
                      (f"beyond the fitted curves (allreduce at this batch reaches their lowest "
                       f"loss {qm.ar[-1].loss:.2f} in {lo:.0f} steps)",),
                      _noise_at(qm, None))
    if train_steps <= hi:
        return Target(qm.ar[0].loss, float(train_steps), ar_batch, label,
                      (f"on the loss plateau (allreduce at this batch leaves it near step "
                       f"{hi:.0f}): every plan gets there early",), _noise_at(qm, qm.ar[0].loss))
    for a, b in zip(qm.ar, qm.ar[1:]):
        sa, sb = a.steps(ar_batch), b.steps(ar_batch)
        if sa <= train_steps <= sb:
            t = (train_steps - sa) / max(sb - sa, 1e-9)
            loss = a.loss + t * (b.loss - a.loss)
            return Target(loss, float(train_steps), ar_batch, label, (), _noise_at(qm, loss))
    raise AssertionError("the grid's steps grow as the loss falls")


def target_from_loss(qm: QualityModel, loss: float, ar_batch: float, model_name: str) -> Target:
    """A target loss on the fitted model's scale; UserError when it cannot be predicted."""
    if model_name != qm.model:
        raise UserError(f"--target-loss {loss}: losses are only predicted for {qm.model} (what "
                        f"the quality model was fitted on), not {model_name}; give "
                        f"--train-steps (the target: allreduce's loss after that many steps)")
    steps = ar_steps_at(qm, loss, ar_batch)
    if steps is None:
        raise UserError(f"--target-loss {loss}: below what the fitted curves reach (their "
                        f"lowest is {qm.ar[-1].loss:.2f}); give a target of at least that")
    flags = (("on the loss plateau: every plan gets there early",)
             if loss >= qm.ar[0].loss else ())
    return Target(loss, steps, ar_batch, f"validation loss {loss:g}", flags, _noise_at(qm, loss))


def ar_steps_for(qm: QualityModel, target: Target, global_batch: float) -> float:
    """All-reduce's steps to `target` at another global batch."""
    if target.loss is not None and not target.flags:
        steps = ar_steps_at(qm, target.loss, global_batch)
        if steps is not None:
            return steps
    bn = target.b_noise
    return target.ar_steps * (1.0 + bn / global_batch) / (1.0 + bn / target.ar_batch)


def out_of_range(qm: QualityModel, values: dict[str, float]) -> list[str]:
    """The fields of `values` outside their fitted range, in words."""
    out = []
    for name, v in values.items():
        lo, hi = qm.ranges.get(name, (v, v))
        if not lo - 1e-9 <= v <= hi + 1e-9:
            out.append(f"{name} {v:g} outside the fitted {lo:g}..{hi:g}")
    return out


def predict_steps(qm: QualityModel, sync: SyncConfig, replicas: int, batch_per_replica: float,
                  target: Target, model_name: str | None = None) -> StepsPrediction:
    """Steps `sync` over `replicas` replicas of `batch_per_replica` sequences needs to reach
    `target` (all-reduce's at the same global batch, inflated after DiLoCo's warm-up)."""
    global_batch = replicas * batch_per_replica
    ar = ar_steps_for(qm, target, global_batch)
    flags = list(target.flags)
    if model_name is not None and model_name != qm.model:
        flags.append(f"model {model_name}: the inflation was measured on {qm.model}")
    flags += out_of_range(qm, {"global_batch": global_batch})
    if not sync.rule.local_steps or replicas < 2 or sync.warmup_steps >= ar:
        return StepsPrediction(ar, ar, 1.0, tuple(flags))
    if sync.mode != DILOCO.name:  # another local-step rule: priced with DiLoCo's curves
        flags.append(f"sync {sync.mode}: the inflation was measured on {DILOCO.name}")
    w = sync.warmup_steps
    x = features(replicas, sync.inner_steps, batch_per_replica, ar, w, sync.compression,
                 sync.overlap, sync.fragments, sync.outer_lr, sync.outer_momentum)
    inflation = max(1.0, math.exp(float(np.dot(qm.theta, x))))
    flags += out_of_range(qm, {
        "replicas": replicas, "inner_steps": sync.inner_steps,
        "batch_per_replica": batch_per_replica, "warmup_steps": w, "fragments": sync.fragments,
        "outer_gain": outer_gain(sync.outer_lr, sync.outer_momentum), "ar_steps": ar,
        "int8": float(sync.compression == "int8"), "fp16": float(sync.compression == "fp16"),
        "overlap": float(sync.overlap)})
    if len(flags) > len(target.flags) or target.flags:
        inflation *= 1.0 + OUT_OF_RANGE_MARGIN
    return StepsPrediction(w + (ar - w) * inflation, ar, inflation, tuple(flags))
