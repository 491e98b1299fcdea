"""The plan a seed project's command line implies, and the runner's overrides of a plan.

DT-FM, OpenDiLoCo and torchrun users start every rank with a model, a world size and a rank,
and no planning step: `obvious_plan` makes the plan they mean (N / S replicas of the layers
split evenly into S stages, rank r = stage r mod S of replica r div S, the devices in rank
order). `with_overrides` applies the runner's --sync, --inner-steps, --outer-lr,
--outer-momentum, --compression, --sync-warmup-steps, --micro-batch-size and
--total-batch-size to any plan and checks the result like a plan file. Pure: no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from formats.errors import UserError
from formats.models import ModelSpec, model_record
from formats.plan import Plan, validate_plan
from scheduler.layer_split import even_split

OVERRIDE_FLAGS = {"mode": "--sync", "inner_steps": "--inner-steps", "outer_lr": "--outer-lr",
                  "outer_momentum": "--outer-momentum", "compression": "--compression",
                  "warmup_steps": "--sync-warmup-steps"}
"""The plan's sync fields the runner may override, and their flags: the one declaration
(modules.config.PlanOverrideConfig holds a field per flag, `sync_fields` and the ranks'
agreement, modules.plan_flags.agreed_plan_fields, are derived from it)."""


def override_attr(flag: str) -> str:
    """The PlanOverrideConfig field of a runner flag (`--sync-warmup-steps` ->
    `sync_warmup_steps`)."""
    return flag[2:].replace("-", "_")
DEFAULT_MICRO_BATCH_SIZE = 4
DEFAULT_MICRO_BATCHES = 4
"""The obvious plan's batch: 4 micro-batches of 4 sequences per replica per step (what the
lab plans and benchmarks train; a batch of 1 sequence gives too noisy a gradient to learn
from). --micro-batch-size and --total-batch-size override it."""


def obvious_plan(spec: ModelSpec, world_size: int, num_stages: int) -> Plan:
    """world_size / num_stages replicas of num_stages evenly split stages, in rank order."""
    if num_stages < 1 or world_size % num_stages:
        raise UserError(f"--stages {num_stages}: must divide the world size {world_size} "
                        f"(each replica is one pipeline of {num_stages} ranks)")
    if num_stages > spec.num_layers:
        raise UserError(f"--stages {num_stages}: {spec.name} has only {spec.num_layers} layers")
    replicas = world_size // num_stages
    pipelines: list[list[Any]] = [[r * num_stages + s for s in range(num_stages)]
                                  for r in range(replicas)]
    plan = Plan("", "", spec.name, even_split(spec.num_layers, num_stages), pipelines,
                micro_batch_size=DEFAULT_MICRO_BATCH_SIZE,
                num_micro_batches=DEFAULT_MICRO_BATCHES,
                model_config=model_record(spec), search={"method": "obvious (no --plan)"})
    validate_plan(plan, model=spec)
    return plan


def with_overrides(plan: Plan, sync: dict[str, Any], micro_batch_size: int | None,
                   total_batch_size: int | None) -> Plan:
    """The plan with the runner's sync fields (None: the plan's) and batch, checked."""
    given = {k: v for k, v in sync.items() if v is not None}
    unknown = set(given) - set(OVERRIDE_FLAGS)
    assert not unknown, unknown
    new_sync = dataclasses.replace(plan.sync, **given)
    if "mode" in given and not new_sync.rule.local_steps and "inner_steps" not in given:
        new_sync = dataclasses.replace(new_sync, inner_steps=1, fragments=1, overlap=False,
                                       warmup_steps=0)
    if not new_sync.rule.local_steps and given.get("inner_steps", 1) != 1:
        raise UserError(f"--inner-steps {given['inner_steps']}: only with --sync diloco (the "
                        f"plan's sync is {new_sync.mode})")
    mbs = micro_batch_size or plan.micro_batch_size
    micro = plan.num_micro_batches
    if total_batch_size is not None:
        lanes = plan.num_replicas * plan.lanes_per_replica
        per_step = lanes * mbs
        if total_batch_size % per_step:
            raise UserError(f"--total-batch-size {total_batch_size}: must be a multiple of "
                            f"{per_step} ({lanes} replica(s) x micro-batch size {mbs})")
        micro = total_batch_size // per_step
    out = dataclasses.replace(plan, sync=new_sync, micro_batch_size=mbs, num_micro_batches=micro)
    try:
        validate_plan(out)
    except UserError as e:
        flag = next((f for k, f in OVERRIDE_FLAGS.items() if f"sync.{k}" in str(e)), "overrides")
        raise UserError(f"{flag}: {e}") from None
    return out


def total_batch_size(plan: Plan) -> int:
    """Sequences per step over all replicas."""
    return plan.num_replicas * plan.lanes_per_replica * plan.num_micro_batches * \
        plan.micro_batch_size


def describe(plan: Plan) -> str:
    """One line about a plan built or changed by the runner."""
    s = plan.sync
    sync = (f"diloco H={s.inner_steps} outer lr {s.outer_lr} momentum {s.outer_momentum}"
            if s.rule.local_steps else s.mode)
    return (f"{plan.model}: {plan.num_stages} stage(s) {[list(x) for x in plan.stages]} x "
            f"{plan.num_replicas} replica(s), pipelines {plan.pipelines}, {sync}, compression "
            f"{s.compression}, {plan.num_micro_batches} micro-batch(es) of "
            f"{plan.micro_batch_size} (total batch {total_batch_size(plan)} sequences)")
