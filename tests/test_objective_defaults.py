"""An objective declares its own search defaults (scheduler/planning.py ObjectiveKind): `plan`
without --budget/--window takes them from the objective's registration, and an objective
registered without them gets the documented fallbacks instead of a KeyError."""

from __future__ import annotations

from scheduler import planning
from scheduler.cli.plan import plan_request_from_args
from scheduler.cli.plan_sync import sync_from_args
from scheduler.planning import FALLBACK_BUDGET, FALLBACK_WINDOW, ObjectiveKind, search_defaults
from scheduler.scheduler import build_parser


def request(*flags: str) -> planning.PlanRequest:
    args = build_parser().parse_args(["plan", "--scenario", "lab", "--model", "gpt-tiny",
                                      "--out", "unused.json", *flags])
    return plan_request_from_args(args, sync_from_args(args)[0])


def test_plan_takes_the_budget_and_window_the_objective_declares(monkeypatch):
    assert search_defaults("dtfm") == (20_000, 1_000)
    assert search_defaults("simulated") == (8_000, 0)
    monkeypatch.setitem(planning.OBJECTIVES, "simulated",
                        ObjectiveKind(planning.make_simulated, budget=1234, window=56))
    req = request("--objective", "simulated")
    assert (req.search.budget, req.search.window) == (1234, 56)
    req = request("--objective", "simulated", "--budget", "99", "--window", "0")
    assert (req.search.budget, req.search.window) == (99, 0)  # given: the flags win


def test_an_objective_registered_without_defaults_gets_the_fallbacks(monkeypatch):
    monkeypatch.setitem(planning.OBJECTIVES, "toy", planning.make_dtfm)  # a bare factory
    assert search_defaults("toy") == (FALLBACK_BUDGET, FALLBACK_WINDOW)
    monkeypatch.setitem(planning.OBJECTIVES, "dtfm", ObjectiveKind(planning.make_dtfm))
    req = request("--objective", "dtfm")
    assert (req.search.budget, req.search.window) == (FALLBACK_BUDGET, FALLBACK_WINDOW)


def test_the_objectives_defaults_are_what_plan_help_says():
    text = build_parser()._subparsers._group_actions[0].choices["plan"].format_help()
    words = " ".join(text.split())
    assert "20000 for dtfm, 8000 for simulated" in words
    assert "1000 for dtfm, 0 for simulated" in words

