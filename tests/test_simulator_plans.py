"""simulate_plan on plan files: results, the timeline PNG, and clear errors on bad input."""

from __future__ import annotations

import re

import numpy as np
import pytest

from formats.errors import UserError
from formats.models import get_model
from formats.plan import Plan, SyncConfig, plan_from_dict
from scheduler.layer_split import even_split
from scheduler.scenarios import make_scenario
from scheduler.simulator import format_sim_table, simulate_plan
from scheduler.timeline import save_timeline_png

CLUSTER = make_scenario("mixed", 0)


def plan_dict(**over) -> dict:
    """A valid gpt3-xl plan for `mixed` (4 stages x 4 replicas on devices 0..15)."""
    plan = Plan(CLUSTER.name, CLUSTER.sha256(), "gpt3-xl", even_split(24, 4),
                np.arange(16).reshape(4, 4).tolist(), 1, 8, SyncConfig("diloco", 50, "int8"))
    obj = plan.to_dict()
    obj.update(over)
    return obj


def test_simulate_plan_reports_breakdown_and_table():
    res = simulate_plan(CLUSTER, None, plan_from_dict(plan_dict()))
    assert res.step_s > 0 and res.tokens_per_s > 0
    assert res.sync.inner_steps == 50
    assert res.dp_comm_s == pytest.approx(res.dp_comm_round_s / 50)
    table = format_sim_table(res)
    for words in ("step time", "pipeline bubble", "outer sync per round", "tokens/s", "6 6 6 6"):
        assert words in table
    assert set(res.to_dict()) >= {"step_s", "compute_s", "bubble_s", "pp_comm_s", "dp_comm_s",
                                  "tokens_per_s", "dp_comm_per_round_s", "memory_gb"}


def test_a_warmup_plan_reports_the_run_mean_step():
    # sync.warmup_steps W: the first W steps all-reduce (the allreduce step of the same
    # assignment and payload), the rest are DiLoCo steps; the run's mean is what
    # `plan --sync auto` ranks a plan by, so simulate reports it beside the steady step
    warm = plan_dict(sync={"mode": "diloco", "inner_steps": 50, "compression": "int8",
                           "warmup_steps": 100})
    res = simulate_plan(CLUSTER, None, plan_from_dict(warm), timeline=False)
    ar = simulate_plan(CLUSTER, None, plan_from_dict(plan_dict(
        sync={"mode": "allreduce", "inner_steps": 1, "compression": "int8"})), timeline=False)
    steady = simulate_plan(CLUSTER, None, plan_from_dict(plan_dict()), timeline=False)
    assert res.step_s == pytest.approx(steady.step_s)
    assert (res.train_steps, res.train_steps_from) == (1000, "default")
    assert res.allreduce_step_s == pytest.approx(ar.step_s) and ar.step_s > res.step_s
    assert res.run_step_s == pytest.approx((100 * ar.step_s + 900 * res.step_s) / 1000)
    out = res.to_dict()
    assert out["run_step_s"] == pytest.approx(res.run_step_s, abs=1e-6)
    assert out["warmup"] == {"warmup_steps": 100, "train_steps": 1000,
                             "train_steps_from": "default",
                             "allreduce_step_s": pytest.approx(ar.step_s, abs=1e-6)}
    assert re.search(rf"run mean step \(warm-up\) +{res.run_step_s:.3f} s", format_sim_table(res))
    # the run length the planner ranked it by, when the plan records one
    res = simulate_plan(CLUSTER, None, plan_from_dict({**warm, "predicted": {"train_steps": 400}}),
                        timeline=False)
    assert (res.train_steps, res.train_steps_from) == (400, "plan")
    assert res.run_step_s == pytest.approx((100 * ar.step_s + 300 * res.step_s) / 400)
    assert "predicted.train_steps" in format_sim_table(res)
    with pytest.raises(UserError, match="predicted.train_steps"):
        simulate_plan(CLUSTER, None, plan_from_dict({**warm, "predicted": {"train_steps": 0}}))
    # no warm-up: the run's mean is the steady step, and no warm-up entry
    assert steady.run_step_s == steady.step_s and "warmup" not in steady.to_dict()
    assert "run mean step" not in format_sim_table(steady)


def test_timeline_png(tmp_path):
    res = simulate_plan(CLUSTER, None, plan_from_dict(plan_dict()))
    kinds = {b.kind for b in res.timeline}
    assert kinds == {"fwd", "bwd", "send", "tied", "allreduce"}  # gpt3-xl ties its embeddings
    assert len([b for b in res.timeline if b.kind == "fwd"]) == 16 * 8
    out = tmp_path / "t.png"
    save_timeline_png(res, out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert [p.name for p in tmp_path.iterdir()] == ["t.png"]  # no temp file left behind


@pytest.mark.parametrize("sync", [SyncConfig(), SyncConfig("diloco", 50, "int8")])
def test_timeline_ends_where_the_reported_step_ends(sync):
    # The boxes must tell the same story as the numbers: the pipeline and tied sums end at the
    # makespan, the last all-reduce message arrives at makespan + the exposed sync per round.
    plan = plan_dict(sync={"mode": sync.mode, "inner_steps": sync.inner_steps,
                           "compression": sync.compression})
    res = simulate_plan(CLUSTER, None, plan_from_dict(plan))
    arrive = lambda kinds: max(b.end_s + b.latency_s for b in res.timeline if b.kind in kinds)
    assert res.tied_comm_s > 0
    assert arrive({"fwd", "bwd", "send", "tied"}) == pytest.approx(res.makespan_s, rel=1e-12)
    assert arrive({"tied"}) > arrive({"fwd", "bwd", "send"})
    assert arrive({"allreduce"}) == pytest.approx(res.makespan_s + res.dp_comm_round_s,
                                                  rel=1e-12)
    quick = simulate_plan(CLUSTER, None, plan_from_dict(plan), timeline=False)
    assert quick.parts() == pytest.approx(res.parts(), rel=1e-9, abs=1e-9)
    assert [quick.dp_comm_round_s, *quick.dp_allreduce_s] == pytest.approx(
        [res.dp_comm_round_s, *res.dp_allreduce_s], rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("over,words", [
    ({"pipelines": [[0, 1, 2, 99], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]},
     "device ids [99] are not in cluster"),
    ({"stages": [{"layers": [0, 6]}, {"layers": [6, 12]}, {"layers": [12, 18]},
                 {"layers": [18, 23]}]}, "cover layers [0, 23)"),
    ({"stages": [{"layers": [0, 6]}, {"layers": [7, 12]}, {"layers": [12, 18]},
                 {"layers": [18, 24]}]}, "must start at 6"),
    ({"sync": {"mode": "diloco", "inner_steps": 0, "compression": "int8"}}, "inner_steps"),
    ({"sync": {"mode": "diloco", "inner_steps": 5, "compression": "int4"}}, "compression"),
    ({"model": "gpt-7"}, "unknown preset"),
    ({"num_micro_batches": 400}, "needs"),
])
def test_bad_plans_name_the_problem(over, words):
    with pytest.raises(UserError, match=re.escape(words)):
        simulate_plan(CLUSTER, None, plan_from_dict(plan_dict(**over)))


def test_memory_error_names_device_and_gb():
    with pytest.raises(UserError) as err:
        simulate_plan(CLUSTER, get_model("gpt3-xl"),
                      plan_from_dict(plan_dict(num_micro_batches=400)))
    msg = str(err.value)
    assert msg.startswith("memory: device ") and " GB" in msg and "400 micro-batches" in msg
