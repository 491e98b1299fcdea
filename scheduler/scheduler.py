"""Planner CLI: export scenarios, plan a cluster, evaluate any plan.

    python scheduler/scheduler.py scenario worldwide --seed 0 --out cluster.json
    python scheduler/scheduler.py plan --scenario worldwide --seed 0 --model gpt3-xl \\
        --stages 8 --replicas 8 --out plan.json
    python scheduler/scheduler.py evaluate --cluster cluster.json --plan plan.json
    python scheduler/scheduler.py simulate --cluster cluster.json --plan plan.json
    python scheduler/scheduler.py explain --cluster cluster.json --plan plan.json --metrics RUN

User mistakes print `error: ...` and exit with status 2; nothing is written then.

This file is the entry point: it builds the parser of the subcommands in scheduler/cli/ (one
module each) and dispatches to the one given.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: this file shares the package's name, so put the repo root first.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    # The planner's matrices are small: OpenBLAS's other threads only spin (0.2 CPU s of a
    # 1 s plan measured on 2 cores, the same wall time). A caller's own setting is kept.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from scheduler.cli import clock  # noqa: E402, I001  (first: `plan --time-limit` counts from here)

import argparse  # noqa: E402
import functools  # noqa: E402
from collections.abc import Callable  # noqa: E402

from formats.errors import UserError, run_main  # noqa: E402
from scheduler.cli import fields  # noqa: E402
from scheduler.cli.evaluate import add_evaluate_command  # noqa: E402
from scheduler.cli.explain import add_explain_command  # noqa: E402
from scheduler.cli.plan import add_plan_command  # noqa: E402
from scheduler.cli.scenario import add_scenario_command  # noqa: E402
from scheduler.cli.simulate import add_simulate_command  # noqa: E402

SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_scenario_command, add_plan_command, add_evaluate_command, add_simulate_command,
    add_explain_command]
"""Each adds one subcommand (its module in scheduler/cli/); a new one appends its adder here."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand, its help naming fields by their flags."""
    p = argparse.ArgumentParser(prog="scheduler.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    fields.help_in_flag_words(p, fields.flags_of_fields(p))
    return p


@functools.cache
def planner_flags() -> dict[str, str]:
    """{`Class.field`: flag} for every flag of this command that sets a library field, read
    from the parser (so it lists exactly the flags the subcommands declare)."""
    return fields.flags_of_fields(build_parser())


def in_flag_words(message: str) -> str:
    """A library error message with every field this CLI sets named by its flag."""
    return fields.in_flag_words(message, planner_flags())


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; user errors exit 2 without a traceback."""
    clock.restart_if_late()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"error: {fields.in_flag_words(str(e), fields.flags_of_fields(parser))}",
              file=sys.stderr)
        return e.exit_code
    except OSError as e:  # e.g. the disk filled up while writing: say which file, no traceback
        print(f"error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1


def entry() -> None:
    """Console entry point (setup.py): run main() under run_main (every output is written
    atomically and closed by then: no interpreter teardown)."""
    run_main(main, skip_teardown=True)


if __name__ == "__main__":
    entry()
