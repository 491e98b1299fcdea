"""The quality side of `plan --sync auto` (scheduler/quality.py) and the warm-up's charge
(scheduler/simulator/warmup.py): the table's lookup and its limits, the run's mean step, and
the choice bounded by the predicted loss ratio."""

from __future__ import annotations

import pytest

from formats.plan import SyncConfig
from scheduler import quality
from scheduler.objective import CostBreakdown
from scheduler.quality import LOSS_TABLE, PROVENANCE, loss_ratio, warmup_options
from scheduler.simulator.warmup import run_step_s, warmup_share
from scheduler.sync_search import Scored, SyncChoice, choose, with_warmups

TABLE = {10: ((0, 1.20), (40, 1.05), (80, 1.01)), 20: ((40, 1.10), (80, 1.03))}
"""Warm-up steps of a 400-step run (quality.MEASURED_STEPS)."""


@pytest.fixture
def table(monkeypatch):
    monkeypatch.setattr(quality, "LOSS_TABLE", TABLE)


def diloco(h: int, w: int = 0) -> SyncConfig:
    return SyncConfig("diloco", h, warmup_steps=w)


def test_run_step_charges_the_warmup_at_allreduce_step():
    assert run_step_s(1.0, 3.0, 100, 400) == pytest.approx((100 * 3.0 + 300 * 1.0) / 400)
    assert run_step_s(1.0, 3.0, 0, 400) == 1.0
    assert run_step_s(1.0, 3.0, 900, 400) == 3.0  # all warm-up: allreduce
    assert warmup_share(40, 400) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        run_step_s(1.0, 3.0, 1, 0)


def test_loss_ratio_looks_up_the_table_within_its_limits(table):
    assert loss_ratio(SyncConfig(), 400) == 1.0
    assert loss_ratio(diloco(10, 40), 400) == pytest.approx(1.05)
    assert loss_ratio(diloco(10, 60), 400) == pytest.approx(1.05)  # the next smaller warm-up
    assert loss_ratio(diloco(10, 400), 400) == 1.0  # all warm-up
    assert loss_ratio(diloco(20, 0), 400) is None  # below every measured warm-up of H = 20
    assert loss_ratio(diloco(40, 80), 400) is None  # H above the table: no prediction
    # between H = 1 (allreduce, 1.0) and 10, and between 10 and 20: linear in H
    assert loss_ratio(diloco(4, 40), 400) == pytest.approx(1 + 0.05 * 3 / 9)
    assert loss_ratio(diloco(15, 80), 400) == pytest.approx((1.01 + 1.03) / 2)
    assert warmup_options(4, 400) == (0, 40, 80) and warmup_options(64, 400) == ()


def test_the_warmup_is_steps_in_long_runs_and_a_share_in_short_ones(table):
    # a 1,200-step run needs the 400-step run's 80 steps, not 20% of it (240)
    assert loss_ratio(diloco(10, 80), 1200) == pytest.approx(1.01)
    assert loss_ratio(diloco(10, 40), 1200) == pytest.approx(1.05)
    assert warmup_options(10, 1200) == (0, 40, 80)
    # a run shorter than the table's 400 steps: the same share (30 steps: 80 -> 6)
    assert warmup_options(10, 30) == (0, 3, 6)
    assert loss_ratio(diloco(10, 6), 30) == pytest.approx(1.01)
    assert loss_ratio(diloco(10, 5), 30) == pytest.approx(1.05)  # 5/30 of 400 = 66.7 -> 40
    assert warmup_options(10, 50) == (0, 5, 10)  # rounded up: never less than measured
    assert loss_ratio(diloco(10, 5), 50) == pytest.approx(1.05)


def test_the_shipped_table_has_provenance_and_sane_values():
    assert "diloco_convergence.py" in PROVENANCE and "2026" in PROVENANCE
    for h, rows in LOSS_TABLE.items():
        assert h >= 2 and [w for w, _ in rows] == sorted(w for w, _ in rows)
        assert all(isinstance(w, int) and 0 <= w < quality.MEASURED_STEPS and r > 0.9
                   for w, r in rows)


def test_warmups_are_charged_and_the_choice_is_bounded_by_the_loss_ratio(table):
    ar = Scored(SyncChoice(SyncConfig()), CostBreakdown("simulated", 2.0), 0)
    h10 = Scored(SyncChoice(diloco(10)), CostBreakdown("simulated", 1.0), 0)
    got = with_warmups([ar, h10], 400)
    assert [(s.choice.sync.warmup_steps, s.cost.cost_s, s.loss_ratio) for s in got] == [
        (0, 2.0, 1.0), (0, 1.0, pytest.approx(1.20)), (40, 1.1, pytest.approx(1.05)),
        (80, 1.2, pytest.approx(1.01))]
    assert choose(got).choice.sync.warmup_steps == 0  # no quality bound: the fastest
    assert choose(got, max_loss_ratio=1.06).choice.sync.warmup_steps == 40
    assert choose(got, max_loss_ratio=1.02).choice.sync.warmup_steps == 80
    assert choose(got, max_loss_ratio=1.0).choice.sync.mode == "allreduce"
    # within the 2% band the lower predicted loss wins
    assert choose(got, tolerance=0.1, max_loss_ratio=1.06).choice.sync.warmup_steps == 80
    # a DiLoCo step whose allreduce step was never scored gets no warm-up variants
    assert [s.choice.sync.warmup_steps for s in with_warmups([h10], 400)] == [0]
