"""Memory estimate per device and the plans it rejects."""

from __future__ import annotations

import numpy as np
import pytest

from formats.errors import UserError
from formats.models import get_model
from formats.plan import SyncConfig
from scheduler.cost_simulated import SimulatedObjective
from scheduler.layer_split import even_split
from scheduler.memory import (
    MemoryConfig,
    check_plan_memory,
    layer_activation_bytes,
    memory_table,
    stage_memory,
)
from scheduler.scenarios import make_scenario
from tests.test_simulator_closed_forms import uniform_cluster

XL = get_model("gpt3-xl")


def test_middle_stage_numbers_by_hand():
    m = stage_memory(XL, 3, 6, micro_batch_size=1, num_micro_batches=61, diloco=False)
    params = 3 * XL.layer_params()
    assert m.state_bytes == pytest.approx(params * 16)
    stored = 61 * 3 * 2048 * 2048 * 2  # fp16 layer inputs of every micro-batch
    one_layer = 2048 * 2048 * (34 + 5 * 16 * 2048 / 2048)
    assert m.activation_bytes == pytest.approx(stored + one_layer)
    assert m.reserved_bytes == 1e9
    assert 4e9 < m.total_bytes < 7e9  # fits a 16 GB V100, as GPT3-XL on 8 V100 stages must


def test_without_recompute_gpipe_activations_do_not_fit_a_v100():
    m = stage_memory(XL, 3, 6, 1, 61, False, MemoryConfig(recompute=False))
    assert m.activation_bytes == pytest.approx(61 * 3 * layer_activation_bytes(XL))
    assert m.total_bytes > 16e9


def test_diloco_adds_outer_copy_and_momentum_and_ends_carry_embedding_and_logits():
    plain = stage_memory(XL, 0, 3, 1, 61, False)
    dil = stage_memory(XL, 0, 3, 1, 61, True)
    assert dil.state_bytes - plain.state_bytes == pytest.approx(XL.stage_params(0, 3) * 8)
    middle = stage_memory(XL, 3, 6, 1, 61, False)
    assert plain.state_bytes > middle.state_bytes  # token embedding on the first stage
    last = stage_memory(XL, 21, 24, 1, 61, False)
    assert last.activation_bytes - middle.activation_bytes == pytest.approx(2048 * 50257 * 6)


def test_table_matches_stage_memory_and_grows_with_micro_batches():
    small = memory_table(get_model("gpt-small"), 1, 4, False)
    big = memory_table(get_model("gpt-small"), 1, 40, False)
    assert small[1, 4] == stage_memory(get_model("gpt-small"), 1, 4, 1, 4, False).total_bytes
    assert np.isinf(small[3, 3]) and np.isinf(small[4, 2])
    assert (big[np.isfinite(big)] > small[np.isfinite(small)]).all()


def test_overflowing_plan_is_rejected_naming_device_and_numbers():
    cluster = uniform_cluster(4, memory_gb=6.0)
    stages = [(0, 21), (21, 22), (22, 23), (23, 24)]
    pipe = np.array([[2, 0, 1, 3]])
    with pytest.raises(UserError) as err:
        check_plan_memory(cluster, XL, stages, pipe, 1, 61, False)
    msg = str(err.value)
    assert "device 2" in msg and "stage 0" in msg and "layers [0, 21]" in msg
    assert "6 GB" in msg and "needs" in msg and "fewer layers" in msg


def test_objective_returns_inf_when_nothing_fits_and_avoids_small_gpus():
    cluster = uniform_cluster(4, memory_gb=2.0)
    obj = SimulatedObjective(cluster, XL, SyncConfig(), 1, 61)
    assert obj.cost(np.arange(4).reshape(1, 4)) == float("inf")
    assert obj.breakdown(np.arange(4).reshape(1, 4)).cost_s == float("inf")


def test_split_respects_the_smallest_memory_of_each_group():
    # mixed: T4/V100 have 16 GB; with many micro-batches a stage of a 16 GB group must stay small.
    cluster = make_scenario("mixed", 0)
    obj = SimulatedObjective(cluster, XL, SyncConfig(), 1, 61)
    rng = np.random.default_rng(0)
    for _ in range(5):
        pipe = rng.permutation(64)[:16].reshape(4, 4)
        bd = obj.breakdown(pipe)
        if not np.isfinite(bd.cost_s):
            continue
        check_plan_memory(cluster, XL, bd.stages, pipe, 1, 61, False)  # raises if not


def test_even_split_of_xl_on_eight_v100_stages_fits():
    cluster = make_scenario("worldwide", 0)
    pipe = np.arange(64).reshape(8, 8)
    check_plan_memory(cluster, XL, even_split(24, 8), pipe, 1, 61, True)


def test_dtfm_open_shape_plan_fits_and_refuses_shapes_that_cannot():
    # Issue 26: `plan --objective dtfm` without a shape on `mixed` (seed 9) wrote a 1 x 64 plan
    # needing 37 GB per 16 GB device: the comm-only objective prefers the widest shape.
    from scheduler.planning import PlanRequest, plan_best_shape
    from scheduler.search import SearchConfig
    from scheduler.simulator.step import simulate_plan

    cluster = make_scenario("mixed", 9)
    req = PlanRequest(0, 0, objective="dtfm", search=SearchConfig(budget=400, time_limit_s=60))
    out = plan_best_shape(cluster, XL, req)
    plan = out.plan
    assert (plan.num_stages, plan.num_replicas) != (1, 64)
    refused = plan.search["shapes_refused"]
    assert any(r.startswith("1 x 64:") and "16 GB" in r for r in refused)
    simulate_plan(cluster, XL, plan, timeline=False)  # raises UserError if any device overflows
    check_plan_memory(cluster, XL, list(plan.stages), np.array(plan.pipelines), 1,
                      plan.num_micro_batches, False)


def test_dtfm_shape_that_cannot_fit_exits_2_naming_the_smallest_device(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, str(ROOT / "scheduler" / "scheduler.py"), "plan",
                        "--scenario", "mixed", "--seed", "9", "--model", "gpt3-xl",
                        "--stages", "1", "--replicas", "64", "--objective", "dtfm",
                        "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
    line = r.stderr.strip().splitlines()[-1]
    assert "needs 37.08 GB" in line and "16 GB" in line and "device" in line
