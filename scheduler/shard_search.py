"""Hierarchical plans: stages held by shard groups (FSDP2) placed inside one site, searched over
S x D x R and compared with the best D = 1 plan by the simulator's time per sequence.

Placement: a site is a region of the cluster file (devices that share fast links: a host or a
data centre). Each site's devices, by id, are cut into shard groups of D (a site's remainder
is left out of that D); replica r takes S consecutive shard groups, so a replica's stages stay
in one site when the site holds S groups and the replicas sync across sites. Where a site's
devices differ in speed or memory, layouts of 2..8 stages with a different D per stage are
scored too (every ascending vector of divisors of L ending in L, and its reverse): the
fastest devices hold the stages of fewer devices (each of them runs L / D of the replica's L
lanes), the slowest the stage of D = L (untied models: tied embeddings need the same D on
both ends). The layer split
balances the stages' compute on the slowest device of each stage (layer_split.split_layers),
memory per device checked (memory.stage_memory with D). Every candidate is replayed by the
simulator (simulator/sharded.py); the cost that ranks plans of different D and R is
step / (R x D): each lane of a replica trains the batch a D = 1 replica does, so that is the
time per sequence up to the same constant as planning.per_replica_cost.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from itertools import combinations_with_replacement

import numpy as np

from formats.cluster import Cluster
from formats.errors import UserError
from formats.models import ModelSpec, model_record
from formats.plan import Plan, SyncConfig
from formats.sync_rules import sync_rule
from scheduler.layer_split import flops_table, split_layers
from scheduler.memory import stage_memory
from scheduler.planning import PlanRequest, default_micro_batches
from scheduler.simulator.config import SimConfig
from scheduler.simulator.step import SimResult, simulate

MAX_MIXED_STAGES = 8
"""The most stages a layout with D per stage is scored with (the D vectors multiply with S)."""


def sites(cluster: Cluster) -> list[list[int]]:
    """Devices that share a site (a region of the cluster file), each ascending, the sites in
    order of their first device: the connected components of the same-region graph."""
    import networkx as nx  # here: its import costs ~0.1 s, and only --max-shard needs it

    graph = nx.Graph()
    graph.add_nodes_from(range(cluster.num_devices))
    by_region: dict[str, list[int]] = {}
    for d, region in enumerate(cluster.regions()):
        by_region.setdefault(region, []).append(d)
    for members in by_region.values():
        nx.add_path(graph, members)
    return sorted((sorted(c) for c in nx.connected_components(graph)), key=lambda c: c[0])


def shard_groups(cluster: Cluster, degree: int) -> list[list[int]]:
    """Shard groups of `degree` devices, each inside one site (a site's remainder unused)."""
    groups = []
    for site in sites(cluster):
        groups += [site[k:k + degree] for k in range(0, len(site) - degree + 1, degree)]
    return groups


@dataclass
class Candidate:
    """One sharded (or D = 1) plan the comparison scored."""

    label: str
    num_stages: int
    shard_degree: int
    num_replicas: int
    step_s: float
    """Simulated step time (inf: does not fit)."""
    plan: Plan | None = None
    result: SimResult | None = None

    @property
    def per_sequence_s(self) -> float:
        """step / (R x D): what ranks plans of different widths."""
        return self.step_s / (self.num_replicas * self.shard_degree)


def memory_table(model: ModelSpec, req: PlanRequest, degree: int, diloco: bool,
                 lanes: int = 1) -> np.ndarray:
    """(L+1, L+1) bytes a device of a D-way shard group needs for a stage [a, b) (inf: b <= a),
    running `lanes` lanes' micro-batches (L / D with per-stage D)."""
    n = model.num_layers
    table = np.full((n + 1, n + 1), np.inf)
    for a in range(n):
        for b in range(a + 1, n + 1):
            table[a, b] = stage_memory(model, a, b, req.micro_batch_size,
                                       req.num_micro_batches * lanes, diloco, req.sim.memory(),
                                       degree, req.reshard_after_forward,
                                       req.outer_state).total_bytes
    return table


def layer_split(cluster: Cluster, model: ModelSpec, pipelines: list[list[list[int]]],
                need: np.ndarray | list[np.ndarray]) -> list[tuple[int, int]]:
    """Stages balancing compute on each stage's slowest device (x the lanes it runs, L / D),
    each stage's bytes per device (`need`: memory_table, or one per stage) within its smallest
    device ([] when nothing fits)."""
    s_count = len(pipelines[0])
    if s_count > model.num_layers:
        return []
    flops = flops_table(model)
    cost = np.empty((s_count, *flops.shape))
    lanes = max(len(g) for g in pipelines[0])
    for s in range(s_count):
        devs = [cluster.devices[d] for chain in pipelines for d in chain[s]]
        speed, memory = min(d.tflops for d in devs), min(d.memory_gb for d in devs) * 1e9
        table = need[s] if isinstance(need, list) else need
        work = lanes // len(pipelines[0][s])
        cost[s] = np.where(table <= memory, flops * work / speed, np.inf)
    stages, worst = split_layers(cost)
    return stages if np.isfinite(worst) else []


def sharded_candidates(cluster: Cluster, model: ModelSpec, req: PlanRequest,
                       syncs: tuple[SyncConfig, ...], deadline: float) -> list[Candidate]:
    """Every D in 2..req.max_shard, every S up to the shard groups, under each sync: scored
    until `deadline` (a time.perf_counter() value; at least one layout is scored)."""
    out: list[Candidate] = []
    digest = cluster.sha256()
    for degree in range(2, min(req.max_shard, model.shard_limit()) + 1):
        groups = shard_groups(cluster, degree)
        tables = {mode: memory_table(model, req, degree, sync_rule(mode).local_steps)
                  for mode in {sync.mode for sync in syncs}} if groups else {}
        for s_count in range(1, min(len(groups), model.num_layers) + 1):
            r_count = len(groups) // s_count
            pipes = [groups[r * s_count:(r + 1) * s_count] for r in range(r_count)]
            for sync in syncs:
                if out and time.perf_counter() > deadline:
                    return out
                if not sync.rule.local_steps or r_count > 1:
                    out.append(_score(cluster, model, req, pipes, sync, tables[sync.mode],
                                      digest))
    return out + mixed_candidates(cluster, model, req, syncs, deadline, bool(out))


def degree_vectors(lanes: int, s_count: int) -> list[tuple[int, ...]]:
    """D per stage for `s_count` stages, ascending: each divides `lanes`, the last is `lanes`,
    not all equal (those are the uniform layouts)."""
    divisors = [d for d in range(1, lanes + 1) if lanes % d == 0]
    return [(*head, lanes) for head in combinations_with_replacement(divisors, s_count - 1)
            if head and min(head) < lanes]


def _differing_sites(cluster: Cluster) -> list[list[int]]:
    """Sites whose devices differ in speed or memory, each fastest (then largest) first."""
    out = []
    for site in sites(cluster):
        devs = [cluster.devices[d] for d in site]
        if len({(d.tflops, d.memory_gb) for d in devs}) < 2:
            continue  # devices alike: the same D everywhere balances better
        out.append(sorted(site, key=lambda d: (-cluster.devices[d].tflops,
                                               -cluster.devices[d].memory_gb, d)))
    return out


def _carve(ranked: list[int], degrees: tuple[int, ...]) -> list[list[list[int]]]:
    """A site's replicas for ascending `degrees`: the stage of fewest devices gets the site's
    fastest devices (each runs L / D lanes), the next stage the next fastest, and so on."""
    count = len(ranked) // sum(degrees)
    pos, by_stage = 0, []
    for d in degrees:
        by_stage.append(ranked[pos:pos + count * d])
        pos += count * d
    return [[sorted(by_stage[s][r * d:(r + 1) * d]) for s, d in enumerate(degrees)]
            for r in range(count)]


def mixed_layouts(cluster: Cluster, lanes: int,
                  max_stages: int = 2) -> list[tuple[tuple[int, ...], list]]:
    """Layouts with a different D per stage (2..max_stages stages), where a site's devices
    differ in speed or memory: for every ascending D vector (degree_vectors) each site is cut
    into replicas by _carve; (degrees, pipelines) for the vector and for its reverse (the
    stage of D = L first)."""
    out = []
    ranked_sites = _differing_sites(cluster)
    for s_count in range(2, max_stages + 1):
        for degrees in degree_vectors(lanes, s_count):
            chains = [c for ranked in ranked_sites for c in _carve(ranked, degrees)]
            if chains:
                out.append((degrees, chains))
                out.append((degrees[::-1], [chain[::-1] for chain in chains]))
    return out


def _most_stages(cluster: Cluster, model: ModelSpec, lanes: int) -> int:
    """The most stages a mixed layout of L = `lanes` can have: one layer each, one device on
    every stage but the last (L devices), within the largest site, at most MAX_MIXED_STAGES."""
    biggest = max((len(s) for s in sites(cluster)), default=0)
    return min(model.num_layers, biggest - lanes + 1, MAX_MIXED_STAGES)


def mixed_candidates(cluster: Cluster, model: ModelSpec, req: PlanRequest,
                     syncs: tuple[SyncConfig, ...], deadline: float,
                     scored: bool) -> list[Candidate]:
    """D per stage (mixed_layouts, up to _most_stages stages) for every L in
    2..req.max_shard, under each sync, until
    `deadline` (`scored`: a layout was scored already)."""
    out: list[Candidate] = []
    if model.tie_embeddings or model.num_layers < 2:
        return out  # tied embeddings need the same D on the first and the last stage
    digest = cluster.sha256()
    for lanes in range(2, min(req.max_shard, model.shard_limit()) + 1):
        tables: dict[tuple[str, int], np.ndarray] = {}  # per (sync mode, D): stages share them
        for degrees, pipes in mixed_layouts(cluster, lanes, _most_stages(cluster, model, lanes)):
            for mode, d in {(sync.mode, d) for sync in syncs for d in degrees} - tables.keys():
                tables[mode, d] = memory_table(model, req, d, sync_rule(mode).local_steps,
                                                lanes // d)
            need = {sync.mode: [tables[sync.mode, d] for d in degrees] for sync in syncs}
            for sync in syncs:
                if (out or scored) and time.perf_counter() > deadline:
                    return out
                if not sync.rule.local_steps or len(pipes) > 1:
                    out.append(_score(cluster, model, req, pipes, sync, need[sync.mode], digest))
    return out


def _score(cluster: Cluster, model: ModelSpec, req: PlanRequest, pipes: list[list[list[int]]],
           sync: SyncConfig, need: np.ndarray | list[np.ndarray], digest: str) -> Candidate:
    """Simulate one layout under one sync (inf when it does not fit)."""
    s_count, r_count = len(pipes[0]), len(pipes)
    degrees = [len(g) for g in pipes[0]]
    degree = max(degrees)  # L: the lanes a replica runs
    way = f"{degree}-way" if len(set(degrees)) == 1 else \
        "(" + ", ".join(str(d) for d in degrees) + ")-way"
    label = f"{s_count} x {way} x {r_count}, {sync.mode}"
    stages = layer_split(cluster, model, pipes, need)
    if not stages:
        return Candidate(label, s_count, degree, r_count, float("inf"))
    try:
        result = simulate(cluster, model, stages, pipes, sync, req.micro_batch_size,
                          req.num_micro_batches, req.sim, False,
                          req.pipeline_compression, req.reshard_after_forward, req.outer_state)
    except UserError:  # a device over its memory (the split's check is per stage's least)
        return Candidate(label, s_count, degree, r_count, float("inf"))
    plan = Plan(cluster.name, digest, model.name, stages, pipes,  # type: ignore[arg-type]
                req.micro_batch_size, req.num_micro_batches, sync, req.pipeline_compression,
                reshard_after_forward=req.reshard_after_forward, outer_state=req.outer_state,
                model_config=model_record(model))
    return Candidate(label, s_count, degree, r_count, result.step_s, plan, result)


def flat_candidate(cluster: Cluster, model: ModelSpec, plan: Plan, sim: SimConfig) -> Candidate:
    """The D = 1 plan the ordinary planner found, replayed by the same simulator."""
    result = simulate(cluster, model, plan.stages, plan.pipelines, plan.sync,
                      plan.micro_batch_size, plan.num_micro_batches, sim,
                      False, plan.pipeline_compression)
    label = f"{plan.num_stages} x 1-way x {plan.num_replicas}, {plan.sync.mode} (D = 1 search)"
    return Candidate(label, plan.num_stages, 1, plan.num_replicas, result.step_s, plan, result)


def choose(flat: Candidate | None, sharded: list[Candidate], seed: int,
           started: float) -> tuple[Candidate, list[Candidate]]:
    """The candidate with the least time per sequence (the D = 1 plan on ties), its plan's
    predicted and search blocks filled; UserError when none fits."""
    every = ([flat] if flat else []) + sorted(sharded, key=lambda c: c.per_sequence_s)
    best = min(every, key=lambda c: c.per_sequence_s, default=None)
    if best is None or not np.isfinite(best.per_sequence_s) or best.plan is None:
        raise UserError("no plan fits: neither a D = 1 plan nor a sharded one (raise "
                        "--max-shard, use fewer or smaller micro-batches, or bigger devices)")
    if best.shard_degree > 1 and best.result is not None:
        res = best.result
        plan = replace(best.plan, predicted={
            "objective": "simulated", "cost": round(res.step_s, 6),
            **{k: round(v, 6) for k, v in res.parts().items()},
            "per_sequence_s": round(best.per_sequence_s, 9),
            "fsdp_comm_s": round(res.fsdp_comm_s, 6),
            "fsdp_bytes_per_step": res.fsdp_bytes_per_step,
            "dp_bytes_per_step": res.dp_bytes_per_step},
            search={"method": "shard-layout", "seed": seed, "evaluations": len(every),
                    "wall_s": round(time.perf_counter() - started, 3),
                    "stopped_by": "converged", "shard_degree": best.shard_degree})
        best = replace(best, plan=plan)
    return best, every


def plan_hierarchical(cluster: Cluster, model: ModelSpec, req: PlanRequest,
                      syncs: tuple[SyncConfig, ...], flat: Plan | None,
                      started: float) -> tuple[Candidate, list[Candidate]]:
    """The best of the D = 1 plan `flat` (None: none found or none fits) and every sharded
    layout with D <= req.max_shard under each of `syncs`, by time per sequence. The layouts
    are scored until req.search.time_limit_s after `started` (at least one)."""
    if req.num_micro_batches == 0:
        req = replace(req, num_micro_batches=default_micro_batches(
            model, req.micro_batch_size, req.tokens_per_replica))
    base = flat_candidate(cluster, model, flat, req.sim) if flat is not None else None
    deadline = started + req.search.time_limit_s
    best, every = choose(base, sharded_candidates(cluster, model, req, syncs, deadline),
                         req.search.seed, started)
    if best.shard_degree > 1 and best.plan is not None:
        best.plan.search["sim_config"] = asdict(req.sim)
    return best, every
