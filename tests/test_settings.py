"""formats/settings.py: a setting is declared once (type, range or choices, flag, doc) and both
command lines and every validation read that declaration."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from formats import settings
from formats.errors import UserError
from formats.settings import check, flag_of, setting


@dataclasses.dataclass
class Example:
    """An example config."""

    count: int = setting(2, lo=1, hi=10)
    """how many"""
    rate: float = setting(0.5, lo=0.0, lo_open=True, hi=1.0, flag="--rate-of-things")
    """a fraction"""
    mode: str = setting("a", choices=("a", "b"))
    """which mode"""
    size: int | None = setting(None, choices=(1, 2, 4))
    """bytes per value"""
    name: str | None = setting(None, choices=("x", "y"), noun="thing")
    """a named thing"""
    fast: bool = False
    """go fast"""

    def __post_init__(self) -> None:
        check(self, flag_of)


@pytest.mark.parametrize("field,value,words", [
    ("count", 0, "must be in [1, 10], got 0"),
    ("count", 2.0, "must be in [1, 10], got 2.0, not an integer"),
    ("count", True, "not an integer"),
    ("rate", 0.0, "must be in (0, 1], got 0.0"),
    ("rate", float("nan"), "must be in (0, 1], got nan"),
    ("rate", 10 ** 400, "(401 characters)"),
    ("mode", "c", "must be one of a, b, got 'c'"),
    ("size", 3, "must be 1, 2 or 4, got 3"),
    ("name", "z", "unknown thing 'z'; known: x, y"),
    ("fast", "yes", "must be true or false, got 'yes'"),
])
def test_problems_are_worded_without_the_field_name(field, value, words):
    assert words in settings.problem(Example, field, value)
    with pytest.raises(UserError) as err:
        Example(**{field: value})
    assert str(err.value).startswith(flag_of(Example, field) + ": ")


def test_good_values_and_none_where_allowed_pass():
    for field, value in (("count", 10), ("rate", 1), ("size", None), ("name", "y"),
                         ("fast", True)):
        assert settings.problem(Example, field, value) is None
    assert Example(count=1, size=4).count == 1


def test_generated_flags_carry_the_rule_default_and_doc():
    p = argparse.ArgumentParser()
    settings.add_flags(p, Example, ("count", "rate", "mode", "fast"), bounded=True,
                       flag_metavar=True, defaults={"count": None})
    helptext = p.format_help()
    assert "--rate-of-things RATE_OF_THINGS" in helptext and "a fraction (default 0.5)" in helptext
    args = p.parse_args(["--rate-of-things", "0.25", "--mode", "b", "--fast"])
    assert settings.value_of(args, Example, "count") is None  # the caller resolves it
    assert (settings.value_of(args, Example, "rate"), settings.value_of(args, Example, "mode"),
            settings.value_of(args, Example, "fast")) == (0.25, "b", True)
    with pytest.raises(SystemExit):
        p.parse_args(["--count", "11"])  # argparse's error, worded by the rule


def test_generated_flags_refuse_out_of_range_with_the_rules_words(capsys):
    p = argparse.ArgumentParser()
    settings.add_flags(p, Example, ("count",), bounded=True)
    with pytest.raises(SystemExit):
        p.parse_args(["--count", "11"])
    assert "argument --count: must be in [1, 10], got 11" in capsys.readouterr().err


def test_from_args_round_trips_a_whole_config():
    p = argparse.ArgumentParser()
    settings.add_flags(p, Example)
    assert settings.from_args(Example, p.parse_args(["--count", "3"])) == Example(count=3)


def test_one_set_of_limits_shared_by_the_planner_and_the_runtime():
    import modules.config as runtime_config
    from scheduler.search import SearchConfig

    assert runtime_config.MAX_SECONDS is settings.MAX_SECONDS
    assert settings.problem(SearchConfig, "time_limit_s", settings.MAX_SECONDS * 2)
    assert settings.problem(runtime_config.RunConfig, "timeout_s", settings.MAX_SECONDS * 2)


def test_the_planners_flag_words_come_from_the_declarations():
    from scheduler.planning import PlanRequest
    from scheduler.scheduler import in_flag_words, planner_flags
    from scheduler.search import SearchConfig
    from scheduler.simulator.config import SimConfig
    from scheduler.sync_search import SyncBounds

    flags = planner_flags()
    assert flags["PlanRequest.num_stages"] == flag_of(PlanRequest, "num_stages") == "--stages"
    assert flags["SearchConfig.seed"] == "--search-seed"
    # flags written by hand that set a field are found too (their dest names the field)
    assert flags["PlanRequest.reshard_after_forward"] == "--no-reshard-after-forward"
    assert flags["SyncBounds.max_compression"] == flag_of(SyncBounds, "max_compression") == \
        "--compression"
    assert flags["SimConfig.runtime"] == "--runtime"
    # every flag is the one its field declares (--no-...: the negation of a bool field)
    assert all(flag == flag_of(cls, name) for cls in (PlanRequest, SearchConfig, SimConfig,
                                                      SyncBounds)
               for name in (f.name for f in dataclasses.fields(cls))
               if (flag := flags.get(settings.qualified(cls, name))) and "no-" not in flag)
    assert in_flag_words("SearchConfig.time_limit_s: x") == "--time-limit: x"
    with pytest.raises(UserError, match=r"^PlanRequest\.objective: unknown objective 'x'"):
        PlanRequest(1, 1, objective="x")
    with pytest.raises(UserError, match=r"^SearchConfig\.budget: must be in \[1, "):
        SearchConfig(budget=0)


def test_flags_of_fields_reads_the_parser_and_rewords_help():
    from scheduler.cli.fields import field_dest, flags_of_fields, help_in_flag_words

    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    one = sub.add_parser("one")
    settings.add_flags(one, Example, ("count", "rate"))
    one.add_argument("--by-hand", dest=field_dest(Example, "mode"), help="see Example.count")
    one.add_argument("--other", help="no field")
    flags = flags_of_fields(p)
    assert flags == {"Example.count": "--count", "Example.rate": "--rate-of-things",
                     "Example.mode": "--by-hand"}
    help_in_flag_words(p, flags)
    assert "see --count" in one.format_help()
