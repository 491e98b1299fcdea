"""Runtime profiles and calibration files of the performance model (`plan --runtime cpu|gpu`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_entry
from test_simulator_closed_forms import uniform_cluster

from formats.errors import UserError
from formats.models import get_model
from formats.plan import SyncConfig
from scheduler.layer_split import even_split
from scheduler.simulator import (
    RUNTIME_PROFILES,
    SimConfig,
    load_calibration,
    resolve_sim_config,
    save_calibration,
    simulate,
)

SCHED = "scheduler/scheduler.py"
HAND_LIST = ["--mfu", "1", "--activation-bytes", "4", "--recompute", "off",
             "--collective-latency-factor", "2", "--allreduce-algorithm", "gloo",
             "--outer-store-round-trips", "3"]
"""What benchmarks/end_to_end.py passed before `--runtime cpu` existed."""
SMALL_PLAN = ["--model", "gpt-tiny", "--stages", "4", "--replicas", "2", "--micro-batch-size",
              "4", "--micro-batches", "4", "--budget", "200", "--random-samples", "10",
              "--quiet"]


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("lab") / "lab.json"
    assert run_entry(SCHED, "scenario", "lab", "--out", str(path)).returncode == 0
    return str(path)


def plan(lab: str, out, *extra: str) -> dict:
    """Run `plan` on the lab cluster; the plan file's content."""
    r = run_entry(SCHED, "plan", "--cluster", lab, *SMALL_PLAN, *extra, "--out", str(out))
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


def simulate_json(lab: str, plan_path, *extra: str) -> dict:
    r = run_entry(SCHED, "simulate", "--cluster", lab, "--plan", str(plan_path), "--json",
                  *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_profiles_describe_the_runtimes():
    cpu, gpu = RUNTIME_PROFILES["cpu"], RUNTIME_PROFILES["gpu"]
    assert (cpu.mfu, cpu.activation_bytes, cpu.recompute, cpu.collective_latency_factor,
            cpu.outer_store_round_trips) == (1.0, 4, False, 2.0, 3)
    assert (gpu.activation_bytes, gpu.recompute, gpu.collective_latency_factor) == (2, True, 1.0)
    assert gpu.recompute == SimConfig().recompute and 0.0 < gpu.mfu < 1.0
    assert (cpu.runtime, gpu.runtime) == ("cpu", "gpu")


def test_profile_values_reach_the_simulator():
    model = get_model("gpt-small")
    pipe = np.arange(4).reshape(2, 2)
    cluster = uniform_cluster(4, 30.0, 0.1, tflops=10.0)
    run = lambda config: simulate(cluster, model, even_split(model.num_layers, 2), pipe,
                                  SyncConfig("diloco", 10), 1, 2, config)
    cpu, gpu = run(resolve_sim_config(runtime="cpu")), run(resolve_sim_config(runtime="gpu"))
    by_hand = run(SimConfig(mfu=1.0, activation_bytes=4, recompute=False,
                            collective_latency_factor=2.0, allreduce_algorithm="gloo",
                            outer_store_round_trips=3))
    assert cpu.parts() == by_hand.parts() and cpu.dp_comm_round_s == by_hand.dp_comm_round_s
    # compute: forward + 2 (cpu) or 3 (gpu, recompute) forwards, at mfu 1 or 0.4
    mfu = RUNTIME_PROFILES["gpu"].mfu
    assert gpu.compute_s / cpu.compute_s == pytest.approx((4 / mfu) / 3)
    # a ring of 2 has 2 steps: gloo pays one more 30 ms latency per step
    assert max(cpu.dp_allreduce_s) - max(gpu.dp_allreduce_s) == pytest.approx(2 * 0.030)
    assert cpu.pp_comm_s > gpu.pp_comm_s  # fp32 activations: twice the bytes


def test_resolve_order_profile_then_calibration_then_overrides(tmp_path):
    save_calibration(tmp_path / "cal.json", {"mfu": 0.5, "collective_latency_factor": 3},
                     runtime="cpu", measured={"flops_per_rank": 1.3e10})
    cal = load_calibration(tmp_path / "cal.json")
    assert cal.settings == {"mfu": 0.5, "collective_latency_factor": 3.0}
    config = resolve_sim_config(calibration=cal)  # the file names its runtime
    assert (config.runtime, config.mfu, config.collective_latency_factor,
            config.activation_bytes, config.calibration) == ("cpu", 0.5, 3.0, 4,
                                                             str(tmp_path / "cal.json"))
    config = resolve_sim_config(SimConfig(reserved_gb=2.0), "cpu", cal, mfu=0.25)
    assert (config.mfu, config.reserved_gb, config.recompute) == (0.25, 2.0, False)
    with pytest.raises(UserError, match="calibrates the 'cpu' runtime, not the 'gpu'"):
        resolve_sim_config(runtime="gpu", calibration=cal)
    with pytest.raises(UserError, match=r"SimConfig\.mfu: must be in \(0, 1\]"):
        resolve_sim_config(runtime="cpu", mfu=1.5)


def test_runtime_cpu_plans_exactly_as_the_hand_list_and_is_recorded(lab, tmp_path):
    named = plan(lab, tmp_path / "named.json", "--runtime", "cpu")
    hand = plan(lab, tmp_path / "hand.json", *HAND_LIST)
    cfg = named["search"]["sim_config"]
    assert cfg["runtime"] == "cpu" and hand["search"]["sim_config"]["runtime"] is None
    assert {k: v for k, v in cfg.items() if k != "runtime"} == \
        {k: v for k, v in hand["search"]["sim_config"].items() if k != "runtime"}
    assert (named["pipelines"], named["stages"]) == (hand["pipelines"], hand["stages"])
    assert named["predicted"] == hand["predicted"]
    # simulate reuses what the plan recorded
    assert simulate_json(lab, tmp_path / "named.json")["step_s"] == pytest.approx(
        named["predicted"]["step_s"], abs=2e-6)


def test_flags_override_the_profile_and_the_recorded_model(lab, tmp_path):
    saved = plan(lab, tmp_path / "p.json", "--runtime", "cpu", "--mfu", "0.5", "--recompute",
                 "on")
    cfg = saved["search"]["sim_config"]
    assert (cfg["runtime"], cfg["mfu"], cfg["recompute"], cfg["activation_bytes"],
            cfg["collective_latency_factor"]) == ("cpu", 0.5, True, 4, 2.0)
    as_gpu = simulate_json(lab, tmp_path / "p.json", "--runtime", "gpu")
    by_flags = simulate_json(lab, tmp_path / "p.json", "--mfu", "0.4", "--activation-bytes", "2",
                             "--recompute", "on", "--collective-latency-factor", "1",
                             "--allreduce-algorithm", "ring")
    assert as_gpu == by_flags
    assert as_gpu["pp_comm_s"] < simulate_json(lab, tmp_path / "p.json")["pp_comm_s"]


def test_calibration_file_overrides_the_profile_and_flags_override_it(lab, tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"format": "calibration/1", "runtime": "cpu", "mfu": 0.5,
                               "measured": {"gflops_per_rank": 13.0}}))
    cfg = plan(lab, tmp_path / "p.json", "--calibration", str(cal))["search"]["sim_config"]
    assert (cfg["runtime"], cfg["mfu"], cfg["activation_bytes"], cfg["calibration"]) == \
        ("cpu", 0.5, 4, str(cal))
    cfg = plan(lab, tmp_path / "q.json", "--calibration", str(cal), "--mfu", "0.25",
               "--activation-bytes", "2")["search"]["sim_config"]
    assert (cfg["mfu"], cfg["activation_bytes"], cfg["recompute"]) == (0.25, 2, False)


@pytest.mark.parametrize("content,message", [
    ({"format": "calibration/1", "mfu": 2}, "cal.json: mfu: must be in (0, 1], got 2"),
    ({"format": "calibration/1", "activation_bytes": 3},
     "cal.json: activation_bytes: must be 1, 2 or 4, got 3"),
    ({"format": "calibration/1", "recompute": "no"},
     "cal.json: recompute: must be true or false, got 'no'"),
    ({"format": "calibration/1", "collective_latency_factor": 0.5},
     "cal.json: collective_latency_factor: must be in [1, 10], got 0.5"),
    ({"format": "calibration/1", "outer_store_round_trips": 1.5},
     "cal.json: outer_store_round_trips: must be in [0, 100], got 1.5"),
    ({"format": "calibration/1", "runtime": "tpu"}, "cal.json: runtime: unknown runtime 'tpu'"),
    ({"format": "calibration/1", "mfu_": 0.5}, "cal.json: mfu_: unknown key"),
    ({"format": "calibration/1", "measured": [1]}, "cal.json: measured: expected an object"),
    ({"mfu": 0.5}, "cal.json: format: expected 'calibration/1', got None"),
    ([0.5], "cal.json: expected a JSON object, got list"),
    ("{not json", "cal.json: not valid JSON (line 1"),
])
def test_a_bad_calibration_file_exits_2_naming_the_field(lab, tmp_path, content, message):
    cal, out = tmp_path / "cal.json", tmp_path / "p.json"
    cal.write_text(content if isinstance(content, str) else json.dumps(content))
    r = run_entry(SCHED, "plan", "--cluster", lab, *SMALL_PLAN, "--calibration", str(cal),
                  "--out", str(out))
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_calibration_errors_name_the_file_runtime_mismatch_and_missing_file(lab, tmp_path):
    cal = tmp_path / "cal.json"
    save_calibration(cal, {"mfu": 0.5}, runtime="cpu")
    plan(lab, tmp_path / "p.json")
    for args, words in ((["--runtime", "gpu", "--calibration", str(cal)],
                         "calibrates the 'cpu' runtime, not the 'gpu' one"),
                        (["--calibration", str(tmp_path / "missing.json")],
                         "cannot read calibration file")):
        r = run_entry(SCHED, "simulate", "--cluster", lab, "--plan", str(tmp_path / "p.json"),
                      *args)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(UserError, match="mfu: must be in"):
        save_calibration(tmp_path / "bad.json", {"mfu": 3.0})
    assert not (tmp_path / "bad.json").exists()


def test_a_bad_recorded_model_names_the_plan_key(lab, tmp_path):
    saved = plan(lab, tmp_path / "p.json", "--runtime", "cpu")
    saved["search"]["sim_config"]["mfu"] = 7
    (tmp_path / "p.json").write_text(json.dumps(saved))
    r = run_entry(SCHED, "simulate", "--cluster", lab, "--plan", str(tmp_path / "p.json"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "p.json: search.sim_config.mfu: must be in (0, 1], got 7" in r.stderr
