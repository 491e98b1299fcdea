"""The CPU lab's ranks share the host's cores: the simulator's processor-sharing fixed point
(scheduler/simulator/sharing.py), its plumbing (SimConfig.shared_cores, calibration files, the
flag) and the benchmarks' noisy-machine verdict (testkit/lab_calibration.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from conftest import run_entry
from test_simulator_closed_forms import uniform_cluster

from formats.cluster import Cluster
from formats.models import get_model
from formats.plan import SyncConfig
from scheduler.layer_split import even_split
from scheduler.simulator import RUNTIME_PROFILES, load_calibration, save_calibration, simulate
from scheduler.simulator.sharing import compute_intervals, core_slowdown, work_weighted_slowdown
from testkit.calibrate import CoreSharing

CPU = RUNTIME_PROFILES["cpu"]


def slowdown(r: int, s: int, m: int, cores: float, tf: float = 1.0, tb: float = 1.0,
             tx: float = 0.0) -> float:
    t = np.full((r, s), tf)
    link = np.full((r, s - 1), tx)
    return core_slowdown(t, t * tb / tf, link, link, link, link, m, cores)


def test_everyone_computing_at_once_is_slowed_by_ranks_over_cores_exactly():
    assert slowdown(8, 1, 4, 2.0) == 4.0  # 1 x 8: what a calibration with 8 at once measures
    t, z = np.full((8, 1), 1.0), np.zeros((8, 0))
    assert core_slowdown(t, t, z, z, z, z, 4, 2.0, 2.0) == 5.0  # 2 other tasks: (8 + 2) / 2
    assert slowdown(8, 1, 4, 8.0) == 1.0  # a core each
    assert slowdown(8, 1, 4, 16.0) == 1.0  # more cores than ranks: no speed-up


def test_work_weighted_slowdown_of_a_hand_made_profile():
    # [0,1]: 1 runs, [1,2]: 2 run, [2,3]: 1 runs -> work 4, slowed work 1 + 2*2 + 1 = 6 (1 core)
    starts, ends = np.array([0.0, 1.0]), np.array([2.0, 3.0])
    assert work_weighted_slowdown(starts, ends, 1.0) == 1.5
    assert work_weighted_slowdown(starts, ends, 2.0) == 1.0
    # 1 other task always running on 2 cores: 1 runs -> 1, 2 run -> 1.5: (1 + 2*1.5 + 1) / 4
    assert work_weighted_slowdown(starts, ends, 2.0, 1.0) == 1.25
    # back to back: an end and a start at the same instant do not overlap
    assert work_weighted_slowdown(np.array([0.0, 1.0]), np.array([1.0, 2.0]), 1.0) == 1.0


def test_a_pipeline_whose_ranks_take_turns_is_slowed_less():
    # 1 replica, 2 stages, 2 micro-batches, forward = backward = 1, free links, 1 core:
    # F0[0,1] F1[1,2] | F'0[1,2] F'1[2,3] | B'1[3,4] B'1[4,5] | B0[4,5] B0[5,6]
    starts, ends = compute_intervals(np.ones((1, 2)), np.ones((1, 2)), np.zeros((1, 1)),
                                     np.zeros((1, 1)), np.zeros((1, 1)), np.zeros((1, 1)), 2)
    assert sorted(zip(starts, ends)) == [(0, 1), (1, 2), (1, 2), (2, 3), (3, 4), (4, 5),
                                         (4, 5), (5, 6)]
    # concurrency 1,2,1,1,2,1 over unit pieces: (1+4+1+1+4+1) / 8 = 1.5, whatever k
    assert slowdown(1, 2, 2, 1.0) == 1.5
    # one rank at a time and a core for it: no slowdown
    assert slowdown(1, 2, 1, 1.0) == 1.0
    # slow links keep the ranks apart: the forward waits 10 s for its input, less sharing
    assert 1.0 < slowdown(4, 2, 4, 2.0, tx=10.0) < slowdown(4, 2, 4, 2.0) < 4.0


def lab_like(tflops: float) -> Cluster:
    return uniform_cluster(8, lat_ms=20.0, gbps=0.05, tflops=tflops, memory_gb=4.0)


def step(cluster: Cluster, pipelines: np.ndarray, config, sync: SyncConfig | None = None):
    model = get_model("gpt-tiny")
    return simulate(cluster, model, even_split(model.num_layers, pipelines.shape[1]), pipelines,
                    sync or SyncConfig("allreduce"), 4, 4, config, timeline=False)


def test_1x8_with_shared_cores_equals_the_old_model_on_the_all_at_once_speed():
    """The old model (tflops measured with all 8 at once, nothing shared) and the new one
    (tflops alone, 2 shared cores) agree exactly where all 8 always compute together."""
    wide = np.arange(8).reshape(8, 1)
    old = step(lab_like(0.005), wide, CPU)
    new = step(lab_like(0.020), wide, replace(CPU, shared_cores=2.0))
    assert new.step_s == pytest.approx(old.step_s, rel=1e-12)
    assert new.compute_s == pytest.approx(old.compute_s, rel=1e-12)


def test_pipelined_plans_get_more_cpu_than_the_all_at_once_speed():
    deep = np.arange(8).reshape(2, 4)
    old = step(lab_like(0.005), deep, CPU)
    new = step(lab_like(0.020), deep, replace(CPU, shared_cores=2.0))
    alone = step(lab_like(0.020), deep, CPU)
    assert alone.step_s < new.step_s < old.step_s


def test_gpu_hosts_keep_their_model():
    deep = np.arange(8).reshape(2, 4)
    gpu = RUNTIME_PROFILES["gpu"]
    assert gpu.shared_cores == 0.0 and CPU.shared_cores == 0.0
    assert step(lab_like(10.0), deep, gpu).step_s == step(lab_like(10.0), deep, gpu).step_s


def test_shared_cores_reaches_plan_and_simulate_from_a_calibration_file(tmp_path):
    lab = tmp_path / "lab.json"
    assert run_entry("scheduler/scheduler.py", "scenario", "lab", "--out", str(lab)).returncode == 0
    cal = tmp_path / "cal.json"
    save_calibration(cal, {"shared_cores": 2}, runtime="cpu", measured={"cores": 2})
    assert load_calibration(cal).settings == {"shared_cores": 2.0}
    out = tmp_path / "p.json"
    r = run_entry("scheduler/scheduler.py", "plan", "--cluster", str(lab), "--model", "gpt-tiny",
                  "--stages", "2", "--replicas", "4", "--micro-batch-size", "4",
                  "--micro-batches", "4", "--budget", "100", "--random-samples", "5", "--quiet",
                  "--runtime", "cpu", "--calibration", str(cal), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["search"]["sim_config"]["shared_cores"] == 2.0
    sim = [json.loads(run_entry("scheduler/scheduler.py", "simulate", "--cluster", str(lab),
                                "--plan", str(out), "--json", *extra).stdout)["step_s"]
           for extra in ([], ["--shared-cores", "0"])]
    assert sim[0] > sim[1]  # sharing 2 cores among 8 ranks is slower than a core each
    bad = run_entry("scheduler/scheduler.py", "simulate", "--cluster", str(lab), "--plan",
                    str(out), "--shared-cores", "-1")
    assert bad.returncode == 2 and "shared" in bad.stderr and "Traceback" not in bad.stderr


def sharing(alone: list[float], shared: list[float]) -> CoreSharing:
    return CoreSharing(8, [a * 1e9 for a in alone], [s * 1e9 for s in shared], 2)


def test_core_sharing_figures_are_medians_and_their_ratio():
    c = sharing([20.0, 22.0, 21.0], [5.0, 5.5, 5.25])
    assert (c.alone, c.shared) == (21e9, 5.25e9)
    assert c.shared_cores == 2.0 and c.spread == 1.1
    assert sharing([20.0], [10.0]).shared_cores == 2.0  # clamped to the machine's cores


def test_the_fit_finds_core_speed_cores_load_and_contention():
    def fit(alone: float, pair: float, shared: float) -> tuple[float, ...]:
        got = CoreSharing(8, [alone * 1e9], [shared * 1e9], 2, [pair * 1e9]).fit()
        return round(got[0] / 1e9, 3), *(round(v, 3) for v in got[1:])

    assert fit(20.0, 20.0, 5.0) == (20.0, 2.0, 0.0, 0.0)  # a quiet 2-core machine
    # 2 tasks of other work: alone 20 x 2/3, 2 at once 20 x 2/4, 8 at once 20 x 2/10
    assert fit(20.0 * 2 / 3, 10.0, 4.0) == (20.0, 2.0, 2.0, 0.0)
    # cores that do not add up (8 at once: 1.6 cores' worth; 2 at once as fast as alone):
    # fewer cores or contention, whichever fits best, reproduces every figure within 3%
    s, c, load, g = fit(20.0, 20.0, 4.0)
    speed = [s * min(1.0, c / (n + load)) / (1 + g * (n - 1)) for n in (1, 2, 8)]
    assert speed == pytest.approx([20.0, 20.0, 4.0], rel=0.03) and load == 0.0
    assert (c < 1.9) != (g > 0.0)  # one form or the other
    # each process beside another costs 3%: 2 at once 20 / 1.03, 8 at once 20 x 2/8 / 1.21
    assert fit(20.0, 20.0 / 1.03, 20.0 * 2 / 8 / 1.21) == (20.0, 2.0, 0.0, 0.03)


def test_contention_stretches_whoever_computes_beside_others():
    t, z = np.full((8, 1), 1.0), np.zeros((8, 0))
    # 1 x 8, everyone at once on 2 cores, 3% per other rank: 8/2 x (1 + 7 x 0.03)
    assert core_slowdown(t, t, z, z, z, z, 4, 2.0, 0.0, 0.03) == pytest.approx(4.0 * 1.21)
    # the hand-made profile (1, 2, 1 running) on 1 core, 50%: (1 + 2 x 2 x 1.5 + 1) / 4
    starts, ends = np.array([0.0, 1.0]), np.array([2.0, 3.0])
    assert work_weighted_slowdown(starts, ends, 1.0, 0.0, 0.5) == 2.0
    assert work_weighted_slowdown(starts, ends, 1.0) == 1.5  # none: as before


def test_the_noise_verdict_names_what_moved():
    from testkit.lab_calibration import noise_verdict

    steady = sharing([20.0, 20.5, 20.2], [5.0, 5.1, 5.05])
    assert noise_verdict(steady) == ""
    assert noise_verdict(steady, sharing([19.8, 20.1], [5.0, 5.02])) == ""
    # a quiet machine's 10% between the calibration and the check after is not noise: it
    # cannot by itself make a prediction miss the 15% bar
    assert noise_verdict(steady, sharing([20.0, 20.0], [4.6, 4.6])) == ""
    assert "moved 19%" in noise_verdict(steady, sharing([20.0, 20.0], [4.25, 4.25]))
    assert "rounds differ by 30%" in noise_verdict(sharing([20.0, 26.0, 22.0], [5.0, 5.0, 5.0]))
    why = noise_verdict(steady, sharing([20.0, 20.0], [2.5, 2.6]))
    assert "all ranks at once moved" in why and "5.0 -> 2.5" in why


def test_the_optimizer_step_is_charged_as_compute_per_parameter():
    wide = np.arange(8).reshape(8, 1)
    model = get_model("gpt-tiny")
    config = replace(CPU, shared_cores=2.0)
    base = step(lab_like(0.020), wide, config)
    charged = step(lab_like(0.020), wide, replace(config, optimizer_flops_per_param=100.0))
    # 8 ranks on 2 cores, all at once: 4 x the optimizer's seconds alone
    extra = 4 * model.stage_params(0, model.num_layers) * 100.0 / 0.020e12
    assert charged.compute_s - base.compute_s == pytest.approx(extra, rel=1e-9)
    assert step(lab_like(0.020), wide, CPU).compute_s == pytest.approx(base.compute_s / 4)


def test_calibration_measures_the_optimizer_per_parameter():
    c = replace(sharing([20.0], [5.0]), optimizer_s=[0.01, 0.03, 0.02], params=1_000_000)
    assert c.optimizer_flops_per_param == pytest.approx(0.02 * 20e9 / 1e6)
    assert sharing([20.0], [5.0]).optimizer_flops_per_param == 0.0


def row(name: str, predicted: float, measured: float, tokens: float) -> dict:
    return {"name": name, "predicted_s": predicted, "measured_s": measured,
            "prediction_error": (predicted - measured) / measured, "wire_mb_per_step": 1.0,
            "tokens_per_s": tokens, "loss_ratio_vs_allreduce": 1.0,
            "seconds_to_allreduce_loss": None}


def test_a_prediction_within_the_bar_passes_however_noisy_and_a_miss_is_noisy_only_if_noisy():
    from testkit.lab_calibration import verdict

    assert verdict(-0.149, "") == verdict(0.149, "moved 30%") == "PASS"
    assert verdict(-0.16, "") == "MISS" and verdict(0.16, "moved 30%") == "NOISY"


def test_bad_network_verdicts_say_noisy_instead_of_miss():
    from benchmarks.bad_network import targets

    rows = [row("allreduce", 1.0, 1.0, 100.0), row("+ overlap", 0.5, 0.8, 150.0),
            row("planner --sync auto (1x8)", 0.3, 0.3, 140.0)]
    quiet = targets(rows)
    assert any(ln.startswith("MISS every prediction within 15% (worst -37.5%") for ln in quiet)
    assert any(ln.startswith("MISS --sync auto's choice") and "+ overlap" in ln for ln in quiet)
    noisy = targets(rows, "the calibration's rounds differ by 30%")
    assert [ln for ln in noisy if "prediction" in ln or "--sync auto" in ln][:2] == [
        "NOISY every prediction within 15% (worst -37.5%, + overlap)",
        "NOISY --sync auto's choice at least as fast (tokens/s) as every other row "
        "(faster: + overlap)"]
    assert noisy[-1] == ("NOISY machine too noisy to judge the predictions: the calibration's "
                         "rounds differ by 30%")
    assert not any(ln.startswith(("PASS every", "MISS every")) for ln in noisy)
    within = targets([rows[0], rows[2]], "the calibration's rounds differ by 30%")
    assert any(ln.startswith("PASS every prediction within 15%") for ln in within)
    assert any(ln.startswith("PASS --sync auto's choice") for ln in within)


def test_the_outer_round_is_charged_per_parameter_for_its_payload_once_per_round():
    wide = np.arange(8).reshape(8, 1)
    model = get_model("gpt-tiny")
    config = replace(CPU, shared_cores=2.0)
    int8 = SyncConfig("diloco", inner_steps=4, compression="int8")
    base = step(lab_like(0.020), wide, config, int8)
    charged = replace(config, outer_int8_flops_per_param=200.0, outer_flops_per_param=50.0)
    got = step(lab_like(0.020), wide, charged, int8)
    # 8 ranks on 2 cores, all at once: 4 x the round's seconds alone, a quarter per step (H 4)
    extra = 4 * model.stage_params(0, model.num_layers) * 200.0 / 0.020e12 / 4
    assert got.compute_s - base.compute_s == pytest.approx(extra, rel=1e-9)
    # the fp32 payload's figure for a round with that payload; nothing with allreduce
    none = replace(int8, compression="none")
    got_none = step(lab_like(0.020), wide, charged, none)
    assert got_none.compute_s - step(lab_like(0.020), wide, config, none).compute_s == \
        pytest.approx(extra / 4, rel=1e-9)
    assert step(lab_like(0.020), wide, charged).compute_s == \
        pytest.approx(step(lab_like(0.020), wide, config).compute_s, rel=1e-12)
    # one replica: no outer all-reduce, nothing charged
    deep = np.arange(4).reshape(1, 4)
    assert step(lab_like(0.020), deep, charged, int8).compute_s == \
        pytest.approx(step(lab_like(0.020), deep, config, int8).compute_s, rel=1e-12)


def test_the_planners_objective_charges_the_outer_round_as_simulate_does():
    from scheduler.cost_simulated import SimulatedObjective

    model = get_model("gpt-tiny")
    config = replace(CPU, shared_cores=2.0, outer_int8_flops_per_param=300.0)
    sync = SyncConfig("diloco", inner_steps=4, compression="int8")
    for pipes in (np.arange(8).reshape(8, 1), np.arange(8).reshape(4, 2)):
        obj = SimulatedObjective(lab_like(0.020), model, sync, 4, 4, config)
        sim = simulate(lab_like(0.020), model, even_split(model.num_layers, pipes.shape[1]),
                       pipes, sync, 4, 4, config, timeline=False)
        assert obj.cost(pipes) <= sim.step_s * (1 + 1e-9)  # its split is at least as good
        plain = SimulatedObjective(lab_like(0.020), model, sync, 4, 4,
                                   replace(config, outer_int8_flops_per_param=0.0))
        assert obj.cost(pipes) > plain.cost(pipes)


def test_calibration_converts_the_outer_rounds_cpu_seconds_per_parameter():
    c = replace(sharing([20.0], [5.0]), outer_cpu_s={"none": 0.005, "int8": 0.01},
                params=1_000_000)
    assert c.outer_flops_per_param("int8") == pytest.approx(0.01 * 20e9 / 1e6)
    assert c.outer_flops_per_param("fp16") == 0.0  # not measured: not charged
    assert c.fit() is c.fit()  # fitted once


def test_calibration_measures_the_outer_rounds_cpu_through_gloo():
    """Two real processes in a gloo group: the runtime's outer round takes CPU, and the int8
    codec adds to the fp32 payload's."""
    from testkit.calibrate import measure_core_sharing

    c = measure_core_sharing(get_model("gpt-tiny"), 1, 2, rounds=2, repeats=1)
    assert set(c.outer_cpu_s) == {"none", "fp16", "int8"}
    assert 0.0 < c.outer_cpu_s["none"] < c.outer_cpu_s["int8"]
    assert c.outer_flops_per_param("int8") > c.outer_flops_per_param("none") > 0.0


def test_shard_groups_share_the_cores_over_all_lanes_and_fsdp_is_not_stretched():
    """2 replicas x 4-way shard groups, one stage, on 2 shared cores: the 8 lanes always
    compute at once, so the compute (not FSDP's collectives, priced on the links) is stretched
    by 8 / 2 = 4, as a 1 x 8 plan's is; per-shard outer rounds charged on 1/D of the
    parameters."""
    model = get_model("gpt-tiny")
    groups = [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    sync = SyncConfig("diloco", 4, "int8")

    def run(config):
        return simulate(lab_like(0.020), model, [(0, model.num_layers)], groups, sync, 4, 4,
                        config, timeline=False)

    alone, shared = run(CPU), run(replace(CPU, shared_cores=2.0))
    raw = alone.compute_s - alone.fsdp_comm_s
    assert shared.compute_s - shared.fsdp_comm_s == pytest.approx(4 * raw, rel=1e-6)
    assert shared.fsdp_comm_s == pytest.approx(alone.fsdp_comm_s, rel=1e-9)
    charged = run(replace(CPU, shared_cores=2.0, outer_int8_flops_per_param=400.0))
    extra = 4 * model.stage_params(0, model.num_layers) / 4 * 400.0 / 0.020e12 / 4
    assert charged.compute_s - shared.compute_s == pytest.approx(extra, rel=1e-6)


def test_the_calibration_caps_the_cores_at_the_cpu_affinity():
    """A lab pinned to one core (sched_setaffinity, as `taskset -c 0` does) fits at most one
    core, not the machine's count."""
    import subprocess
    import sys

    code = ("import os; os.sched_setaffinity(0, {0}); "
            "from testkit.calibrate import usable_cores; print(usable_cores())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


def test_the_lab_reads_its_delay_lines_cpu_seconds(monkeypatch, tmp_path):
    """The link emulation's own CPU (userspace delay lines) is read from /proc per recorded pid:
    here this process stands in for one, and its CPU time grows as it works."""
    import os
    import types

    import scripts.netemu.netns as netns
    from testkit.lab_network import Network

    net = Network(tmp_path / "cluster.json", tmp_path, False)
    assert net.emulation_cpu_s() == 0.0  # not active: no delay lines
    net.active = True
    monkeypatch.setattr(netns, "load_state", lambda prefix: types.SimpleNamespace(
        delay_pids={"ns-0": os.getpid(), "ns-1": 2 ** 22 + 1}))  # the second one is gone
    before = net.emulation_cpu_s()
    sum(i * i for i in range(3_000_000))
    assert net.emulation_cpu_s() > before > 0.0


def test_fsdp_cpu_is_charged_per_unit_and_micro_batch_on_sharded_stages():
    """Shard groups: FSDP2's own CPU (fsdp_flops_per_unit, or fsdp_gathered_flops_per_unit
    without reshard_after_forward) per FSDP unit and micro-batch, charged as compute on
    stages of D > 1: gpt-tiny in one stage is 4 blocks + the root, 4 micro-batches."""
    groups = [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    model = get_model("gpt-tiny")
    config = replace(CPU, shared_cores=0.0)

    def compute(reshard: bool, **fsdp: float) -> float:
        return simulate(lab_like(0.020), model, [(0, model.num_layers)], groups,
                        SyncConfig("allreduce"), 4, 4, replace(config, **fsdp), timeline=False,
                        reshard_after_forward=reshard).compute_s

    extra = 5 * 4 * 1e8 / 0.020e12
    for reshard, key in ((True, "fsdp_flops_per_unit"), (False, "fsdp_gathered_flops_per_unit")):
        base = compute(reshard)
        assert compute(reshard, **{key: 1e8}) - base == pytest.approx(extra, rel=1e-9)
    assert compute(True, fsdp_gathered_flops_per_unit=1e8) == compute(True)  # the other mode's
    flat = step(lab_like(0.020), np.arange(8).reshape(8, 1), config)  # no shard groups
    assert step(lab_like(0.020), np.arange(8).reshape(8, 1),
                replace(config, fsdp_flops_per_unit=1e8)).compute_s == flat.compute_s


@pytest.mark.timeout(120)
def test_calibration_measures_fsdps_own_cpu():
    """A real measurement (a fresh process, a gloo group of one): FSDP2 adds CPU beside the
    plain model's step in both modes (1.4-2.7 ms per unit and micro-batch on the lab's 2-core
    machine for gpt-tiny)."""
    from testkit.calibrate import measure_fsdp_cpu

    got = measure_fsdp_cpu(get_model("gpt-tiny"), 2, 2, repeats=7)
    assert set(got) == {"reshard", "gathered"}
    assert all(1e-4 < v < 0.05 for v in got.values()), got
