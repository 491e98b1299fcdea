"""Plan a cluster end to end: build the objective, search, run the baselines, make the Plan.

This is the library behind `scheduler.py plan`; it does no I/O besides the progress callback.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from formats.cluster import MAX_DENSE_DEVICES, Cluster
from formats.errors import UserError
from formats.models import ModelSpec, model_record
from formats.plan import (
    MAX_BATCH_COUNT,
    MAX_DEVICE_ID,
    OUTER_STATES,
    PIPELINE_COMPRESSIONS,
    Plan,
    SyncConfig,
)
from formats.settings import MAX_COUNT, check, setting
from scheduler.baselines import (
    best_of_random,
    hand_structured,
    index_order_plan,
    structured_plans,
)
from scheduler.cost_dtfm import DTFM_TOKENS_PER_REPLICA, DtfmObjective
from scheduler.cost_simulated import SimulatedObjective
from scheduler.layer_split import stage_replica_shapes
from scheduler.memory import stage_memory
from scheduler.objective import CostBreakdown, Objective
from scheduler.search import (
    SearchConfig,
    SearchResult,
    evolutionary_search,
)
from scheduler.search.islands import leaf_orders
from scheduler.search.matching import PairCache
from scheduler.simulator.config import SimConfig
from scheduler.simulator.step import simulate_plan

MAX_SHARD = 1024
"""Most devices per shard group the planner tries (the model's shard limit also bounds it)."""
OBJECTIVE_NAMES = ("dtfm", "simulated")
"""The cost models a plan can minimise (OBJECTIVES holds their factories)."""
DEFAULT_OBJECTIVE = "simulated"
"""What a PlanRequest, `plan` and `evaluate` use when no objective is named."""
MAX_TOKENS = 1e15
"""Largest token budget per replica per step."""


@dataclass(frozen=True)
class PlanRequest:
    """Everything `plan` needs besides the cluster and the model. Checked when made: a bad
    field is a UserError naming it (`PlanRequest.num_stages`)."""

    num_stages: int = setting(flag="--stages", lo=0, hi=MAX_DEVICE_ID)
    """pipeline stages S (0: try every S x R = devices and keep the cheapest; with R given,
    the S that goes with it)"""
    num_replicas: int = setting(flag="--replicas", lo=0, hi=MAX_DEVICE_ID)
    """data-parallel replicas R (S x R = devices; 0: derived)"""
    micro_batch_size: int = setting(1, lo=1, hi=MAX_BATCH_COUNT)
    """sequences per micro-batch"""
    num_micro_batches: int = setting(0, flag="--micro-batches", lo=0, hi=MAX_BATCH_COUNT)
    """micro-batches per replica per step (0: derived from the tokens per replica: tokens /
    (seq_len x micro-batch size), i.e. 61 for gpt3-xl)"""
    objective: str = setting(DEFAULT_OBJECTIVE, choices=OBJECTIVE_NAMES, noun="objective")
    """cost model to minimise"""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """How the replicas of a stage keep their parameters in step."""
    search: SearchConfig = field(default_factory=SearchConfig)
    """Budget (per searched shape) and seed of the evolutionary search; its time limit bounds
    the whole of plan_best_shape: every shape's set-up and search, and the baselines."""
    random_samples: int = setting(1000, lo=1, hi=MAX_COUNT)
    """random plans of the best-of-random baseline"""
    tokens_per_replica: float = setting(DTFM_TOKENS_PER_REPLICA, lo=0.0, lo_open=True,
                                        hi=MAX_TOKENS)
    """token budget per replica per step that sets the default micro-batch count (the DT-FM
    setting: 1.25e5)"""
    sim: SimConfig = field(default_factory=SimConfig)
    """Performance model of the simulated objective (runtime profile, MFU, activation bytes,
    recompute, collective latency); recorded in the plan's search.sim_config."""
    pipeline_compression: str = setting("none", choices=PIPELINE_COMPRESSIONS)
    """how activations and their gradients cross pipeline links: none (compute dtype), bf16
    (2 bytes per value), int8 (1 byte per value + one fp32 scale per token); objective
    simulated only (the plan's pipeline_compression)"""
    max_shard: int = setting(1, lo=1, hi=MAX_SHARD)
    """most devices per shard group (FSDP2 inside a replica, docs/hierarchical.md); 1 (the
    default) plans exactly as before, above 1 the D = 1 plan is compared with every sharded
    layout by the simulator's time per sequence (scheduler/shard_search.py)"""
    reshard_after_forward: bool = setting(True, hidden=True)
    """sharded plans: free each block's gathered parameters after its forward (Plan field)"""
    outer_state: str = setting("device", choices=OUTER_STATES)
    """sharded DiLoCo plans: where the memory model puts each shard's anchor and outer
    momentum, device or host (the plan's outer_state; the runner's --outer-state decides)"""

    def __post_init__(self) -> None:
        """UserError naming the first bad field (the fields' declared rules, then the rules
        between fields)."""
        check(self)
        self.sync.validate()
        if self.pipeline_compression != "none" and self.objective != "simulated":
            raise UserError(f"PlanRequest.pipeline_compression: the {self.objective} objective "
                            f"does not model it; plan with objective 'simulated'")


@dataclass
class PlanOutcome:
    """The plan and the numbers the CLI prints next to it."""

    plan: Plan
    ours: CostBreakdown
    random_cost: float
    index_cost: float
    history: list[tuple[int, float]]
    best_structured: tuple[str, float]
    """Our search's best topology-aware starting plan (name, cost), before evolution."""
    baselines: dict[str, CostBreakdown] = field(default_factory=dict)
    """Each baseline's cost with its parts, by row label: hand-structured (regions), best of N
    random plans, index order."""
    hand_structured: str = ""
    """How the best hand-structured plan was built."""
    random_scored: int = 0
    """Random plans scored for the best-of-random baseline (fewer than asked when the time
    limit ended it)."""


def default_micro_batches(model: ModelSpec, micro_batch_size: int,
                          tokens_per_replica: float = DTFM_TOKENS_PER_REPLICA) -> int:
    """Micro-batches per replica that carry `tokens_per_replica` tokens per step: the DT-FM
    budget of 1.25e5 tokens gives 61 sequences of 2048 for gpt3-xl (at least 1)."""
    return max(1, int(tokens_per_replica // (model.seq_len * micro_batch_size)))


def make_dtfm(cluster: Cluster, model: ModelSpec, req: PlanRequest) -> DtfmObjective:
    """The DT-FM objective for this request's shape and batch."""
    sequences = req.num_micro_batches * req.micro_batch_size
    return DtfmObjective(cluster, model, req.num_stages, req.num_replicas, sequences)


def make_simulated(cluster: Cluster, model: ModelSpec, req: PlanRequest) -> SimulatedObjective:
    """The simulator's predicted step time (compute, memory, bubbles, sync) for this request."""
    return SimulatedObjective(cluster, model, req.sync, req.micro_batch_size,
                              req.num_micro_batches, req.sim,
                              pipeline_compression=req.pipeline_compression)


FALLBACK_BUDGET = 8_000
"""Evaluations per search of an objective that declares no budget (ObjectiveKind.budget):
the simulated objective's, the costlier of the two measured."""
FALLBACK_WINDOW = 0
"""Convergence window of an objective that declares none: 0, the search runs to its budget
(no window was measured for it)."""


@dataclass(frozen=True)
class ObjectiveKind:
    """A cost model the planner can minimise: its factory (called as the kind itself) and the
    search defaults that suit its cost per evaluation, used when `plan` is given no --budget
    or --window."""

    make: Callable[[Cluster, ModelSpec, PlanRequest], Objective]
    budget: int = FALLBACK_BUDGET
    """Evaluations per search when none is given (SearchConfig.budget)."""
    window: int = FALLBACK_WINDOW
    """Convergence window when none is given (SearchConfig.window; 0: run to the budget)."""

    def __call__(self, cluster: Cluster, model: ModelSpec, req: PlanRequest) -> Objective:
        """The objective for this cluster, model and request."""
        return self.make(cluster, model, req)


OBJECTIVES: dict[str, ObjectiveKind] = {
    # dtfm stops 1,000 evaluations after its last gain (docs/planner.md, "When the search
    # stops"); simulated, whose evaluations cost ~6x more and whose quality under a window
    # was not measured, runs to its budget. The budgets are what one core does in 5-12 s for
    # 64 devices (dtfm ~0.25 ms, simulated ~1.5 ms each), so that the budget or convergence,
    # not the clock, ends a default run and the plan is reproducible from its seed
    # (simulated: 3,000 lost 1.19x on `universities`).
    "dtfm": ObjectiveKind(make_dtfm, budget=20_000, window=1_000),
    "simulated": ObjectiveKind(make_simulated, budget=8_000, window=0),
}
"""Objectives by name; a new one registers here (its search defaults with it, or the
fallbacks) and in OBJECTIVE_NAMES."""
assert tuple(OBJECTIVES) == OBJECTIVE_NAMES
BASELINE_SHARE = 0.15
"""Part of the time limit kept for scoring the baselines (used only when the search runs
into the clock; a search ended by its budget leaves them more)."""
FINISH_SHARE = 0.03
"""Part of the time limit kept for writing the plan and exiting (at least FINISH_MIN_S)."""
FINISH_MIN_S = 0.3
"""Seconds kept at least for writing the plan and the interpreter's exit (measured: 0.15-0.2 s
after a 1,000-device plan on a loaded 2-core machine)."""
POLISH_SHARE = 0.05
"""Part of a shape's time kept for polishing the simulated objective's layer split."""


def search_defaults(objective: str) -> tuple[int, int]:
    """(budget, window) of a search minimising `objective` when none is given: what its
    ObjectiveKind declares; FALLBACK_BUDGET and FALLBACK_WINDOW for an objective registered
    as a bare factory."""
    kind = OBJECTIVES[objective]
    return (getattr(kind, "budget", FALLBACK_BUDGET), getattr(kind, "window", FALLBACK_WINDOW))


def check_shape(cluster: Cluster, model: ModelSpec, req: PlanRequest) -> None:
    """UserError unless S x R uses every device and S fits the model's layers."""
    s, r, n = req.num_stages, req.num_replicas, cluster.num_devices
    if s < 1 or r < 1:
        raise UserError(f"PlanRequest.num_stages and PlanRequest.num_replicas must be >= 1, "
                        f"got {s} and {r}")
    if s * r != n:
        raise UserError(f"PlanRequest.num_stages {s} x PlanRequest.num_replicas {r} = {s * r} "
                        f"devices, but cluster '{cluster.name}' has {n}; choose S x R = {n}")
    if s > model.num_layers:
        raise UserError(f"PlanRequest.num_stages {s}: {model.name} has only {model.num_layers} "
                        f"layers")


def search_plan(cluster: Cluster, objective: Objective, dtfm: DtfmObjective, num_stages: int,
                num_replicas: int, config: SearchConfig,
                progress: Callable[[int, float], None] | None = None,
                deadline: float | None = None,
                act_orders: dict[float, list[np.ndarray]] | None = None) -> SearchResult:
    """Our search over all devices of the cluster, minimising `objective`: DT-FM's link times
    drive the matching and the clustering of the seeds, and the plans built from the cluster's
    regions (baselines.structured_plans) join the starting population.

    `deadline` (a time.perf_counter() value): the search, set-up included, ends by then
    (config.time_limit_s is replaced). `act_orders`: device orders from the activation times,
    by activation size, kept across calls (they do not depend on the shape)."""
    devices = np.arange(cluster.num_devices)
    seeds = structured_plans(cluster.regions(), dtfm.act, devices, num_stages, num_replicas)
    orders = None
    if act_orders is not None:
        key = dtfm.constants.activation_gb
        if key not in act_orders:
            act_orders[key] = leaf_orders([dtfm.act], devices)
        # = leaf_orders([act, grad]): the identity order, then each matrix's orders.
        orders = act_orders[key] + leaf_orders([dtfm.grad], devices)[1:]
    if deadline is not None:
        config = replace(config, time_limit_s=max(deadline - time.perf_counter(), 1e-3))
    return evolutionary_search(objective, dtfm.act, devices, num_stages, num_replicas, config,
                               [dtfm.grad], progress, seeds, orders)


def candidate_shapes(cluster: Cluster, model: ModelSpec, req: PlanRequest
                     ) -> list[tuple[int, int]]:
    """(S, R) shapes to try: the given one, or every factorisation of the device count that
    the model's layers allow when num_stages and num_replicas are left out (0)."""
    n = cluster.num_devices
    s, r = req.num_stages, req.num_replicas
    if s and r:
        return [(s, r)]
    if s or r:
        given = s or r
        if n % given:
            raise UserError(f"{'PlanRequest.num_stages' if s else 'PlanRequest.num_replicas'} "
                            f"{given} does not divide the "
                            f"{n} devices of cluster '{cluster.name}'")
        return [(s, n // s)] if s else [(n // r, r)]
    shapes = stage_replica_shapes(n, model.num_layers)
    if not shapes:
        raise UserError(f"no S x R = {n} with S <= {model.num_layers} layers of {model.name}")
    return shapes


def check_scale(cluster: Cluster, req: PlanRequest) -> None:
    """UserError when the objective cannot work on a cluster this large: the simulated one
    needs the N x N matrices, which a compact cluster builds only up to MAX_DENSE_DEVICES."""
    n = cluster.num_devices
    if req.objective == "simulated" and cluster.is_compact and n > MAX_DENSE_DEVICES:
        raise UserError(f"PlanRequest.objective: 'simulated' needs the full {n} x {n} link "
                        f"matrices, which a compact cluster builds only up to "
                        f"{MAX_DENSE_DEVICES} devices; plan '{cluster.name}' with 'dtfm'")


@dataclass
class ShapeResult:
    """One searched shape: its plan and what scoring its baselines needs."""

    req: PlanRequest
    """The request with this shape and the micro-batch count filled in."""
    plan: Plan
    ours: CostBreakdown
    search: SearchResult
    objective: Objective
    dtfm: DtfmObjective


def search_shape(cluster: Cluster, model: ModelSpec, req: PlanRequest, deadline: float,
                 digest: str, progress: Callable[[int, float], None] | None = None,
                 act_orders: dict[float, list[np.ndarray]] | None = None) -> ShapeResult:
    """Build the objective, search one S x R shape and make its Plan, all before
    time.perf_counter() passes `deadline` (POLISH_SHARE of the time is kept for the
    simulated objective's split polish). `digest`: the cluster's sha256; `act_orders`: as
    search_plan."""
    if req.num_micro_batches == 0:
        req = replace(req, num_micro_batches=default_micro_batches(
            model, req.micro_batch_size, req.tokens_per_replica))
    check_shape(cluster, model, req)
    objective = OBJECTIVES[req.objective](cluster, model, req)
    check_memory(cluster, model, req, objective)
    # DT-FM's link times drive matching and seeding (the objective itself when it is DT-FM).
    dtfm = objective if isinstance(objective, DtfmObjective) else make_dtfm(cluster, model, req)
    start = time.perf_counter()
    result = search_plan(cluster, objective, dtfm, req.num_stages, req.num_replicas, req.search,
                         progress, start + (deadline - start) * (1 - POLISH_SHARE), act_orders)
    wall = time.perf_counter() - start
    polish = getattr(objective, "polish", None)  # the simulated objective refines its split
    ours = polish(result.pipelines, deadline=deadline) if polish else \
        objective.breakdown(result.pipelines)
    plan = Plan(
        cluster=cluster.name, cluster_sha256=digest, model=model.name,
        stages=list(ours.stages), pipelines=result.pipelines.tolist(),
        micro_batch_size=req.micro_batch_size, num_micro_batches=req.num_micro_batches,
        sync=req.sync, pipeline_compression=req.pipeline_compression,
        predicted=predicted(ours), model_config=model_record(model),
        search={"method": "evolutionary", "seed": req.search.seed,
                "evaluations": result.evaluations, "wall_s": round(wall, 3),
                "stopped_by": result.stopped_by,
                **({"sim_config": asdict(req.sim)} if req.objective == "simulated" else {})},
    )
    if not np.isfinite(ours.cost_s):
        simulate_plan(cluster, model, plan, req.sim, timeline=False)  # names the device
        raise UserError(f"no {req.num_stages} x {req.num_replicas} plan of {model.name} fits "
                        f"the devices of '{cluster.name}'")
    return ShapeResult(req, plan, ours, result, objective, dtfm)


def predicted(cost: CostBreakdown) -> dict[str, float | str]:
    """A plan's `predicted` block: objective, cost and its parts (s, rounded to the us)."""
    return {"objective": cost.objective, "cost": round(cost.cost_s, 6),
            **{k: round(v, 6) for k, v in cost.parts.items()}}


def check_memory(cluster: Cluster, model: ModelSpec, req: PlanRequest,
                 objective: Objective) -> None:
    """UserError, before any search, when no plan of this shape can fit. An objective that
    models memory (`least_stage_memory`: it places stages by memory) is refused when the
    fullest stage of the best split needs more than any group of R devices offers, i.e. than
    the R-th largest device memory; one with a fixed split that ignores memory (dtfm: even
    stages, any device anywhere) when its fullest stage needs more than the smallest device."""
    least = getattr(objective, "least_stage_memory", None)
    if least is None:
        _check_fixed_split_memory(cluster, model, req, getattr(objective, "stages", None))
        return
    need = least(req.num_stages)
    best_group = sorted((d.memory_gb for d in cluster.devices), reverse=True)[
        req.num_replicas - 1] * 1e9
    if need > best_group:
        raise UserError(f"no {req.num_stages} x {req.num_replicas} plan of {model.name} fits "
                        f"the devices of '{cluster.name}': with {req.num_stages} stage(s) "
                        f"some stage needs at least {need / 1e9:.2f} GB (parameters, optimizer "
                        f"state, activations of {req.num_micro_batches} micro-batches) on each "
                        f"of {req.num_replicas} devices, and only "
                        f"{sum(d.memory_gb * 1e9 >= need for d in cluster.devices)} have that "
                        f"much")


def _check_fixed_split_memory(cluster: Cluster, model: ModelSpec, req: PlanRequest,
                              stages: list[tuple[int, int]] | None) -> None:
    """UserError when the fullest of `stages` does not fit on the smallest device: an
    objective blind to memory may put any stage on any device."""
    if not stages:
        return
    diloco = req.sync.rule.local_steps
    need, (a, b) = max((stage_memory(model, a, b, req.micro_batch_size, req.num_micro_batches,
                                     diloco, req.sim.memory(),
                                     outer_state=req.outer_state).total_bytes, (a, b))
                       for a, b in stages)
    small = min(cluster.devices, key=lambda d: d.memory_gb)
    if need > small.memory_gb * 1e9:
        raise UserError(
            f"no {req.num_stages} x {req.num_replicas} plan of {model.name} fits with the "
            f"{req.objective} objective: its even split gives a stage layers [{a}, {b}), which "
            f"needs {need / 1e9:.2f} GB (parameters, optimizer state, activations of "
            f"{req.num_micro_batches} micro-batches), and it may run on any device, but device "
            f"{small.id} ({small.name}, {small.gpu}) has {small.memory_gb:g} GB; use more "
            f"stages, fewer micro-batches, or --objective simulated (it places stages by "
            f"memory)")


def plan_best_shape(cluster: Cluster, model: ModelSpec, req: PlanRequest,
                    progress: Callable[[int, float], None] | None = None,
                    started: float | None = None) -> PlanOutcome:
    """Search every candidate shape, keep the cheapest, score its baselines.

    req.search.time_limit_s bounds all of it, counted from `started` (a time.perf_counter()
    value; default: now), so that a caller can count what it did before (loading the
    cluster): the shapes share what is left of it but BASELINE_SHARE and the finish reserve
    (FINISH_SHARE, FINISH_MIN_S), the baselines of the chosen shape get what is left but the
    finish reserve (at least one plan of each kind is scored). Every phase stops at its
    deadline, so the call ends within the limit up to one objective evaluation (or one
    uninterruptible set-up step, such as one matching of two big stage groups) past it."""
    started = time.perf_counter() if started is None else started
    limit = req.search.time_limit_s
    end = started + limit - max(limit * FINISH_SHARE, min(FINISH_MIN_S, limit / 10))
    search_end = end - limit * BASELINE_SHARE
    check_scale(cluster, req)
    shapes = candidate_shapes(cluster, model, req)
    best, stops, skipped = search_shapes(cluster, model, req, shapes, search_end,
                                         cluster.sha256(), progress)
    best.plan.search["shapes_tried"] = [list(x) for x in shapes if x not in skipped]
    if skipped:
        best.plan.search["shapes_skipped"] = [list(x) for x in skipped]
    # Reproducible only if no shape's search was cut by the wall limit.
    best.plan.search["stopped_by"] = next(
        (s for s in ("time", "budget") if s in stops), "converged")
    return outcome_with_baselines(cluster, best, end)


def per_replica_cost(cost_s: float, num_replicas: int) -> float:
    """A step's cost divided by its replicas: what ranks plans of different widths. The batch
    per replica is fixed (M x b sequences), so a plan with R replicas trains R x M x b
    sequences per step; cost / R is its time per sequence up to that constant. (Ranking by
    the step alone would prefer narrow, deep plans that simply train less per step.)"""
    return cost_s / num_replicas


def search_shapes(cluster: Cluster, model: ModelSpec, req: PlanRequest,
                  shapes: list[tuple[int, int]], deadline: float, digest: str,
                  progress: Callable[[int, float], None] | None = None
                  ) -> tuple[ShapeResult, set[str], list[tuple[int, int]]]:
    """search_shape for each shape, sharing the time until `deadline`; the cheapest result
    per sequence (per_replica_cost),
    what stopped each search, and the shapes skipped because the deadline had passed before
    their turn (never the first). UserError when no shape works."""
    best: ShapeResult | None = None
    failures: list[str] = []
    stops: set[str] = set()
    skipped: list[tuple[int, int]] = []
    act_orders: dict[float, list[np.ndarray]] = {}  # the same for every shape: made once
    overrun = 0.0  # the most a shape ran past its end: expect the last one to do so too
    for k, (s, r) in enumerate(shapes):
        # each shape gets an equal share of the time left (a shape that cannot fit quits early)
        now = time.perf_counter()
        if best is not None and now >= deadline:
            skipped.append((s, r))
            stops.add("time")
            continue
        shape_end = now + max(deadline - overrun - now, 0.0) / (len(shapes) - k)
        try:
            found = search_shape(cluster, model, replace(req, num_stages=s, num_replicas=r),
                                 shape_end, digest, progress, act_orders)
        except UserError as e:
            if len(shapes) == 1:
                raise
            failures.append(f"{s} x {r}: {e}")
            continue
        finally:
            overrun = max(overrun, time.perf_counter() - shape_end)
        stops.add(found.plan.search["stopped_by"])
        if best is None or (per_replica_cost(found.ours.cost_s, r) <
                            per_replica_cost(best.ours.cost_s, best.plan.num_replicas)):
            best = found
    if best is None:
        raise UserError("no shape works:\n  " + "\n  ".join(failures))
    if failures:  # e.g. shapes whose stages cannot fit in memory: said in the plan's search
        best.plan.search["shapes_refused"] = failures
    return best, stops, skipped


def outcome_with_baselines(cluster: Cluster, found: ShapeResult, deadline: float
                           ) -> PlanOutcome:
    """The PlanOutcome of a searched shape, its baselines scored before `deadline`. When the
    clock cut the search short and a baseline plan is cheaper, that plan is the one returned
    (plan.search says so: `taken_from`, and `search_cost`, what the search had found)."""
    # Keep time for the three baseline rows' breakdowns, about one evaluation each.
    per_eval = found.search.wall_s / max(found.search.evaluations, 1)
    rows_s = min(3 * per_eval, max(deadline - time.perf_counter(), 0.0) / 2)
    base = score_baselines(cluster, found.objective, found.dtfm, found.req,
                           found.ours.objective, deadline - rows_s, found.search.pairs)
    plan, ours = found.plan, found.ours
    label = min(base.rows, key=lambda k: base.rows[k].cost_s)
    if plan.search["stopped_by"] == "time" and base.rows[label].cost_s < ours.cost_s:
        ours = base.rows[label]
        plan = replace(plan, stages=list(ours.stages), pipelines=base.plans[label].tolist(),
                       predicted=predicted(ours),
                       search={**plan.search, "taken_from": label,
                               "search_cost": round(found.ours.cost_s, 6)})
    random_label = next(k for k in base.rows if k.startswith("best of"))
    return PlanOutcome(plan, ours, base.rows[random_label].cost_s,
                       base.rows["index order"].cost_s, found.search.history,
                       found.search.best_structured, base.rows, base.how, base.random_scored)


@dataclass
class Baselines:
    """The baseline plans of one shape, scored by the plan's objective."""

    rows: dict[str, CostBreakdown]
    """Cost with its parts, by row label: hand-structured (regions), best of N random, index
    order."""
    plans: dict[str, np.ndarray]
    """The (R, S) plans, by the same labels."""
    how: str
    """How the hand-structured plan was built."""
    random_scored: int
    """Random plans scored (fewer than asked when the deadline ended it)."""


def score_baselines(cluster: Cluster, objective: Objective, dtfm: DtfmObjective,
                    req: PlanRequest, name: str, deadline: float = math.inf,
                    cache: PairCache | None = None) -> Baselines:
    """The baselines scored by `objective` (called `name`): the best hand-structured plan, the
    best of req.random_samples random plans, index order. The structured plans get half the
    time left before `deadline`, the random ones the rest (`cache`: the search's matchings,
    reused)."""
    devices = np.arange(cluster.num_devices)
    index_plan = index_order_plan(devices, req.num_stages, req.num_replicas)
    now = time.perf_counter()
    how, hand_plan, _ = hand_structured(objective, cluster.regions(), dtfm.act, devices,
                                        req.num_stages, req.num_replicas,
                                        now + max(deadline - now, 0.0) / 2, cache)
    random_plan, _, scored = best_of_random(objective, devices, req.num_stages,
                                            req.num_replicas, req.random_samples,
                                            seed=req.search.seed, deadline=deadline)

    def score(p: np.ndarray) -> CostBreakdown:
        if p.ndim != 2:  # no baseline plan of this kind could be scored (none fits)
            return CostBreakdown(name, float("inf"))
        return objective.breakdown(p)

    plans = {"hand-structured (regions)": hand_plan, f"best of {scored} random": random_plan,
             "index order": index_plan}
    return Baselines({label: score(p) for label, p in plans.items()}, plans, how, scored)
