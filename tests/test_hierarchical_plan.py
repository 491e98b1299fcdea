"""Hierarchical replicas (issue 22), planner side: the plan/2 format with shard groups, memory
per device of a shard group, the simulator's FSDP collectives and per-shard outer rings against
closed forms, and the planner's choice on a two-site cluster."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest

from formats.cluster import Cluster, Device
from formats.errors import UserError
from formats.models import get_model
from formats.plan import Plan, SyncConfig, load_plan, plan_from_dict, save_plan, validate_plan
from scheduler.memory import stage_memory
from scheduler.planning import PlanRequest, plan_best_shape
from scheduler.search import SearchConfig
from scheduler.shard_search import (
    degree_vectors,
    mixed_layouts,
    plan_hierarchical,
    shard_groups,
    sites,
)
from scheduler.simulator import LinkTables, SimConfig, build_inputs, format_sim_table, simulate
from scheduler.simulator.sharded import fsdp_collective_s, fsdp_compute
from testkit.fuzz import plan_dict


def sharded_dict(pipelines: list, fmt: str = "plan/2", **extra) -> dict:
    """A plan/2 object of gpt-tiny with one stage (or two when the chains say so)."""
    obj = plan_dict()
    s = len(pipelines[0])
    obj.update(format=fmt, pipelines=pipelines, num_stages=s, num_replicas=len(pipelines),
               stages=[{"layers": [0, 4]}] if s == 1 else [{"layers": [0, 2]}, {"layers": [2, 4]}],
               **extra)
    return obj


# --------------------------------------------------------------------------- format


def test_plan1_file_loads_unchanged_and_is_written_as_plan1(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(plan_dict()))
    plan = load_plan(path)
    assert not plan.is_sharded and plan.shard_degrees() == [1, 1]
    assert plan.lanes() == [[0, 1], [2, 3]] and plan.shard_peers(1, 0) == [1, 3]
    assert plan.locate(3) == (1, 1, 0) and plan.stage_of(3) == (1, 1)
    out = plan.to_dict()
    assert out["format"] == "plan/1" and "reshard_after_forward" not in out
    assert out["pipelines"] == [[0, 1], [2, 3]]


def test_plan2_round_trip_and_helpers(tmp_path):
    obj = sharded_dict([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], reshard_after_forward=False,
                       outer_state="host")
    path = tmp_path / "p.json"
    save_plan(plan_from_dict(obj), path)
    plan = load_plan(path)
    assert plan.to_dict()["format"] == "plan/2"
    assert plan.pipelines == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert plan.reshard_after_forward is False and plan.outer_state == "host"
    assert plan.shard_group(1, 0) == [4, 5] and plan.shard_degrees() == [2, 2]
    assert plan.shard_peers(1, 1) == [3, 7]  # device 1 of stage 1 in each replica
    assert plan.lanes() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert plan.locate(7) == (1, 1, 1) and sorted(plan.devices()) == list(range(8))
    assert plan_from_dict(plan.to_dict()) == plan


@pytest.mark.parametrize("pipelines, fmt, match", [
    ([[[]], [[1]]], "plan/2", r"pipelines\[0\]\[0\]: empty shard group"),
    ([[[0, 1]], [[2, 3, 4]]], "plan/2", r"pipelines\[1\]\[0\]: shard group of 3 devices but "
                                        r"replica 0 holds stage 0 with 2; .*same D in every"),
    ([[[0, 1]], [[1, 2]]], "plan/2", r"pipelines\[1\]\[0\]: device 1 appears twice"),
    ([[[0, 1], [2]]], "plan/2", r"stage 0 has D = 2 but the last stage has D = 1; gpt-tiny "
                                r"ties its embeddings"),
    ([[[0, 1, 2], [3, 4]]], "plan/2", r"pipelines\[0\]\[1\]: stage 1 has D = 2, which does "
                                      r"not divide the largest D = 3"),
    ([[list(range(65))]], "plan/2", r"D = 65 devices per shard group.*at most 64"),
    ([[[0, 1]], [[2, 3]]], "plan/1", r"shard groups .* need format 'plan/2'"),
])
def test_malformed_shard_groups_are_refused_by_name(pipelines, fmt, match):
    with pytest.raises(UserError, match=match):
        validate_plan(plan_from_dict(sharded_dict(pipelines, fmt)))


def untied_dict(pipelines: list) -> dict:
    """sharded_dict of an untied gpt-tiny (different D on the two ends is allowed)."""
    config = {**get_model("gpt-tiny").fields(), "name": "gpt-tiny-untied",
              "tie_embeddings": False}
    return sharded_dict(pipelines, model="gpt-tiny-untied", model_config=config)


def test_d_per_stage_lanes_and_devices():
    """D = 2 then D = 1: a replica runs L = 2 lanes; the stage of D = 1 runs both."""
    plan = plan_from_dict(untied_dict([[[0, 1], [2]], [[3, 4], [5]]]))
    validate_plan(plan)
    assert plan.shard_degrees() == [2, 1] and plan.lanes_per_replica == 2
    assert plan.lanes() == [[0, 2], [1, 2], [3, 5], [4, 5]]
    assert plan.lanes_of(2) == [0, 1] and plan.lanes_of(4) == [3] and plan.lanes_of(5) == [2, 3]
    assert plan.shard_peers(1, 0) == [2, 5] and plan.shard_peers(0, 1) == [1, 4]


@pytest.mark.parametrize("key, value, match", [
    ("outer_state", "disk", r"plan.outer_state: 'disk' is not one of device, host"),
    ("reshard_after_forward", 1, r"plan.reshard_after_forward: expected true or false"),
])
def test_bad_shard_fields_are_refused_by_name(key, value, match):
    with pytest.raises(UserError, match=match):
        validate_plan(plan_from_dict(sharded_dict([[[0, 1]], [[2, 3]]], **{key: value})))


# --------------------------------------------------------------------------- memory


def test_memory_with_d1_is_todays():
    tiny = get_model("gpt-tiny")
    # Values of main's memory.py before shard groups existed.
    assert stage_memory(tiny, 0, 4, 2, 3, True).total_bytes == 1022120448.0
    assert stage_memory(tiny, 0, 2, 1, 2, False).total_bytes == 1007426048.0
    assert stage_memory(get_model("gpt3-xl"), 0, 24, 1, 4, True).total_bytes == 36948605440.0
    assert stage_memory(tiny, 0, 4, 2, 3, True, shard_degree=1).gathered_bytes == 0.0


@pytest.mark.parametrize("start, end", [(0, 24), (4, 20)])
def test_memory_with_d4_holds_a_quarter_of_the_state(start, end):
    xl, d = get_model("gpt3-xl"), 4
    full = stage_memory(xl, start, end, 1, 4, True)
    shard = stage_memory(xl, start, end, 1, 4, True, shard_degree=d)
    assert shard.state_bytes == pytest.approx(full.state_bytes / d)
    assert shard.activation_bytes == full.activation_bytes  # lanes: not sharded
    # Transiently one block's fp32 parameters and gradients (the embedding on the first stage).
    unit = xl.embedding_params() if start == 0 else xl.layer_params()
    assert shard.gathered_bytes == unit * 8.0
    if start > 0:  # a middle stage: shard + the gathered block within 1.1 / D of the whole
        assert shard.state_bytes + shard.gathered_bytes <= 1.1 / d * full.state_bytes
    whole = stage_memory(xl, start, end, 1, 4, True, shard_degree=d,
                         reshard_after_forward=False)
    assert whole.gathered_bytes == xl.stage_params(start, end) * 8.0


def test_outer_state_on_host_leaves_the_device():
    tiny, d = get_model("gpt-tiny"), 2
    dev = stage_memory(tiny, 0, 4, 1, 2, True, shard_degree=d)
    host = stage_memory(tiny, 0, 4, 1, 2, True, shard_degree=d, outer_state="host")
    outer = tiny.stage_params(0, 4) / d * 8
    assert dev.state_bytes - host.state_bytes == outer and host.host_bytes == outer


# --------------------------------------------------------------------------- simulator


def uniform(n: int, lat_ms: float, gbps: float, tflops: float = 1.0) -> Cluster:
    devs = [Device(i, f"d{i}", "r", f"10.0.0.{i + 1}", "X", tflops, 80.0) for i in range(n)]
    lat, bw = np.full((n, n), lat_ms), np.full((n, n), gbps)
    np.fill_diagonal(lat, 0.0)
    np.fill_diagonal(bw, np.inf)
    return Cluster("uniform", devs, lat, bw)


def test_fsdp_gather_is_half_a_ring_allreduce():
    config = SimConfig()
    tables = LinkTables(uniform(4, 10.0, 1.0), config)
    payload = 4e6
    expect = 3 * (0.010 * config.collective_latency_factor + payload / 4 * 8 / 1e9)
    assert fsdp_collective_s(tables, np.arange(4), payload) == pytest.approx(expect)
    assert fsdp_collective_s(tables, np.arange(1), payload) == 0.0


def test_fsdp_overlap_rule():
    fwd, bwd = fsdp_compute(np.array([[1.0]]), np.array([[2.0]]), np.array([[0.5]]),
                            np.array([2.0]), 4, True)
    assert fwd[0, 0] == 1.25 and bwd[0, 0] == 2.25  # max(c, g) + g / blocks; scatter likewise
    fwd, bwd = fsdp_compute(np.array([[0.1]]), np.array([[0.2]]), np.array([[0.8]]),
                            np.array([2.0]), 4, False)  # once a step: 0.2 per micro-batch
    assert fwd[0, 0] == pytest.approx(0.2 + 0.1) and bwd[0, 0] == pytest.approx(0.2 + 0.1)


def test_fsdp_on_the_cpu_runtime_is_not_hidden_and_reshard_off_saves_it():
    """CPU runtime: a micro-batch = compute + its gathers and scatters; without
    reshard_after_forward one gather and one scatter a step (amortised)."""
    fwd, bwd = fsdp_compute(np.array([[1.0]]), np.array([[2.0]]), np.array([[0.5]]),
                            np.array([2.0]), 4, True, overlap=False)
    assert fwd[0, 0] == 1.5 and bwd[0, 0] == 3.0
    fwd, bwd = fsdp_compute(np.array([[1.0]]), np.array([[2.0]]), np.array([[0.8]]),
                            np.array([2.0]), 4, False, overlap=False)
    assert fwd[0, 0] == pytest.approx(1.2) and bwd[0, 0] == pytest.approx(2.2)
    cluster, model = uniform(8, 2.0, 0.2), get_model("gpt-tiny")
    cpu = SimConfig(runtime="cpu", mfu=1.0, activation_bytes=4, recompute=False)
    sync = SyncConfig("diloco", 5, "int8")
    groups = [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    on, off = (simulate(cluster, model, [(0, 4)], groups, sync, 2, 2, cpu, timeline=False,
                        reshard_after_forward=r) for r in (True, False))
    assert off.fsdp_comm_s == pytest.approx(on.fsdp_comm_s / 3)  # 2 passes a step, not 6
    assert on.step_s - off.step_s == pytest.approx(on.fsdp_comm_s - off.fsdp_comm_s)


@pytest.mark.parametrize("mode", ["allreduce", "diloco"])
def test_step_and_per_shard_rings_closed_form(mode):
    """2 replicas x 4-way shard groups, one stage: 4 outer rings of 2 devices, each 1/4 of the
    payload; the step = m (forward + backward with FSDP) + the ring's exposed time."""
    cluster, model, config, m, d = uniform(8, 10.0, 1.0), get_model("gpt-tiny"), SimConfig(), 3, 4
    sync = SyncConfig(mode, 2 if mode == "diloco" else 1)
    groups = [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    res = simulate(cluster, model, [(0, 4)], groups, sync, 1, m, config, timeline=False)
    lat = 0.010 * config.collective_latency_factor
    payload = model.stage_params(0, 4) * 4.0
    ring = 2 * (2 - 1) * (lat + payload / d / 2 * 8 / 1e9)  # R = 2, 1/D of the payload
    assert res.dp_allreduce_s == pytest.approx([ring] * d)
    plain = build_inputs(LinkTables(cluster, config), model, [(0, 4)],
                         np.array([[0], [1], [4], [5]]), sync, 1, m, config)
    gather = 3 * (5 * lat + payload / d * 8 / 1e9)  # 5 collectives: 4 blocks + the root
    fwd = max(plain.t_fwd[0, 0], gather) + gather / 4
    bwd = max(plain.t_bwd[0, 0], 2 * gather) + gather / 4
    h = sync.inner_steps
    assert res.step_s == pytest.approx(m * (fwd + bwd) + ring / h)
    assert res.tokens_per_step == 2 * d * m * model.seq_len  # R x D lanes
    flat = simulate(cluster, model, [(0, 4)], [[0], [4]], sync, 1, m, config, timeline=False)
    assert res.dp_bytes_per_step == pytest.approx(flat.dp_bytes_per_step)  # D rings x 1/D
    assert res.fsdp_bytes_per_step == 2 * (d - 1) * payload * 3 * m


def test_d_per_stage_memory_and_step():
    """Stage 0 on 2 devices, stage 1 on 1 device that runs both lanes: its activations and
    compute count twice its micro-batches; FSDP only on stage 0; one outer ring per shard."""
    cluster, config, m = uniform(6, 10.0, 1.0), SimConfig(), 2
    model = get_model("gpt-tiny")
    untied = plan_from_dict(untied_dict([[[0, 1], [2]]])).model_spec()
    sync = SyncConfig("allreduce")
    res = simulate(cluster, untied, [(0, 2), (2, 4)], [[[0, 1], [2]], [[3, 4], [5]]], sync, 1,
                   m, config, timeline=False)
    need = {d: gb for d, gb, _ in res.memory_gb}
    one = stage_memory(untied, 2, 4, 1, 2 * m, False, config.memory()).total_bytes / 1e9
    assert need[2] == pytest.approx(one) and len(need) == 6
    assert res.tokens_per_step == 2 * 2 * m * model.seq_len  # R x L lanes
    payload = untied.stage_params(0, 2) * 4.0
    assert res.fsdp_bytes_per_step == 2 * (2 - 1) * payload * 3 * m  # stage 0 only
    flat = simulate(cluster, untied, [(0, 2), (2, 4)], [[0, 2], [3, 5]], sync, 1, m, config,
                    timeline=False)
    assert res.dp_bytes_per_step == pytest.approx(flat.dp_bytes_per_step)
    assert res.step_s > flat.step_s  # stage 1's device runs two lanes
    # the report names each stage's D (not "2 devices each": stage 1 has one device)
    assert res.shard_degree == 2 and res.shard_degrees == [2, 1]
    assert res.to_dict()["shard_degrees"] == [2, 1]
    assert re.search(r"shard groups \(FSDP\) +2 1 devices each \(by stage\)",
                     format_sim_table(res))


# --------------------------------------------------------------------------- planner


def two_sites(inside: tuple[float, float] = (0.01, 100.0),
              across: tuple[float, float] = (40.0, 1.0)) -> Cluster:
    """Two sites of 4 A100-40GB, fast inside, one slow link between (like `badlink`); ids
    interleaved so that a site is not an id range."""
    site = [0, 1, 0, 1, 1, 0, 0, 1]
    devs = [Device(i, f"d{i}", f"site-{site[i]}", f"10.0.0.{i + 1}", "A100-40GB", 312.0, 40.0)
            for i in range(8)]
    same = np.array([[site[i] == site[j] for j in range(8)] for i in range(8)])
    lat, bw = np.where(same, inside[0], across[0]), np.where(same, inside[1], across[1])
    np.fill_diagonal(lat, 0.0)
    np.fill_diagonal(bw, np.inf)
    return Cluster("two-sites", devs, lat, bw)


def test_sites_and_shard_groups_stay_inside_a_site():
    cluster = two_sites()
    assert sites(cluster) == [[0, 2, 5, 6], [1, 3, 4, 7]]
    assert shard_groups(cluster, 4) == [[0, 2, 5, 6], [1, 3, 4, 7]]
    assert shard_groups(cluster, 3) == [[0, 2, 5], [1, 3, 4]]


def test_planner_picks_two_sharded_replicas_with_diloco_across_sites():
    """llama-1b's state (36 GB with DiLoCo) fits no single 40 GB device with its activations;
    with --max-shard 4 the planner writes 2 replicas x 4-way sharded, one per site."""
    cluster, model = two_sites(), get_model("llama-1b")
    sync = SyncConfig("diloco", 50, "int8", overlap=True)
    req = PlanRequest(0, 0, micro_batch_size=8, objective="simulated", sync=sync, max_shard=4,
                      search=SearchConfig(budget=300, time_limit_s=60, seed=0),
                      random_samples=20)
    flat = plan_best_shape(cluster, model, req).plan
    assert flat.num_stages > 1  # D = 1: only a pipeline fits
    best, every = plan_hierarchical(cluster, model, req, (sync,), flat, time.perf_counter())
    plan = best.plan
    assert isinstance(plan, Plan) and plan.to_dict()["format"] == "plan/2"
    assert (plan.num_stages, plan.shard_degree(0), plan.num_replicas) == (1, 4, 2)
    assert plan.sync.mode == "diloco"
    assert sorted(sorted(plan.shard_group(r, 0)) for r in range(2)) == sites(cluster)
    assert best.per_sequence_s < every[0].per_sequence_s  # every[0]: the D = 1 plan
    assert plan.predicted["cost"] == pytest.approx(best.step_s, abs=1e-6)
    validate_plan(plan, cluster, model)
    # Without a D = 1 plan (none found) the sharded one is still chosen.
    alone, _ = plan_hierarchical(cluster, model, req, (sync,), None, time.perf_counter())
    assert alone.label == best.label


def test_planner_gives_the_fast_device_of_a_site_the_stage_of_fewer_devices():
    """Two sites of one fast (312 TFLOPS, 80 GB) and two slow (100 TFLOPS, 16 GB) devices,
    llama-150m (untied): the planner scores D per stage and writes 2 stages of D = (1, 2):
    the fast device runs both lanes of stage 0, the slow pair stage 1, one replica a site;
    faster per sequence than the D = 1 search's plan."""
    site, fast = [0, 0, 0, 1, 1, 1], {0, 3}
    devs = [Device(i, f"d{i}", f"site-{site[i]}", f"10.0.0.{i + 1}", "X",
                   312.0 if i in fast else 100.0, 80.0 if i in fast else 16.0) for i in range(6)]
    same = np.array([[site[i] == site[j] for j in range(6)] for i in range(6)])
    lat, bw = np.where(same, 0.01, 40.0), np.where(same, 100.0, 1.0)
    np.fill_diagonal(lat, 0.0)
    np.fill_diagonal(bw, np.inf)
    cluster, model = Cluster("mixed", devs, lat, bw), get_model("llama-150m")
    sync = SyncConfig("diloco", 50, "int8", overlap=True)
    req = PlanRequest(0, 0, micro_batch_size=8, objective="simulated", sync=sync, max_shard=2,
                      search=SearchConfig(budget=200, time_limit_s=60, seed=0),
                      random_samples=20)
    flat = plan_best_shape(cluster, model, req).plan
    best, every = plan_hierarchical(cluster, model, req, (sync,), flat, time.perf_counter())
    assert any("(2, 1)-way" in c.label for c in every)  # both orders scored
    plan = best.plan
    assert isinstance(plan, Plan) and plan.shard_degrees() == [1, 2]
    assert plan.pipelines == [[[0], [1, 2]], [[3], [4, 5]]]
    assert best.per_sequence_s < every[0].per_sequence_s  # every[0]: the D = 1 plan
    validate_plan(plan, cluster, model)


def test_d_vectors_for_more_than_two_stages():
    assert degree_vectors(2, 2) == [(1, 2)]
    assert degree_vectors(4, 3) == [(1, 1, 4), (1, 2, 4), (1, 4, 4), (2, 2, 4), (2, 4, 4)]
    assert degree_vectors(3, 1) == []  # one stage: uniform D only


def test_planner_scores_three_stages_of_different_d_with_memory_per_device():
    """Two sites of two fast (312 TFLOPS, 80 GB) and two slow (100 TFLOPS, 4 GB) devices,
    llama-150m (untied), DiLoCo H = 50 int8, --max-shard 2: 3-stage layouts with D per stage
    are scored; (1, 1, 2) (the slow pair on the last stage, with the head) does not fit the
    slow devices' 4 GB; (2, 1, 1) does and is written: the slow pair shards stage 0, each fast
    device holds a stage of its own, faster per sequence than the D = 1 search's 4 x 1 x 2."""
    site, fast = [0] * 4 + [1] * 4, {0, 1, 4, 5}
    devs = [Device(i, f"d{i}", f"site-{site[i]}", f"10.0.0.{i + 1}", "X",
                   312.0 if i in fast else 100.0, 80.0 if i in fast else 4.0) for i in range(8)]
    same = np.array([[site[i] == site[j] for j in range(8)] for i in range(8)])
    lat, bw = np.where(same, 0.01, 40.0), np.where(same, 100.0, 1.0)
    np.fill_diagonal(lat, 0.0)
    np.fill_diagonal(bw, np.inf)
    cluster, model = Cluster("mixed3", devs, lat, bw), get_model("llama-150m")
    assert [d for d, _ in mixed_layouts(cluster, 2, 3)] == [(1, 2), (2, 1), (1, 1, 2), (2, 1, 1)]
    sync = SyncConfig("diloco", 50, "int8", overlap=True)
    req = PlanRequest(0, 0, micro_batch_size=8, objective="simulated", sync=sync, max_shard=2,
                      search=SearchConfig(budget=200, time_limit_s=60, seed=0),
                      random_samples=20)
    flat = plan_best_shape(cluster, model, req).plan
    best, every = plan_hierarchical(cluster, model, req, (sync,), flat, time.perf_counter())
    by_label = {c.label: c for c in every}
    assert by_label["3 x (1, 1, 2)-way x 2, diloco"].step_s == float("inf")  # 4 GB devices
    plan = best.plan
    assert isinstance(plan, Plan) and plan.shard_degrees() == [2, 1, 1], best.label
    assert plan.pipelines == [[[2, 3], [1], [0]], [[6, 7], [5], [4]]]
    assert best.per_sequence_s < every[0].per_sequence_s  # every[0]: the D = 1 plan
    validate_plan(plan, cluster, model)
    for chain in plan.pipelines:  # every device holds its stage's share within its memory
        for (a, b), group in zip(plan.stages, chain):
            lanes = 2 // len(group)
            need = stage_memory(model, a, b, 8, plan.num_micro_batches * lanes, True,
                                req.sim.memory(), len(group)).total_bytes
            assert all(need <= devs[d].memory_gb * 1e9 for d in group)


def test_max_shard_default_is_one():
    assert PlanRequest(1, 1).max_shard == 1
    with pytest.raises(UserError, match=r"PlanRequest.max_shard: must be in \[1, 1024\]"):
        PlanRequest(1, 1, max_shard=0)


def test_cli_plans_simulates_and_evaluates_a_sharded_plan(tmp_path, capsys):
    from formats.cluster import save_cluster
    from scheduler.scheduler import main
    cluster_file, plan_file = tmp_path / "c.json", tmp_path / "p.json"
    save_cluster(two_sites(), cluster_file)
    rc = main(["plan", "--cluster", str(cluster_file), "--model", "llama-1b", "--objective",
               "simulated", "--sync", "diloco", "--inner-steps", "50", "--compression", "int8",
               "--overlap", "--micro-batch-size", "8", "--max-shard", "4", "--budget", "200",
               "--random-samples", "20", "--quiet", "--json", "--out", str(plan_file)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shard_degree"] == 4 and out["chosen"] == "1 x 4-way x 2, diloco"
    plan = load_plan(plan_file)
    assert plan.shard_degrees() == [4] and plan.num_replicas == 2
    assert main(["simulate", "--cluster", str(cluster_file), "--plan", str(plan_file),
                 "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["shard_degree"] == 4 and sim["step_s"] == pytest.approx(plan.predicted["cost"])
    assert sim["shard_degrees"] == [4]
    assert main(["simulate", "--cluster", str(cluster_file), "--plan", str(plan_file)]) == 0
    assert re.search(r"shard groups \(FSDP\) +4 devices each\n", capsys.readouterr().out)
    assert main(["evaluate", "--cluster", str(cluster_file), "--plan", str(plan_file)]) == 0
    assert "simulated cost" in (out := capsys.readouterr().out) and "(D = 4;" in out
    assert main(["evaluate", "--cluster", str(cluster_file), "--plan", str(plan_file),
                 "--objective", "dtfm"]) == 2
    assert "only the simulated objective models" in capsys.readouterr().err


def test_a_shard_that_does_not_fit_is_named():
    cluster = two_sites()  # 40 GB devices; llama-1b unsharded with DiLoCo does not fit
    model, sync = get_model("llama-1b"), SyncConfig("diloco", 4)
    with pytest.raises(UserError, match=r"device 0 .* stage 0 .* of replica 0 as 1 of 2 shards"
                                        r".*shard the stage over more devices"):
        simulate(cluster, model, [(0, 16)], [[[0, 2]], [[1, 3]]], sync, 8, 8, timeline=False)
