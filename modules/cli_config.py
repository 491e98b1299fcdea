"""dist_runner.py's command line: one flag per field of LaunchConfig and RunConfig (and the
configs nested in it), made by formats.settings from the fields' declarations, so a setting's
name, type, default, range and help are written once (in modules/config.py).

    add_flags(parser, RunConfig)          # --steps, --lr, --ckpt-dir, ... (nested configs too)
    cfg = from_args(RunConfig, parser.parse_args())
"""

from __future__ import annotations

import argparse

from formats.settings import add_flags, field_docs, from_args
from modules.config import LaunchConfig, RunConfig
from modules.seed_flags import add_seed_flags

__all__ = ["add_flags", "field_docs", "from_args", "runner_parser"]


def runner_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """dist_runner.py's parser: one flag per field of LaunchConfig and RunConfig (also used by
    the launcher to check the flags it passes on before starting any rank)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run one rank (= device id) of a plan: its pipeline stage of its replica.")
    add_flags(p, LaunchConfig)  # numbers: finite only; the fields' own checks give the ranges
    add_flags(p, RunConfig)
    add_seed_flags(p)  # the seeds' names: refused with the flag to use here
    return p
