"""`plan --sync auto`: the sync configuration chosen with the assignment, within the bounds."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_entry

from formats.cluster import Cluster, Device, save_cluster
from formats.errors import UserError
from formats.models import get_model
from formats.plan import SyncConfig, load_plan
from scheduler.cost_simulated import SimulatedObjective
from scheduler.objective import CostBreakdown
from scheduler.planning import PlanRequest
from scheduler.scenarios import make_scenario
from scheduler.scheduler import main
from scheduler.search import SearchConfig
from scheduler.simulator.config import RUNTIME_PROFILES
from scheduler.sync_search import (
    Scored,
    SyncBounds,
    SyncChoice,
    choose,
    inner_step_options,
    plan_sync_auto,
    score_choices,
    sync_choices,
)

SCHED = "scheduler/scheduler.py"
SMALL = ("--model", "gpt-tiny", "--runtime", "cpu", "--micro-batches", "4", "--budget", "300",
         "--random-samples", "50", "--time-limit", "20", "--quiet")
"""A small, fast plan: the budget, not the clock, ends each search."""


def two_sites(gbps_across: float, lat_ms_across: float = 40.0) -> Cluster:
    """8 CPU ranks in two sites of 4, 200 Mbit/s inside a site, `gbps_across` between."""
    devs = [Device(i, f"d{i}", "ab"[i // 4], f"10.0.0.{i + 1}", "CPU", 0.01, 4.0)
            for i in range(8)]
    same = np.array([[i // 4 == j // 4 for j in range(8)] for i in range(8)])
    lat = np.where(same, 2.0, lat_ms_across)
    bw = np.where(same, 0.2, gbps_across)
    np.fill_diagonal(lat, 0.0)
    np.fill_diagonal(bw, np.inf)
    return Cluster("two-sites", devs, lat, bw)


def test_inner_step_options_are_powers_of_two_and_the_bound():
    assert inner_step_options(1) == []
    assert inner_step_options(2) == [2]
    assert inner_step_options(64) == [2, 4, 8, 16, 32, 64]
    assert inner_step_options(100) == [2, 4, 8, 16, 32, 64, 100]


@pytest.mark.parametrize("max_h,dp,pp", [(1, "none", "none"), (8, "fp16", "bf16"),
                                         (3, "int8", "int8")])
def test_sync_choices_stay_within_the_bounds_least_risky_first(max_h, dp, pp):
    choices = sync_choices(SyncBounds(max_h, dp, pp))
    assert choices[0] == SyncChoice(SyncConfig(), "none")  # the safest comes first
    assert [c.risk() for c in choices] == sorted(c.risk() for c in choices)
    dp_allowed = ("none", "fp16", "int8")[:("none", "fp16", "int8").index(dp) + 1]
    pp_allowed = ("none", "bf16", "int8")[:("none", "bf16", "int8").index(pp) + 1]
    for c in choices:
        c.sync.validate()
        assert c.sync.inner_steps <= max_h and c.sync.fragments <= c.sync.inner_steps
        assert c.sync.compression in dp_allowed and c.pipeline_compression in pp_allowed
    assert {c.sync.compression for c in choices} == set(dp_allowed)
    assert {c.pipeline_compression for c in choices} == set(pp_allowed)
    assert any(c.sync.mode == "diloco" for c in choices) == (max_h > 1)
    assert len({c.label() for c in choices}) == len(choices)


def test_choose_takes_the_least_risky_within_the_tolerance():
    def scored(choice: SyncChoice, cost: float) -> Scored:
        return Scored(choice, CostBreakdown("simulated", cost), 0)

    safe = SyncChoice(SyncConfig())
    h4 = SyncChoice(SyncConfig("diloco", 4))
    h64 = SyncChoice(SyncConfig("diloco", 64, overlap=True))
    assert choose([scored(safe, 1.01), scored(h64, 1.0)]).choice == safe  # 1% is not worth it
    assert choose([scored(safe, 2.0), scored(h4, 1.015), scored(h64, 1.0)]).choice == h4
    assert choose([scored(safe, 2.0), scored(h4, 1.5), scored(h64, 1.0)]).choice == h64
    assert choose([scored(safe, float("inf"))]) is None


def auto(cluster: Cluster, bounds: SyncBounds, time_limit_s: float = 20.0):
    req = PlanRequest(0, 0, 4, 4, "simulated", search=SearchConfig(300, time_limit_s),
                      random_samples=50, sim=RUNTIME_PROFILES["cpu"])
    return plan_sync_auto(cluster, get_model("gpt-tiny"), req, bounds)


@pytest.mark.parametrize("max_h,allow_pp", [(16, "bf16"), (8, "none")])
def test_bad_link_picks_diloco_within_the_bounds(max_h, allow_pp):
    # 5 Mbit/s between the sites: allreduce's step is mostly communication
    out = auto(two_sites(0.005), SyncBounds(max_h, "none", allow_pp, 200))
    plan = out.outcome.plan
    assert plan.sync.mode == "diloco" and 2 <= plan.sync.inner_steps <= max_h
    assert plan.pipeline_compression in ("none", "bf16")[:("none", "bf16").index(allow_pp) + 1]
    assert out.allreduce.sync.mode == "allreduce"
    # ranked by predicted time to the target: DiLoCo needs more steps than allreduce (the
    # quality model) and still gets there sooner over a 5 Mbit/s link
    ours, ar = plan.predicted["to_target"], out.allreduce.predicted["to_target"]
    assert ours["target"] == ar["target"] and "after 200 steps" in ours["target"]
    assert ours["steps"] > ar["steps"] and ours["seconds"] < ar["seconds"]
    w = plan.sync.warmup_steps
    ar_step = out.allreduce_cost.cost_s
    assert ar["seconds"] == pytest.approx(ar["steps"] * ar_step, rel=1e-3)
    assert ours["seconds"] >= (ours["steps"] - w) * out.outcome.ours.cost_s * (1 - 1e-3)
    assert ours["tokens"] == pytest.approx(ours["steps"] * plan.num_replicas * 16 * 64,
                                           rel=1e-4)
    assert plan.predicted["cost"] == pytest.approx(out.outcome.ours.cost_s, abs=1e-6)
    assert plan.search["sync_auto"]["allreduce"]["sync"]["mode"] == "allreduce"


def test_fast_links_keep_allreduce():
    # every link fast: an all-reduce of all 8 replicas costs < 1% of the step (200 Mbit/s
    # inside a site, or 0.1 ms per ring step, would cost 2.4%: DiLoCo H=2 then buys > 2%)
    slow_inside = two_sites(100.0, 0.1)
    bw = np.full_like(slow_inside.bandwidth_gbps, 1000.0)
    np.fill_diagonal(bw, np.inf)
    fast = Cluster("fast", slow_inside.devices, np.minimum(slow_inside.latency_ms, 0.01), bw)
    assert auto(fast, SyncBounds(1)).outcome.plan.sync.mode == "allreduce"
    # even when DiLoCo is allowed, it must buy more than the tolerance to be taken
    out = auto(fast, SyncBounds(64, "int8", "int8"))
    assert out.outcome.plan.sync == SyncConfig()
    assert out.outcome.plan.pipeline_compression == "none"


def test_auto_needs_the_simulated_objective():
    req = PlanRequest(0, 0, 1, 4, "dtfm")
    with pytest.raises(UserError, match="PlanRequest.objective"):
        plan_sync_auto(make_scenario("badlink"), get_model("gpt-tiny"), req, SyncBounds(8))


def test_cli_prints_both_plans_and_writes_the_choice(tmp_path):
    cluster, plan, ar = tmp_path / "c.json", tmp_path / "p.json", tmp_path / "ar.json"
    save_cluster(two_sites(0.02), cluster)
    r = run_entry(SCHED, "plan", "--cluster", str(cluster), *SMALL, "--sync", "auto",
                  "--max-inner-steps", "32", "--allow-pipeline-compression", "int8",
                  "--compression", "fp16", "--out", str(plan), "--allreduce-out", str(ar))
    assert r.returncode == 0, r.stderr
    for row in ("chosen:", "allreduce:", "step time (s)", "exposed pipeline comm",
                "exposed DP / outer sync", "hidden DP / outer sync", "pipeline MB per step",
                "the sequences per second of the best allreduce plan"):
        assert row in r.stdout
    saved = load_plan(plan)
    assert saved.sync.mode == "diloco" and saved.sync.inner_steps <= 32
    assert saved.sync.compression in ("none", "fp16")
    assert load_plan(ar).sync.mode == "allreduce"
    # simulate and evaluate read the written sync and pipeline compression
    sim = run_entry(SCHED, "simulate", "--cluster", str(cluster), "--plan", str(plan), "--json")
    assert sim.returncode == 0, sim.stderr
    out = json.loads(sim.stdout)
    assert out["step_s"] == pytest.approx(saved.predicted["cost"], rel=1e-5)
    assert out["pipeline_compression"] == saved.pipeline_compression
    assert out["sync"]["overlap"] == saved.sync.overlap
    ev = run_entry(SCHED, "evaluate", "--cluster", str(cluster), "--plan", str(plan), "--json")
    assert json.loads(ev.stdout)["cost"] == pytest.approx(saved.predicted["cost"], rel=1e-5)


def test_cli_json_has_both_breakdowns(tmp_path):
    r = run_entry(SCHED, "plan", "--scenario", "badlink", *SMALL, "--sync", "auto",
                  "--micro-batch-size", "4", "--train-steps", "200", "--max-inner-steps", "8",
                  "--out", str(tmp_path / "p.json"), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["chosen"]["sync"]["mode"] == "diloco" and out["allreduce"]["sync"]["mode"] == \
        "allreduce"
    per_seq = lambda e: e["cost"] / e["num_replicas"]  # noqa: E731 - widths may differ
    assert out["speedup_vs_allreduce"] == pytest.approx(
        per_seq(out["allreduce"]) / per_seq(out["chosen"]))
    for key in ("step_s", "pp_comm_s", "dp_comm_s", "dp_hidden_s", "pp_bytes_per_step"):
        assert key in out["chosen"]["parts"] and key in out["allreduce"]["parts"]


def test_fixed_diloco_flags_are_written(tmp_path):
    plan = tmp_path / "p.json"
    r = run_entry(SCHED, "plan", "--scenario", "badlink", *SMALL, "--sync", "diloco",
                  "--inner-steps", "8", "--overlap", "--fragments", "2",
                  "--pipeline-compression", "int8", "--sync-warmup-steps", "40", "--out",
                  str(plan))
    assert r.returncode == 0, r.stderr
    saved = load_plan(plan)
    assert saved.sync == SyncConfig("diloco", 8, overlap=True, fragments=2, warmup_steps=40)
    assert saved.pipeline_compression == "int8"


@pytest.mark.parametrize("args,flag", [
    (("--sync", "auto", "--max-inner-steps", "0"), "--max-inner-steps"),
    (("--sync", "diloco", "--max-inner-steps", "4"), "--max-inner-steps"),
    (("--allow-pipeline-compression", "bf16"), "--allow-pipeline-compression"),
    (("--sync", "auto", "--allow-pipeline-compression", "fp8"), "--allow-pipeline-compression"),
    (("--sync", "auto", "--inner-steps", "4"), "--inner-steps"),
    (("--sync", "auto", "--pipeline-compression", "bf16"), "--pipeline-compression"),
    (("--sync", "auto", "--objective", "dtfm"), "--objective"),
    (("--sync", "diloco", "--inner-steps", "2", "--fragments", "4"), "--fragments"),
    (("--overlap",), "--overlap"),
    (("--pipeline-compression", "int8", "--objective", "dtfm"), "--pipeline-compression"),
    (("--allreduce-out", "x.json"), "--allreduce-out"),
    (("--sync", "auto", "--sync-warmup-steps", "4"), "--sync-warmup-steps"),
    (("--sync-warmup-steps", "4"), "--sync-warmup-steps"),
    (("--sync", "diloco", "--sync-warmup-steps", "-1"), "--sync-warmup-steps"),
    (("--train-steps", "400"), "--train-steps"),
    (("--sync", "auto", "--max-loss-ratio", "0.5"), "--max-loss-ratio"),
])
def test_bad_flags_exit_2_naming_the_flag(tmp_path, capsys, args, flag):
    out = tmp_path / "p.json"
    argv = ["plan", "--scenario", "badlink", "--model", "gpt-tiny", *args, "--out", str(out),
            "--quiet"]
    try:
        status = main(argv)  # in-process: a subprocess per case costs seconds of imports
    except SystemExit as e:  # argparse's own checks
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("tolerance", [0.0, 0.02, 0.2])
def test_pruned_scoring_chooses_what_scoring_everything_chooses(tolerance):
    cluster, model = make_scenario("badlink", 1), get_model("gpt-tiny")
    obj = SimulatedObjective(cluster, model, None, 1, 4, RUNTIME_PROFILES["cpu"])
    rng = np.random.default_rng(0)
    pipes = [rng.permutation(8).reshape(2, 4), rng.permutation(8).reshape(4, 2)]
    choices = sync_choices(SyncBounds(32, "int8", "int8"))
    pruned = score_choices([obj, obj], pipes, choices, float("inf"), tolerance)
    everything = [Scored(c, CostBreakdown("simulated", obj.with_sync(
        c.sync, c.pipeline_compression).cost(p)), k) for c in choices for k, p in enumerate(pipes)]
    assert len(pruned) < len(everything)
    best, full = choose(pruned, tolerance), choose(everything, tolerance)
    assert (best.choice, best.anchor) == (full.choice, full.anchor)
    assert best.cost.cost_s == full.cost.cost_s
