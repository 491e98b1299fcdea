"""Time to loss in the lab benchmarks (testkit/lab_metrics.py, testkit/lab_training.py):
evaluations are left out of the measured step time and of the time to a loss, which is read at
the first evaluation that reached it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from formats.plan import Plan, save_plan
from testkit import lab, lab_metrics, lab_training


def test_time_to_loss_and_step_time_leave_evaluations_out(tmp_path):
    save_plan(Plan("local", "", "gpt-tiny", [(0, 4)], [[0]]), tmp_path / "p.json")
    # 6 steps of 1 s each; evaluations of 0.5 s after steps 2, 4 and 6
    recs = [{"step": i, "step_s": 1.0, "wall_time": 100.0 + i + 0.5 * ((i - 1) // 2),
             "tokens_per_s": 10.0, "dp_bytes_sent": 0, "loss": 3.0}
            | ({"val_loss": 3.0 - i / 10, "eval_s": 0.5} if i % 2 == 0 else {})
            for i in range(1, 7)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = lab.Run("r", tmp_path / "p.json")
    lab_metrics.read_metrics(run, tmp_path / "m.jsonl", 0)
    assert run.measured_s == pytest.approx(1.0)  # not 1.17: the two evaluations inside
    assert run.tokens_per_s == pytest.approx(10.0)
    assert run.val_losses == [(2.0, pytest.approx(2.8)), (4.0, pytest.approx(2.6)),
                              (6.0, pytest.approx(2.4))]
    assert lab_metrics.seconds_to_loss(run, 2.6) == 4.0
    assert lab_metrics.seconds_to_loss(run, 2.7) == 4.0
    assert lab_metrics.seconds_to_loss(run, 2.0) is None
    assert lab_metrics.seconds_to_loss(run, None) is None


def write(path, recs):
    """A replica-0 metrics file, each launch ending in a summary record (no step_s)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def step(i: int, wall: float, val: float | None = None, eval_s: float = 0.0,
         step_s: float = 1.0) -> dict:
    return ({"step": i, "step_s": step_s, "wall_time": wall, "tokens_per_s": 10.0,
             "dp_bytes_sent": 0, "loss": 3.0}
            | ({"val_loss": val, "eval_s": eval_s} if val is not None else {}))


def test_training_clock_leaves_out_the_relaunch_gap_and_evaluations():
    # launch 1: steps 1-4 at 1 s, an evaluation of 0.5 s after step 2; relaunch 100 s later,
    # its first step 2 s (slower: a fresh process), then 1 s
    recs = [step(1, 11.0), step(2, 12.0, 2.9, 0.5), step(3, 13.5), step(4, 14.5, 2.8, 0.5),
            step(5, 117.0, step_s=2.0), step(6, 118.0, 2.7, 0.5)]
    assert lab_metrics.training_clock(recs, [4]) == pytest.approx([1, 2, 3, 4, 6, 7])
    # without the resume point the gap would count: the relaunch has to be named
    assert lab_metrics.training_clock(recs, [])[4] == pytest.approx(106.0)


def test_train_on_extends_a_run_for_the_budget_unless_it_reached_the_loss(tmp_path,
                                                                         monkeypatch):
    save_plan(Plan("local", "", "gpt-tiny", [(0, 4)], [[0]]), tmp_path / "p.json")
    path = tmp_path / "m.jsonl"
    first = [step(i, 10.0 + i, 3.0 - i / 100 if i % 2 == 0 else None) for i in range(1, 5)]
    write(path, first + [{"summary": True}])
    calls = []

    def fake_train(run, net, steps, out, extra=(), checkpoint=False, resume=False):
        # the resumed launch: steps 5.. at 1 s each from wall time 500, losses falling
        assert resume and extra == ["--x"]
        calls.append(steps)
        more = [step(i, 500.0 + i - 4, 2.5 if i >= 8 else 2.9) for i in range(5, steps + 1)]
        write(path, first + [{"summary": True}] + more)
        return path

    monkeypatch.setattr(lab_training, "train", fake_train)
    run = lab.Run("r", tmp_path / "p.json")
    lab_metrics.read_metrics(run, path, 0)
    assert (run.trained_s, run.steps_trained, run.final_val_loss) == (4.0, 4, 2.96)
    lab_training.train_on(run, None, tmp_path, ["--x"], 2.96, 10.0, 0, 4)  # reached: nothing to do
    assert calls == []
    lab_training.train_on(run, None, tmp_path, ["--x"], 2.5, 10.0, 0, 4)
    # 6 s of the budget left at 1 s/step, plus one: steps 5..11, one launch
    assert calls == [11] and run.resumed_at == [4]
    assert run.trained_s == pytest.approx(11.0) and lab_metrics.seconds_to_loss(run, 2.5) == 8.0
    # the equal-steps columns stay those of the first 4 steps
    assert run.final_val_loss == 2.96 and run.measured_s == pytest.approx(1.0)


def test_budget_steps_launches_a_row_for_the_budget_in_one_go():
    run = lab.Run("r", None, predicted_s=0.5)
    # 40 s at 0.5 s/step with a 10% margin: 88 steps, rounded up to whole rounds of H = 5
    assert lab_training.budget_steps(run, 40.0, 30, 5, 5) == 90
    assert lab_training.budget_steps(run, 10.0, 30, 5, 5) == 30  # the equal-steps part at least
    assert lab_training.budget_steps(run, None, 30, 4, 5) == 30  # allreduce itself: no budget
    # a longer launch would not evaluate at step 6 (every 5): launch 6, train_on does the rest
    assert lab_training.budget_steps(run, 40.0, 6, 1, 5) == 6


def test_stop_flags_end_a_row_at_the_exact_target_after_the_equal_steps_part(tmp_path,
                                                                            capsys):
    import dist_runner

    assert lab_training.stop_flags(None, 30) == []
    target = 3.2612345678901234
    flags = lab_training.stop_flags(target, 30)
    assert flags == ["--stop-at-loss", repr(target), "--min-steps", "30"]
    _, cfg = dist_runner.parse_args(["--steps", "90", "--eval-every", "5", "--eval-sequences",
                                     "4", *flags])
    assert (cfg.data.stop_at_loss, cfg.data.min_steps) == (target, 30)  # the same float
    # a row that trained fewer steps than the equal-steps part: said, and read over its steps
    save_plan(Plan("local", "", "gpt-tiny", [(0, 4)], [[0]]), tmp_path / "p.json")
    write(tmp_path / "m.jsonl", [step(i, 10.0 + i, 2.5 if i == 4 else None) for i in range(1, 5)])
    assert lab_metrics.step_records(tmp_path / "m.jsonl") == 4
    run = lab.Run("r", tmp_path / "p.json")
    lab_metrics.read_metrics(run, tmp_path / "m.jsonl", 0, 6)
    assert "note: r trained 4 steps, fewer than the 6 of the equal-steps loss" in \
        capsys.readouterr().out
    assert (run.steps_trained, run.final_val_loss) == (4, 2.5)


def test_training_clock_leaves_out_the_stop_at_loss_checks():
    # an evaluation of 0.5 s and a --stop-at-loss check of 0.25 s after step 2
    recs = [step(1, 11.0), step(2, 12.0, 2.9, 0.5) | {"stop_check_s": 0.25}, step(3, 13.75)]
    assert lab_metrics.training_clock(recs) == pytest.approx([1, 2, 3])


def _write(path: Path, recs: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_the_run_clock_leaves_out_the_slowest_evaluation(tmp_path):
    """Blocking sync: replica 0 evaluates 0.3 s sooner, then waits that out at the next sync
    (its step 3 takes 1.3 s). Its own clock would count the wait as training."""
    path = tmp_path / "m.jsonl"
    mine = [step(1, 11.0), step(2, 12.0, 2.9, 0.5), step(3, 13.8, step_s=1.3), step(4, 14.8)]
    theirs = [step(1, 11.0), step(2, 12.0, 2.9, 0.8), step(3, 13.8), step(4, 14.8)]
    _write(path, mine)
    _write(tmp_path / "m.r1.jsonl", theirs)
    assert lab_metrics.training_clock(mine) == pytest.approx([1, 2, 3.3, 4.3])
    assert lab_metrics.run_clock(mine, path) == pytest.approx([1, 2, 3, 4])
    _write(tmp_path / "m.r1.jsonl", theirs[:1])  # it left after step 1: not compared
    assert lab_metrics.run_clock(mine, path) == pytest.approx([1, 2, 3.3, 4.3])


def test_the_run_clock_goes_at_the_slowest_replicas_pace(tmp_path):
    """Overlapped rounds: replica 1 trains 0.2 s a step slower and replica 0 does not wait for
    it within the run; the run ends when replica 1 does."""
    path = tmp_path / "m.jsonl"
    _write(path, [step(1, 11.0), step(2, 12.0, 2.9, 0.5), step(3, 13.5), step(4, 14.5)])
    _write(tmp_path / "m.r1.jsonl", [step(1, 11.2, step_s=1.2), step(2, 12.4, 2.9, 0.5),
                                     step(3, 14.1, step_s=1.2), step(4, 15.3, step_s=1.2)])
    assert lab_metrics.run_clock(lab_metrics.step_records_of(path), path) == pytest.approx(
        [1.2, 2.4, 3.6, 4.8])
