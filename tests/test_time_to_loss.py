"""Time to loss in the lab benchmarks (testkit/lab.py): evaluations are left out of the
measured step time and of the time to a loss, which is read at the first evaluation that
reached it."""

from __future__ import annotations

import json

import pytest

from formats.plan import Plan, save_plan
from testkit import lab


def test_time_to_loss_and_step_time_leave_evaluations_out(tmp_path):
    save_plan(Plan("local", "", "gpt-tiny", [(0, 4)], [[0]]), tmp_path / "p.json")
    # 6 steps of 1 s each; evaluations of 0.5 s after steps 2, 4 and 6
    recs = [{"step": i, "step_s": 1.0, "wall_time": 100.0 + i + 0.5 * ((i - 1) // 2),
             "tokens_per_s": 10.0, "dp_bytes_sent": 0, "loss": 3.0}
            | ({"val_loss": 3.0 - i / 10, "eval_s": 0.5} if i % 2 == 0 else {})
            for i in range(1, 7)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = lab.Run("r", tmp_path / "p.json")
    lab.read_metrics(run, tmp_path / "m.jsonl", 0)
    assert run.measured_s == pytest.approx(1.0)  # not 1.17: the two evaluations inside
    assert run.tokens_per_s == pytest.approx(10.0)
    assert run.val_losses == [(2.0, pytest.approx(2.8)), (4.0, pytest.approx(2.6)),
                              (6.0, pytest.approx(2.4))]
    assert lab.seconds_to_loss(run, 2.6) == 4.0
    assert lab.seconds_to_loss(run, 2.7) == 4.0
    assert lab.seconds_to_loss(run, 2.0) is None
    assert lab.seconds_to_loss(run, None) is None
