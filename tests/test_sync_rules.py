"""formats/sync_rules.py: the registry of outer-sync rules, and a rule registered from a test
reaching plan validation, the simulator and the quality model by what it declares."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from formats import sync_rules
from formats.errors import UserError
from formats.plan import Plan, SyncConfig, plan_from_dict
from formats.sync_rules import SyncRule, register_sync_rule, sync_modes, sync_rule
from scheduler.layer_split import even_split
from scheduler.scenarios import make_scenario
from scheduler.simulator import simulate_plan

CLUSTER = make_scenario("mixed", 0)


@pytest.fixture
def toy_rules(monkeypatch):
    """Two rules registered for one test only: every-step `toy_ar`, local-step `toy_local`."""
    monkeypatch.setattr(sync_rules, "_RULES", dict(sync_rules._RULES))
    register_sync_rule(SyncRule("toy_ar", "every-step averaging, by another name", False))
    register_sync_rule(SyncRule("toy_local", "local steps, by another name", True))


def _plan(sync: SyncConfig) -> Plan:
    return Plan(CLUSTER.name, CLUSTER.sha256(), "gpt3-xl", even_split(24, 4),
                np.arange(16).reshape(4, 4).tolist(), 1, 8, sync)


def test_the_shipped_rules_and_what_they_declare() -> None:
    assert sync_modes() == ("allreduce", "diloco")
    assert not sync_rule("allreduce").local_steps and sync_rule("diloco").local_steps
    assert SyncConfig("diloco", 4).rule is sync_rules.DILOCO


@pytest.mark.parametrize("mode", ["gossip", "", ["diloco"], None])
def test_an_unknown_mode_is_refused_by_field_with_the_choices(mode) -> None:
    with pytest.raises(UserError, match=r"sync\.mode: .* is not one of allreduce, diloco"):
        SyncConfig(mode).validate()


def test_a_very_long_unknown_mode_is_shown_cut_to_one_line() -> None:
    with pytest.raises(UserError) as e:
        SyncConfig("x" * 10_000).validate()
    assert len(str(e.value)) < 160 and "'xxx" in str(e.value) and "..." in str(e.value)


@pytest.mark.parametrize("name", ["diloco", "allreduce", "auto"])
def test_a_taken_or_reserved_name_cannot_be_registered(name) -> None:
    with pytest.raises(ValueError, match=name):
        register_sync_rule(SyncRule(name, "x", True))


def test_a_registered_rule_is_validated_by_what_it_declares(toy_rules) -> None:
    assert sync_modes()[-2:] == ("toy_ar", "toy_local")
    SyncConfig("toy_ar").validate()
    SyncConfig("toy_local", 8, overlap=True, fragments=2, warmup_steps=10).validate()
    with pytest.raises(UserError, match="only makes sense with mode 'diloco' or 'toy_local'"):
        SyncConfig("toy_ar", 4).validate()
    with pytest.raises(UserError, match="sync.overlap and sync.fragments only apply"):
        SyncConfig("toy_ar", overlap=True).validate()
    back = plan_from_dict(_plan(SyncConfig("toy_local", 8)).to_dict())
    assert back.sync.mode == "toy_local" and back.sync.rule.local_steps


def test_the_simulator_prices_a_registered_rule_by_what_it_declares(toy_rules) -> None:
    """No cost hook of its own yet: an every-step rule costs all-reduce's step, a local-step
    rule DiLoCo's (the same assignment, payload and H)."""
    for toy, known in (("toy_ar", "allreduce"), ("toy_local", "diloco")):
        h = 50 if sync_rule(toy).local_steps else 1
        got = simulate_plan(CLUSTER, None, _plan(SyncConfig(toy, h, "int8")), timeline=False)
        want = simulate_plan(CLUSTER, None, _plan(SyncConfig(known, h, "int8")),
                             timeline=False)
        assert got.step_s == pytest.approx(want.step_s) and got.step_s > 0
    ar = simulate_plan(CLUSTER, None, _plan(SyncConfig("allreduce", 1, "int8")), timeline=False)
    assert ar.step_s > got.step_s  # the local-step rule was not priced as an all-reduce


def test_the_quality_model_flags_a_local_step_rule_it_was_not_fitted_on(toy_rules) -> None:
    from scheduler.quality import OUT_OF_RANGE_MARGIN, predict_steps, target_from_steps
    from scheduler.quality_fitted import FITTED

    target = target_from_steps(FITTED, 200, 64)
    base = SyncConfig("diloco", 8)
    known = predict_steps(FITTED, base, 4, 16, target)
    toy = predict_steps(FITTED, dataclasses.replace(base, mode="toy_local"), 4, 16, target)
    # priced with DiLoCo's curves, flagged, and so charged as outside the fitted range
    assert known.steps > known.ar_steps
    assert toy.steps == pytest.approx(known.steps * (1 + OUT_OF_RANGE_MARGIN))
    assert any("toy_local" in f and "diloco" in f for f in toy.flags)
    assert not any("toy_local" in f for f in known.flags)
