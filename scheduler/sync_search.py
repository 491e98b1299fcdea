"""`plan --sync auto`: choose the sync configuration together with the assignment.

The discrete choices (mode allreduce | diloco, H, overlap, fragments, the data-parallel payload,
the pipeline compression) enter the search as an outer layer around the assignment search:

1. Two anchor searches, each a full `plan_best_shape` (every S x R shape, the evolutionary
   search, the baselines) under one sync configuration: the most synchronous one allowed
   (allreduce) and the least (DiLoCo with the largest H, overlapped), both with the most
   compression allowed. The first finds assignments that keep the data-parallel rings short,
   the second assignments tuned for the pipeline alone. They share ANCHORS_SHARE of the time.
2. The allowed configurations (sync_choices: a few hundred at most) are scored on both anchors'
   assignments with the simulated objective (its own layer split each), until the deadline:
   first the most compressed one of each (mode, H, overlap, fragments), then the other
   compressions of those that came near the fastest (score_choices).
3. Time to the target (with_targets): each configuration's predicted steps to the target loss
   (scheduler.quality: all-reduce's steps at its global batch, inflated for DiLoCo after its
   warm-up), each DiLoCo one once per warm-up of WARMUP_OPTIONS and outer optimizer of
   OUTER_OPTIONS; its predicted seconds to the
   target = the warm-up's steps at the all-reduce step of the same payloads and assignment plus
   the rest at its own step (scheduler.simulator.warmup).
4. The choice: the configuration of least predicted time to the target; among those within
   RISK_TOLERANCE (the simulator's noise band) of it, the least risky (SyncChoice.risk). The
   best allreduce configuration is chosen the same way among allreduce ones, to show beside.
   Both get the objective's split polish.

The target (SyncBounds): `target_loss` (on the fitted model's scale), or all-reduce's loss
after `train_steps` steps of the allreduce anchor's plan (its global batch).

Why not one search per configuration: hundreds of configurations would leave each a sliver of
the time limit; and the assignment depends on the configuration mainly through whether the
rings matter, which the two anchors span.

Faster steps are not a sooner model: more replicas, a larger H, a stale (overlapped) outer
step and lossy payloads cost steps to a loss, DiLoCo from a fresh model most of all. The
planner ranks by predicted time to the target, so a faster step wins only when it is faster by
more than the steps it loses (docs/planner.md, docs/results/quality_model.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np

from formats.cluster import Cluster
from formats.errors import UserError
from formats.models import ModelSpec
from formats.plan import COMPRESSIONS, MAX_INNER_STEPS, PIPELINE_COMPRESSIONS, Plan, SyncConfig
from formats.settings import check, setting
from formats.sync_rules import sync_rule
from scheduler.cost_simulated import SimulatedObjective
from scheduler.objective import CostBreakdown
from scheduler.planning import (
    FINISH_MIN_S,
    FINISH_SHARE,
    PlanOutcome,
    PlanRequest,
    per_replica_cost,
    plan_best_shape,
    predicted,
)
from scheduler.quality import (
    QualityModel,
    Target,
    predict_steps,
    target_from_loss,
    target_from_steps,
)
from scheduler.quality_fitted import FITTED
from scheduler.simulator.report import sync_label
from scheduler.simulator.warmup import DEFAULT_TRAIN_STEPS

RISK_TOLERANCE = 0.02
"""A riskier configuration must predict a time to the target (or, before the targets are
priced, a step) more than this fraction shorter to be chosen (the simulator's noise band)."""
ANCHORS_SHARE = 0.84
"""Part of the time limit the anchor searches share equally (the rest: scoring, polish)."""
FRAGMENT_OPTIONS = (1, 2, 4)
"""Streaming-DiLoCo fragment counts tried (at most H)."""
WARMUP_OPTIONS = (0, 10, 30, 60)
"""DiLoCo warm-ups (all-reduce steps) tried, each below all-reduce's steps to the target."""
OUTER_OPTIONS = ((1.0, 0.0), (0.7, 0.9))
"""DiLoCo outer (learning rate, momentum) tried: plain averaging, and DiLoCo's Nesterov
default (the two the quality model was fitted on; docs/results/quality_model.md)."""
POLISH_REPLAYS = 400
"""Split-polish replays of each of the two final plans."""


@dataclass(frozen=True)
class SyncBounds:
    """What `--sync auto` may choose from: the user's bounds on quality risk."""

    max_inner_steps: int = setting(1, lo=1, hi=MAX_INNER_STEPS)
    """--sync auto: largest DiLoCo H it may choose (1: allreduce only; DiLoCo is tried with
    H = 2, 4, 8, ... and this)"""
    max_compression: str = setting("none", flag="--compression", choices=COMPRESSIONS)
    """--sync auto: most lossy data-parallel payload it may choose: none < fp16 < int8"""
    max_pipeline_compression: str = setting("none", flag="--allow-pipeline-compression",
                                            choices=PIPELINE_COMPRESSIONS)
    """--sync auto: most lossy pipeline compression it may choose: none < bf16 < int8"""
    train_steps: int = setting(DEFAULT_TRAIN_STEPS, lo=1, hi=MAX_INNER_STEPS)
    """--sync auto: the target is the validation loss the best allreduce plan reaches after
    this many steps; plans are ranked by their predicted time to it"""
    target_loss: float | None = setting(None, lo=0.0, lo_open=True, hi=1e6)
    """--sync auto: rank plans by predicted time to this validation loss instead (on the
    scale of the model the quality model was fitted on; see docs/planner.md)"""

    def __post_init__(self) -> None:
        """UserError naming the bad field (`SyncBounds.max_inner_steps`)."""
        check(self)


@dataclass(frozen=True)
class SyncChoice:
    """One sync configuration the planner may write into a plan."""

    sync: SyncConfig
    pipeline_compression: str = "none"

    def risk(self) -> tuple[int, int, int, int, int]:
        """Quality risk, lexicographic: H (0 for allreduce), overlap (a stale outer step),
        pipeline compression, data-parallel payload, fragments."""
        s = self.sync
        return (s.inner_steps if s.rule.local_steps else 0, int(s.overlap),
                PIPELINE_COMPRESSIONS.index(self.pipeline_compression),
                COMPRESSIONS.index(s.compression), s.fragments)

    def label(self) -> str:
        """One line: `diloco H=64 overlap, dp int8, pp bf16`."""
        return sync_label(self.sync, self.pipeline_compression)

    def to_dict(self) -> dict:
        """The plan's `sync` and `pipeline_compression` fields."""
        return {"sync": self.sync.to_dict(), "pipeline_compression": self.pipeline_compression}


def inner_step_options(max_inner_steps: int) -> list[int]:
    """DiLoCo H tried: 2, 4, 8, ... up to the bound, and the bound ([] when it is 1)."""
    options = {max_inner_steps} if max_inner_steps >= 2 else set()
    h = 2
    while h < max_inner_steps:
        options.add(h)
        h *= 2
    return sorted(options)


def sync_choices(bounds: SyncBounds) -> list[SyncChoice]:
    """Every configuration within `bounds`, least risky first."""
    dp = COMPRESSIONS[:COMPRESSIONS.index(bounds.max_compression) + 1]
    pp = PIPELINE_COMPRESSIONS[:PIPELINE_COMPRESSIONS.index(bounds.max_pipeline_compression) + 1]
    syncs = [SyncConfig("allreduce", 1, c) for c in dp]
    for h in inner_step_options(bounds.max_inner_steps):
        syncs += [SyncConfig("diloco", h, c, overlap=o, fragments=f)
                  for c in dp for o in (False, True) for f in FRAGMENT_OPTIONS if f <= h]
    return sorted((SyncChoice(s, p) for s in syncs for p in pp), key=SyncChoice.risk)


def anchor_choices(bounds: SyncBounds) -> list[SyncChoice]:
    """The configurations the assignment is searched under: allreduce and (when H > 1 is
    allowed) DiLoCo with the largest H, overlapped; both with the most compression allowed."""
    anchors = [SyncChoice(SyncConfig("allreduce", 1, bounds.max_compression),
                          bounds.max_pipeline_compression)]
    if bounds.max_inner_steps >= 2:
        anchors.append(SyncChoice(SyncConfig("diloco", bounds.max_inner_steps,
                                             bounds.max_compression, overlap=True),
                                  bounds.max_pipeline_compression))
    return anchors


@dataclass
class Scored:
    """A configuration scored on one anchor's assignment."""

    choice: SyncChoice
    cost: CostBreakdown
    anchor: int
    """Index of the anchor whose assignment it was scored on."""
    replicas: int = 1
    """R of that assignment (with the batch: its global batch, which sets allreduce's steps
    to the target; before the targets are priced, configurations are compared by cost / R,
    planning.per_replica_cost)."""
    batch_per_replica: float = 1.0
    """Sequences per replica and step of that assignment's plan."""
    steps: float | None = None
    """Predicted steps to the target (scheduler.quality; None: not predicted yet)."""
    seconds: float | None = None
    """Predicted seconds to the target (the warm-up's steps at allreduce's step)."""
    flags: tuple[str, ...] = ()
    """Why the steps prediction is uncertain (outside the fitted ranges)."""

    @property
    def rank_cost(self) -> float:
        """What `choose` compares: the predicted time to the target, else the step per
        replica (the time per sequence)."""
        if self.seconds is not None:
            return self.seconds
        return per_replica_cost(self.cost.cost_s, self.replicas)


def choose(scored: list[Scored], tolerance: float = RISK_TOLERANCE) -> Scored | None:
    """The least risky configuration whose rank cost (time to the target, once predicted) is
    within `tolerance` of the least (the cheaper on equal risk); None when nothing has a
    finite cost."""
    finite = [s for s in scored if np.isfinite(s.cost.cost_s) and np.isfinite(s.rank_cost)]
    if not finite:
        return None
    best = min(s.rank_cost for s in finite)
    near = [s for s in finite if s.rank_cost <= best * (1.0 + tolerance)]
    return min(near, key=lambda s: (s.choice.risk(), s.rank_cost))


def with_targets(scored: list[Scored], target: Target, qm: QualityModel = FITTED,
                 model_name: str | None = None) -> list[Scored]:
    """Every scored configuration with its predicted steps and seconds to `target`; each
    DiLoCo one once per outer optimizer of OUTER_OPTIONS and warm-up of WARMUP_OPTIONS below
    all-reduce's steps (a warm-up's
    steps cost the all-reduce step of the same payloads on the same assignment, and are only
    tried where that step was scored)."""
    ar = {(s.anchor, s.choice.sync.compression, s.choice.pipeline_compression): s.cost.cost_s
          for s in scored if not s.choice.sync.rule.local_steps}
    out = []
    for s in scored:
        sync = s.choice.sync
        key = (s.anchor, sync.compression, s.choice.pipeline_compression)
        options = ([(w, o) for w in WARMUP_OPTIONS for o in OUTER_OPTIONS]
                   if sync.rule.local_steps else [(0, None)])
        for w, outer in options:
            if w and key not in ar:
                continue  # its warm-up's step was not scored (the deadline)
            warm = sync if outer is None else replace(
                sync, warmup_steps=w, outer_lr=outer[0], outer_momentum=outer[1])
            pred = predict_steps(qm, warm, s.replicas, s.batch_per_replica, target, model_name)
            if w and w >= pred.ar_steps:
                continue  # all warm-up: that is allreduce
            seconds = w * ar.get(key, 0.0) + (pred.steps - w) * s.cost.cost_s
            out.append(replace(s, choice=replace(s.choice, sync=warm), steps=pred.steps,
                               seconds=seconds, flags=pred.flags))
    return out


def resolve_target(bounds: SyncBounds, qm: QualityModel, ar_batch: float,
                   model_name: str) -> Target:
    """The target of `bounds`: its loss, or allreduce's after its train_steps at `ar_batch`."""
    if bounds.target_loss is not None:
        return target_from_loss(qm, bounds.target_loss, ar_batch, model_name)
    target = target_from_steps(qm, bounds.train_steps, ar_batch)
    if model_name != qm.model:
        target = replace(target, loss=None)  # another model's loss scale: steps only
    return target


@dataclass
class AutoOutcome:
    """What `plan --sync auto` found: the chosen plan and the best allreduce plan beside it."""

    outcome: PlanOutcome
    """The chosen plan (sync and pipeline compression written into it) with its anchor
    search's numbers; its baselines were scored under the anchor's configuration."""
    allreduce: Plan
    """The best allreduce plan."""
    allreduce_cost: CostBreakdown
    anchors: list[str]
    """The anchor configurations searched, by label."""
    scored: int
    """Configurations x anchors scored."""
    choices: int
    """Configurations allowed by the bounds."""


def skeleton(choice: SyncChoice) -> tuple[str, int, bool, int]:
    """A configuration without its compressions: mode, H, overlap, fragments."""
    s = choice.sync
    return s.mode, s.inner_steps, s.overlap, s.fragments


def score_choices(objectives: list[SimulatedObjective], pipelines: list[np.ndarray],
                  choices: list[SyncChoice], deadline: float,
                  tolerance: float = RISK_TOLERANCE,
                  batches: list[float] | None = None) -> list[Scored]:
    """Choices on each anchor's assignment, until the deadline. Compression never lengthens a
    step (for a given split), so first the most compressed choice of every skeleton (the
    fastest it can be), least risky skeleton first; then the other compressions of the
    skeletons that came within `tolerance` of the fastest, and of allreduce (the plan shown
    beside), least risky first. The allreduce skeleton is always scored in full.
    `batches`: each anchor plan's sequences per replica and step (default 1)."""
    batches = batches or [1.0] * len(objectives)
    groups: dict[tuple[str, int, bool, int], list[SyncChoice]] = {}
    for choice in choices:  # least risky first, so each group's last is its most compressed
        groups.setdefault(skeleton(choice), []).append(choice)
    scored: list[Scored] = []

    def score(choice: SyncChoice) -> float:
        costs = []
        for k, (obj, pipe) in enumerate(zip(objectives, pipelines)):
            cost = obj.with_sync(choice.sync, choice.pipeline_compression).cost(pipe)
            scored.append(Scored(choice, CostBreakdown(obj.name, cost), k, pipe.shape[0],
                                 batches[k]))
            costs.append(scored[-1].rank_cost)
        return min(costs)

    fastest: dict[tuple[str, int, bool, int], float] = {}
    for key, group in groups.items():
        if fastest and time.perf_counter() > deadline:
            break
        fastest[key] = score(group[-1])
    best = min(fastest.values())
    for key, group in groups.items():
        if key not in fastest or (sync_rule(key[0]).local_steps and
                                  fastest[key] > best * (1.0 + tolerance)):
            continue
        for choice in group[:-1]:
            if sync_rule(key[0]).local_steps and time.perf_counter() > deadline:
                return scored
            score(choice)
    return scored


def _final_plan(base: Plan, objective: SimulatedObjective, found: Scored,
                pipelines: np.ndarray, deadline: float) -> tuple[Plan, CostBreakdown]:
    """`base` with the choice written in, its split polished (until `deadline`)."""
    obj = objective.with_sync(found.choice.sync, found.choice.pipeline_compression)
    cost = obj.polish(pipelines, POLISH_REPLAYS, deadline)
    plan = replace(base, stages=list(cost.stages), pipelines=pipelines.tolist(),
                   sync=found.choice.sync, pipeline_compression=found.choice.pipeline_compression,
                   predicted=predicted(cost))
    return plan, cost


def plan_sync_auto(cluster: Cluster, model: ModelSpec, req: PlanRequest, bounds: SyncBounds,
                   progress: Callable[[int, float], None] | None = None,
                   started: float | None = None, anchors: list[SyncChoice] | None = None,
                   tolerance: float = RISK_TOLERANCE, qm: QualityModel = FITTED) -> AutoOutcome:
    """Search the assignment and the sync configuration within `bounds` (module docstring);
    req.search.time_limit_s bounds all of it from `started` (a time.perf_counter() value);
    req.sync and req.pipeline_compression are replaced by the anchors' (default
    anchor_choices(bounds); benchmarks/sync_auto_search.py compares others)."""
    if req.objective != "simulated":
        raise UserError("PlanRequest.objective: choosing the sync configuration needs the "
                        f"simulated objective, not {req.objective!r}")
    started = time.perf_counter() if started is None else started
    limit = req.search.time_limit_s
    end = started + limit - max(limit * FINISH_SHARE, min(FINISH_MIN_S, limit / 10))
    anchors = anchors or anchor_choices(bounds)
    outcomes: list[PlanOutcome] = []
    for k, anchor in enumerate(anchors):
        now = time.perf_counter()
        anchor_end = started + limit * ANCHORS_SHARE * (k + 1) / len(anchors)
        if k and anchor_end - now < 0.05 * limit:
            break  # the first anchor overran: no time for a second search worth having
        sub = replace(req, sync=anchor.sync, pipeline_compression=anchor.pipeline_compression,
                      search=replace(req.search, time_limit_s=max(anchor_end - now, 1e-3)))
        outcomes.append(plan_best_shape(cluster, model, sub, progress, now))
    objectives = [SimulatedObjective(cluster, model, o.plan.sync, o.plan.micro_batch_size,
                                     o.plan.num_micro_batches, req.sim,
                                     pipeline_compression=o.plan.pipeline_compression)
                  for o in outcomes]
    pipelines = [np.asarray(o.plan.pipelines) for o in outcomes]
    choices = sync_choices(bounds)
    polish_end = time.perf_counter() + (end - time.perf_counter()) * 0.8
    batches = [float(batch_per_replica(o.plan)) for o in outcomes]
    target = resolve_target(bounds, qm, outcomes[0].plan.num_replicas * batches[0], model.name)
    scored = with_targets(score_choices(objectives, pipelines, choices, polish_end, tolerance,
                                        batches), target, qm, model.name)
    chosen = choose(scored, tolerance)
    allreduce = choose([s for s in scored if not s.choice.sync.rule.local_steps],
                       tolerance)
    if chosen is None or allreduce is None:
        raise UserError(f"no plan of {model.name} fits the devices of '{cluster.name}' under "
                        f"any sync configuration allowed")
    polish_each = (end - time.perf_counter()) / 2
    ar_plan, ar_cost = _final_plan(outcomes[allreduce.anchor].plan,
                                   objectives[allreduce.anchor], allreduce,
                                   pipelines[allreduce.anchor], time.perf_counter() + polish_each)
    plan, cost = _final_plan(outcomes[chosen.anchor].plan, objectives[chosen.anchor], chosen,
                             pipelines[chosen.anchor], end)
    record_target(plan, chosen, target, cost.cost_s)
    record_target(ar_plan, allreduce, target, ar_cost.cost_s)
    plan.search = {**plan.search, "sync_auto": {
        "anchors": [a.label() for a in anchors[:len(outcomes)]],
        "chosen_on_anchor": chosen.anchor, "configurations": len(choices),
        "scored": len(scored), "risk_tolerance": tolerance, "bounds": asdict(bounds),
        "quality_model": qm.provenance,
        "allreduce": {**allreduce.choice.to_dict(), "cost": round(ar_cost.cost_s, 6),
                      "to_target": ar_plan.predicted["to_target"]}}}
    outcome = replace(outcomes[chosen.anchor], plan=plan, ours=cost)
    return AutoOutcome(outcome, ar_plan, ar_cost, [a.label() for a in anchors[:len(outcomes)]],
                       len(scored), len(choices))


def batch_per_replica(plan: Plan) -> int:
    """Sequences one replica trains per step: lanes x micro-batches x micro-batch size."""
    return plan.lanes_per_replica * plan.num_micro_batches * plan.micro_batch_size


def record_target(plan: Plan, found: Scored, target: Target, step_s: float) -> None:
    """Into the plan's `predicted`: the target and the predicted steps, tokens and seconds to
    it (`to_target`; `step_s`: the plan's polished step); with a warm-up, `train_steps` (the
    steps it was charged over) and the run's mean step."""
    steps = found.steps if found.steps is not None else target.ar_steps
    w = plan.sync.warmup_steps if plan.sync.rule.local_steps else 0
    if found.seconds is not None:  # the warm-up's part as scored, the rest at the polished step
        found = replace(found, seconds=found.seconds - (steps - w) * (found.cost.cost_s - step_s))
    seqs = steps * plan.num_replicas * batch_per_replica(plan)
    plan.predicted["to_target"] = {
        "target": target.label, "loss": None if target.loss is None else round(target.loss, 4),
        "steps": round(steps, 1), "tokens": int(seqs * plan.model_spec().seq_len),
        "seconds": None if found.seconds is None else round(found.seconds, 3),
        "flags": list(found.flags)}
    if plan.sync.warmup_steps:
        plan.predicted["train_steps"] = max(1, math.ceil(steps))
        plan.predicted["run_step_s"] = round(found.seconds / steps, 6)
