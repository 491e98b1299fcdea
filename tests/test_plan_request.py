"""PlanRequest: checked when made, never written into, errors name fields (the CLI: flags)."""

from __future__ import annotations

import dataclasses

import pytest

from formats.errors import UserError
from formats.models import get_model
from formats.plan import SyncConfig
from scheduler.planning import (
    PlanRequest,
    candidate_shapes,
    check_shape,
    default_micro_batches,
    plan_best_shape,
)
from scheduler.scenarios import make_scenario
from scheduler.scheduler import in_flag_words
from scheduler.search import SearchConfig
from scheduler.simulator import SimConfig, resolve_sim_config

LAB = make_scenario("lab", 0)
TINY = get_model("gpt-tiny")


@pytest.mark.parametrize("kwargs,field", [
    ({"num_stages": -1}, "PlanRequest.num_stages"),
    ({"micro_batch_size": 0}, "PlanRequest.micro_batch_size"),
    ({"num_micro_batches": -2}, "PlanRequest.num_micro_batches"),
    ({"objective": "fastest"}, "PlanRequest.objective"),
    ({"random_samples": 0}, "PlanRequest.random_samples"),
    ({"tokens_per_replica": 0.0}, "PlanRequest.tokens_per_replica"),
    ({"sync": SyncConfig("allreduce", 5)}, "sync.inner_steps"),
])
def test_a_bad_field_is_a_user_error_naming_it(kwargs, field):
    args = {"num_stages": 4, "num_replicas": 2, **kwargs}
    with pytest.raises(UserError) as err:
        PlanRequest(**args)
    assert str(err.value).startswith(field) and "--" not in str(err.value)


@pytest.mark.parametrize("make,field", [
    (lambda: SearchConfig(budget=0), "SearchConfig.budget"),
    (lambda: SearchConfig(time_limit_s=float("nan")), "SearchConfig.time_limit_s"),
    (lambda: SearchConfig(seed=-1), "SearchConfig.seed"),
    (lambda: SimConfig(mfu=1.5), "SimConfig.mfu"),
    (lambda: SimConfig(activation_bytes=3), "SimConfig.activation_bytes"),
    (lambda: SimConfig(runtime="tpu"), "SimConfig.runtime"),
])
def test_nested_configs_name_their_fields(make, field):
    with pytest.raises(UserError) as err:
        make()
    assert str(err.value).startswith(field + ": ") and "--" not in str(err.value)


def test_shape_errors_name_fields_and_the_cli_words_them_as_flags():
    with pytest.raises(UserError) as err:
        check_shape(LAB, TINY, PlanRequest(3, 2))
    message = str(err.value)
    assert message.startswith("PlanRequest.num_stages 3 x PlanRequest.num_replicas 2 = 6")
    assert in_flag_words(message).startswith("--stages 3 x --replicas 2 = 6 devices")
    with pytest.raises(UserError, match=r"^PlanRequest\.num_replicas 3 does not divide"):
        candidate_shapes(LAB, TINY, PlanRequest(0, 3))
    assert in_flag_words("SearchConfig.budget: must be >= 1, got 0") == \
        "--budget: must be >= 1, got 0"
    assert in_flag_words("SimConfig.collective_latency_factor: x") == \
        "--collective-latency-factor: x"


def test_planning_leaves_the_callers_request_as_it_was():
    req = PlanRequest(4, 2, micro_batch_size=4, num_micro_batches=0, objective="simulated",
                      search=SearchConfig(budget=100, time_limit_s=60),
                      random_samples=5, sim=resolve_sim_config(runtime="cpu"))
    before = dataclasses.replace(req)
    out = plan_best_shape(LAB, TINY, req)
    assert req == before and req.num_micro_batches == 0  # derived for the plan, not written back
    assert out.plan.num_micro_batches == default_micro_batches(TINY, 4) > 1
    assert out.plan.search["sim_config"]["runtime"] == "cpu"
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.num_micro_batches = 3  # type: ignore[misc]
