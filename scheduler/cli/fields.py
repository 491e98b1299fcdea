"""The planner's flags that set library fields: which fields of which config class each
subcommand has a flag for, the command's defaults and --help words where they differ from the
field's, and the field -> flag wording of errors, read back from the parser that was built.

A generated flag's dest is `Class.field` (formats.settings.add_flags); a flag written by hand
that sets a field takes the same dest, so `flags_of_fields(parser)` finds every flag that sets
a field, and an error the library words with `PlanRequest.num_stages` reaches the user as
`--stages`."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from typing import Any

from formats import argtypes, settings
from formats.settings import MAX_SEED
from scheduler.planning import OBJECTIVES, PlanRequest, search_defaults
from scheduler.search import SearchConfig
from scheduler.simulator.config import SimConfig
from scheduler.sync_search import SyncBounds

PLAN_FLAGS: dict[type, tuple[str, ...]] = {
    PlanRequest: ("num_stages", "num_replicas", "objective", "micro_batch_size",
                  "num_micro_batches", "tokens_per_replica"),
    SearchConfig: ("budget", "window", "time_limit_s", "seed"),
}
"""The library fields `plan` has a flag for, generated from their declarations
(formats.settings), in --help order; the sync and performance-model groups add theirs."""
SYNC_FLAGS: dict[type, tuple[str, ...]] = {
    PlanRequest: ("pipeline_compression",),
    SyncBounds: ("max_inner_steps", "max_pipeline_compression", "train_steps",
                 "target_loss"),
}
SHARD_FLAGS = ("max_shard", "outer_state")
"""The PlanRequest fields of the shard-group group (--no-reshard-after-forward: by hand)."""
SIM_FLAGS = ("mfu", "activation_bytes", "collective_latency_factor", "allreduce_algorithm",
             "outer_store_round_trips",
             "shared_cores", "background_load", "core_contention", "optimizer_flops_per_param",
             "outer_flops_per_param", "outer_fp16_flops_per_param", "outer_int8_flops_per_param",
             "fsdp_flops_per_unit", "fsdp_gathered_flops_per_unit")
"""The SimConfig fields with a generated flag (--runtime, --calibration, --recompute: by
hand, in scheduler.cli.perf_model)."""
CLI_DEFAULTS: dict[type, dict[str, Any]] = {
    PlanRequest: {"num_stages": 0, "num_replicas": 0, "pipeline_compression": None},
    SearchConfig: {"budget": None, "window": None, "time_limit_s": 60.0},
    SyncBounds: {"max_inner_steps": None, "max_pipeline_compression": None,
                 "train_steps": None, "target_loss": None},
    SimConfig: {name: None for name in SIM_FLAGS},
}
"""Where a flag's default differs from its field's (None: not given; the command resolves it:
--budget by objective, the performance model from the plan, profile and calibration)."""
DEFAULT_WORDS = {
    "SearchConfig.budget": "default: " + ", ".join(f"{search_defaults(k)[0]} for {k}"
                                                   for k in OBJECTIVES),
    "SearchConfig.window": "default: " + ", ".join(f"{search_defaults(k)[1]} for {k}"
                                                   for k in OBJECTIVES),
    "SearchConfig.time_limit_s": "default 60, a safety net; here it bounds the whole command: "
    "loading the cluster, the search of every shape (sharing it), the baselines; not --plot. A "
    "search cut by it is not reproducible, one ended by the budget or convergence is",
    "PlanRequest.pipeline_compression": "default none",
    "SyncBounds.max_inner_steps": "default 1: allreduce only",
    "SyncBounds.max_pipeline_compression": "default none",
    "SyncBounds.train_steps": "default 1000, the runner's --steps default",
    "SyncBounds.target_loss": "default: none, the target is set by --train-steps",
}
"""What --help says of a flag's default where the command, not the field, decides it."""
SEED = argtypes.integer(0, MAX_SEED)
"""The argparse type of a seed flag."""
FIELD_DEST = re.compile(r"[A-Z]\w*\.\w+")
"""The dest of a flag that sets a library field: `Class.field`."""


def add_field_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                    names: tuple[str, ...]) -> None:
    """Flags for fields `names` of `cls`: rules and help from their declarations, the command's
    defaults (CLI_DEFAULTS), values checked by the fields' rules (argparse errors, exit 2)."""
    words = {n: DEFAULT_WORDS[settings.qualified(cls, n)] for n in names
             if settings.qualified(cls, n) in DEFAULT_WORDS}
    settings.add_flags(parser, cls, names, defaults=CLI_DEFAULTS.get(cls, {}),
                       default_words=words, bounded=True, flag_metavar=True)


def field_dest(cls: type, name: str) -> str:
    """The dest of a flag written by hand that sets field `name` of `cls` (what add_flags
    gives a generated one), so that flags_of_fields finds it."""
    return settings.qualified(cls, name)


def arg(args: argparse.Namespace, cls: type, name: str) -> Any:
    """The value of a flag that sets field `name` of `cls` (generated or by field_dest)."""
    return settings.value_of(args, cls, name)


def _actions(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """Every argument of `parser` and of its subcommands' parsers."""
    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _actions(sub)


def flags_of_fields(parser: argparse.ArgumentParser) -> dict[str, str]:
    """{`Class.field`: the flag that sets it} for every flag of `parser` (subcommands
    included) whose dest names a field; one field has one flag in every subcommand."""
    flags: dict[str, str] = {}
    for action in _actions(parser):
        if action.option_strings and FIELD_DEST.fullmatch(action.dest):
            flag = flags.setdefault(action.dest, action.option_strings[0])
            assert flag == action.option_strings[0], (action.dest, flag, action.option_strings)
    return flags


def in_flag_words(message: str, flags: dict[str, str]) -> str:
    """`message` (a library error or a help text) with every field in `flags` named by its
    flag; the longest names first, so no field is replaced inside a longer one."""
    for name in sorted(flags, key=len, reverse=True):
        message = message.replace(name, flags[name])
    return message


def help_in_flag_words(parser: argparse.ArgumentParser, flags: dict[str, str]) -> None:
    """Reword every --help text of `parser` (subcommands included) with in_flag_words: a field's
    docstring names other fields the library's way."""
    for action in _actions(parser):
        if action.help and action.help is not argparse.SUPPRESS:
            action.help = in_flag_words(action.help, flags)
