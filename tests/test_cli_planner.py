"""`python scheduler/scheduler.py`: round trips and user errors (exit 2, nothing written).

Most tests run the script in this interpreter (`sched`: testkit/help_texts.run_script, as
`__main__` with its argv, its output and exit status captured), which saves a fresh interpreter
and its imports a call; test_bad_budget_exits_2_and_writes_nothing and
test_runs_as_a_module_and_the_budget_caps_evaluations start real processes (the script, and
`python -m scheduler.scheduler`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, run_entry
from test_cluster_formats import tiny_cluster_dict

from testkit.help_texts import run_script

SCHED = "scheduler/scheduler.py"


def sched(*args: str) -> subprocess.CompletedProcess:
    """`python scheduler/scheduler.py ARGS...`, run in this interpreter."""
    return run_script(str(ROOT / SCHED), *args)


def test_scenario_plan_evaluate_round_trip(tmp_path):
    cluster, plan = tmp_path / "c.json", tmp_path / "p.json"
    r = sched("scenario", "universities", "--seed", "2", "--out", str(cluster))
    assert r.returncode == 0, r.stderr
    r = sched("plan", "--cluster", str(cluster), "--model", "gpt3-xl", "--stages", "8",
              "--replicas", "8", "--budget", "2500", "--out", str(plan), "--json", "--quiet",
              "--plot", str(tmp_path / "p.png"), "--objective", "dtfm")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    saved = json.loads(plan.read_text())
    assert saved["predicted"]["objective"] == "dtfm"
    assert saved["predicted"]["cost"] == pytest.approx(summary["predicted"]["cost"])
    assert summary["ratio_vs_random"] < 1 and summary["ratio_vs_index"] < 1
    assert sorted(d for chain in saved["pipelines"] for d in chain) == list(range(64))
    assert (tmp_path / "p.png").stat().st_size > 10_000
    r = sched("evaluate", "--cluster", str(cluster), "--plan", str(plan), "--json",
              "--objective", "dtfm")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["cost"] == pytest.approx(saved["predicted"]["cost"], rel=1e-5)


def test_plan_prints_a_table_with_baselines(tmp_path):
    r = sched("plan", "--scenario", "spot", "--model", "gpt3-xl", "--stages", "8",
              "--replicas", "8", "--budget", "1500", "--out", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    for row in ("ours (evolutionary)", "hand-structured (regions)", "best of 1000 random",
                "index order", "evaluations", "dp_comm_s", "pp_comm_s"):
        assert row in r.stdout
    evaluations = json.loads((tmp_path / "p.json").read_text())["search"]["evaluations"]
    assert 0 < evaluations <= 1500
    assert "searching:" in r.stderr


def _bad(raw_mutation):
    raw = tiny_cluster_dict(4)
    raw_mutation(raw)
    return raw


@pytest.mark.parametrize("raw,message", [
    (_bad(lambda d: d["bandwidth_gbps"].pop()), "bandwidth_gbps: expected 4 rows"),
    (_bad(lambda d: d["latency_ms"][2].append(1.0)), "latency_ms[2]: expected 4 values"),
    (_bad(lambda d: d["bandwidth_gbps"][0].__setitem__(1, -2)), "bandwidth_gbps[0][1]"),
    (_bad(lambda d: d["bandwidth_gbps"][3].__setitem__(1, 0)), "bandwidth_gbps[3][1]"),
    (_bad(lambda d: d["bandwidth_gbps"][1].__setitem__(0, float("nan"))), "bandwidth_gbps[1][0]"),
    (_bad(lambda d: d["devices"][0].pop("memory_gb")), "missing key 'memory_gb'"),
    (_bad(lambda d: d["devices"][3].__setitem__("id", 1)), "duplicate id 1"),
])
def test_bad_cluster_exits_2_and_writes_nothing(tmp_path, raw, message):
    cluster, out = tmp_path / "c.json", tmp_path / "p.json"
    cluster.write_text(json.dumps(raw))
    r = sched("plan", "--cluster", str(cluster), "--model", "gpt-tiny", "--stages",
              "2", "--replicas", "2", "--out", str(out))
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and "np.float64" not in r.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == [cluster]


@pytest.mark.parametrize("args,message", [
    (["--model", "gpt-huge", "--stages", "2", "--replicas", "2"], "unknown preset 'gpt-huge'"),
    (["--model", "gpt-tiny", "--stages", "3", "--replicas", "2"], "3 x --replicas 2 = 6"),
    (["--model", "gpt-tiny", "--stages", "4", "--replicas", "1", "--sync", "diloco",
      "--inner-steps", "0"], "sync.inner_steps"),
    (["--model", "gpt-tiny", "--stages", "2", "--replicas", "2", "--mfu", "1.5"],
     "--mfu: must be in (0, 1]"),
])
def test_bad_arguments_exit_2(tmp_path, args, message):
    cluster, out = tmp_path / "c.json", tmp_path / "p.json"
    cluster.write_text(json.dumps(tiny_cluster_dict(4)))
    r = sched("plan", "--cluster", str(cluster), *args, "--out", str(out))
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_evaluate_rejects_a_plan_for_another_cluster(tmp_path):
    small, plan = tmp_path / "small.json", tmp_path / "p.json"
    small.write_text(json.dumps(tiny_cluster_dict(4)))
    assert sched("plan", "--scenario", "datacenter", "--model", "gpt3-xl", "--stages",
                 "8", "--replicas", "8", "--budget", "500", "--out", str(plan),
                 "--quiet").returncode == 0
    r = sched("evaluate", "--cluster", str(small), "--plan", str(plan))
    assert r.returncode == 2 and "are not in cluster 'tiny'" in r.stderr


def test_help_is_truthful():
    r = sched("plan", "--help")
    assert r.returncode == 0
    for flag in ("--scenario", "--cluster", "--stages", "--replicas", "--objective", "--budget",
                 "--search-seed", "--out", "--plot", "--json"):
        assert flag in r.stdout


def test_evaluate_scores_a_hand_written_plan(tmp_path):
    # A plan not made by us: only the keys plan/1 requires, no predicted/search blocks.
    cluster, plan = tmp_path / "c.json", tmp_path / "p.json"
    cluster.write_text(json.dumps(tiny_cluster_dict(4)))
    plan.write_text(json.dumps({"format": "plan/1", "model": "gpt-tiny",
                                "stages": [{"layers": [0, 2]}, {"layers": [2, 4]}],
                                "pipelines": [[3, 1], [0, 2]]}))
    r = sched("evaluate", "--cluster", str(cluster), "--plan", str(plan), "--json",
              "--objective", "dtfm")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    # By hand: 5 ms and 1 Gbps everywhere; one DP peer, one boundary each way.
    from formats.models import get_model
    from scheduler.cost_dtfm import dtfm_constants
    c = dtfm_constants(get_model("gpt-tiny"), 2, 1)
    dp = 2 * (0.005 + c.gradient_gb / 2 * 8 / 1.0)
    pp = 2 * (0.005 + c.activation_gb * 8 / 1.0)
    assert got["dp_comm_s"] == pytest.approx(dp) and got["pp_comm_s"] == pytest.approx(pp)
    assert got["cost"] == pytest.approx(dp + pp)


def test_evaluate_names_a_bad_plan(tmp_path):
    cluster, plan = tmp_path / "c.json", tmp_path / "p.json"
    cluster.write_text(json.dumps(tiny_cluster_dict(4)))
    plan.write_text(json.dumps({"format": "plan/1", "model": "gpt-tiny",
                                "stages": [{"layers": [0, 2]}, {"layers": [2, 4]}],
                                "pipelines": [[3, 1], [3, 2]]}))
    r = sched("evaluate", "--cluster", str(cluster), "--plan", str(plan))
    assert r.returncode == 2 and "device 3 appears twice" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_budget_exits_2_and_writes_nothing(tmp_path):
    out = tmp_path / "p.json"
    r = run_entry(SCHED, "plan", "--scenario", "datacenter", "--model", "gpt3-xl", "--stages",
                  "8", "--replicas", "8", "--budget", "0", "--out", str(out))
    assert r.returncode == 2 and "--budget" in r.stderr and not out.exists()
    assert "error: argument --budget: must be in [1, " in r.stderr and "Traceback" not in r.stderr


def test_runs_as_a_module_and_the_budget_caps_evaluations(tmp_path):
    import sys

    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-m", "scheduler.scheduler", "plan", "--scenario",
                        "regional", "--seed", "1", "--model", "gpt3-xl", "--stages", "8",
                        "--replicas", "8", "--budget", "300", "--search-seed", "3", "--out",
                        str(out), "--json", "--quiet"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["evaluations"] <= 300 and summary["search"]["seed"] == 3
    saved = json.loads(out.read_text())
    assert saved["num_micro_batches"] == 61 and saved["micro_batch_size"] == 1
    assert set(saved["predicted"]) >= {"objective", "cost", "dp_comm_s", "pp_comm_s"}
    assert summary["baselines"]["index order"]["cost"] >= summary["cost"]


def test_default_objective_is_simulated_and_simulate_replays_the_plan(tmp_path):
    cluster, plan, png = tmp_path / "c.json", tmp_path / "p.json", tmp_path / "t.png"
    assert sched("scenario", "mixed", "--seed", "1", "--out",
                 str(cluster)).returncode == 0
    r = sched("plan", "--cluster", str(cluster), "--model", "gpt3-xl", "--stages", "8",
              "--replicas", "8", "--budget", "600", "--random-samples", "50",
              "--sync", "diloco", "--inner-steps", "50", "--compression", "int8",
              "--out", str(plan), "--quiet")
    assert r.returncode == 0, r.stderr
    saved = json.loads(plan.read_text())
    assert saved["predicted"]["objective"] == "simulated"
    assert saved["sync"] == {"mode": "diloco", "inner_steps": 50, "compression": "int8",
                             "outer_lr": 0.7, "outer_momentum": 0.9, "overlap": False,
                             "fragments": 1}
    assert saved["pipeline_compression"] == "none"
    r = sched("simulate", "--cluster", str(cluster), "--plan", str(plan), "--json",
              "--timeline", str(png))
    assert r.returncode == 0, r.stderr
    sim = json.loads(r.stdout)
    assert sim["step_s"] == pytest.approx(saved["predicted"]["step_s"], rel=1e-6)
    r = sched("evaluate", "--cluster", str(cluster), "--plan", str(plan), "--json")
    assert r.returncode == 0, r.stderr  # scores the plan's own layer split
    assert json.loads(r.stdout)["cost"] == pytest.approx(saved["predicted"]["cost"], rel=1e-6)
    assert png.stat().st_size > 10_000


def test_shapes_are_searched_when_stages_and_replicas_are_left_out(tmp_path):
    plan = tmp_path / "p.json"
    r = sched("plan", "--scenario", "random", "--seed", "3", "--model", "gpt-small",
              "--budget", "300", "--random-samples", "20", "--micro-batches", "4",
              "--out", str(plan), "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    saved = json.loads(plan.read_text())
    assert saved["search"]["shapes_tried"] == [[1, 64], [2, 32], [4, 16], [8, 8]] or \
        len(saved["search"]["shapes_tried"]) >= 3
    assert saved["num_stages"] * saved["num_replicas"] == 64


def test_simulate_rejects_a_plan_that_does_not_fit_in_memory(tmp_path):
    cluster, plan = tmp_path / "c.json", tmp_path / "p.json"
    assert sched("scenario", "worldwide", "--out", str(cluster)).returncode == 0
    chains = [[r * 2, r * 2 + 1] for r in range(32)]  # gpt3-xl in 2 stages: 12 layers a V100
    plan.write_text(json.dumps({"format": "plan/1", "model": "gpt3-xl",
                                "stages": [{"layers": [0, 12]}, {"layers": [12, 24]}],
                                "pipelines": chains, "num_micro_batches": 61}))
    r = sched("simulate", "--cluster", str(cluster), "--plan", str(plan))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "device" in r.stderr and "GB" in r.stderr


def test_performance_model_flags_are_recorded_in_the_plan_and_reused(tmp_path):
    cluster, plan = tmp_path / "c.json", tmp_path / "p.json"
    assert sched("scenario", "lab", "--out", str(cluster)).returncode == 0
    r = sched("plan", "--cluster", str(cluster), "--model", "gpt-tiny", "--stages",
              "4", "--replicas", "2", "--micro-batch-size", "4", "--micro-batches", "4",
              "--mfu", "1", "--activation-bytes", "4", "--recompute", "off", "--budget", "300",
              "--random-samples", "20", "--out", str(plan), "--quiet")
    assert r.returncode == 0, r.stderr
    saved = json.loads(plan.read_text())
    cfg = saved["search"]["sim_config"]
    assert (cfg["mfu"], cfg["activation_bytes"], cfg["recompute"]) == (1.0, 4, False)
    sim = lambda *extra: json.loads(sched("simulate", "--cluster", str(cluster),
                                          "--plan", str(plan), "--json", *extra).stdout)
    same = sim()  # the plan's own performance model by default
    assert same["step_s"] == pytest.approx(saved["predicted"]["step_s"], abs=2e-6)
    gpu = sim("--mfu", "0.4", "--activation-bytes", "2", "--recompute", "on")
    assert gpu["pp_comm_s"] < same["pp_comm_s"]  # half the activation bytes on the wire
    assert gpu["compute_s"] == pytest.approx(same["compute_s"] * 4 / 3 / 0.4, rel=1e-5)


def test_simulate_reports_a_warmup_plans_run_mean_step(tmp_path):
    cluster, plan = tmp_path / "c.json", tmp_path / "p.json"
    assert sched("scenario", "lab", "--out", str(cluster)).returncode == 0
    r = sched("plan", "--cluster", str(cluster), "--model", "gpt-tiny", "--stages", "2",
              "--replicas", "4", "--sync", "diloco", "--inner-steps", "4",
              "--sync-warmup-steps", "250", "--budget", "100", "--random-samples", "10",
              "--out", str(plan), "--quiet")
    assert r.returncode == 0, r.stderr
    r = sched("simulate", "--cluster", str(cluster), "--plan", str(plan), "--json")
    assert r.returncode == 0, r.stderr
    sim = json.loads(r.stdout)
    warm = sim["warmup"]
    assert (warm["warmup_steps"], warm["train_steps"], warm["train_steps_from"]) == \
        (250, 1000, "default")
    assert sim["sync"]["warmup_steps"] == 250 and warm["allreduce_step_s"] > sim["step_s"]
    assert sim["run_step_s"] == pytest.approx(
        (250 * warm["allreduce_step_s"] + 750 * sim["step_s"]) / 1000, abs=1e-5)
    r = sched("simulate", "--cluster", str(cluster), "--plan", str(plan))
    assert "run mean step (warm-up)" in r.stdout and "the runner's --steps default" in r.stdout


@pytest.mark.parametrize("body, status, out, err", [
    ("sys.stdout.write('table'); sys.stderr.write('progress'); return 3", 3, "table",
     "progress"),
    ("print('half'); raise UserError('--out: no such folder')", 2, "half\n",
     "error: --out: no such folder\n"),
])
def test_an_entry_point_without_teardown_flushes_its_output_and_keeps_its_status(
        body, status, out, err):
    """run_main(skip_teardown=True) (the planner's entry point: it skips the interpreter's
    teardown, 0.05-0.07 s) still delivers every byte written, unterminated lines included,
    and the exit status; a user error still prints its one line and exits 2."""
    code = ("import sys\nfrom formats.errors import UserError, run_main\n"
            f"def main(argv):\n    {body}\nrun_main(main, skip_teardown=True)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (status, out, err)
