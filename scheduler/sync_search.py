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
3. Warm-ups (with_warmups): each DiLoCo configuration once per warm-up (in steps) the quality
   table measured (scheduler.quality), its cost the run's mean step (the warm-up's steps at the
   allreduce step of the same payloads and assignment; scheduler.simulator.warmup), and its
   predicted loss ratio to allreduce.
4. The choice: among the configurations whose predicted loss ratio is at most
   SyncBounds.max_loss_ratio, the one of lowest predicted loss ratio, then least risky
   (SyncChoice.risk), whose run step is within RISK_TOLERANCE (the simulator's noise band) of
   the fastest; the best allreduce configuration is chosen the same way among allreduce ones,
   to show beside it. Both get the objective's split polish.

Why not one search per configuration: hundreds of configurations would leave each a sliver of
the time limit; and the assignment depends on the configuration mainly through whether the
rings matter, which the two anchors span.

Faster is not better for the model's quality: a larger H, a stale (overlapped) outer step and
lossy payloads can cost loss per step, and DiLoCo from a fresh model most of all. The planner
only picks within the user's bounds (SyncBounds) and within the loss the quality table
predicts (docs/bad_links.md has the table and its limits).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np

from formats.cluster import Cluster
from formats.errors import UserError
from formats.models import ModelSpec
from formats.plan import COMPRESSIONS, MAX_INNER_STEPS, PIPELINE_COMPRESSIONS, Plan, SyncConfig
from formats.settings import check, setting
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
from scheduler.quality import PROVENANCE, loss_ratio, warmup_options
from scheduler.simulator.report import sync_label
from scheduler.simulator.warmup import DEFAULT_TRAIN_STEPS, run_step_s

RISK_TOLERANCE = 0.02
"""A riskier configuration must predict a step more than this fraction shorter to be chosen
(the simulator's noise band; the quality side is SyncBounds.max_loss_ratio)."""
ANCHORS_SHARE = 0.84
"""Part of the time limit the anchor searches share equally (the rest: scoring, polish)."""
FRAGMENT_OPTIONS = (1, 2, 4)
"""Streaming-DiLoCo fragment counts tried (at most H)."""
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
    """--sync auto: steps the run will train (the runner's --steps): a DiLoCo warm-up's
    all-reduce steps are charged as their share of it"""
    max_loss_ratio: float = setting(1.02, lo=1.0, hi=10.0)
    """--sync auto: largest predicted validation loss over allreduce's (after the same tokens,
    from the measured table of docs/bad_links.md) it may choose"""

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
        return (s.inner_steps if s.mode == "diloco" else 0, int(s.overlap),
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
    """R of that assignment: configurations on assignments of different widths are ranked
    by cost / R (planning.per_replica_cost), the step time per sequence trained."""
    loss_ratio: float | None = None
    """Predicted final loss over allreduce's (scheduler.quality; None: not predicted)."""

    @property
    def rank_cost(self) -> float:
        """What `choose` compares: the step per replica."""
        return per_replica_cost(self.cost.cost_s, self.replicas)


def choose(scored: list[Scored], tolerance: float = RISK_TOLERANCE,
           max_loss_ratio: float | None = None) -> Scored | None:
    """Among the configurations predicted within `max_loss_ratio` (None: all), the lowest
    predicted loss ratio, then the least risky, whose step is within `tolerance` of the
    fastest (the faster on equal risk); None when nothing has a finite cost."""
    finite = [s for s in scored if np.isfinite(s.cost.cost_s) and (
        max_loss_ratio is None or (s.loss_ratio is not None and s.loss_ratio <= max_loss_ratio))]
    if not finite:
        return None
    best = min(s.rank_cost for s in finite)
    near = [s for s in finite if s.rank_cost <= best * (1.0 + tolerance)]
    return min(near, key=lambda s: (s.loss_ratio or 1.0, s.choice.risk(), s.rank_cost))


def with_warmups(scored: list[Scored], train_steps: int) -> list[Scored]:
    """Every scored configuration with its predicted loss ratio; each DiLoCo one once per
    warm-up the quality table measured for its H (scheduler.quality.warmup_options), its cost
    the mean step of a run of
    `train_steps` (the warm-up's steps at the allreduce step of the same payloads on the same
    assignment)."""
    ar = {(s.anchor, s.choice.sync.compression, s.choice.pipeline_compression): s.cost.cost_s
          for s in scored if s.choice.sync.mode == "allreduce"}
    out = []
    for s in scored:
        sync = s.choice.sync
        if sync.mode != "diloco":
            out.append(replace(s, loss_ratio=loss_ratio(sync, train_steps)))
            continue
        key = (s.anchor, sync.compression, s.choice.pipeline_compression)
        for w in warmup_options(sync.inner_steps, train_steps) or (0,):
            if w and key not in ar:
                continue  # its warm-up's step was not scored (the deadline)
            warm = replace(sync, warmup_steps=w)
            cost = run_step_s(s.cost.cost_s, ar.get(key, 0.0), w, train_steps)
            out.append(replace(s, choice=replace(s.choice, sync=warm),
                               cost=CostBreakdown(s.cost.objective, cost, dict(s.cost.parts)),
                               loss_ratio=loss_ratio(warm, train_steps)))
    return out


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
                  tolerance: float = RISK_TOLERANCE) -> list[Scored]:
    """Choices on each anchor's assignment, until the deadline. Compression never lengthens a
    step (for a given split), so first the most compressed choice of every skeleton (the
    fastest it can be), least risky skeleton first; then the other compressions of the
    skeletons that came within `tolerance` of the fastest, and of allreduce (the plan shown
    beside), least risky first. The allreduce skeleton is always scored in full."""
    groups: dict[tuple[str, int, bool, int], list[SyncChoice]] = {}
    for choice in choices:  # least risky first, so each group's last is its most compressed
        groups.setdefault(skeleton(choice), []).append(choice)
    scored: list[Scored] = []

    def score(choice: SyncChoice) -> float:
        costs = []
        for k, (obj, pipe) in enumerate(zip(objectives, pipelines)):
            cost = obj.with_sync(choice.sync, choice.pipeline_compression).cost(pipe)
            scored.append(Scored(choice, CostBreakdown(obj.name, cost), k, pipe.shape[0]))
            costs.append(scored[-1].rank_cost)
        return min(costs)

    fastest: dict[tuple[str, int, bool, int], float] = {}
    for key, group in groups.items():
        if fastest and time.perf_counter() > deadline:
            break
        fastest[key] = score(group[-1])
    best = min(fastest.values())
    for key, group in groups.items():
        if key not in fastest or (key[0] != "allreduce" and
                                  fastest[key] > best * (1.0 + tolerance)):
            continue
        for choice in group[:-1]:
            if key[0] != "allreduce" and time.perf_counter() > deadline:
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
                   tolerance: float = RISK_TOLERANCE) -> AutoOutcome:
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
    scored = with_warmups(score_choices(objectives, pipelines, choices, polish_end, tolerance),
                          bounds.train_steps)
    chosen = choose(scored, tolerance, bounds.max_loss_ratio)
    allreduce = choose([s for s in scored if s.choice.sync.mode == "allreduce"], tolerance)
    if chosen is None or allreduce is None:
        raise UserError(f"no plan of {model.name} fits the devices of '{cluster.name}' under "
                        f"any sync configuration allowed")
    polish_each = (end - time.perf_counter()) / 2
    ar_plan, ar_cost = _final_plan(outcomes[allreduce.anchor].plan,
                                   objectives[allreduce.anchor], allreduce,
                                   pipelines[allreduce.anchor], time.perf_counter() + polish_each)
    plan, cost = _final_plan(outcomes[chosen.anchor].plan, objectives[chosen.anchor], chosen,
                             pipelines[chosen.anchor], end)
    _record(plan, chosen, bounds)
    plan.search = {**plan.search, "sync_auto": {
        "anchors": [a.label() for a in anchors[:len(outcomes)]],
        "chosen_on_anchor": chosen.anchor, "configurations": len(choices),
        "scored": len(scored), "risk_tolerance": tolerance, "bounds": asdict(bounds),
        "quality_table": PROVENANCE,
        "allreduce": {**allreduce.choice.to_dict(), "cost": round(ar_cost.cost_s, 6)}}}
    outcome = replace(outcomes[chosen.anchor], plan=plan, ours=cost)
    return AutoOutcome(outcome, ar_plan, ar_cost, [a.label() for a in anchors[:len(outcomes)]],
                       len(scored), len(choices))


def _record(plan: Plan, chosen: Scored, bounds: SyncBounds) -> None:
    """Into the plan's `predicted`: the loss ratio the choice assumed and, with a warm-up, the
    run's mean step it was ranked by (the warm-up's all-reduce steps included)."""
    plan.predicted["loss_ratio"] = chosen.loss_ratio
    if plan.sync.warmup_steps:
        plan.predicted["train_steps"] = bounds.train_steps
        plan.predicted["run_step_s"] = round(chosen.cost.cost_s, 6)
