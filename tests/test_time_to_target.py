"""Time to a target loss in words (scheduler/time_to_target.py): what `plan --sync auto`,
`simulate` and `explain` print of a plan's predicted.to_target, and the measured time to it."""

from __future__ import annotations

import pytest

from formats.plan import Plan, load_plan, save_plan
from scheduler.time_to_target import (
    explain_rows,
    measured_to_target,
    simulate_rows,
    target_rows,
)

OURS = {"target": "allreduce's loss after 200 steps of 64 sequences", "loss": 2.5,
        "steps": 300.0, "tokens": 2_457_600, "seconds": 60.0, "flags": []}
AR = {**OURS, "steps": 200.0, "tokens": 819_200, "seconds": 240.0}


def recs(step_s: float = 0.25, eval_s: float = 1.0):
    """40 steps, evaluations every 10 (each `eval_s` long), the loss falling 0.02 a step."""
    out, clock = [], 100.0
    for i in range(1, 41):
        clock += step_s
        r = {"step": i, "step_s": step_s, "wall_time": clock, "loss": 3.0 - 0.02 * i}
        if i % 10 == 0:
            clock += eval_s
            r |= {"val_loss": 3.0 - 0.02 * i, "eval_s": eval_s, "wall_time": clock}
        out.append(r)
    return out


def test_plan_prints_time_to_the_target_first_with_the_ratio():
    rows = target_rows(OURS, AR)
    assert rows[0] == "  target: allreduce's loss after 200 steps of 64 sequences " \
                      "(validation loss 2.500)"
    assert "60.0 s against allreduce's 240.0 s: 4.00x sooner" in rows[1]
    assert "300 steps" in rows[2] and "2,457,600 tokens" in rows[2]
    assert target_rows(None, AR) == []
    flagged = target_rows({**OURS, "flags": ["outer_gain 3 outside the fitted 1..2"]}, AR)
    assert flagged[-1] == ("  uncertain (a DiLoCo plan is charged 15% more steps for it): "
                           "outer_gain 3 outside the fitted 1..2")


def test_simulate_prices_the_steps_at_the_step_simulated_now():
    assert simulate_rows({}, 0.2) == []
    row = simulate_rows({"to_target": OURS}, 0.25)[0]
    assert "predicted 300 steps, 2,457,600 tokens; at 0.250 s a step 75.0 s" in row
    assert "(the plan predicted 60.0 s)" in row


def test_measured_time_to_target_leaves_evaluations_out():
    r = recs()
    # loss 2.6 first seen at the evaluation of step 20: 20 steps of 0.25 s, evaluations out
    assert measured_to_target(r, 2.6) == (20, pytest.approx(5.0))
    assert measured_to_target(r, 1.0) is None
    assert measured_to_target([], 2.6) is None


def test_explain_names_the_larger_error():
    pred = {"to_target": {**OURS, "loss": 2.6, "steps": 20.0, "seconds": 2.5}}
    rows = explain_rows(pred, recs())
    assert "measured 5.0 s at step 20, predicted 2.5 s at step 20" in rows[0]
    assert "steps 1.00x predicted, time per step 2.00x: the larger error is the step time" \
        in rows[1]
    pred = {"to_target": {**OURS, "loss": 2.6, "steps": 10.0, "seconds": 2.5}}
    assert "the larger error is the steps" in explain_rows(pred, recs())[1]
    missed = explain_rows({"to_target": {**OURS, "loss": 1.0}}, recs())
    assert missed[0].endswith("not reached in 40 steps (predicted 300 steps, 60.0 s)")
    assert explain_rows({"to_target": {**OURS, "loss": None}}, recs()) == []


def test_the_target_round_trips_through_the_plan_file(tmp_path):
    plan = Plan("c", "", "gpt-tiny", [(0, 4)], [[0], [1]], predicted={"to_target": OURS})
    save_plan(plan, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json").predicted["to_target"] == OURS


def test_a_plans_line_names_its_outer_optimizer_when_not_the_default():
    """Plain averaging and Nesterov reach a loss at different steps: the one-line sync label
    says which the planner chose (the default Nesterov one is left unsaid)."""
    from formats.plan import SyncConfig
    from scheduler.simulator.report import sync_label

    avg = SyncConfig(mode="diloco", inner_steps=16, warmup_steps=30, compression="int8",
                     outer_lr=1.0, outer_momentum=0.0)
    assert sync_label(avg) == "diloco H=16 W=30 outer lr 1 momentum 0, dp int8, pp none"
    nesterov = SyncConfig(mode="diloco", inner_steps=16)
    assert sync_label(nesterov) == "diloco H=16, dp none, pp none"
