"""The runner's plan when its flags say more than a plan file (issue 25).

Without --plan the ranks build the obvious plan of --model, the world size and --stages
(scheduler.quick_plan); with one, --model is checked against the model the plan was made for.
Either way the overrides (--sync, --inner-steps, --outer-lr, --outer-momentum, --compression,
--sync-warmup-steps, --micro-batch-size, --total-batch-size) are applied once, by
RunConfig.resolve (PlanOverrideConfig.apply, then OuterSyncConfig.apply's --fragments and
--overlap); every rank checks through the store that the others resolved the same
(dist_runner.on_store, agreed_plan_fields below).
"""

from __future__ import annotations

import os
from typing import Any

from formats.errors import UserError
from formats.hf_config import resolve_model
from formats.models import ModelSpec
from formats.plan import MAX_WORLD_SIZE, Plan
from modules.config import LaunchConfig, RunConfig
from scheduler.quick_plan import OVERRIDE_FLAGS, obvious_plan, total_batch_size


def _world_size(launch: LaunchConfig) -> int:
    """--world-size, else $WORLD_SIZE (torchrun): what a plan-less run is sized by."""
    if launch.world_size is not None:
        return launch.world_size
    value = os.environ.get("WORLD_SIZE")
    if value is None or not value.isdigit() or int(value) < 1:
        raise UserError("without --plan, --world-size (or $WORLD_SIZE, as torchrun sets) is "
                        "required: the plan is that many ranks")
    if len(value) > 9 or int(value) > MAX_WORLD_SIZE:
        raise UserError(f"$WORLD_SIZE {value[:20]}: more ranks than a run may have (at most "
                        f"{MAX_WORLD_SIZE})")
    return int(value)


def flag_model(launch: LaunchConfig, cfg: RunConfig) -> ModelSpec | None:
    """--model's spec, else --init-from's config.json (None: neither given)."""
    if launch.model:
        return resolve_model(launch.model)
    if cfg.ckpt.init_from:
        return resolve_model(os.path.join(cfg.ckpt.init_from, "config.json"), "--init-from")
    return None


def plan_without_file(launch: LaunchConfig, cfg: RunConfig) -> Plan:
    """The obvious plan of the flags (no --plan), before the runner's overrides (which
    RunConfig.resolve applies, as to a plan file)."""
    if launch.coordinator or launch.cluster:
        raise UserError(f"{'--coordinator' if launch.coordinator else '--cluster'}: needs "
                        "--plan (make one with scheduler.py plan)")
    spec = flag_model(launch, cfg)
    if spec is None:
        raise UserError("--plan or --model is required (a preset, or a Hugging Face "
                        "config.json or its folder)")
    return obvious_plan(spec, _world_size(launch), launch.stages)


def check_model_flag(launch: LaunchConfig, plan: Plan) -> None:
    """With --plan and --model: the same model (the name aside), else UserError."""
    if not launch.model:
        return
    mine, theirs = resolve_model(launch.model).fields(), plan.model_spec().fields()
    diff = [k for k in mine if k != "name" and mine[k] != theirs[k]]
    if diff:
        shown = ", ".join(f"{k} {mine[k]!r} (plan: {theirs[k]!r})" for k in diff)
        raise UserError(f"--model {launch.model}: is not the model {launch.plan} was made for "
                        f"({plan.model}): {shown}; re-plan with this --model")


def agreed_plan_fields(plan: Plan) -> dict[str, Any]:
    """What every rank must have resolved alike ({flag: value}, for modules.control.agreement)."""
    return {"--model": plan.model_spec().fields(), "--stages": [list(x) for x in plan.stages],
            **{flag: getattr(plan.sync, name) for name, flag in OVERRIDE_FLAGS.items()},
            "--micro-batch-size": plan.micro_batch_size,
            "--total-batch-size": total_batch_size(plan)}
