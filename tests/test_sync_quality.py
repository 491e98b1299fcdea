"""The quality side of `plan --sync auto` (scheduler/quality.py, quality_fit.py): steps to a
target loss read from curves, the fit on curves made from known coefficients, the shipped fit
reproduced from its recorded curves, targets refused by name, out-of-range configurations
flagged and charged, and the warm-up's charge (scheduler/simulator/warmup.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from formats.errors import UserError
from formats.plan import SyncConfig
from scheduler import quality_fit
from scheduler.objective import CostBreakdown
from scheduler.quality import (
    FEATURES,
    OUT_OF_RANGE_MARGIN,
    ArPoint,
    QualityModel,
    features,
    predict_steps,
    steps_to_loss,
    target_from_loss,
    target_from_steps,
)
from scheduler.quality_fitted import FITTED
from scheduler.simulator.warmup import run_step_s, warmup_share
from scheduler.sync_search import Scored, SyncChoice, choose, with_targets

ROOT = Path(__file__).resolve().parent.parent
S_MIN = lambda loss: 100.0 * math.exp(2.0 * (3.0 - loss))  # noqa: E731
B_NOISE = lambda loss: 40.0 * (3.4 - loss)  # noqa: E731
THETA = dict(const=0.05, log2_m=0.08, log2_h=0.04, progress=0.1, int8=0.03,
             log2_outer_gain=0.1)


def curve_of(steps_at) -> list[list[float]]:
    """A curve every 10 steps to 600 from a loss -> steps function (monotone)."""
    losses = np.linspace(3.3, 2.2, 2000)
    steps = np.array([steps_at(v) for v in losses])
    return [[t, round(float(np.interp(t, steps, losses)), 5)] for t in range(10, 610, 10)]


def ar_run(b: int) -> dict:
    return {"name": f"ar{b}", "mode": "allreduce", "replicas": 1, "batch": b, "global_batch": b,
            "inner_steps": 1, "warmup": 0, "compression": "none", "overlap": False,
            "fragments": 1, "outer_lr": 0.7, "seed": 0,
            "curve": curve_of(lambda v: S_MIN(v) * (1 + B_NOISE(v) / b))}


def dl_run(m: int, h: int, w: int = 0, comp: str = "none", mom: float = 0.0) -> dict:
    theta = np.array([THETA.get(f, 0.0) for f in FEATURES])

    def steps(v: float) -> float:
        ar = S_MIN(v) * (1 + B_NOISE(v) / (16 * m))
        if ar <= w:
            return ar
        x = features(m, h, 16, ar, w, comp, False, 1, 1.0, mom)
        return w + (ar - w) * max(1.0, math.exp(float(theta @ x)))
    return {**ar_run(16 * m), "name": f"dl-m{m}-h{h}-w{w}-{comp}", "mode": "diloco",
            "replicas": m, "batch": 16, "inner_steps": h, "warmup": w, "compression": comp,
            "outer_lr": 1.0, "outer_momentum": mom, "curve": curve_of(steps)}


SYNTHETIC = {"provenance": {"model": "gpt-tiny", "date": "test"},
             "runs": [ar_run(b) for b in (8, 16, 64, 128)]
             + [dl_run(m, h) for m in (2, 4, 8) for h in (4, 8, 16, 32)]
             + [dl_run(8, 8, 30), dl_run(4, 16, 60), dl_run(8, 8, comp="int8"),
                dl_run(4, 8, comp="int8"), dl_run(8, 8, mom=0.9), dl_run(4, 16, mom=0.5),
                dl_run(2, 32, mom=0.9)]}


def test_steps_to_loss_interpolates_the_smoothed_running_minimum():
    curve = [(10, 3.0), (20, 2.9), (30, 2.8), (40, 2.7)]
    assert steps_to_loss(curve, 2.85) == pytest.approx(25.0)
    assert steps_to_loss(curve, 3.5) == 10.0
    assert steps_to_loss(curve, 2.6) is None
    # a noisy bump up does not count as progress lost: the running minimum
    assert steps_to_loss([(10, 3.0), (20, 2.5), (30, 3.0), (40, 2.4)], 2.7) is not None


def test_the_allreduce_fit_recovers_known_batch_scaling():
    points = quality_fit.fit_allreduce([ar_run(b) for b in (8, 16, 64, 128)])
    assert points[0].loss > points[-1].loss
    for p in points[::5]:
        assert p.s_min == pytest.approx(S_MIN(p.loss), rel=0.03)
        assert p.b_noise == pytest.approx(B_NOISE(p.loss), rel=0.15, abs=1.0)


def test_the_diloco_fit_recovers_known_coefficients_and_predicts_a_held_out_run():
    qm = quality_fit.fit(SYNTHETIC)
    got = dict(zip(FEATURES, qm.theta))
    for name in ("log2_m", "log2_h", "progress", "int8", "log2_outer_gain"):
        assert got[name] == pytest.approx(THETA[name], abs=0.03), name
    held = dl_run(6, 12)  # between fitted M and H
    for n in (120, 180):
        target = target_from_steps(qm, n, 96)
        measured = steps_to_loss(held["curve"], target.loss)
        pred = predict_steps(qm, SyncConfig("diloco", 12, outer_lr=1.0, outer_momentum=0.0), 6,
                             16, target)
        assert pred.steps == pytest.approx(measured, rel=0.05)
        assert pred.inflation > 1.0 and not pred.flags


def test_the_shipped_fit_is_reproduced_from_its_recorded_curves():
    data = json.loads((ROOT / "scheduler/quality_curves.json").read_text())
    refit = quality_fit.fit(data)
    assert quality_fit.to_source(refit) == (ROOT / "scheduler/quality_fitted.py").read_text()
    assert refit == FITTED
    assert "quality_sweep.py" in FITTED.provenance and FITTED.observations > 50
    assert len({r["name"] for r in data["runs"]}) == len(data["runs"])
    assert {r["replicas"] for r in data["runs"] if r["mode"] == "diloco"} >= {2, 4, 8}


def test_targets_the_model_cannot_predict_are_refused_by_name():
    lowest = FITTED.ar[-1].loss
    with pytest.raises(UserError, match=r"--target-loss 1\.5: below what the fitted curves"):
        target_from_loss(FITTED, 1.5, 128, "gpt-tiny")
    with pytest.raises(UserError, match="--target-loss.*only predicted for gpt-tiny"):
        target_from_loss(FITTED, lowest + 0.1, 128, "llama-1b")
    t = target_from_loss(FITTED, lowest + 0.05, 128, "gpt-tiny")
    assert t.loss == lowest + 0.05 and not t.flags
    beyond = target_from_steps(FITTED, 100_000, 128)
    assert beyond.loss is None and "beyond the fitted curves" in beyond.flags[0]


def test_outside_the_fitted_ranges_is_flagged_and_charged():
    target = target_from_steps(FITTED, 200, 64)
    inside = predict_steps(FITTED, SyncConfig("diloco", 8), 4, 16, target)
    outside = predict_steps(FITTED, SyncConfig("diloco", 8, fragments=4), 4, 16, target)
    assert not inside.flags and outside.flags[0].startswith("fragments 4 outside the fitted")
    gain = predict_steps(FITTED, SyncConfig("diloco", 8, outer_lr=2.0), 4, 16, target)
    assert gain.flags[0].startswith("outer_gain 20 outside the fitted")
    fp16 = predict_steps(FITTED, SyncConfig("diloco", 8, "fp16"), 4, 16, target)
    assert "fp16 1 outside the fitted 0..0" in fp16.flags  # never measured: not assumed free
    assert outside.steps == pytest.approx(inside.steps * (1 + OUT_OF_RANGE_MARGIN))
    allreduce = predict_steps(FITTED, SyncConfig(), 4, 16, target)
    assert allreduce.inflation == 1.0 and allreduce.steps == pytest.approx(target.ar_steps)


def test_allreduce_steps_to_a_target_follow_the_batch():
    qm = QualityModel((ArPoint(3.0, 100.0, 0.0), ArPoint(2.5, 200.0, 64.0)), (0.0,) * 11, {},
                      "gpt-tiny", "test")
    target = target_from_loss(qm, 2.5, 64, "gpt-tiny")
    assert target.ar_steps == pytest.approx(400.0)
    assert predict_steps(qm, SyncConfig(), 2, 64, target).steps == pytest.approx(300.0)
    assert predict_steps(qm, SyncConfig(), 1, 16, target).steps == pytest.approx(1000.0)


def test_run_step_charges_the_warmup_at_allreduce_step():
    assert run_step_s(1.0, 3.0, 100, 400) == pytest.approx((100 * 3.0 + 300 * 1.0) / 400)
    assert run_step_s(1.0, 3.0, 0, 400) == 1.0
    assert run_step_s(1.0, 3.0, 900, 400) == 3.0  # all warm-up: allreduce
    assert warmup_share(40, 400) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        run_step_s(1.0, 3.0, 1, 0)


def test_the_choice_is_the_least_time_to_the_target():
    target = target_from_steps(FITTED, 200, 64)
    ar = Scored(SyncChoice(SyncConfig()), CostBreakdown("simulated", 2.0), 0, 4, 16)
    h8 = Scored(SyncChoice(SyncConfig("diloco", 8)), CostBreakdown("simulated", 0.5), 0, 4, 16)
    got = with_targets([ar, h8], target)
    # allreduce once, DiLoCo once per warm-up below allreduce's steps and outer optimizer
    assert [s.choice.sync.warmup_steps for s in got] == [0, 0, 0, 10, 10, 30, 30, 60, 60]
    for s in got[1:]:
        w = s.choice.sync.warmup_steps
        assert s.seconds == pytest.approx(w * 2.0 + (s.steps - w) * 0.5)
        assert s.steps > got[0].steps  # DiLoCo needs more steps than allreduce
    best = choose(got)
    assert best.seconds == min(s.seconds for s in got)
    slow_step = Scored(h8.choice, CostBreakdown("simulated", 1.99), 0, 4, 16)
    assert choose(with_targets([ar, slow_step], target)).choice.sync.mode == "allreduce"
