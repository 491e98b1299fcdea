"""Fit scheduler.quality's model on measured loss curves (benchmarks/quality_sweep.py's
`runs`), and write it as Python source (scheduler/quality_fitted.py). Pure: a dict in, a model
or a string out.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any

import numpy as np

from formats.plan import SyncConfig
from formats.sync_rules import ALLREDUCE, DILOCO
from scheduler.quality import (
    FEATURES,
    LOSS_GRID_STEP,
    RIDGE,
    ArPoint,
    QualityModel,
    Target,
    ar_steps_at,
    features,
    outer_gain,
    predict_steps,
    steps_to_loss,
    target_from_steps,
)

MIN_AR_STEPS = 60
"""Targets all-reduce reaches sooner than this are on the plateau: not fitted."""


def _fitted(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if r.get("fit", True)]


def _smoothed(curve: list) -> list[tuple[float, float]]:
    vals = [v for _, v in curve]
    return [(s, float(np.mean(vals[max(0, i - 1):i + 2]))) for i, (s, _) in enumerate(curve)]


def loss_grid(ar_runs: list[dict[str, Any]]) -> list[float]:
    """Target losses (highest first) between where the fastest all-reduce run is at step
    MIN_AR_STEPS (past the plateau) and the lowest loss that all-reduce runs of two batches
    reach (the batch relation needs two)."""
    reach: dict[float, float] = {}
    for r in ar_runs:
        low = min(v for _, v in _smoothed(r["curve"]))
        reach[r["global_batch"]] = min(low, reach.get(r["global_batch"], low))
    lowest = sorted(reach.values())[1] if len(reach) > 1 else next(iter(reach.values()))
    top = min(next(v for s, v in _smoothed(r["curve"]) if s >= MIN_AR_STEPS) for r in ar_runs)
    hi = math.floor(top / LOSS_GRID_STEP) * LOSS_GRID_STEP
    lo = math.ceil(lowest / LOSS_GRID_STEP) * LOSS_GRID_STEP
    n = int(round((hi - lo) / LOSS_GRID_STEP))
    return [round(hi - k * LOSS_GRID_STEP, 4) for k in range(n + 1)]


def fit_allreduce(ar_runs: list[dict[str, Any]]) -> tuple[ArPoint, ...]:
    """S = S_min + S_min B_noise / B at every grid loss (least squares in 1/B, B_noise >= 0)."""
    points = []
    for loss in loss_grid(ar_runs):
        obs = [(1.0 / r["global_batch"], steps_to_loss(r["curve"], loss)) for r in ar_runs]
        obs = [(x, s) for x, s in obs if s is not None]
        xs, ss = np.array([o[0] for o in obs]), np.array([o[1] for o in obs])
        if len(set(xs.tolist())) < 2:
            slope, s_min = 0.0, float(ss.mean())
        else:
            slope, s_min = np.polyfit(xs, ss, 1)
        if slope < 0 or s_min <= 0:  # noise: no batch effect at this loss
            slope, s_min = 0.0, float(ss.mean())
        points.append(ArPoint(loss, round(float(s_min), 3), round(float(slope / s_min), 3)))
    return tuple(points)


def _observations(qm_ar: QualityModel, runs: list[dict[str, Any]]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """x rows and y = log((S - W) / (S_ar - W)) for every DiLoCo run and reached target."""
    xs, ys = [], []
    for r in runs:
        if r["mode"] != DILOCO.name:
            continue
        w, b = r["warmup"], r["batch"]
        for p in qm_ar.ar:
            s = steps_to_loss(r["curve"], p.loss)
            ar = ar_steps_at(qm_ar, p.loss, r["global_batch"])
            if s is None or ar is None or ar <= w + 5 or s <= w:
                continue
            xs.append(features(r["replicas"], r["inner_steps"], b, ar, w, r["compression"],
                               r["overlap"], r["fragments"], r["outer_lr"],
                               r.get("outer_momentum", 0.9)))
            ys.append(math.log((s - w) / (ar - w)))
    return np.array(xs), np.array(ys)


def span_of(vals: list[float]) -> tuple[float, float]:
    """(min, max) of `vals`: a 0/1 input never set spans (0, 0)."""
    return (min(vals), max(vals))


def _ranges(runs: list[dict[str, Any]], ar: tuple[ArPoint, ...]) -> dict[str, tuple]:
    dl = [r for r in runs if r["mode"] == DILOCO.name]

    def span(key, rows):
        vals = [float(r[key]) for r in rows]
        return (round(min(vals), 4), round(max(vals), 4))
    batches = [r["global_batch"] for r in runs]
    gains = [outer_gain(r["outer_lr"], r.get("outer_momentum", 0.9)) for r in dl]
    steps = [p.steps(b) for p in ar for b in (min(batches), max(batches))]
    return {"replicas": span("replicas", dl), "inner_steps": span("inner_steps", dl),
            "batch_per_replica": span("batch", dl), "global_batch": span("global_batch", runs),
            "warmup_steps": span("warmup", dl), "fragments": span("fragments", dl),
            "outer_gain": (round(min(gains), 4), round(max(gains), 4)),
            "ar_steps": (round(min(steps), 1), round(max(steps), 1)),
            "int8": span_of([float(r["compression"] == "int8") for r in dl]),
            "fp16": span_of([float(r["compression"] == "fp16") for r in dl]),
            "overlap": span_of([float(r["overlap"]) for r in dl])}


def fit(data: dict[str, Any]) -> QualityModel:
    """The quality model of a sweep's curves (its `fit: true` runs)."""
    runs = _fitted(data["runs"])
    ar_runs = [r for r in runs if r["mode"] == ALLREDUCE.name]
    ar = fit_allreduce(ar_runs)
    prov = data.get("provenance", {})
    base = QualityModel(ar, (0.0,) * len(FEATURES), {}, prov.get("model", "gpt-tiny"), "")
    x, y = _observations(base, runs)
    penalty = RIDGE * len(y) * np.eye(len(FEATURES))
    penalty[0, 0] = 0.0  # the intercept is not shrunk
    theta = np.linalg.solve(x.T @ x + penalty, x.T @ y)
    resid = y - x @ theta
    provenance = (f"{prov.get('command', 'benchmarks/quality_sweep.py')} on {prov.get('date')} "
                  f"({prov.get('machine')}): {len(runs)} runs of {base.model}, "
                  f"{prov.get('recipe', '')}")
    return QualityModel(ar, tuple(round(float(t), 5) for t in theta), _ranges(runs, ar),
                        base.model, provenance, round(float(resid.std()), 4), len(y))


def check_held_out(qm: QualityModel, data: dict[str, Any]) -> list[dict[str, Any]]:
    """Predicted against measured steps for every run of `data` (held out or not), at the
    losses all-reduce reaches in 150, 200 and 250 steps at the run's global batch."""
    rows = []
    for r in data["runs"]:
        if r["mode"] != DILOCO.name:
            continue
        sync = SyncConfig(DILOCO.name, r["inner_steps"], r["compression"], outer_lr=r["outer_lr"],
                          outer_momentum=r.get("outer_momentum", 0.9),
                          overlap=r["overlap"], fragments=r["fragments"],
                          warmup_steps=r["warmup"])
        for n in (150, 200, 250):
            target = _target_at(qm, n, r["global_batch"])
            if target is None:
                continue
            measured = steps_to_loss(r["curve"], target.loss)
            pred = predict_steps(qm, sync, r["replicas"], r["batch"], target)
            rows.append({"run": r["name"], "fit": r.get("fit", True), "ar_steps": n,
                         "loss": round(target.loss, 4), "predicted": round(pred.steps, 1),
                         "measured": None if measured is None else round(measured, 1),
                         "flags": list(pred.flags)})
    return rows


def _target_at(qm: QualityModel, steps: int, batch: float) -> Target | None:
    t = target_from_steps(qm, steps, batch)
    return t if t.loss is not None and not t.flags else None


def to_source(qm: QualityModel) -> str:
    """scheduler/quality_fitted.py's text for `qm` (lines within 100 characters)."""
    ar = "".join(f"    ArPoint({p.loss}, {p.s_min}, {p.b_noise}),\n" for p in qm.ar)
    ranges = "".join(f"        {k!r}: {tuple(float(v) for v in r)!r},\n"
                     for k, r in qm.ranges.items())
    theta = "".join(f"        {t!r},  # {name}\n" for name, t in zip(FEATURES, qm.theta))
    prov = "".join(f"        {chunk!r}\n" for chunk in textwrap.wrap(
        qm.provenance, 80, drop_whitespace=False))
    return (f'"""The quality model fitted on scheduler/quality_curves.json (generated by\n'
            f'`python benchmarks/quality_sweep.py --fit`; do not edit by hand)."""\n\n'
            f"from scheduler.quality import ArPoint, QualityModel\n\n"
            f"AR = (\n{ar})\n\n"
            f"FITTED = QualityModel(\n    ar=AR,\n    theta=(\n{theta}    ),\n"
            f"    ranges={{\n{ranges}    }},\n    model={qm.model!r},\n"
            f"    provenance=(\n{prov}    ),\n"
            f"    residual_sd={qm.residual_sd!r},\n    observations={qm.observations!r},\n)\n"
            f'"""The shipped model: what `plan --sync auto` predicts steps to a target with."""\n')
