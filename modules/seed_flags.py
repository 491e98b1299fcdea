"""The seed projects' flags that dist_runner.py names differently: each is recognised and
refused in one line that names the flag to use here (docs/coming_from.md), instead of
argparse's bare "unrecognized arguments".

Flags whose meaning is the same here keep their name and are real flags (`--total-batch-size`,
`--micro-batch-size`, `--lr`, `--dist-url`, ...); these ones differ in name or in meaning.
"""

from __future__ import annotations

import argparse
from typing import Any

from formats.errors import UserError

OPENDILOCO = "OpenDiLoCo's"
DTFM = "DT-FM's"
HV = "OpenDiLoCo's hivemind"

REPLICAS = "no such flag here: replicas = world size / --stages (or the plan's)"
SEED_FLAGS: dict[str, tuple[str, str]] = {
    "--path-model": (OPENDILOCO, "here use --model M (a preset, or a folder holding a "
                                 "config.json); --init-from DIR to start from its weights"),
    "--per-device-train-batch-size": (OPENDILOCO, "here use --micro-batch-size B (sequences "
                                                  "per micro-batch on each device)"),
    "--total-steps": (OPENDILOCO, "here use --steps N (training stops at step N; "
                                  "--lr-schedule cosine decays to it)"),
    "--seq-length": (OPENDILOCO, "here use max_position_embeddings in the --model config.json"),
    "--pipeline-group-size": (DTFM, "here use --stages S (or the plan's stages)"),
    "--data-group-size": (DTFM, REPLICAS),
    "--num-iters": (DTFM, "here use --steps N"),
    "--hv.initial-peers": (HV, "here use --outer-backend hivemind --initial-peers MADDR"),
    "--hv.host-maddrs": (HV, "here use --host-maddrs"),
    "--hv.announce-maddrs": (HV, "here use --announce-maddrs"),
    "--hv.local-steps": (HV, "here use --sync diloco --inner-steps H"),
    "--hv.outer-lr": (HV, "here use --outer-lr"),
    "--hv.galaxy-size": (HV, REPLICAS),
    "--hv.world-rank": (HV, "here use --rank (the plan says which replica and stage)"),
    "--hv.matchmaking-time": (HV, "here use --matchmaking-timeout-s"),
    "--hv.averaging-timeout": (HV, "here use --averaging-timeout-s"),
    "--hv.timeout-waiting-for-peers": (HV, "here use --timeout-s"),
    "--hv.hivemind-compression": (HV, "here use --compression none|fp16|int8"),
    "--hv.fail-rank-drop": (HV, "no such flag here: always on (a replica that stops "
                                "heartbeating is dropped; --min-replicas)"),
    "--hv.skip-load-from-peers": (HV, "no such flag here: the default (--join loads the "
                                      "state from a peer)"),
}
"""flag -> (whose flag it is, what to give here)."""


def seed_flag_message(flag: str, given: str | None = None) -> str:
    """The one-line pointer for a seed project's flag (`given`: as spelled on the command line)."""
    whose, here = SEED_FLAGS[flag]
    return f"{given or flag} is {whose} flag; {here} (docs/coming_from.md)"


class _SeedFlag(argparse.Action):
    """Refuses its flag with the pointer (UserError: `error: ...`, exit 2), value or not."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        raise UserError(seed_flag_message(self.dest, option_string))


def add_seed_flags(parser: argparse.ArgumentParser) -> None:
    """Hidden flags (absent from --help) for the seeds' names, each refused with its pointer;
    also the snake_case spelling (OpenDiLoCo's config parser accepts both)."""
    for flag in SEED_FLAGS:
        names = [flag]
        snake = "--" + flag[2:].replace("-", "_")
        if snake != flag:
            names.append(snake)
        parser.add_argument(*names, dest=flag, nargs="?", action=_SeedFlag,
                            help=argparse.SUPPRESS, default=argparse.SUPPRESS)
