"""The simulated objective inside the search: it runs, and it beats naive plans on `mixed`."""

from __future__ import annotations

import numpy as np
import pytest

from formats.errors import UserError
from formats.models import get_model
from formats.plan import SyncConfig
from scheduler.baselines import index_order_plan
from scheduler.cost_dtfm import DtfmObjective
from scheduler.cost_simulated import SimulatedObjective
from scheduler.layer_split import even_split
from scheduler.planning import PlanRequest, make_simulated, search_plan
from scheduler.scenarios import make_scenario
from scheduler.search import SearchConfig
from scheduler.simulator import simulate

XL = get_model("gpt3-xl")


@pytest.mark.timeout(120)
def test_search_with_simulated_objective_beats_index_order_and_matches_simulator():
    cluster = make_scenario("mixed", 0)
    sync = SyncConfig("diloco", 100, "int8")
    obj = make_simulated(cluster, XL, PlanRequest(8, 8, 1, 16, sync=sync))
    dtfm = DtfmObjective(cluster, XL, 8, 8, 16)
    res = search_plan(cluster, obj, dtfm, 8, 8, SearchConfig(budget=400, time_limit_s=30))
    ours = obj.breakdown(res.pipelines)
    assert ours.cost_s == pytest.approx(res.cost)
    index = obj.cost(index_order_plan(np.arange(64), 8, 8))
    assert ours.cost_s < 0.9 * index
    event = simulate(cluster, XL, ours.stages, res.pipelines, sync, 1, 16, timeline=True)
    assert event.step_s == pytest.approx(ours.cost_s, rel=1e-9)


def test_fixed_split_must_match_stage_count():
    cluster = make_scenario("mixed", 0)
    obj = SimulatedObjective(cluster, XL, SyncConfig(), 1, 4, stages=even_split(24, 4))
    with pytest.raises(UserError, match="fixed split has 4 stages"):
        obj.cost(np.arange(16).reshape(2, 8))


def test_bad_batch_is_a_user_error():
    with pytest.raises(UserError, match="num_micro_batches"):
        SimulatedObjective(make_scenario("mixed", 0), XL, SyncConfig(), 1, 0)
