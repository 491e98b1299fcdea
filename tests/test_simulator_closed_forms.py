"""The simulator against closed forms, and its fast path against its event engine."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from formats.cluster import Cluster, Device
from formats.models import get_model
from formats.plan import SyncConfig
from scheduler.cost_simulated import SimulatedObjective
from scheduler.layer_split import even_split
from scheduler.scenarios import make_scenario
from scheduler.simulator import (
    EventEngine,
    LinkTables,
    SimConfig,
    StepInputs,
    build_inputs,
    payload_bytes_per_param,
    replay_events,
    replay_fast,
    ring_allreduce_time,
    simulate,
)
from scheduler.simulator.collectives import undominated


def uniform_cluster(n: int, lat_ms: float = 10.0, gbps: float = 1.0, tflops: float = 100.0,
                    memory_gb: float = 80.0) -> Cluster:
    """n identical devices, all links equal."""
    devs = [Device(i, f"d{i}", "r", f"10.0.0.{i + 1}", "X", tflops, memory_gb) for i in range(n)]
    lat = np.full((n, n), lat_ms)
    bw = np.full((n, n), gbps)
    np.fill_diagonal(lat, 0.0)
    np.fill_diagonal(bw, np.inf)
    return Cluster("uniform", devs, lat, bw)


def inputs(r: int, s: int, m: int, tf: float, tb: float, tx: float, lat: float,
           ring_tx: float = 0.0, ring_lat: float = 0.0, h: int = 1,
           tied: tuple[float, float] | None = None) -> StepInputs:
    """Homogeneous hand-made step inputs; `tied`: (busy, latency) of each tied-sum step."""
    pipe = np.arange(r * s).reshape(r, s)
    full = lambda v, shape: np.full(shape, float(v))
    return StepInputs(pipe, full(tf, (r, s)), full(tb, (r, s)), full(tx, (r, s - 1)),
                      full(lat, (r, s - 1)), full(tx, (r, s - 1)), full(lat, (r, s - 1)),
                      [pipe[:, k] for k in range(s)], [full(ring_tx, r) for _ in range(s)],
                      [full(ring_lat, r) for _ in range(s)], m, h,
                      *((full(tied[0], (r, 2)), full(tied[1], (r, 2))) if tied else (None, None)))


def test_single_transfer_is_latency_plus_bytes_over_bandwidth():
    eng = EventEngine()
    link = eng.resource("link", ordered=False)
    t = eng.task(link, 8e9 / 2e9, [], latency=0.03)  # 1 GB at 2 Gbit/s + 30 ms
    start, end = eng.run()
    assert start[t] == 0.0
    assert end[t] == pytest.approx(4.0 + 0.03)


def test_link_is_fifo_later_messages_queue_but_latency_overlaps():
    eng = EventEngine()
    link = eng.resource("link", ordered=False)
    a = eng.task(link, 1.0, [], latency=5.0)
    b = eng.task(link, 1.0, [], latency=5.0)
    start, end = eng.run()
    assert sorted([start[a], start[b]]) == [0.0, 1.0]  # second waits for the wire, not the flight
    assert sorted([end[a], end[b]]) == [6.0, 7.0]


@pytest.mark.parametrize("r,s,m", [(1, 4, 8), (3, 5, 7), (2, 1, 6), (1, 2, 1)])
def test_homogeneous_gpipe_closed_form(r, s, m):
    tf, tb, tx, lat = 0.3, 0.7, 0.05, 0.02
    inp = inputs(r, s, m, tf, tb, tx, lat)
    expect = (m + s - 1) * (tf + tb) + 2 * (s - 1) * (tx + lat)
    assert replay_fast(inp).step_s == pytest.approx(expect)
    assert replay_events(inp)[0].step_s == pytest.approx(expect)


def test_slow_link_bounds_the_pipeline():
    # Transfers slower than compute: stage 1 receives one activation per tx, so the link is the
    # bottleneck: forward of stage 1 ends at tf + m*tx + lat + tf.
    m, tf, tb, tx, lat = 6, 0.1, 0.2, 0.5, 0.01
    inp = inputs(1, 2, m, tf, tb, tx, lat)
    fast, _ = replay_events(inp)
    f_end_stage1 = tf + (m - 1) * tx + tx + lat + tf  # last activation arrives, one forward
    # stage 1 then runs m backwards; stage 0 gets the last gradient after more link queueing
    b1_end = f_end_stage1 + m * tb
    # gradient j leaves stage 1 at f_end1 + (j+1) tb; link busy tx each -> the last leaves at
    # f_end1 + tb + (m-1) tx (tx > tb), arrives + tx + lat, then stage 0 does its last backward.
    expect = f_end_stage1 + tb + (m - 1) * tx + tx + lat + tb
    assert expect > b1_end
    assert fast.makespan_s == pytest.approx(expect)
    assert replay_fast(inp).makespan_s == pytest.approx(expect)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_ring_allreduce_closed_form(n):
    payload, gbps, lat_ms = 3e8, 2.0, 15.0
    c = uniform_cluster(n, lat_ms=lat_ms, gbps=gbps)
    bw_bits = c.bandwidth_gbps * 1e9
    expect = 2 * (n - 1) / n * payload * 8 / (gbps * 1e9) + 2 * (n - 1) * lat_ms / 1e3
    ring = np.arange(n)
    nxt = np.roll(ring, -1)
    assert ring_allreduce_time(c.latency_ms[ring, nxt] / 1e3, bw_bits[ring, nxt], payload) \
        == pytest.approx(expect)
    # and the event engine, with the group's ring as link tasks after a zero pipeline
    tx = payload / n * 8 / (gbps * 1e9)
    inp = inputs(n, 1, 1, 1e-9, 1e-9, 0.0, 0.0, ring_tx=tx, ring_lat=lat_ms / 1e3)
    times, boxes = replay_events(inp)
    assert times.dp_time_s[0] == pytest.approx(expect)
    assert sum(b.kind == "allreduce" for b in boxes) == 2 * (n - 1) * n


def test_ring_bottleneck_link_decides():
    n, payload = 4, 1e8
    lat = np.full(n, 0.01)
    bits = np.full(n, 1e9)
    bits[2] = 1e8  # one slow link
    expect = 2 * (n - 1) * (0.01 + payload / n * 8 / 1e8)
    assert ring_allreduce_time(lat, bits, payload) == pytest.approx(expect)


def test_dp_overlaps_with_earlier_stages_backward():
    # Stage 1 finishes its backward tb*... before stage 0: a short all-reduce of stage 1 hides.
    r, s, m, tf, tb = 2, 2, 4, 0.1, 0.2
    hidden = inputs(r, s, m, tf, tb, 0.0, 0.0, ring_tx=0.05, ring_lat=0.0)
    base = (m + s - 1) * (tf + tb)
    t = replay_fast(hidden)
    # group 0's all-reduce starts at the makespan and is exposed: 2(n-1) * 0.05
    assert t.step_s == pytest.approx(base + 2 * 0.05)
    assert t.dp_start_s[1] < t.dp_start_s[0] == pytest.approx(base)


def test_tied_sum_delays_the_end_stages_rings_in_numbers_and_events():
    r, s, m, tf, tb, tx, lat = 3, 3, 4, 0.1, 0.2, 0.01, 0.02
    tied_tx, tied_lat, ring_tx = 0.3, 0.05, 0.04
    inp = inputs(r, s, m, tf, tb, tx, lat, ring_tx=ring_tx, tied=(tied_tx, tied_lat))
    base = (m + s - 1) * (tf + tb) + 2 * (s - 1) * (tx + lat)  # stage 0's last backward
    ring = 2 * (r - 1) * ring_tx
    fast = replay_fast(inp)
    times, boxes = replay_events(inp)
    assert fast.makespan_s == pytest.approx(base + 2 * (tied_tx + tied_lat))
    assert fast.step_s == pytest.approx(base + 2 * (tied_tx + tied_lat) + ring)
    for key in ("makespan_s", "pipeline_s", "dp_exposed_round_s", "step_s"):
        assert getattr(times, key) == pytest.approx(getattr(fast, key), rel=1e-12)
    tied = [b for b in boxes if b.kind == "tied"]
    assert len(tied) == r * 2 * 2  # per replica: 2 steps, both directions
    assert {b.device for b in tied} == {d for k in range(r) for d in (k * s, k * s + s - 1)}
    tied_end = max(b.end_s + b.latency_s for b in tied)
    assert tied_end == pytest.approx(fast.makespan_s)
    ring_start = {k: min(b.start_s for b in boxes if b.kind == "allreduce" and b.device % s == k)
                  for k in range(s)}
    assert ring_start[0] == ring_start[s - 1] == pytest.approx(tied_end)
    assert ring_start[1] < min(b.start_s for b in tied)  # the middle stage does not wait


def test_diloco_amortises_outer_sync_over_h():
    r, s, m = 4, 3, 5
    every = inputs(r, s, m, 0.1, 0.2, 0.01, 0.0, ring_tx=1.0, ring_lat=0.1)
    diloco = inputs(r, s, m, 0.1, 0.2, 0.01, 0.0, ring_tx=1.0, ring_lat=0.1, h=50)
    a, d = replay_fast(every), replay_fast(diloco)
    assert a.makespan_s == pytest.approx(d.makespan_s)
    assert d.dp_exposed_round_s == pytest.approx(a.dp_exposed_round_s)
    assert d.step_s == pytest.approx(d.makespan_s + a.dp_exposed_round_s / 50)
    assert replay_events(diloco)[0].step_s == pytest.approx(d.step_s)


def test_payload_sizes_by_compression():
    assert payload_bytes_per_param("none") == 4.0
    assert payload_bytes_per_param("fp16") == 2.0
    assert payload_bytes_per_param("int8", 256) == pytest.approx(1.015625)


def test_compression_shortens_the_allreduce_in_simulate():
    c = uniform_cluster(8, lat_ms=5.0, gbps=1.0)
    model = get_model("gpt-small")
    pipe = np.arange(8).reshape(4, 2)
    stages = even_split(model.num_layers, 2)
    times = {comp: simulate(c, model, stages, pipe, SyncConfig(compression=comp), 1, 4)
             for comp in ("none", "fp16", "int8")}
    # minus the latency part: fp32 is gloo's ring (2(n-1) = 6 steps), fp16/int8 a direct
    # reduce-scatter (one step: all 4 devices in one region, so one link per sender carries
    # its 3 chunks, the ring's bandwidth term) and a ring all-gather (3 steps)
    steps = {"none": 6, "fp16": 4, "int8": 4}
    ar = {k: v.dp_allreduce_s[0] - steps[k] * 0.005 for k, v in times.items()}
    assert ar["none"] / ar["fp16"] == pytest.approx(2.0)
    assert ar["none"] / ar["int8"] == pytest.approx(4.0 / 1.015625)


def test_compressed_allreduce_is_a_direct_reduce_scatter_then_a_ring_all_gather():
    """Two regions of two devices: each sender's chunks into the other region share one link
    (0.1 Gbit/s, 20 ms), into its own one link (1 Gbit/s, 1 ms); the all-gather ring crosses
    the slow links twice, so each of its 3 steps is a slow link's."""
    devs = [Device(i, f"d{i}", "ab"[i // 2], f"10.0.0.{i + 1}", "X", 100.0, 80.0)
            for i in range(4)]
    cross = np.add.outer(np.arange(4) // 2, np.arange(4) // 2) == 1
    lat, gbps = np.where(cross, 20.0, 1.0), np.where(cross, 0.1, 1.0)
    np.fill_diagonal(lat, 0.0)
    np.fill_diagonal(gbps, np.inf)
    c = Cluster("two-regions", devs, lat, gbps)
    model = get_model("gpt-tiny")
    stages = even_split(model.num_layers, 1)
    pipe = np.arange(4).reshape(4, 1)
    payload = model.stage_params(0, model.num_layers) * payload_bytes_per_param("int8", 256)
    chunk_bits = payload / 4 * 8
    direct = 0.020 + 2 * chunk_bits / 0.1e9  # two chunks into the other region, one link
    gather = 3 * (0.020 + chunk_bits / 0.1e9)
    t = simulate(c, model, stages, pipe, SyncConfig(compression="int8"), 1, 4)
    assert t.dp_allreduce_s[0] == pytest.approx(direct + gather)
    fp32 = simulate(c, model, stages, pipe, SyncConfig(), 1, 4)
    assert fp32.dp_allreduce_s[0] == pytest.approx(6 * (0.020 + chunk_bits * 4 / 1.015625
                                                         / 0.1e9))


def test_undominated_links_keep_the_max_for_every_payload():
    lat = np.array([1.0, 2.0, 2.0, 0.5, 2.0])
    spb = np.array([3.0, 1.0, 2.0, 4.0, 2.0])  # link 4 copies link 2
    assert undominated(lat, spb).tolist() == [2, 0, 3]
    rng = np.random.default_rng(0)
    lat, spb = rng.random(64), rng.random(64)
    keep = undominated(lat, spb)
    bits = np.geomspace(1e-3, 1e3, 50)[:, None]
    assert np.array_equal((lat + bits * spb).max(axis=1),
                          (lat[keep] + bits * spb[keep]).max(axis=1))
    assert len(keep) < 64


@pytest.mark.parametrize("sync", [SyncConfig(), SyncConfig("diloco", 100, "int8"),
                                  SyncConfig(compression="fp16")])
@pytest.mark.parametrize("scenario,seed", [("mixed", 0), ("worldwide", 3), ("random", 5)])
def test_fast_path_equals_event_engine_on_heterogeneous_plans(scenario, seed, sync):
    cluster = make_scenario(scenario, seed)
    model = get_model("gpt3-xl")
    rng = np.random.default_rng(seed)
    obj = SimulatedObjective(cluster, model, sync, 1, 13)
    for _ in range(2):
        pipe = rng.permutation(cluster.num_devices)[:32].reshape(4, 8)
        bd = obj.breakdown(pipe)
        if not np.isfinite(bd.cost_s):
            continue
        res = simulate(cluster, model, bd.stages, pipe, sync, 1, 13, timeline=True)  # events
        assert res.step_s == pytest.approx(bd.cost_s, rel=1e-9)
        assert obj.cost(pipe) == pytest.approx(bd.cost_s, rel=1e-12)
        for key in ("compute_s", "bubble_s", "pp_comm_s", "tied_comm_s", "dp_comm_s"):
            assert bd.parts[key] == pytest.approx(res.parts()[key], rel=1e-9, abs=1e-9)
        assert res.tied_comm_s > 0  # gpt3-xl ties its embeddings: the tied tasks are replayed
        # without a timeline simulate takes the fast path, the objective's recurrences
        quick = simulate(cluster, model, bd.stages, pipe, sync, 1, 13, timeline=False)
        assert quick.step_s == pytest.approx(bd.cost_s, rel=1e-12) and quick.timeline == []
        assert quick.parts() == pytest.approx(res.parts(), rel=1e-9, abs=1e-9)
        assert [quick.dp_comm_round_s, *quick.dp_allreduce_s] == pytest.approx(
            [res.dp_comm_round_s, *res.dp_allreduce_s], rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("model_name", ["gpt3-xl", "llama-150m"])  # tied, untied
@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_replay_fast_equals_replay_events_field_by_field(model_name, factor):
    cluster = make_scenario("worldwide", 1)
    model = get_model(model_name)
    config = SimConfig(collective_latency_factor=factor)
    pipe = np.random.default_rng(2).permutation(cluster.num_devices)[:24].reshape(4, 6)
    inp = build_inputs(LinkTables(cluster, config), model, even_split(model.num_layers, 6),
                       pipe, SyncConfig(), 1, 9, config)
    assert (inp.tied_s is not None) == model.tie_embeddings
    fast, (events, _) = replay_fast(inp), replay_events(inp)
    for key in ("makespan_s", "pipeline_s", "dp_exposed_round_s", "step_s"):
        assert getattr(events, key) == pytest.approx(getattr(fast, key), rel=1e-9)
    for key in ("dp_start_s", "dp_time_s"):
        np.testing.assert_allclose(getattr(events, key), getattr(fast, key), rtol=1e-9)


def test_breakdown_parts_add_up_and_tokens_per_second():
    cluster = make_scenario("mixed", 1)
    model = get_model("gpt3-xl")
    pipe = np.random.default_rng(1).permutation(64).reshape(8, 8)
    res = simulate(cluster, model, even_split(24, 8), pipe, SyncConfig(), 1, 61)
    p = res.parts()
    assert p["compute_s"] + p["bubble_s"] + p["pp_comm_s"] + p["tied_comm_s"] \
        + p["dp_comm_s"] == pytest.approx(p["step_s"])
    assert p["tied_comm_s"] > 0  # gpt3-xl ties its embeddings: 412 MB summed every step
    assert min(p.values()) >= -1e-9
    assert res.tokens_per_step == 8 * 61 * 2048
    assert res.tokens_per_s == pytest.approx(res.tokens_per_step / res.step_s)
    d = res.to_dict()
    assert d["sync"]["mode"] == "allreduce" and len(d["memory_gb"]) == 64


def test_faster_gpus_give_shorter_steps_mfu_scales_compute():
    model = get_model("gpt-small")
    pipe = np.arange(4).reshape(1, 4)
    stages = even_split(model.num_layers, 4)
    slow = simulate(uniform_cluster(4, tflops=50), model, stages, pipe, SyncConfig(), 2, 8)
    fast = simulate(uniform_cluster(4, tflops=100), model, stages, pipe, SyncConfig(), 2, 8)
    assert fast.compute_s == pytest.approx(slow.compute_s / 2)
    half = simulate(uniform_cluster(4, tflops=100), model, stages, pipe, SyncConfig(), 2, 8,
                    SimConfig(mfu=0.2))
    assert half.compute_s == pytest.approx(slow.compute_s)


def test_activation_bytes_set_the_pipeline_message_size():
    model = get_model("gpt-small")  # 128 x 384 values per sequence cross a boundary
    pipe = np.arange(2).reshape(1, 2)
    stages = even_split(model.num_layers, 2)
    lat_ms, gbps = 10.0, 0.1
    fp32 = simulate(uniform_cluster(2, lat_ms, gbps, tflops=1e6), model, stages, pipe,
                    SyncConfig(), 2, 1, SimConfig(activation_bytes=4))
    fp16 = simulate(uniform_cluster(2, lat_ms, gbps, tflops=1e6), model, stages, pipe,
                    SyncConfig(), 2, 1, SimConfig(activation_bytes=2))
    one_message = 2 * 128 * 384 * 2 * 8 / (gbps * 1e9)  # fp16 payload of 2 sequences, seconds
    # one forward and one backward message each way: the difference is 2 x the extra bytes
    assert fp32.pp_comm_s - fp16.pp_comm_s == pytest.approx(2 * one_message, rel=1e-6)


def test_tied_embedding_sum_is_a_two_rank_allreduce_after_both_ends():
    model = get_model("gpt-small")  # tied: 256 x 384 fp32 = 393 216 bytes
    lat_ms, gbps = 20.0, 0.05
    cluster = uniform_cluster(3, lat_ms, gbps, tflops=1e6)
    pipe = np.arange(3).reshape(1, 3)
    res = simulate(cluster, model, even_split(model.num_layers, 3), pipe, SyncConfig(), 1, 1)
    half_bits = 256 * 384 * 4 / 2 * 8
    assert res.tied_comm_s == pytest.approx(2 * (lat_ms / 1e3 + half_bits / (gbps * 1e9)),
                                            rel=1e-6)
    untied = simulate(cluster, get_model("llama-150m"), even_split(12, 3), pipe, SyncConfig(),
                      1, 1, SimConfig(reserved_gb=0.0))
    assert untied.tied_comm_s == 0.0  # llama presets keep separate embedding and head


def test_collective_latency_factor_scales_only_the_latency_of_allreduce_steps():
    model = get_model("gpt-small")
    pipe = np.arange(4).reshape(2, 2)  # 2 replicas x 2 stages: rings of 2, tied pairs
    stages = even_split(model.num_layers, 2)
    cluster = uniform_cluster(4, 30.0, 0.1, tflops=1e6)
    one = simulate(cluster, model, stages, pipe, SyncConfig(), 1, 1, SimConfig())
    two = simulate(cluster, model, stages, pipe, SyncConfig(), 1, 1,
                   SimConfig(collective_latency_factor=2.0))
    # a ring of 2 has 2 steps: each pays one more 30 ms latency
    assert max(two.dp_allreduce_s) - max(one.dp_allreduce_s) == pytest.approx(2 * 0.030)
    assert two.tied_comm_s - one.tied_comm_s == pytest.approx(2 * 0.030)
    assert two.pp_comm_s == pytest.approx(one.pp_comm_s)  # point-to-point is unchanged


def test_diloco_outer_step_pays_store_round_trips_to_device_0_once_per_round():
    model = get_model("gpt-small")
    pipe = np.arange(4).reshape(2, 2)
    stages = even_split(model.num_layers, 2)
    cluster = uniform_cluster(4, 25.0, 1.0, tflops=1e6)
    sync = SyncConfig("diloco", 10, "int8")
    base = simulate(cluster, model, stages, pipe, sync, 1, 1, SimConfig())
    agree = simulate(cluster, model, stages, pipe, sync, 1, 1,
                     SimConfig(outer_store_round_trips=5))
    # 5 round trips of 2 x 25 ms, paid once per outer round of H = 10 steps
    assert agree.dp_comm_round_s - base.dp_comm_round_s == pytest.approx(5 * 0.050)
    assert agree.step_s - base.step_s == pytest.approx(5 * 0.050 / 10)
    every_step = simulate(cluster, model, stages, pipe, SyncConfig(), 1, 1,
                          SimConfig(outer_store_round_trips=5))
    assert every_step.step_s == pytest.approx(
        simulate(cluster, model, stages, pipe, SyncConfig(), 1, 1, SimConfig()).step_s)


# --------------------------------------------------------------------------- bad links (issue 15)


@pytest.mark.parametrize("h", [2, 5, 40])
def test_overlap_hides_the_outer_sync_up_to_h_steps_of_compute(h):
    # One stage, so the ring starts at the makespan; no store agreement.
    r, m, tf, tb, ring_tx, ring_lat = 3, 2, 0.1, 0.2, 0.15, 0.05
    blocking = inputs(r, 1, m, tf, tb, 0.0, 0.0, ring_tx=ring_tx, ring_lat=ring_lat, h=h)
    overlapped = replace(blocking, overlap=True)
    makespan = m * (tf + tb)
    sync = 2 * (r - 1) * (ring_tx + ring_lat)  # 0.8 s: more than 2 steps, less than 5
    expect_exposed = max(0.0, sync - h * makespan)
    for times in (replay_fast(overlapped), replay_events(overlapped)[0]):
        assert times.makespan_s == pytest.approx(makespan)
        assert times.dp_exposed_round_s == pytest.approx(expect_exposed)
        assert times.step_s == pytest.approx(makespan + expect_exposed / h)
        assert times.dp_sync_round_s == pytest.approx(sync)
        assert times.dp_hidden_round_s == pytest.approx(sync - expect_exposed)
    assert replay_fast(blocking).dp_exposed_round_s == pytest.approx(sync)  # nothing hidden
    if h * makespan >= sync:
        assert replay_fast(overlapped).step_s == pytest.approx(makespan)


@pytest.mark.parametrize("f", [1, 3])
def test_overlapped_syncs_hide_their_store_agreement_too(f):
    # The runtime's background worker runs the whole outer round (arrivals, all-reduce,
    # commit), so with overlap the agreement hides behind compute like the ring does.
    r, m, tf, tb, ring_tx, agree = 3, 2, 0.1, 0.2, 0.05, 0.3
    blocking = replace(inputs(r, 1, m, tf, tb, 0.0, 0.0, ring_tx=ring_tx, h=2), agree_s=agree,
                       fragments=f)
    makespan, ring = m * (tf + tb), 2 * (r - 1) * ring_tx
    assert replay_fast(blocking).dp_exposed_round_s == pytest.approx(f * (ring + agree))
    overlapped = replace(blocking, overlap=True)
    expect = max(0.0, f * (ring + agree) - 2 * makespan)  # 0 for f=1, 0.3 s for f=3
    assert replay_fast(overlapped).dp_exposed_round_s == pytest.approx(expect)


def test_background_sync_gets_the_link_share_the_pipeline_leaves():
    r, m, tf, tb, ring_tx = 2, 4, 0.1, 0.2, 0.5
    base = replace(inputs(r, 1, m, tf, tb, 0.0, 0.0, ring_tx=ring_tx, h=1), overlap=True)
    makespan = m * (tf + tb)  # 1.2 s
    busy = [np.full(r, 0.3)]  # the pipeline keeps each ring link's shared link busy 0.3 s/step
    slowed = replace(base, ring_pp_busy=busy)
    share = 1 - 0.3 / makespan
    assert replay_fast(slowed).dp_time_s[0] == pytest.approx(2 * (r - 1) * ring_tx / share)
    assert replay_fast(base).dp_time_s[0] == pytest.approx(2 * (r - 1) * ring_tx)
    full = replace(base, ring_pp_busy=[np.full(r, 5.0)])  # saturated: the floor share
    assert replay_fast(full).dp_time_s[0] == pytest.approx(2 * (r - 1) * ring_tx / 0.05)


def test_overlap_contention_comes_from_pipeline_traffic_into_the_same_region():
    # 2 replicas x 2 stages, pipelines [0, 1] and [2, 3]; stage 0's ring link 0 -> 2 and
    # device 0's activation send 0 -> 1 share a link only when 1 and 2 are in one region.
    model = get_model("gpt-small")
    c = uniform_cluster(4, lat_ms=10.0, gbps=0.02, tflops=0.5)
    sync = SyncConfig("diloco", 4, overlap=True)
    stages = even_split(model.num_layers, 2)

    def run(regions: str, s: SyncConfig):
        devs = [replace(d, region=regions[i]) for i, d in enumerate(c.devices)]
        return simulate(Cluster("c", devs, c.latency_ms, c.bandwidth_gbps), model, stages,
                        [[0, 1], [2, 3]], s, 1, 2, timeline=False)

    alone = run("abcd", SyncConfig("diloco", 4))  # blocking: the pipeline is done
    apart, shared = run("abcd", sync), run("abbb", sync)
    assert apart.dp_allreduce_s == pytest.approx(alone.dp_allreduce_s)
    assert shared.dp_allreduce_s[0] > alone.dp_allreduce_s[0] * 1.01
    assert shared.makespan_s == pytest.approx(alone.makespan_s)  # the pipeline keeps its speed


@pytest.mark.parametrize("f", [2, 4])
def test_fragments_send_the_same_bytes_with_f_ring_starts(f):
    n, lat_ms, gbps = 4, 20.0, 0.5
    model = get_model("gpt-small")
    c = uniform_cluster(n, lat_ms=lat_ms, gbps=gbps, tflops=1e6)
    pipe = np.arange(n).reshape(n, 1)
    stages = even_split(model.num_layers, 1)
    one = simulate(c, model, stages, pipe, SyncConfig("diloco", 8), 1, 1, timeline=False)
    many = simulate(c, model, stages, pipe, SyncConfig("diloco", 8, fragments=f), 1, 1,
                    timeline=False)
    assert many.dp_bytes_per_step == pytest.approx(one.dp_bytes_per_step)
    starts = 2 * (n - 1) * lat_ms / 1e3  # latency of one ring all-reduce
    transfer = one.dp_allreduce_s[0] - starts
    assert many.dp_allreduce_s[0] == pytest.approx(transfer / f + starts)
    # blocking fragments: F ring starts per round, the same bytes
    assert many.dp_sync_round_s == pytest.approx(transfer + f * starts, rel=1e-6)
    assert many.dp_comm_round_s == pytest.approx(one.dp_comm_round_s + (f - 1) * starts,
                                                 rel=1e-6)
    events = simulate(c, model, stages, pipe, SyncConfig("diloco", 8, fragments=f), 1, 1)
    assert events.step_s == pytest.approx(many.step_s)


@pytest.mark.parametrize("act_bytes", [4, 2])
def test_pipeline_compression_bytes_per_boundary(act_bytes):
    model = get_model("gpt-small")  # 128 tokens x 384 values per sequence
    c = uniform_cluster(3, 10.0, 0.1, tflops=1e6)
    pipe = np.arange(3).reshape(1, 3)
    stages = even_split(model.num_layers, 3)
    mbs, m = 2, 3
    per_message = {"none": mbs * 128 * 384 * act_bytes, "bf16": mbs * 128 * 384 * 2,
                   "int8": mbs * 128 * (384 + 4)}
    for mode, msg in per_message.items():
        res = simulate(c, model, stages, pipe, SyncConfig(), mbs, m,
                       SimConfig(activation_bytes=act_bytes), timeline=False,
                       pipeline_compression=mode)
        # 2 boundaries, a message each way per micro-batch
        assert res.pp_bytes_per_step == pytest.approx(2 * 2 * m * msg)
        assert res.to_dict()["pipeline_compression"] == mode


@pytest.mark.parametrize("sync", [SyncConfig(), SyncConfig("diloco", 8, "int8", overlap=True)])
@pytest.mark.parametrize("act_bytes", [4, 2])
def test_pipeline_compression_never_lengthens_the_step(sync, act_bytes):
    cluster = make_scenario("mixed", 2)
    model = get_model("gpt3-xl")
    rng = np.random.default_rng(4)
    config = SimConfig(activation_bytes=act_bytes)
    for _ in range(3):
        pipe = rng.permutation(cluster.num_devices)[:32].reshape(4, 8)
        steps = [simulate(cluster, model, even_split(24, 8), pipe, sync, 1, 8, config,
                          timeline=False, pipeline_compression=mode).step_s
                 for mode in ("none", "bf16", "int8")]
        assert steps[0] >= steps[1] - 1e-12 and steps[1] >= steps[2] - 1e-12
        assert steps[2] < steps[0]
