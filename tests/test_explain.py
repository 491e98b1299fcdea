"""`scheduler.py explain`: measured vs predicted per stage and rank, and the named cause.

Synthetic cases start from the simulator's own prediction of a 2 x 2 plan (so a run that
matches the model names nothing) and change one thing: one device computes 3x slower, one
link adds pipeline waiting to both its ends, every device computes 2x slower.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from formats.cluster import Cluster, Device, load_cluster, save_cluster
from formats.errors import UserError
from formats.plan import Plan, load_plan, save_plan
from scheduler.explain import explain, format_explanation, positions, predict
from scheduler.scheduler import main as scheduler_main
from scheduler.simulator.config import RUNTIME_PROFILES
from scheduler.simulator.kernel import no_transfers
from scheduler.simulator.replay import replay_fast
from tests.conftest import run_entry
from tests.test_tracking import two_rank_run

CPU = RUNTIME_PROFILES["cpu"]


def cluster4() -> Cluster:
    devices = [Device(i, f"d{i}", "A", f"10.0.0.{i + 1}", "cpu", 0.05, 8.0) for i in range(4)]
    lat = [[0 if i == j else 5.0 for j in range(4)] for i in range(4)]
    bw = [[1.0] * 4 for _ in range(4)]
    return Cluster("four", devices, lat, bw)


def plan4(cluster: Cluster) -> Plan:
    return Plan("four", cluster.sha256(), "gpt-tiny", [(0, 2), (2, 4)], [[0, 1], [2, 3]],
                micro_batch_size=2, num_micro_batches=4)


def records(plan: Plan, cluster: Cluster, compute_factor=None, pp_extra=None, dp_extra=None,
            steps: int = 3, fsdp_factor=None) -> dict[int, list[dict]]:
    """Per-rank timing records as the prediction says, with the given changes (seconds added
    to a rank's pipeline or data-parallel wait, factors on its compute or, with shard groups,
    on its FSDP seconds, recorded apart as the runtime does)."""
    pred = predict(plan, cluster, CPU)
    where = positions(plan)
    out = {}
    for d, p in pred.ranks.items():
        compute = p.compute_s * (compute_factor or {}).get(d, 1.0)
        fsdp = p.fsdp_s * (fsdp_factor or {}).get(d, 1.0)
        pp = p.waiting_s + p.pp_s + (pp_extra or {}).get(d, 0.0)
        comm = pp + p.dp_s + (dp_extra or {}).get(d, 0.0)
        out[d] = [{"step": k, "rank": d, "replica": where[d][0], "stage": where[d][1],
                   "step_s": compute + comm + fsdp, "compute_s": compute, "comm_s": comm,
                   "pp_wait_s": pp, "fsdp_s": fsdp} for k in range(1, steps + 1)]
    return out


def names(ex) -> list[str]:
    return [c.name for c in ex.causes]


def test_the_prediction_itself_names_nothing():
    c = cluster4()
    ex = explain(plan4(c), c, CPU, records(plan4(c), c))
    assert names(ex) == []
    assert ex.measured_step_s == pytest.approx(ex.predicted_step_s, rel=1e-9)
    for row in ex.rows:
        assert row.measured.compute_s == pytest.approx(row.predicted.compute_s)
        assert row.measured.step_s == pytest.approx(row.predicted.step_s)


def test_the_tied_embedding_sum_counts_as_data_parallel_sync():
    """The runtime times the tied-embedding sum outside its pipeline receives (pp_wait_s), so
    the prediction counts it in dp too: a run as the model says, recorded that way, names
    nothing (it named a slow sync of the sum's seconds when the prediction put them in pp)."""
    c = cluster4()
    plan = plan4(c)
    pred = predict(plan, c, CPU)
    times = replay_fast(pred.inputs)
    tied = pred.inputs.tied_s
    assert tied is not None and tied.max() > 0.1 * times.step_s
    free = replay_fast(no_transfers(pred.inputs)).makespan_s
    where = {d: (r, s) for r, pipe in enumerate(plan.pipelines) for s, d in enumerate(pipe)}
    recs = {}
    for d, p in pred.ranks.items():
        assert p.pp_s == pytest.approx(times.pipeline_s - free)
        assert p.dp_s == pytest.approx(times.step_s - times.pipeline_s)
        pp_wait = p.waiting_s + times.pipeline_s - free  # receives only: no tied sum in it
        step = times.step_s
        recs[d] = [{"step": k, "rank": d, "replica": where[d][0], "stage": where[d][1],
                    "step_s": step, "compute_s": p.compute_s, "comm_s": step - p.compute_s,
                    "pp_wait_s": pp_wait} for k in (1, 2, 3)]
    assert names(explain(plan, c, CPU, recs)) == []


def test_straggler_device_is_named():
    c = cluster4()
    plan = plan4(c)
    pred = predict(plan, c, CPU)
    slow = 3.0 * pred.ranks[3].compute_s
    delay = slow - pred.ranks[3].compute_s  # the others wait for it
    others = {d: delay for d in (0, 1, 2)}
    ex = explain(plan, c, CPU, records(plan, c, {3: 3.0}, pp_extra=others))
    assert names(ex)[0] == "straggler device 3"
    assert "mis-estimated FLOP/s" not in names(ex)
    assert not [n for n in names(ex) if n.startswith("slow link")]
    assert "leave device 3 out" in ex.causes[0].fix


def test_slow_stage_is_named_not_its_devices():
    c = cluster4()
    plan = plan4(c)
    ex = explain(plan, c, CPU, records(plan, c, {1: 2.5, 3: 2.5}))
    assert names(ex)[0] == "slow stage 1"
    assert not [n for n in names(ex) if n.startswith("straggler")]


def test_slow_link_is_named():
    c = cluster4()
    plan = plan4(c)
    extra = 2.0 * predict(plan, c, CPU).step_s
    # both ends of link 2-3 wait on pipeline transfers; replica 0 waits for it in the sync
    ex = explain(plan, c, CPU, records(plan, c, pp_extra={2: extra, 3: extra},
                                       dp_extra={0: extra, 1: extra}))
    assert names(ex)[0] == "slow link 2-3"
    assert ex.causes[0].seconds == pytest.approx(extra, rel=1e-6)
    assert "slow link 0-1" not in names(ex)
    assert not [n for n in names(ex) if n.startswith("straggler")]
    assert "tc.py probe" in ex.causes[0].fix


def test_slow_sync_is_named():
    c = cluster4()
    plan = plan4(c)
    extra = predict(plan, c, CPU).step_s
    ex = explain(plan, c, CPU, records(plan, c, dp_extra={0: extra, 2: extra}))
    assert names(ex) == ["slow data-parallel sync of stage 0"]
    assert "--compression int8" in ex.causes[0].fix


def test_a_sync_faster_than_predicted_is_named_and_a_spread_miss_is_not_called_a_match():
    """Every rank of stage 0 waiting less on the sync than predicted (the model over-charges
    it) is named; a step off by 10% or more with no single cause says the difference is
    spread, not that the model matches the run."""
    c = cluster4()
    plan = plan4(c)
    pred = predict(plan, c, CPU)
    less = {d: -pred.ranks[d].dp_s for d in (0, 2)}  # stage 0's ring hides its sync entirely
    ex = explain(plan, c, CPU, records(plan, c, dp_extra=less))
    assert names(ex) == ["data-parallel sync of stage 0 faster than predicted"]
    assert ex.causes[0].seconds == pytest.approx(min(-x for x in less.values()), rel=1e-6)
    assert "may have lost to worse ones" in ex.causes[0].fix
    bit = {d: 0.07 * pred.step_s for d in range(4)}  # 7% more sync and 5% more pipeline each
    spread = explain(plan, c, CPU, records(plan, c, dp_extra=bit,
                                           pp_extra={d: 0.05 * pred.step_s for d in range(4)}))
    assert names(spread) == [] and spread.measured_step_s > 1.1 * spread.predicted_step_s
    assert "the difference is spread" in format_explanation(spread)


def test_diloco_means_leave_out_the_warm_up_and_cover_whole_rounds():
    """With DiLoCo the means start after the all-reduce warm-up (rounded up to a round) and
    end at the last whole round: steps 6-20 of 23 with warmup_steps 5 and H = 5 (the warm-up's
    every-step all-reduces are not the step the simulator predicts); without a warm-up the
    first round is left out; an allreduce plan leaves out the first step only."""
    from formats.plan import SyncConfig
    from scheduler.explain import mean_timing, steady_window

    recs = [{"step": k, "step_s": 1.0 if k <= 5 else float(k), "compute_s": 0.1,
             "comm_s": 0.9 if k <= 5 else 0.0} for k in range(1, 24)]
    diloco = replace(plan4(cluster4()), sync=SyncConfig("diloco", 5, "int8", warmup_steps=5))
    skip, rounds, why = steady_window(diloco)
    assert (skip, rounds) == (5, 5) and "warm-up (5 steps)" in why
    m = mean_timing(recs, skip, rounds)
    assert (m.steps, m.step_s, m.comm_s) == (15, pytest.approx(13.0), 0.0)
    assert steady_window(replace(diloco, sync=SyncConfig("diloco", 5, "int8")))[:2] == (1, 5)
    assert steady_window(plan4(cluster4()))[:2] == (1, 1)
    assert mean_timing(recs).steps == 22
    assert mean_timing(recs[:4], 5, 5).steps == 3  # too short for a round: all but the first


def test_wrong_flops_is_named():
    c = cluster4()
    plan = plan4(c)
    ex = explain(plan, c, CPU, records(plan, c, {d: 2.0 for d in range(4)}))
    assert names(ex)[0] == "mis-estimated FLOP/s"
    assert not [n for n in names(ex) if n.startswith(("straggler", "slow"))]
    fix = ex.causes[0].fix  # what a user can run: the installed measure script, not testkit
    assert "python scripts/measure.py --hosts" in fix and "--mfu 0.5" in fix, fix
    assert "testkit" not in fix, fix
    text = format_explanation(ex)
    assert text.count("\n") >= 6 and "biggest difference: mis-estimated FLOP/s" in text


def test_a_uniform_compute_miss_of_a_fifth_is_named():
    """Every rank computing 1.2x its prediction (a machine slower than its calibration, as
    in the demo's 1 x 8 row: 1.22x, 16% of the step) is a mis-estimated FLOP/s, not 'the
    plan's model matches this run'; 1.05x stays unnamed."""
    fast = cluster4()  # devices 10x slower than cluster4's: compute most of the step
    c = Cluster("four", [Device(d.id, d.name, d.region, d.host, d.gpu, 0.005, d.memory_gb)
                         for d in fast.devices], fast.latency_ms, fast.bandwidth_gbps)
    plan = plan4(c)
    ex = explain(plan, c, CPU, records(plan, c, {d: 1.2 for d in range(4)}))
    assert names(ex) == ["mis-estimated FLOP/s"]
    assert "1.20x the predicted time" in ex.causes[0].detail
    assert names(explain(plan, c, CPU, records(plan, c, {d: 1.05 for d in range(4)}))) == []


def test_the_cluster_at_the_measured_speeds_predicts_the_run_it_came_from():
    """measured_cluster: device 3 computing 2x and the others 1.25x their predictions get
    tflops / 2 and / 1.25; the same records against a prediction for that cluster show no
    compute difference left (and no cause); devices outside the run keep their tflops."""
    from scheduler.explain import measured_cluster
    c = cluster4()
    plan = Plan("four", c.sha256(), "gpt-tiny", [(0, 2), (2, 4)], [[0, 1], [2, 3]],
                micro_batch_size=2, num_micro_batches=4)
    recs = records(plan, c, {0: 1.25, 1: 1.25, 2: 1.25, 3: 2.0})
    ex = explain(plan, c, CPU, recs)
    fixed = measured_cluster(c, ex.rows)
    assert [d.tflops for d in fixed.devices] == pytest.approx([0.04, 0.04, 0.04, 0.025])
    again = explain(plan, fixed, CPU, recs)
    for row in again.rows:
        assert row.predicted.compute_s == pytest.approx(row.measured.compute_s, rel=1e-6)
    # no compute cause left; the records keep the first prediction's sync waits, of which the
    # slower cluster's prediction exposes more: named as a sync faster than predicted
    assert names(again) == ["data-parallel sync of stage 0 faster than predicted"]
    six = Cluster("six", [*c.devices, *[replace(c.devices[0], id=i, name=f"d{i}")
                                        for i in (4, 5)]],
                  [[0 if i == j else 5.0 for j in range(6)] for i in range(6)],
                  [[1.0] * 6 for _ in range(6)])
    assert [d.tflops for d in measured_cluster(six, ex.rows).devices][4:] == [0.05, 0.05]


def test_records_of_another_plan_are_refused():
    c = cluster4()
    plan = plan4(c)
    recs = records(plan, c)
    other = Plan("four", "", "gpt-tiny", [(0, 2), (2, 4)], [[0, 2], [1, 3]],
                 micro_batch_size=2, num_micro_batches=4)
    with pytest.raises(UserError, match="another plan"):
        explain(other, c, CPU, recs)
    del recs[3]
    with pytest.raises(UserError, match=r"no timing records of ranks \[3\]"):
        explain(plan, c, CPU, recs)


@pytest.mark.timeout(200)
def test_explain_on_a_real_run(tmp_path, capsys):
    _, run = two_rank_run(tmp_path)
    args = ["explain", "--plan", str(tmp_path / "plan.json"), "--metrics", str(run),
            "--cluster", str(tmp_path / "cluster.json"), "--runtime", "cpu"]
    p = run_entry("scheduler/scheduler.py", *args)  # once as a real process
    assert p.returncode == 0, p.stderr
    rows = [line.split() for line in p.stdout.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert [r[:3] for r in rows] == [["0", "0", "0"], ["1", "1", "0"]]  # stage, rank, replica
    assert scheduler_main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in out["rows"]] == [0, 1] and out["measured_step_s"] > 0
    written = tmp_path / "measured" / "cluster.json"
    under_a_file = tmp_path / "plan.json" / "x.json"
    assert scheduler_main([*args, "--write-cluster", str(under_a_file)]) == 2
    assert "--write-cluster" in capsys.readouterr().err
    assert scheduler_main([*args, "--write-cluster", str(written)]) == 0
    assert f"wrote {written}" in capsys.readouterr().out
    assert [d.id for d in load_cluster(written).devices] == [0, 1]
    # bad inputs: exit 2 with the reason
    other = tmp_path / "other.json"
    save_plan(Plan("two", "", "gpt-tiny", [(0, 2), (2, 4)], [[1, 0]]), other)
    bad = {"no such folder": ["--metrics", str(tmp_path / "nope")],
           "no metrics records": ["--metrics", str(tmp_path)],
           "not the plan the run": ["--plan", str(other)]}
    for want, change in bad.items():
        argv = list(args)
        argv[argv.index(change[0]) + 1] = change[1]
        assert scheduler_main(argv) == 2
        assert want in capsys.readouterr().err
    no_cluster = [a for a in args if a not in ("--cluster", str(tmp_path / "cluster.json"))]
    assert scheduler_main(no_cluster) == 2
    assert "--cluster: not given" in capsys.readouterr().err
    # a plan with a predicted time to a target (one every evaluation reaches): predicted
    # against measured time to it, and which error is larger
    plan = load_plan(tmp_path / "plan.json")
    plan.predicted["to_target"] = {"target": "validation loss 99", "loss": 99.0, "steps": 2.0,
                                   "tokens": 16, "seconds": 0.5, "flags": []}
    save_plan(plan, tmp_path / "plan-target.json")
    argv = list(args)
    argv[argv.index("--plan") + 1] = str(tmp_path / "plan-target.json")
    assert scheduler_main(argv) == 0
    text = capsys.readouterr().out
    assert "time to the target (validation loss 99, loss 99.000): measured" in text
    assert "at step 2, predicted 0.5 s at step 2" in text and "the larger error is the" in text


def test_explain_needs_per_rank_timing(tmp_path, capsys):
    c = cluster4()
    save_cluster(c, tmp_path / "c.json")
    save_plan(plan4(c), tmp_path / "p.json")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    assert scheduler_main(["explain", "--plan", str(tmp_path / "p.json"), "--metrics",
                           str(tmp_path), "--cluster", str(tmp_path / "c.json")]) == 2
    assert "no per-rank timing" in capsys.readouterr().err


@pytest.mark.parametrize("places", [[(1, 0), (1, None)], [([], 0)], [(0, {})], [("0", 0)]])
def test_records_at_another_place_are_refused_whatever_they_hold(places):
    c = cluster4()
    plan = plan4(c)
    recs = records(plan, c)
    recs[0] = [{**recs[0][0], "step": k + 1, "replica": r, "stage": s}
               for k, (r, s) in enumerate(places)]
    with pytest.raises(UserError, match="rank 0 recorded replica/stage .* another plan"):
        explain(plan, c, CPU, recs)


@pytest.mark.parametrize("key", ["step_s", "compute_s", "comm_s"])
def test_negative_seconds_are_no_timing(key):
    c = cluster4()
    plan = plan4(c)
    recs = records(plan, c)
    recs[2] = [{**r, key: -0.5} for r in recs[2]]
    with pytest.raises(UserError, match=r"ranks \[2\]: no timing records .* >= 0"):
        explain(plan, c, CPU, recs)


def plan_sharded(cluster: Cluster) -> Plan:
    """2 replicas x 1 stage, each stage a shard group of 2 devices (FSDP2), DiLoCo across."""
    from formats.plan import SyncConfig

    return Plan("four", cluster.sha256(), "gpt-tiny", [(0, 4)], [[[0, 1]], [[2, 3]]],
                micro_batch_size=2, num_micro_batches=2, sync=SyncConfig("diloco", 5, "int8"))


def test_a_sharded_run_as_predicted_names_nothing():
    """Plans with shard groups: every device predicted with FSDP's seconds apart from its
    compute (they were a traceback before: explain read only device ids in the pipelines)."""
    c = cluster4()
    plan = plan_sharded(c)
    ex = explain(plan, c, CPU, records(plan, c))
    assert names(ex) == [] and [x.rank for x in ex.rows] == [0, 1, 2, 3]
    assert [x.replica for x in ex.rows] == [0, 0, 1, 1]
    for row in ex.rows:
        assert row.predicted.fsdp_s > 0.2 * row.predicted.step_s
        assert row.measured.fsdp_s == pytest.approx(row.predicted.fsdp_s)
        assert row.measured.compute_s == pytest.approx(row.predicted.compute_s)
    assert ex.predicted_step_s == pytest.approx(ex.rows[0].predicted.step_s, rel=1e-9)
    assert "FSDP s" in format_explanation(ex)


def test_slow_fsdp_collectives_are_named():
    c = cluster4()
    plan = plan_sharded(c)
    ex = explain(plan, c, CPU, records(plan, c, fsdp_factor={0: 3.0, 1: 3.0}))
    assert names(ex)[0] == "slow FSDP collectives of shard group [0, 1]"
    assert "--no-reshard-after-forward" in ex.causes[0].fix
    assert not [n for n in names(ex) if "[2, 3]" in n]


@pytest.mark.timeout(200)
def test_explain_on_a_real_sharded_run(tmp_path):
    """A real 1 x (D = 2) run: every rank's timing file holds fsdp_s, and explain prints the
    FSDP column from it."""
    cluster = Cluster("two", [Device(i, f"d{i}", "A", "127.0.0.1", "cpu", 0.02, 8.0)
                              for i in range(2)], [[0, 1], [1, 0]], [[10, 10], [10, 10]])
    save_cluster(cluster, tmp_path / "cluster.json")
    save_plan(Plan("two", cluster.sha256(), "gpt-tiny", [(0, 4)], [[[0, 1]]],
                   micro_batch_size=2, num_micro_batches=2), tmp_path / "plan.json")
    run = tmp_path / "run"
    p = run_entry("scripts/launch_local.py", "--plan", str(tmp_path / "plan.json"),
                  "--threads-per-rank", "1", "--", "--steps", "4", "--fake-data",
                  "--run-dir", str(run), "--timeout-s", "60", timeout=150)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    p = run_entry("scheduler/scheduler.py", "explain", "--plan", str(tmp_path / "plan.json"),
                  "--metrics", str(run), "--cluster", str(tmp_path / "cluster.json"),
                  "--runtime", "cpu")
    assert p.returncode == 0, p.stderr
    assert "FSDP s" in p.stdout
    rows = [line.split() for line in p.stdout.splitlines() if line.split()[:1] == ["0"]]
    assert [r[1] for r in rows] == ["0", "1"]
    assert all(float(r[-3]) > 0 for r in rows), p.stdout  # measured FSDP seconds


def test_a_slow_shard_ring_is_named_by_its_shard():
    """With shard groups the sync runs per shard (device i of every replica): a slow ring is
    named with its shard and devices, the other shard's ring not."""
    c = cluster4()
    plan = plan_sharded(c)
    extra = predict(plan, c, CPU).step_s
    ex = explain(plan, c, CPU, records(plan, c, dp_extra={0: extra, 2: extra}))
    assert names(ex) == ["slow data-parallel sync of stage 0 shard 0"]
    assert "devices [0, 2]" in ex.causes[0].detail



def test_an_absurd_timing_never_becomes_a_cluster_figure():
    """A rank whose compute took 1e-200 of its predicted time would give tflops of 4e198:
    --write-cluster refuses by rank instead of writing what the planner cannot read."""
    from formats.errors import UserError
    from scheduler.explain import measured_cluster
    c = cluster4()
    plan = plan4(c)
    ex = explain(plan, c, CPU, records(plan, c, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1e-200}))
    with pytest.raises(UserError, match=r"--write-cluster: rank 3's measured compute .* gives "
                                        r"tflops .*e\+\d+, which must be in \[1e-09, 1e\+09\]"):
        measured_cluster(c, ex.rows)
