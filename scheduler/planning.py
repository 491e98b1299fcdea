"""Plan a cluster end to end: build the objective, search, run the baselines, make the Plan.

This is the library behind `scheduler.py plan`; it does no I/O besides the progress callback.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from formats.cluster import Cluster
from formats.errors import UserError
from formats.models import ModelSpec
from formats.plan import Plan, SyncConfig
from scheduler.baselines import (
    best_of_random,
    hand_structured,
    index_order_plan,
    structured_plans,
)
from scheduler.cost_dtfm import DTFM_TOKENS_PER_REPLICA, DtfmObjective
from scheduler.objective import CostBreakdown, Objective
from scheduler.search import (
    SearchConfig,
    SearchResult,
    evolutionary_search,
)
from scheduler.simulator import SimConfig, simulate_plan

ObjectiveFactory = Callable[["PlanRequest"], Objective]


@dataclass
class PlanRequest:
    """Everything `plan` needs besides the cluster and the model."""

    num_stages: int
    num_replicas: int
    micro_batch_size: int = 1
    num_micro_batches: int = 0
    """0 = derive from `tokens_per_replica` (the DT-FM budget: 61 micro-batches for gpt3-xl)."""
    objective: str = "dtfm"
    sync: SyncConfig = field(default_factory=SyncConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    random_samples: int = 1000
    tokens_per_replica: float = DTFM_TOKENS_PER_REPLICA
    """Tokens each replica processes per step, used when num_micro_batches is 0."""
    sim: SimConfig = field(default_factory=SimConfig)
    """Performance model of the simulated objective (MFU, activation bytes, recompute)."""


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


def default_micro_batches(model: ModelSpec, micro_batch_size: int,
                          tokens_per_replica: float = DTFM_TOKENS_PER_REPLICA) -> int:
    """Micro-batches per replica that carry `tokens_per_replica` tokens per step: the DT-FM
    budget of 1.25e5 tokens gives 61 sequences of 2048 for gpt3-xl (at least 1)."""
    return max(1, int(tokens_per_replica // (model.seq_len * micro_batch_size)))


def make_dtfm(cluster: Cluster, model: ModelSpec, req: PlanRequest) -> DtfmObjective:
    """The DT-FM objective for this request's shape and batch."""
    sequences = req.num_micro_batches * req.micro_batch_size
    return DtfmObjective(cluster, model, req.num_stages, req.num_replicas, sequences)


def make_simulated(cluster: Cluster, model: ModelSpec, req: PlanRequest) -> Objective:
    """The simulator's predicted step time (compute, memory, bubbles, sync) for this request."""
    from scheduler.cost_simulated import make_simulated as factory  # it imports PlanRequest

    return factory(cluster, model, req)


OBJECTIVES: dict[str, Callable[[Cluster, ModelSpec, PlanRequest], Objective]] = {
    "dtfm": make_dtfm,
    "simulated": make_simulated,
}
"""Objective factories by name; a new objective registers here and the CLI offers it."""
DEFAULT_OBJECTIVE = "simulated"
"""What `plan` and `evaluate` use without --objective."""
DEFAULT_BUDGETS = {"dtfm": 20_000, "simulated": 8_000}
"""Evaluations per search without --budget: what one core does in 5-12 s for 64 devices (dtfm
~0.25 ms, simulated ~1.5 ms each), so that the budget, not the clock, ends a default run and
the plan is reproducible from its seed (simulated: 3,000 lost 1.19x on `universities`)."""


def check_shape(cluster: Cluster, model: ModelSpec, req: PlanRequest) -> None:
    """UserError unless S x R uses every device and S fits the model's layers."""
    s, r, n = req.num_stages, req.num_replicas, cluster.num_devices
    if s < 1 or r < 1:
        raise UserError(f"--stages and --replicas must be >= 1, got {s} and {r}")
    if req.micro_batch_size < 1 or req.num_micro_batches < 1:
        raise UserError(f"--micro-batch-size ({req.micro_batch_size}) and the micro-batch "
                        f"count ({req.num_micro_batches}) must be >= 1")
    if s * r != n:
        raise UserError(f"--stages {s} x --replicas {r} = {s * r} devices, but cluster "
                        f"'{cluster.name}' has {n}; choose S x R = {n}")
    if s > model.num_layers:
        raise UserError(f"--stages {s}: {model.name} has only {model.num_layers} layers")
    if req.objective not in OBJECTIVES:
        raise UserError(f"--objective: unknown {req.objective!r}; known: {', '.join(OBJECTIVES)}")


def search_plan(cluster: Cluster, objective: Objective, dtfm: DtfmObjective, num_stages: int,
                num_replicas: int, config: SearchConfig,
                progress: Callable[[int, float], None] | None = None) -> SearchResult:
    """Our search over all devices of the cluster, minimising `objective`: DT-FM's link times
    drive the matching and the clustering of the seeds, and the plans built from the cluster's
    regions (baselines.structured_plans) join the starting population."""
    devices = np.arange(cluster.num_devices)
    seeds = structured_plans(cluster.regions(), dtfm.t_act, devices, num_stages, num_replicas)
    return evolutionary_search(objective, dtfm.t_act, devices, num_stages, num_replicas, config,
                               [dtfm.t_grad], progress, seeds)


def candidate_shapes(cluster: Cluster, model: ModelSpec, req: PlanRequest
                     ) -> list[tuple[int, int]]:
    """(S, R) shapes to try: the given one, or every factorisation of the device count that
    the model's layers allow when --stages/--replicas are left out (0)."""
    from scheduler.layer_split import stage_replica_shapes

    n = cluster.num_devices
    s, r = req.num_stages, req.num_replicas
    if s and r:
        return [(s, r)]
    if s or r:
        given = s or r
        if n % given:
            raise UserError(f"{'--stages' if s else '--replicas'} {given} does not divide the "
                            f"{n} devices of cluster '{cluster.name}'")
        return [(s, n // s)] if s else [(n // r, r)]
    shapes = stage_replica_shapes(n, model.num_layers)
    if not shapes:
        raise UserError(f"no S x R = {n} with S <= {model.num_layers} layers of {model.name}")
    return shapes


def plan_best_shape(cluster: Cluster, model: ModelSpec, req: PlanRequest,
                    progress: Callable[[int, float], None] | None = None) -> PlanOutcome:
    """plan_cluster for each candidate shape (the time limit shared among them); the cheapest."""
    shapes = candidate_shapes(cluster, model, req)
    best: PlanOutcome | None = None
    failures: list[str] = []
    stops: set[str] = set()
    searched_s = 0.0  # the time limit is for searching; baselines are scored outside it
    for k, (s, r) in enumerate(shapes):
        # each shape gets an equal share of the time left (a shape that cannot fit quits early)
        share = max(req.search.time_limit_s - searched_s, 0.0) / (len(shapes) - k)
        sub = replace(req, num_stages=s, num_replicas=r,
                      search=replace(req.search, time_limit_s=max(share, 1e-3)))
        try:
            out = plan_cluster(cluster, model, sub, progress)
        except UserError as e:
            if len(shapes) == 1:
                raise
            failures.append(f"{s} x {r}: {e}")
            continue
        searched_s += out.plan.search["wall_s"]
        stops.add(out.plan.search["stopped_by"])
        if best is None or out.ours.cost_s < best.ours.cost_s:
            best = out
    if best is None:
        raise UserError("no shape works:\n  " + "\n  ".join(failures))
    best.plan.search["shapes_tried"] = [list(x) for x in shapes]
    # Reproducible only if no shape's search was cut by the wall limit.
    best.plan.search["stopped_by"] = next(
        (s for s in ("time", "budget") if s in stops), "converged")
    return best



def plan_cluster(cluster: Cluster, model: ModelSpec, req: PlanRequest,
                 progress: Callable[[int, float], None] | None = None) -> PlanOutcome:
    """Search a plan and score the random and index-order baselines with the same objective."""
    if req.micro_batch_size < 1:
        raise UserError(f"--micro-batch-size: must be >= 1, got {req.micro_batch_size}")
    if req.num_micro_batches == 0:
        req.num_micro_batches = default_micro_batches(model, req.micro_batch_size,
                                                      req.tokens_per_replica)
    check_shape(cluster, model, req)
    objective = OBJECTIVES[req.objective](cluster, model, req)
    dtfm = make_dtfm(cluster, model, req)  # its link times drive matching and seeding
    devices = np.arange(cluster.num_devices)
    start = time.perf_counter()
    result = search_plan(cluster, objective, dtfm, req.num_stages, req.num_replicas, req.search,
                         progress)
    wall = time.perf_counter() - start
    polish = getattr(objective, "polish", None)  # the simulated objective refines its split
    ours = polish(result.pipelines) if polish else objective.breakdown(result.pipelines)
    plan = Plan(
        cluster=cluster.name, cluster_sha256=cluster.sha256(), model=model.name,
        stages=list(ours.stages), pipelines=result.pipelines.tolist(),
        micro_batch_size=req.micro_batch_size, num_micro_batches=req.num_micro_batches,
        sync=req.sync,
        predicted={"objective": ours.objective, "cost": round(ours.cost_s, 6),
                   **{k: round(v, 6) for k, v in ours.parts.items()}},
        search={"method": "evolutionary", "seed": req.search.seed,
                "evaluations": result.evaluations, "wall_s": round(wall, 3),
                "stopped_by": result.stopped_by,
                **({"sim_config": asdict(req.sim)} if req.objective == "simulated" else {})},
    )
    if not np.isfinite(ours.cost_s):
        simulate_plan(cluster, model, plan, req.sim, timeline=False)  # names the device
        raise UserError(f"no {req.num_stages} x {req.num_replicas} plan of {model.name} fits "
                        f"the devices of '{cluster.name}'")
    how, hand_plan, _ = hand_structured(objective, cluster.regions(), dtfm.t_act, devices,
                                        req.num_stages, req.num_replicas)
    random_plan, _, _ = best_of_random(objective, devices, req.num_stages, req.num_replicas,
                                       req.random_samples, seed=req.search.seed)
    index_plan = index_order_plan(devices, req.num_stages, req.num_replicas)

    def score(p: np.ndarray) -> CostBreakdown:
        if p.ndim != 2:  # no baseline plan of this kind could be scored (none fits)
            return CostBreakdown(ours.objective, float("inf"))
        return objective.breakdown(p)

    baselines = {
        "hand-structured (regions)": score(hand_plan),
        f"best of {req.random_samples} random": score(random_plan),
        "index order": score(index_plan),
    }
    random_cost = baselines[f"best of {req.random_samples} random"].cost_s
    index_cost = baselines["index order"].cost_s
    return PlanOutcome(plan, ours, random_cost, index_cost, result.history,
                       result.best_structured, baselines, how)
