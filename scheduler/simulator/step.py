"""Simulate one training step of a plan: memory check, replay, breakdown (SimResult)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from formats import checks
from formats.cluster import Cluster
from formats.models import ModelSpec
from formats.plan import MAX_INNER_STEPS, Entry, Plan, SyncConfig, validate_plan
from scheduler.memory import check_plan_memory, stage_memory
from scheduler.simulator.collectives import LinkTables
from scheduler.simulator.config import SimConfig
from scheduler.simulator.events import TimelineBox, replay_events
from scheduler.simulator.kernel import StepBreakdown, build_inputs, no_transfers, step_breakdown
from scheduler.simulator.replay import replay_fast
from scheduler.simulator.sharded import (
    build_sharded_inputs,
    fsdp_bytes_per_step,
    shard_array,
    shard_groups,
    stage_degrees,
)
from scheduler.simulator.warmup import DEFAULT_TRAIN_STEPS, run_step_s


@dataclass
class SimResult(StepBreakdown):
    """What `simulate` prints: the step's breakdown (kernel.StepBreakdown's fields: step time,
    its parts, throughput), the plan it is of, memory and the timeline."""

    sync: SyncConfig = field(default_factory=SyncConfig)
    stages: list[tuple[int, int]] = field(default_factory=list)
    pipelines: list[list[int]] = field(default_factory=list)
    memory_gb: list[tuple[int, float, float]] = field(default_factory=list)
    """(device, needed GB, available GB) per device in the plan."""
    timeline: list[TimelineBox] = field(default_factory=list)
    pipeline_compression: str = "none"
    """How activations crossed the pipeline links (Plan.pipeline_compression)."""
    shard_degree: int = 1
    """The largest D (devices per shard group; 1: no FSDP); `pipelines` then lists the R x D
    lanes."""
    shard_degrees: list[int] = field(default_factory=list)
    """D of every stage (stages of one plan may differ)."""
    fsdp_comm_s: float = 0.0
    """FSDP's collectives not hidden behind compute, per step on the busiest lane (a part of
    compute_s)."""
    fsdp_bytes_per_step: float = 0.0
    """Bytes FSDP's all-gathers and reduce-scatters put on the wire per step (all groups)."""
    train_steps: int = 0
    """With a warm-up (sync.warmup_steps W > 0): the run's length its mean step is over
    (the plan's predicted.train_steps, else DEFAULT_TRAIN_STEPS); 0 without one."""
    train_steps_from: str = ""
    """Where train_steps came from: "plan" (predicted.train_steps) or "default"."""
    allreduce_step_s: float = 0.0
    """With a warm-up: the step of its W all-reduce steps (same assignment and payloads)."""
    run_step_s: float = 0.0
    """The run's mean step (simulator/warmup.run_step_s: W steps at allreduce_step_s, the
    rest at step_s), as `plan --sync auto` ranks it; step_s without a warm-up."""

    def parts(self) -> dict[str, float]:
        """The breakdown in seconds; compute + bubble + pp_comm + tied_comm + dp_comm = step."""
        return {"step_s": self.step_s, "compute_s": self.compute_s, "bubble_s": self.bubble_s,
                "pp_comm_s": self.pp_comm_s, "tied_comm_s": self.tied_comm_s,
                "dp_comm_s": self.dp_comm_s}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (no timeline)."""
        out: dict[str, Any] = {k: round(v, 6) for k, v in self.parts().items()}
        out.update({
            "makespan_s": round(self.makespan_s, 6),
            "dp_comm_per_round_s": round(self.dp_comm_round_s, 6),
            "dp_hidden_s": round(self.dp_hidden_s, 6),
            "dp_sync_per_round_s": round(self.dp_sync_round_s, 6),
            "dp_allreduce_s": [round(x, 6) for x in self.dp_allreduce_s],
            "pp_bytes_per_step": self.pp_bytes_per_step,
            "dp_bytes_per_step": self.dp_bytes_per_step,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "sync": {"mode": self.sync.mode, "inner_steps": self.sync.inner_steps,
                     "compression": self.sync.compression, "overlap": self.sync.overlap,
                     "fragments": self.sync.fragments,
                     "warmup_steps": self.sync.warmup_steps},
            "run_step_s": round(self.run_step_s, 6),
            **({"warmup": {"warmup_steps": self.sync.warmup_steps,
                           "train_steps": self.train_steps,
                           "train_steps_from": self.train_steps_from,
                           "allreduce_step_s": round(self.allreduce_step_s, 6)}}
               if self.sync.warmup_steps else {}),
            "pipeline_compression": self.pipeline_compression,
            **({"shard_degree": self.shard_degree, "shard_degrees": self.shard_degrees,
                "fsdp_comm_s": round(self.fsdp_comm_s, 6),
                "fsdp_bytes_per_step": self.fsdp_bytes_per_step}
               if self.shard_degree > 1 else {}),
            "stages": [list(st) for st in self.stages],
            "memory_gb": [{"device": d, "need": round(need, 3), "have": have}
                          for d, need, have in self.memory_gb],
        })
        return out


def memory_use(cluster: Cluster, model: ModelSpec, stages: list[tuple[int, int]],
               pipelines: np.ndarray, micro_batch_size: int, num_micro_batches: int,
               diloco: bool, config: SimConfig, reshard_after_forward: bool = True,
               outer_state: str = "device") -> list[tuple[int, float, float]]:
    """(device, needed GB, available GB) of every device in the plan, by device id;
    `pipelines` (R, S) or, with shard groups, (R, S, D)."""
    groups = shard_array(pipelines)
    degrees = stage_degrees(groups)
    mem = []
    for s, (a, b) in enumerate(stages):
        lanes = groups.shape[2] // int(degrees[s])  # a device runs L / D lanes' micro-batches
        need = stage_memory(model, a, b, micro_batch_size, num_micro_batches * lanes, diloco,
                            config.memory(), int(degrees[s]), reshard_after_forward,
                            outer_state).total_bytes / 1e9
        mem += [(int(d), need, cluster.devices[int(d)].memory_gb)
                for d in set(groups[:, s].ravel().tolist())]
    return sorted(mem)


def simulate(cluster: Cluster, model: ModelSpec, stages: list[tuple[int, int]],
             pipelines: np.ndarray | list[list[Entry]], sync: SyncConfig, micro_batch_size: int,
             num_micro_batches: int, config: SimConfig | None = None,
             timeline: bool = True, pipeline_compression: str = "none",
             reshard_after_forward: bool = True, outer_state: str = "device") -> SimResult:
    """Replay one step (memory checked first: UserError naming a device that overflows): by the
    event engine when a timeline is asked for, else by the vectorised replay (same numbers).
    `pipelines` may hold shard groups (plan/2): then simulator/sharded.py builds the step (no
    timeline: the vectorised replay)."""
    config = config or SimConfig()
    groups = shard_array(pipelines)
    degree = groups.shape[2]
    diloco = sync.rule.local_steps
    check_plan_memory(cluster, model, stages, shard_groups(groups) if degree > 1
                      else groups[:, :, 0], micro_batch_size, num_micro_batches, diloco,
                      config.memory(), reshard_after_forward, outer_state)
    tables = LinkTables(cluster, config)
    if degree > 1:
        inputs, exposed = build_sharded_inputs(tables, model, stages, groups, sync,
                                               micro_batch_size, num_micro_batches, config,
                                               pipeline_compression, reshard_after_forward)
        fsdp, timeline = float(exposed.max()), False
    else:
        inputs = build_inputs(tables, model, stages, groups[:, :, 0], sync, micro_batch_size,
                              num_micro_batches, config, pipeline_compression)
        fsdp = 0.0
    times, boxes = replay_events(inputs) if timeline else (replay_fast(inputs), [])
    free = replay_fast(no_transfers(inputs)).makespan_s
    tokens = inputs.pipelines.shape[0] * num_micro_batches * micro_batch_size * model.seq_len
    breakdown = step_breakdown(inputs, times, free, tokens)
    return SimResult(**vars(breakdown), sync=sync, stages=list(stages),
                     pipelines=inputs.pipelines.tolist(),
                     pipeline_compression=pipeline_compression,
                     memory_gb=memory_use(cluster, model, stages, groups, micro_batch_size,
                                          num_micro_batches, diloco, config,
                                          reshard_after_forward, outer_state),
                     timeline=boxes, shard_degree=degree,
                     shard_degrees=[int(d) for d in stage_degrees(groups)], fsdp_comm_s=fsdp,
                     fsdp_bytes_per_step=fsdp_bytes_per_step(
                         model, stages, groups, num_micro_batches, reshard_after_forward),
                     run_step_s=breakdown.step_s)


def simulate_plan(cluster: Cluster, model: ModelSpec | None, plan: Plan,
                  config: SimConfig | None = None, timeline: bool = True) -> SimResult:
    """Validate `plan` against the cluster and model, then simulate one step of it."""
    model = model or plan.model_spec()
    validate_plan(plan, cluster, model)
    result = simulate(cluster, model, plan.stages, plan.pipelines, plan.sync,
                      plan.micro_batch_size, plan.num_micro_batches, config, timeline,
                      plan.pipeline_compression, plan.reshard_after_forward, plan.outer_state)
    if plan.sync.warmup_steps:
        warm = simulate(cluster, model, plan.stages, plan.pipelines,
                        SyncConfig("allreduce", 1, plan.sync.compression),
                        plan.micro_batch_size, plan.num_micro_batches, config, False,
                        plan.pipeline_compression, plan.reshard_after_forward, plan.outer_state)
        steps, source = plan_train_steps(plan)
        result.train_steps, result.train_steps_from = steps, source
        result.allreduce_step_s = warm.step_s
        result.run_step_s = run_step_s(result.step_s, warm.step_s, plan.sync.warmup_steps,
                                       steps)
    return result


def plan_train_steps(plan: Plan) -> tuple[int, str]:
    """The run length a warm-up is charged over, and where it came from: the plan's
    predicted.train_steps (what `plan --sync auto` ranked it by), else the runner's default."""
    steps = plan.predicted.get("train_steps")
    if steps is None:
        return DEFAULT_TRAIN_STEPS, "default"
    return checks.integer(steps, "predicted.train_steps", 1, MAX_INNER_STEPS), "plan"
