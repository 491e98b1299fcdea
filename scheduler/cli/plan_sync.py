"""The sync group of `plan`: a fixed sync configuration (allreduce or DiLoCo) or `--sync auto`
and the bounds of its choice."""

from __future__ import annotations

import argparse

from formats import argtypes
from formats.errors import UserError
from formats.plan import COMPRESSIONS, MAX_FRAGMENTS, MAX_INNER_STEPS, SyncConfig
from formats.sync_rules import local_step_modes, sync_modes, sync_rule
from scheduler.cli.fields import SYNC_FLAGS, add_field_flags, arg, field_dest
from scheduler.planning import PlanRequest
from scheduler.sync_search import SyncBounds

SYNC_HELP = (
    "--sync auto searches the sync configuration together with the assignment (objective "
    "simulated): allreduce or DiLoCo with H in 2, 4, 8, ... up to --max-inner-steps, "
    "overlapped or not, in 1, 2 or 4 fragments, each data-parallel payload up to "
    "--compression and each pipeline compression up to --allow-pipeline-compression, each "
    "DiLoCo one also with all-reduce warm-ups of 0, 10, 30 and 60 steps; it takes the "
    "configuration of the least predicted wall time to the target (within 2% of it: the "
    "least risky): the target is the validation loss the best allreduce plan reaches after "
    "--train-steps steps (or --target-loss), the steps to it predicted by a quality model "
    "fitted on measured loss curves (replicas, global batch, H, warm-up, payload, overlap, "
    "fragments; docs/planner.md), each step's time by the simulator. It prints the predicted "
    "time, steps and tokens to the target beside the best allreduce plan's; a configuration "
    "outside the fitted ranges is flagged and charged extra steps. The bounds are how much "
    "you allow; the defaults allow nothing (allreduce, no compression).")
"""The sync group's description in `plan --help`."""


def add_sync_args(pl: argparse.ArgumentParser) -> None:
    """The sync group of `plan`: the plan's sync config (or --sync auto and its bounds)."""
    sy = pl.add_argument_group(
        "sync (how replicas of a stage stay in step, and how activations cross pipeline links)",
        SYNC_HELP)
    sy.add_argument("--sync", default="allreduce", choices=(*sync_modes(), "auto"),
                    help="allreduce (default), diloco, or auto (see above)")
    sy.add_argument("--inner-steps", type=argtypes.integer(),  # SyncConfig checks
                    help="DiLoCo H (with --sync diloco; default 1)")
    sy.add_argument("--overlap", action="store_true",
                    help="--sync diloco: run each outer all-reduce behind the next round's "
                         "inner steps, its average applied one round late")
    sy.add_argument("--fragments", type=argtypes.integer(1, MAX_FRAGMENTS),
                    help="--sync diloco: sync the stage's parameters in F fragments by layer, "
                         "each at its own offset in the round (Streaming DiLoCo; F <= H)")
    sy.add_argument("--sync-warmup-steps", type=argtypes.integer(0, MAX_INNER_STEPS),
                    metavar="W",
                    help="--sync diloco: all-reduce gradients every step for the first W "
                         "steps, then DiLoCo from the weights at step W (docs/bad_links.md; "
                         "default 0)")
    # --compression is SyncBounds.max_compression's flag (its declaration names it); without
    # --sync auto the same value is the SyncConfig's compression.
    sy.add_argument("--compression", default="none", choices=COMPRESSIONS,
                    dest=field_dest(SyncBounds, "max_compression"),
                    help="data-parallel payload (default none = fp32); with --sync auto the "
                         "most lossy one it may choose")
    add_field_flags(sy, PlanRequest, SYNC_FLAGS[PlanRequest])
    add_field_flags(sy, SyncBounds, SYNC_FLAGS[SyncBounds])
    sy.add_argument("--max-loss-ratio", type=float, help=argparse.SUPPRESS,
                    dest="removed_max_loss_ratio")  # replaced: refused by name in sync_from_args
    sy.add_argument("--allreduce-out", metavar="FILE",
                    help="--sync auto: also write the best allreduce plan there")


def sync_from_args(args: argparse.Namespace) -> tuple[SyncConfig, SyncBounds | None]:
    """The fixed sync configuration, or (with --sync auto) the bounds of the choice; UserError
    naming a flag that does not go with the --sync given."""
    if args.removed_max_loss_ratio is not None:
        raise UserError("--max-loss-ratio: removed; --sync auto now ranks plans by predicted time "
                        "to a target loss, which prices the loss DiLoCo costs (set the target "
                        "with --train-steps or --target-loss; docs/planner.md)")
    compression = arg(args, SyncBounds, "max_compression")
    if args.sync == "auto":
        return SyncConfig(), _auto_bounds(args, compression)
    for flag, value in (("--max-inner-steps", arg(args, SyncBounds, "max_inner_steps")),
                        ("--allow-pipeline-compression",
                         arg(args, SyncBounds, "max_pipeline_compression")),
                        ("--train-steps", arg(args, SyncBounds, "train_steps")),
                        ("--target-loss", arg(args, SyncBounds, "target_loss"))):
        if value is not None:
            raise UserError(f"{flag} bounds what --sync auto may choose; with --sync "
                            f"{args.sync} give the setting itself")
    local = sync_rule(args.sync, "--sync").local_steps
    if not local and (args.overlap or args.fragments is not None
                      or args.sync_warmup_steps is not None):
        raise UserError(f"--overlap, --fragments and --sync-warmup-steps apply to --sync "
                        f"{local_step_modes('')}, not {args.sync}")
    inner = 1 if args.inner_steps is None else args.inner_steps  # SyncConfig checks it
    fragments = 1 if args.fragments is None else args.fragments
    if args.fragments is not None and fragments > inner >= 1:
        raise UserError(f"--fragments {fragments}: needs at least as many --inner-steps "
                        f"(got {inner})")
    if args.inner_steps is not None and not local and inner != 1:
        raise UserError(f"--inner-steps {inner}: only with --sync {local_step_modes('')}")
    return SyncConfig(args.sync, inner, compression, overlap=args.overlap,
                      fragments=fragments, warmup_steps=args.sync_warmup_steps or 0), None


def _auto_bounds(args: argparse.Namespace, compression: str) -> SyncBounds:
    """--sync auto: the bounds of its choice; UserError for a setting it chooses itself."""
    for flag, value in (("--inner-steps", args.inner_steps), ("--fragments", args.fragments),
                        ("--overlap", True if args.overlap else None),
                        ("--sync-warmup-steps", args.sync_warmup_steps),
                        ("--pipeline-compression",
                         arg(args, PlanRequest, "pipeline_compression"))):
        if value is not None:
            raise UserError(f"{flag}: --sync auto chooses it; bound the choice with "
                            f"--max-inner-steps, --compression and "
                            f"--allow-pipeline-compression instead")
    objective = arg(args, PlanRequest, "objective")
    if objective != "simulated":
        raise UserError(f"--objective {objective}: --sync auto needs --objective "
                        f"simulated (the only cost model of overlap, fragments and "
                        f"pipeline compression)")
    given = {k: arg(args, SyncBounds, k) for k in ("train_steps", "target_loss")}
    return SyncBounds(arg(args, SyncBounds, "max_inner_steps") or 1, compression,
                      arg(args, SyncBounds, "max_pipeline_compression") or "none",
                      **{k: v for k, v in given.items() if v is not None})
