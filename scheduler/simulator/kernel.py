"""The one cost kernel: a plan's per-device and per-link seconds, the ring all-reduce, the step
breakdown. `simulate()` and the planner's `simulated` objective both go through it.

Units: seconds, bytes, bits per second, FLOP/s. A candidate is an (R, S) array of device ids
(R replicas, S stages). Its per-link arrays (PlanLinks) do not depend on the layer split; the
step's inputs (StepInputs) add the split's compute and all-reduce payloads; a replay (replay.py,
events.py) turns them into StepTimes; step_breakdown() says where the step went.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from formats.cluster import Cluster
from formats.models import ModelSpec
from formats.plan import SyncConfig
from scheduler.simulator.config import SimConfig

RING_CACHE_LIMIT = 200_000
"""Stage groups whose ring a RingTable remembers before it starts over."""
RING_STARTS = 64
"""Greedy rings tried per stage group: one from every device up to this many devices; beyond,
fewer (RING_STARTS^2 / n), so that a big group's ring costs about what a 64-device one does
(a 2,000-device group: 0.1 s instead of 15 s)."""
RING_MIN_STARTS = 8
"""The fewest greedy rings tried in a big group."""


class LinkTables:
    """Per-cluster arrays the simulator gathers from: latency (s), bandwidth (bit/s), speeds."""

    def __init__(self, cluster: Cluster, config: SimConfig) -> None:
        self.lat_s = np.array(cluster.latency_ms, dtype=float) / 1e3
        self.bits_per_s = np.array(cluster.bandwidth_gbps, dtype=float) * 1e9
        np.fill_diagonal(self.bits_per_s, np.inf)
        np.fill_diagonal(self.lat_s, 0.0)
        self.sec_per_bit = 1.0 / self.bits_per_s
        """Seconds a link is busy per bit (0 from a device to itself)."""
        self.collective_lat_s = self.lat_s * config.collective_latency_factor
        """Latency each all-reduce step pays on a link (gloo's rendezvous: 2 latencies)."""
        self.flops_per_s = np.array([d.tflops for d in cluster.devices]) * 1e12 * config.mfu
        self.memory_bytes = np.array([d.memory_gb for d in cluster.devices]) * 1e9


# --------------------------------------------------------------------------- collectives


def payload_bytes_per_param(compression: str, int8_block: int = 256) -> float:
    """Bytes per parameter of the data-parallel all-reduce payload."""
    return {"none": 4.0, "fp16": 2.0, "int8": 1.0 + 4.0 / int8_block}[compression]


def ring_step_s(payload_bytes: np.ndarray | float, n: int,
                sec_per_bit: np.ndarray) -> np.ndarray:
    """Seconds a ring link of an n-device all-reduce is busy per step: B/n bytes on the wire."""
    return payload_bytes / n * 8.0 * sec_per_bit


def ring_allreduce_s(step_s: np.ndarray, step_lat_s: np.ndarray, axis: int = -1) -> np.ndarray:
    """Seconds of ring all-reduces whose links (along `axis`, n of them) are busy `step_s` and
    pay `step_lat_s` per step: 2(n-1) steps, each as long as its slowest link,
    = 2(n-1) x max_i(lat_i + B/n * 8 / bw_i). The one formula of every all-reduce here (stage
    groups' rings, the tied-embedding sum of 2 ranks)."""
    step_s, step_lat_s = np.asarray(step_s), np.asarray(step_lat_s)
    n = step_s.shape[axis]
    if n <= 1:  # nothing to exchange
        return np.zeros_like(step_s).sum(axis=axis)
    return 2.0 * (n - 1) * (step_s + step_lat_s).max(axis=axis)


def ring_allreduce_time(lat_s: np.ndarray, bits_per_s: np.ndarray, payload_bytes: float) -> float:
    """Seconds of one ring all-reduce of `payload_bytes` over ring links with these latencies and
    bandwidths (link i: ring[i] -> ring[i+1])."""
    lat_s = np.asarray(lat_s, dtype=float)
    step = ring_step_s(payload_bytes, len(lat_s), 1.0 / np.asarray(bits_per_s, dtype=float))
    return float(ring_allreduce_s(step, lat_s))


def ring_order(group: np.ndarray, lat_s: np.ndarray, bits_per_s: np.ndarray,
               chunk_bytes: float) -> np.ndarray:
    """A ring through `group` with a small bottleneck step time (lat + chunk*8/bw): greedy
    nearest neighbour from every start at once (in groups of more than RING_STARTS devices,
    from RING_STARTS^2 / n evenly spaced starts, at least RING_MIN_STARTS), the ring with the
    smallest bottleneck kept (first start on ties). O(n^3) numpy work for n <= RING_STARTS
    devices, O(RING_STARTS^2 n) beyond."""
    group = np.asarray(group, dtype=np.int64)
    n = len(group)
    if n <= 2:
        return group.copy()
    w = lat_s[np.ix_(group, group)] + chunk_bytes * 8.0 / bits_per_s[np.ix_(group, group)]
    np.fill_diagonal(w, np.inf)
    k = min(n, max(RING_MIN_STARTS, RING_STARTS * RING_STARTS // n))
    starts = np.unique(np.linspace(0, n - 1, k).astype(np.int64)) if k < n else np.arange(n)
    rows = np.arange(len(starts))
    order = np.empty((len(starts), n), dtype=np.int64)
    order[:, 0] = starts
    used = np.zeros((len(starts), n), dtype=bool)  # row k: devices already on ring k
    used[rows, starts] = True
    worst = np.zeros(len(starts))
    for step in range(1, n):
        row = np.where(used, np.inf, w[order[:, step - 1]])
        nxt = row.argmin(axis=1)
        worst = np.maximum(worst, row[rows, nxt])
        used[rows, nxt] = True
        order[:, step] = nxt
    worst = np.maximum(worst, w[order[:, -1], order[:, 0]])
    return group[order[int(np.argmin(worst))]]


def ring_chunk_bytes(model: ModelSpec, num_stages: int, num_replicas: int, compression: str,
                     int8_block: int = 256) -> float:
    """Chunk size the ring order is chosen for: an even stage's payload / R (any split)."""
    per_param = payload_bytes_per_param(compression, int8_block)
    return model.total_params() * per_param / num_stages / max(1, num_replicas)


class Ring(NamedTuple):
    """A stage group's ring and the links it uses (link i: order[i] -> order[i+1])."""

    order: np.ndarray
    lat_s: np.ndarray
    """Latency per all-reduce step of each link (collective latency factor applied)."""
    sec_per_bit: np.ndarray


class RingTable:
    """Rings of stage groups, chosen once per group (the search revisits groups often)."""

    def __init__(self, tables: LinkTables, model: ModelSpec, compression: str,
                 config: SimConfig) -> None:
        self.tables, self.model, self.compression, self.config = tables, model, compression, config
        self._rings: dict[tuple[int, ...], Ring] = {}

    def ring(self, group: np.ndarray, num_stages: int) -> Ring:
        """The ring of `group` (any order) in a plan of `num_stages` stages."""
        members = sorted(int(d) for d in group)
        key = (num_stages, *members)
        hit = self._rings.get(key)
        if hit is None:
            if len(self._rings) > RING_CACHE_LIMIT:
                self._rings.clear()
            t = self.tables
            chunk = ring_chunk_bytes(self.model, num_stages, len(members), self.compression,
                                     self.config.int8_block)
            order = ring_order(np.array(members), t.lat_s, t.bits_per_s, chunk)
            nxt = np.roll(order, -1)
            hit = Ring(order, t.collective_lat_s[order, nxt], t.sec_per_bit[order, nxt])
            self._rings[key] = hit
        return hit


def tied_links(pipelines: np.ndarray, lat_s: np.ndarray, bits_per_s: np.ndarray,
               model: ModelSpec) -> tuple[np.ndarray, np.ndarray] | None:
    """(busy seconds, latency), each (R, 2), of one step of each replica's tied-embedding sum on
    the links first -> last stage and back (None: embeddings not tied or one stage)."""
    if not model.tie_embeddings or pipelines.shape[1] < 2:
        return None
    a, b = pipelines[:, 0], pipelines[:, -1]
    # A 2-rank all-reduce of the fp32 gradient: each step moves half of it. Divided by the
    # bandwidth, as the planner always has, so that its costs (and so its choices between
    # near-equal plans) stay the same to the last bit.
    half_bits = model.vocab_size * model.d_model * 4 / 2 * 8.0
    return (half_bits / np.stack([bits_per_s[a, b], bits_per_s[b, a]], axis=1),
            np.stack([lat_s[a, b], lat_s[b, a]], axis=1))


def outer_agreement_time(pipelines: np.ndarray, lat_s: np.ndarray, sync: SyncConfig,
                         config: SimConfig) -> float:
    """Seconds of a DiLoCo outer step's store round trips (0 with allreduce or one replica)."""
    if sync.mode != "diloco" or pipelines.shape[0] < 2 or not config.outer_store_round_trips:
        return 0.0
    rtt = lat_s[pipelines.ravel(), 0] + lat_s[0, pipelines.ravel()]
    return config.outer_store_round_trips * float(rtt.max())


# --------------------------------------------------------------------------- per-link arrays


@dataclass
class PlanLinks:
    """A candidate's per-device and per-link arrays; they do not depend on the layer split."""

    pipelines: np.ndarray
    """(R, S) device ids."""
    flops_per_s: np.ndarray
    """(R, S) effective speed of each device (tflops x mfu)."""
    fwd_tx: np.ndarray
    """(R, S-1) seconds link pipelines[r,s] -> pipelines[r,s+1] is busy per activation message."""
    fwd_lat: np.ndarray
    """(R, S-1) latency of that link."""
    bwd_tx: np.ndarray
    """(R, S-1) busy seconds of link pipelines[r,s+1] -> pipelines[r,s] per gradient message."""
    bwd_lat: np.ndarray
    """(R, S-1) latency of that link."""
    rings: np.ndarray
    """(S, R) each stage group's devices in ring order."""
    ring_lat: np.ndarray
    """(S, R) latency per all-reduce step of ring link i (rings[s,i] -> rings[s,i+1])."""
    ring_sec_per_bit: np.ndarray
    """(S, R) seconds per bit of that link."""
    memory_bytes: np.ndarray
    """(S,) smallest memory of each stage group."""
    tied_tx: np.ndarray | None
    """(R, 2) busy seconds per tied-embedding sum step, first -> last stage and back."""
    tied_lat: np.ndarray | None
    """(R, 2) latency of those two links."""
    agree_s: float
    """DiLoCo: seconds each outer step spends agreeing on membership through the store."""


def plan_links(tables: LinkTables, model: ModelSpec, pipelines: np.ndarray, sync: SyncConfig,
               micro_batch_size: int, config: SimConfig, rings: RingTable) -> PlanLinks:
    """The per-link arrays of candidate `pipelines` (rings from `rings`, cached there)."""
    pipe = np.asarray(pipelines, dtype=np.int64)
    msg_bits = model.activation_bytes_per_sequence(config.activation_bytes) * micro_batch_size * 8.0
    src, dst = pipe[:, :-1], pipe[:, 1:]
    per_stage = [rings.ring(pipe[:, s], pipe.shape[1]) for s in range(pipe.shape[1])]
    tied = tied_links(pipe, tables.collective_lat_s, tables.bits_per_s, model)
    return PlanLinks(
        pipe, tables.flops_per_s[pipe],
        msg_bits / tables.bits_per_s[src, dst], tables.lat_s[src, dst],
        msg_bits / tables.bits_per_s[dst, src], tables.lat_s[dst, src],
        np.array([r.order for r in per_stage]), np.array([r.lat_s for r in per_stage]),
        np.array([r.sec_per_bit for r in per_stage]), tables.memory_bytes[pipe].min(axis=0),
        *(tied or (None, None)), outer_agreement_time(pipe, tables.lat_s, sync, config))


# --------------------------------------------------------------------------- one step


@dataclass
class StepInputs:
    """Everything a step replay needs, already in seconds. R replicas, S stages, m micro-batches."""

    pipelines: np.ndarray
    """(R, S) device ids."""
    t_fwd: np.ndarray
    """(R, S) forward seconds per micro-batch on each device."""
    t_bwd: np.ndarray
    """(R, S) backward seconds per micro-batch."""
    fwd_tx: np.ndarray
    """(R, S-1) seconds link pipelines[r,s] -> pipelines[r,s+1] is busy per activation message."""
    fwd_lat: np.ndarray
    """(R, S-1) latency of that link."""
    bwd_tx: np.ndarray
    """(R, S-1) busy seconds of link pipelines[r,s+1] -> pipelines[r,s] per gradient message."""
    bwd_lat: np.ndarray
    """(R, S-1) latency of that link."""
    rings: Sequence[np.ndarray]
    """Per stage, its group's devices in ring order."""
    ring_tx: Sequence[np.ndarray]
    """Per stage, (R,) busy seconds of ring link i (ring[i] -> ring[i+1]) per all-reduce step."""
    ring_lat: Sequence[np.ndarray]
    """Per stage, (R,) latency of ring link i."""
    num_micro_batches: int
    inner_steps: int = 1
    """Steps per data-parallel sync: 1 for allreduce, H for diloco."""
    tied_tx: np.ndarray | None = None
    """(R, 2) busy seconds of links pipelines[r,0] -> pipelines[r,-1] and back per step of the
    tied-embedding gradient sum (None: embeddings not tied)."""
    tied_lat: np.ndarray | None = None
    """(R, 2) latency of those two links."""
    agree_s: float = 0.0
    """DiLoCo: seconds each outer step spends agreeing on membership through the store."""

    @property
    def tied_s(self) -> np.ndarray | None:
        """(R,) seconds of each replica's tied-embedding gradient sum (None: not tied)."""
        if self.tied_tx is None or self.tied_lat is None:
            return None
        return ring_allreduce_s(self.tied_tx, self.tied_lat, axis=1)

    def dp_times(self) -> np.ndarray:
        """(S,) seconds of each stage group's all-reduce."""
        return ring_allreduce_s(np.asarray(self.ring_tx), np.asarray(self.ring_lat))


def step_inputs(links: PlanLinks, stage_flops: np.ndarray, stage_payload_bytes: np.ndarray,
                config: SimConfig, num_micro_batches: int, inner_steps: int) -> StepInputs:
    """The step of `links` with a layer split: forward FLOPs per micro-batch (S,) and all-reduce
    payload bytes (S,) of each stage."""
    t_fwd = stage_flops[None, :] / links.flops_per_s
    ring_tx = ring_step_s(stage_payload_bytes[:, None], links.pipelines.shape[0],
                          links.ring_sec_per_bit)
    return StepInputs(links.pipelines, t_fwd, t_fwd * config.backward_factor, links.fwd_tx,
                      links.fwd_lat, links.bwd_tx, links.bwd_lat, links.rings, ring_tx,
                      links.ring_lat, num_micro_batches, inner_steps, links.tied_tx,
                      links.tied_lat, links.agree_s)


def build_inputs(tables: LinkTables, model: ModelSpec, stages: list[tuple[int, int]],
                 pipelines: np.ndarray, sync: SyncConfig, micro_batch_size: int,
                 num_micro_batches: int, config: SimConfig) -> StepInputs:
    """Turn a plan into per-device and per-link seconds (its rings chosen here)."""
    links = plan_links(tables, model, pipelines, sync, micro_batch_size, config,
                       RingTable(tables, model, sync.compression, config))
    tokens = micro_batch_size * model.seq_len
    flops = np.array([model.stage_flops_per_token(a, b) for a, b in stages]) * tokens
    per_param = payload_bytes_per_param(sync.compression, config.int8_block)
    payload = np.array([model.stage_params(a, b) * per_param for a, b in stages])
    return step_inputs(links, flops, payload, config, num_micro_batches,
                       sync.inner_steps if sync.mode == "diloco" else 1)


def no_transfers(inputs: StepInputs) -> StepInputs:
    """The same step with free pipeline transfers and tied sums (to measure what they expose)."""
    zero = np.zeros_like(inputs.fwd_tx)
    return StepInputs(inputs.pipelines, inputs.t_fwd, inputs.t_bwd, zero, zero, zero, zero,
                      inputs.rings, inputs.ring_tx, inputs.ring_lat, inputs.num_micro_batches,
                      inputs.inner_steps, None, None, inputs.agree_s)


@dataclass
class StepTimes:
    """Step time of a replay and where it went."""

    makespan_s: float
    """End of the last backward anywhere, tied-embedding sums included."""
    pipeline_s: float
    """End of the last backward anywhere, pipeline only."""
    dp_start_s: np.ndarray
    """(S,) when each stage group's all-reduce can start."""
    dp_time_s: np.ndarray
    """(S,) duration of each group's all-reduce (per outer round with diloco)."""
    dp_exposed_round_s: float
    """Time the sync adds after the makespan, per sync (= per outer round with diloco)."""
    step_s: float
    """makespan + dp_exposed_round / inner_steps."""


def step_times(b_done: np.ndarray, dp_time: np.ndarray, inner_steps: int,
               tied_s: np.ndarray | None = None, agree_s: float = 0.0) -> StepTimes:
    """Combine the pipeline's per-device end times with the tied-embedding sums, the stage
    groups' all-reduces and (DiLoCo) the outer step's membership agreement `agree_s`."""
    pipeline = float(b_done.max())
    if tied_s is not None and b_done.shape[1] > 1:
        b_done = b_done.copy()
        b_done[:, 0] = b_done[:, -1] = np.maximum(b_done[:, 0], b_done[:, -1]) + tied_s
    makespan = float(b_done.max())
    dp_start = b_done.max(axis=0)
    dp_end = float((dp_start + dp_time).max()) if len(dp_time) else makespan
    exposed = max(0.0, dp_end - makespan) + agree_s
    return StepTimes(makespan, pipeline, dp_start, dp_time, exposed,
                     makespan + exposed / inner_steps)


# --------------------------------------------------------------------------- breakdown


@dataclass
class StepBreakdown:
    """Where one step's time went; compute + bubble + pp_comm + tied_comm + dp_comm = step."""

    step_s: float
    makespan_s: float
    """End of the last backward anywhere, tied-embedding sums included."""
    compute_s: float
    """Forward + backward compute of the busiest device."""
    bubble_s: float
    """Pipeline idle time on the critical path with free transfers: makespan(no comm) - compute."""
    pp_comm_s: float
    """What pipeline transfers add: pipeline makespan - makespan(no comm)."""
    tied_comm_s: float
    """What the tied-embedding gradient sums add after the pipeline."""
    dp_comm_s: float
    """Exposed data-parallel sync per step (amortised over H with diloco)."""
    dp_comm_round_s: float
    """Exposed data-parallel sync per sync (per outer round with diloco)."""
    dp_allreduce_s: list[float]
    """Duration of each stage group's all-reduce."""
    tokens_per_step: int
    tokens_per_s: float


def step_breakdown(inputs: StepInputs, times: StepTimes, free_makespan_s: float,
                   tokens_per_step: int) -> StepBreakdown:
    """The breakdown of a replayed step; `free_makespan_s` is the makespan of the same step
    without transfers (replay of no_transfers(inputs))."""
    compute = float(((inputs.t_fwd + inputs.t_bwd) * inputs.num_micro_batches).max())
    return StepBreakdown(
        step_s=times.step_s, makespan_s=times.makespan_s, compute_s=compute,
        bubble_s=free_makespan_s - compute, pp_comm_s=times.pipeline_s - free_makespan_s,
        tied_comm_s=times.makespan_s - times.pipeline_s,
        dp_comm_s=times.step_s - times.makespan_s, dp_comm_round_s=times.dp_exposed_round_s,
        dp_allreduce_s=[float(x) for x in times.dp_time_s], tokens_per_step=tokens_per_step,
        tokens_per_s=tokens_per_step / times.step_s)
