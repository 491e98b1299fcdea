"""The one cost kernel: a plan's per-device and per-link seconds, the step breakdown.
`simulate()` and the planner's `simulated` objective both go through it; the all-reduce models
and each stage group's ring are collectives.py's.

Units: seconds, bytes, bits per second, FLOP/s. A candidate is an (R, S) array of device ids
(R replicas, S stages). Its per-link arrays (PlanLinks) do not depend on the layer split; the
step's inputs (StepInputs) add the split's compute and all-reduce payloads; a replay (replay.py,
events.py) turns them into StepTimes; step_breakdown() says where the step went.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from formats import wire
from formats.models import ModelSpec
from formats.plan import PIPELINE_COMPRESSIONS, SyncConfig
from formats.wire import payload_bytes_per_param
from scheduler.simulator.collectives import (
    LinkTables,
    Ring,
    RingTable,
    direct_allreduce_s,
    gloo_allreduce_s,
    ring_allreduce_s,
    ring_step_s,
    runs_gloo_allreduce,
)
from scheduler.simulator.config import SimConfig
from scheduler.simulator.sharing import core_slowdown

MIN_LINK_SHARE = 0.05
"""Least share of a link a background outer sync gets when the pipeline's traffic on the same
shared link fills it (so that a saturated link slows the sync 20x rather than forever)."""


# --------------------------------------------------------------------------- messages


def pipeline_message_bytes(model: ModelSpec, micro_batch_size: int, compression: str,
                           activation_bytes: int) -> float:
    """Bytes of one activation (or activation-gradient) message across a stage boundary
    (formats.wire: the same sizes the runtime's PipelineWire sends)."""
    if compression not in PIPELINE_COMPRESSIONS:
        raise ValueError(f"unknown pipeline compression {compression!r}")
    numel = model.seq_len * micro_batch_size * model.d_model
    return float(wire.pipeline_message_bytes(compression, numel, model.d_model,
                                             activation_bytes))


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
    if not sync.rule.local_steps or pipelines.shape[0] < 2 or not config.outer_store_round_trips:
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
    """(S, R) latency per all-reduce step of ring link i (rings[s,i] -> rings[s,i+1]; gloo's
    fp32 all-reduce: one-way, Ring.lat_s)."""
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
    pp_msg_bytes: float = 0.0
    """Bytes of one pipeline message (pipeline compression applied)."""
    ring_pp_busy: np.ndarray | None = None
    """(S, R) seconds per micro-batch that the pipeline keeps busy the shared link of ring link
    i's sender: its messages into the region of the ring successor (see shared_pipeline_busy)."""
    direct_lat: np.ndarray | None = None
    """(S, K) latency of each stage group's direct reduce-scatter links (Ring.direct_lat_s;
    groups with fewer repeat their last: a copy does not change the max)."""
    direct_sec_per_bit: np.ndarray | None = None
    """(S, K) their seconds per bit of one chunk (Ring.direct_sec_per_bit)."""
    direct_sender: np.ndarray | None = None
    """(S, K) the device sending on each (Ring.direct_sender)."""
    tied_gloo_bytes: float | None = None
    """Bytes of the tied-embedding sum when it runs gloo's all-reduce (SimConfig.
    allreduce_algorithm "gloo"; tied_lat then one-way); None: the ring model."""


def shared_pipeline_busy(pipe: np.ndarray, rings: np.ndarray, fwd_tx: np.ndarray,
                         bwd_tx: np.ndarray, region_id: np.ndarray) -> np.ndarray:
    """(S, R) busy seconds per micro-batch of the pipeline messages that share a link with ring
    link i of stage group s (rings[s, i] -> rings[s, i+1]). Contention model: a sender's traffic
    into one region shares one link (what a host's path into another site is, and what the
    emulator's per-(rate, delay) htb class does), so the ring link and the sender's activation
    send (to stage s+1) or gradient send (to stage s-1) share it when those go to the ring
    successor's region."""
    r_count, s_count = pipe.shape
    busy = np.zeros((s_count, r_count))
    for s in range(s_count):
        replica = np.empty(int(pipe.max()) + 1, dtype=np.int64)
        replica[pipe[:, s]] = np.arange(r_count)
        sender = replica[rings[s]]  # replica of each ring link's sender
        to_region = region_id[np.roll(rings[s], -1)]
        if s < s_count - 1:
            busy[s] += np.where(region_id[pipe[sender, s + 1]] == to_region, fwd_tx[sender, s], 0)
        if s > 0:
            busy[s] += np.where(region_id[pipe[sender, s - 1]] == to_region,
                                bwd_tx[sender, s - 1], 0)
    return busy


def plan_links(tables: LinkTables, model: ModelSpec, pipelines: np.ndarray, sync: SyncConfig,
               micro_batch_size: int, config: SimConfig, rings: RingTable,
               pipeline_compression: str = "none") -> PlanLinks:
    """The per-link arrays of candidate `pipelines` (rings from `rings`, cached there)."""
    pipe = np.asarray(pipelines, dtype=np.int64)
    msg_bytes = pipeline_message_bytes(model, micro_batch_size, pipeline_compression,
                                       config.activation_bytes)
    msg_bits = msg_bytes * 8.0
    src, dst = pipe[:, :-1], pipe[:, 1:]
    per_stage = [rings.ring(pipe[:, s], pipe.shape[1]) for s in range(pipe.shape[1])]
    gloo = runs_gloo_allreduce(config)  # the tied sum is fp32 whatever the sync's payload
    tied = tied_links(pipe, tables.lat_s if gloo else tables.collective_lat_s,
                      tables.bits_per_s, model)
    fwd_tx, bwd_tx = msg_bits / tables.bits_per_s[src, dst], msg_bits / tables.bits_per_s[dst, src]
    ring_orders = np.array([r.order for r in per_stage])
    background = sync.rule.local_steps and sync.overlap
    return PlanLinks(
        pipe, tables.flops_per_s[pipe], fwd_tx, tables.lat_s[src, dst], bwd_tx,
        tables.lat_s[dst, src], ring_orders, np.array([r.lat_s for r in per_stage]),
        np.array([r.sec_per_bit for r in per_stage]), tables.memory_bytes[pipe].min(axis=0),
        *(tied or (None, None)), outer_agreement_time(pipe, tables.lat_s, sync, config),
        msg_bytes, shared_pipeline_busy(pipe, ring_orders, fwd_tx, bwd_tx, tables.region_id)
        if background else None, *_stacked_direct_links(per_stage),
        tied_gloo_bytes=model.vocab_size * model.d_model * 4.0 if gloo and tied else None)


def _stacked_direct_links(per_stage: list[Ring]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(S, K) latency, seconds per bit and sender of the stage groups' direct links, each
    group's padded with copies of its last to the longest's K."""
    k = max(len(r.direct_lat_s) for r in per_stage)
    lat, spb = np.empty((len(per_stage), k)), np.empty((len(per_stage), k))
    sender = np.empty((len(per_stage), k), dtype=np.int64)
    for i, r in enumerate(per_stage):
        n = len(r.direct_lat_s)
        assert n or not k, "every group of a compressed sync has direct links"
        for out, x in ((lat, r.direct_lat_s), (spb, r.direct_sec_per_bit),
                       (sender, r.direct_sender)):  # np.pad: 10x slower, and per candidate
            out[i, :n], out[i, n:] = x, x[-1] if n else 0
    return lat, spb, sender


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
    """DiLoCo: seconds each outer sync spends agreeing on membership through the store."""
    overlap: bool = False
    """DiLoCo: the outer syncs run in the background behind the next round's inner steps."""
    fragments: int = 1
    """DiLoCo: F outer syncs per round, each of 1/F of every stage's payload (ring_tx is one
    fragment's)."""
    ring_pp_busy: Sequence[np.ndarray] | None = None
    """Overlap: per stage, (R,) seconds per step the pipeline keeps busy the link that ring link
    i shares (kernel.shared_pipeline_busy x micro-batches); the background sync gets the rest."""
    pp_bytes: float = 0.0
    """Bytes the pipeline sends per step (every boundary, both directions, every replica)."""
    dp_bytes_round: float = 0.0
    """Bytes the data-parallel sync puts on the wire per sync round (every fragment, group and
    ring link)."""
    group_stage: np.ndarray | None = None
    """Stage of each data-parallel group when there are more groups than stages (shard groups:
    D per-shard groups per stage, simulator/sharded.py); None: group s is stage s."""
    direct_tx: Sequence[np.ndarray] | None = None
    """Compressed sync (int8/fp16): per group, (K,) busy seconds of each direct reduce-scatter
    link (PlanLinks.direct_sec_per_bit x one fragment's chunk); None: fp32, whose all-reduce
    is gloo's ring (2(n-1) steps)."""
    direct_lat: Sequence[np.ndarray] | None = None
    """Per group, (K,) latency of those links."""
    direct_sender: Sequence[np.ndarray] | None = None
    """Per group, (K,) the device sending on each (the timeline's row)."""
    gloo_bytes: np.ndarray | None = None
    """(groups,) bytes of each group's all-reduce (one fragment) when it is gloo's fp32 one
    (SimConfig.allreduce_algorithm "gloo"; ring_lat then one-way): gloo_allreduce_s; None:
    the ring model (or the compressed all-reduce)."""
    tied_gloo_bytes: float | None = None
    """Bytes of the tied-embedding sum when it is gloo's all-reduce (PlanLinks'); None: ring."""

    @property
    def tied_s(self) -> np.ndarray | None:
        """(R,) seconds of each replica's tied-embedding gradient sum (None: not tied)."""
        if self.tied_tx is None or self.tied_lat is None:
            return None
        if self.tied_gloo_bytes is not None:
            return gloo_allreduce_s(self.tied_tx, self.tied_lat, self.tied_gloo_bytes, axis=1)
        return ring_allreduce_s(self.tied_tx, self.tied_lat, axis=1)

    def dp_times(self) -> np.ndarray:
        """(S,) seconds of each stage group's all-reduce (of one fragment) on idle links."""
        return self._allreduce_s(np.asarray(self.ring_tx), None)

    def background_dp_times(self, step_s: float) -> np.ndarray:
        """(S,) seconds of each stage group's all-reduce (of one fragment) in the background of
        steps `step_s` long: each ring link gets the share of its link the pipeline leaves
        (1 - busy / step, at least MIN_LINK_SHARE); the pipeline keeps its speed. A direct
        reduce-scatter link gets its sender's smallest ring-link share."""
        tx, share = np.asarray(self.ring_tx), None
        if self.ring_pp_busy is not None and step_s > 0:
            share = np.maximum(1.0 - np.asarray(self.ring_pp_busy) / step_s, MIN_LINK_SHARE)
            tx = tx / share
        return self._allreduce_s(tx, share)

    def _allreduce_s(self, ring_tx: np.ndarray, share: np.ndarray | None) -> np.ndarray:
        """(S,) seconds of each group's all-reduce with these ring-link busy times: for fp32
        the ring (or gloo's own, when gloo_bytes is set), the direct reduce-scatter and ring
        all-gather when compressed."""
        ring_lat = np.asarray(self.ring_lat)
        if self.gloo_bytes is not None:
            return gloo_allreduce_s(ring_tx, ring_lat, self.gloo_bytes)
        if self.direct_tx is None or self.direct_lat is None:
            return ring_allreduce_s(ring_tx, ring_lat)
        direct = np.asarray(self.direct_tx)
        if share is not None:
            direct = direct / share.min(axis=-1, keepdims=True)
        return direct_allreduce_s(direct + np.asarray(self.direct_lat), ring_tx + ring_lat)


def step_inputs(links: PlanLinks, stage_flops: np.ndarray, stage_payload_bytes: np.ndarray,
                config: SimConfig, num_micro_batches: int, sync: SyncConfig) -> StepInputs:
    """The step of `links` with a layer split: forward FLOPs per micro-batch (S,) and all-reduce
    payload bytes (S,) of each stage."""
    t_fwd = stage_flops[None, :] / links.flops_per_s
    if config.shared_cores > 0:  # the CPU lab: ranks computing at once share the host's cores
        t_fwd = t_fwd * core_slowdown(t_fwd, t_fwd * config.backward_factor, links.fwd_tx,
                                      links.fwd_lat, links.bwd_tx, links.bwd_lat,
                                      num_micro_batches, config.shared_cores,
                                      config.background_load, config.core_contention)
    r_count, s_count = links.pipelines.shape
    diloco = sync.rule.local_steps
    fragments = sync.fragments if diloco else 1
    ring_tx = ring_step_s(stage_payload_bytes[:, None] / fragments, r_count,
                          links.ring_sec_per_bit)
    busy = None if links.ring_pp_busy is None else links.ring_pp_busy * num_micro_batches
    pp_bytes = 2.0 * r_count * (s_count - 1) * num_micro_batches * links.pp_msg_bytes
    dp_bytes = 2.0 * (r_count - 1) * float(np.sum(stage_payload_bytes)) if r_count > 1 else 0.0
    direct_tx = direct_lat = direct_sender = gloo_bytes = None
    if runs_gloo_allreduce(config, sync.compression):
        gloo_bytes = stage_payload_bytes / fragments
    if sync.compression != "none" and links.direct_sec_per_bit is not None:
        direct_tx = ring_step_s(stage_payload_bytes[:, None] / fragments, r_count,
                                links.direct_sec_per_bit)
        direct_lat, direct_sender = links.direct_lat, links.direct_sender
    return StepInputs(links.pipelines, t_fwd, t_fwd * config.backward_factor, links.fwd_tx,
                      links.fwd_lat, links.bwd_tx, links.bwd_lat, links.rings, ring_tx,
                      links.ring_lat, num_micro_batches, sync.inner_steps if diloco else 1,
                      links.tied_tx, links.tied_lat, links.agree_s, diloco and sync.overlap,
                      fragments, busy, pp_bytes, dp_bytes, None, direct_tx, direct_lat,
                      direct_sender, gloo_bytes, links.tied_gloo_bytes)


def build_inputs(tables: LinkTables, model: ModelSpec, stages: list[tuple[int, int]],
                 pipelines: np.ndarray, sync: SyncConfig, micro_batch_size: int,
                 num_micro_batches: int, config: SimConfig,
                 pipeline_compression: str = "none") -> StepInputs:
    """Turn a plan into per-device and per-link seconds (its rings chosen here)."""
    links = plan_links(tables, model, pipelines, sync, micro_batch_size, config,
                       RingTable(tables, model, sync.compression, config), pipeline_compression)
    tokens = micro_batch_size * model.seq_len
    params = np.array([model.stage_params(a, b) for a, b in stages], dtype=float)
    flops = np.array([model.stage_flops_per_token(a, b) for a, b in stages]) * tokens
    flops = (flops + optimizer_flops(params, config, num_micro_batches)
             + (outer_round_flops(params, config, sync, num_micro_batches)
                if pipelines.shape[0] > 1 else 0.0))
    payload = params * payload_bytes_per_param(sync.compression, config.int8_block)
    return step_inputs(links, flops, payload, config, num_micro_batches, sync)


def optimizer_flops(stage_params: np.ndarray, config: SimConfig,
                    num_micro_batches: int) -> np.ndarray:
    """The optimizer step's CPU (SimConfig.optimizer_flops_per_param x the stage's parameters)
    as forward FLOPs per micro-batch: spread over the step's forwards and backwards, so that
    the step's compute grows by exactly that much (0 unless calibrated: the CPU lab)."""
    return (stage_params * config.optimizer_flops_per_param
            / (num_micro_batches * (1.0 + config.backward_factor)))


OUTER_CPU_FIELD = {"none": "outer_flops_per_param", "fp16": "outer_fp16_flops_per_param",
                   "int8": "outer_int8_flops_per_param"}
"""The SimConfig field holding a DiLoCo outer round's CPU per parameter, by payload."""


def outer_round_flops(stage_params: np.ndarray, config: SimConfig, sync: SyncConfig,
                      num_micro_batches: int) -> np.ndarray:
    """DiLoCo's outer round's CPU (SimConfig.outer_*flops_per_param for the payload x the
    stage's parameters, once per round of H steps) as forward FLOPs per micro-batch: spread
    over the round's forwards and backwards, as optimizer_flops (0 with allreduce or
    uncalibrated; the caller charges it only with more than one replica)."""
    if not sync.rule.local_steps:
        return np.zeros_like(stage_params)
    per_param = getattr(config, OUTER_CPU_FIELD[sync.compression])
    return (stage_params * per_param
            / (sync.inner_steps * num_micro_batches * (1.0 + config.backward_factor)))


def no_transfers(inputs: StepInputs) -> StepInputs:
    """The same step with free pipeline transfers and tied sums (to measure what they expose)."""
    zero = np.zeros_like(inputs.fwd_tx)
    return replace(inputs, fwd_tx=zero, fwd_lat=zero, bwd_tx=zero, bwd_lat=zero, tied_tx=None,
                   tied_lat=None)


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
    """Time the sync adds to the steps, per sync round (= per outer round with diloco)."""
    step_s: float
    """makespan + dp_exposed_round / inner_steps."""
    dp_sync_round_s: float = 0.0
    """The round's syncs back to back, each from its start to its slowest group's end (F
    fragments, store agreement included): exposed + hidden."""

    @property
    def dp_hidden_round_s(self) -> float:
        """Sync time per round hidden behind compute (backward of earlier stages; overlap: the
        next round's inner steps)."""
        return max(0.0, self.dp_sync_round_s - self.dp_exposed_round_s)


def step_times(b_done: np.ndarray, dp_time: np.ndarray, inputs: StepInputs) -> StepTimes:
    """Combine the pipeline's per-device end times with the tied-embedding sums, the stage
    groups' all-reduces (`dp_time`: one fragment's, on idle links) and (DiLoCo) the outer
    syncs' membership agreement. Per round there are F syncs (fragments). Blocking, each
    exposes what runs past the makespan plus its agreement. Overlapped (background), each runs
    on links the pipeline shares (background_dp_times) and the round's F syncs, each with its
    agreement (the runtime's background worker runs the whole outer round: arrivals, all-reduce,
    commit), have the next round's H inner steps (H x makespan) to finish in: only the excess
    shows."""
    pipeline = float(b_done.max())
    tied_s = inputs.tied_s
    if tied_s is not None and b_done.shape[1] > 1:
        b_done = b_done.copy()
        b_done[:, 0] = b_done[:, -1] = np.maximum(b_done[:, 0], b_done[:, -1]) + tied_s
    makespan = float(b_done.max())
    dp_start = b_done.max(axis=0)
    if inputs.group_stage is not None:
        dp_start = dp_start[inputs.group_stage]
    if inputs.overlap:
        dp_time = inputs.background_dp_times(makespan)
    f, h, agree = inputs.fragments, inputs.inner_steps, inputs.agree_s
    dp_end = float((dp_start + dp_time).max()) if len(dp_time) else makespan
    tail = max(0.0, dp_end - makespan)  # one sync's run past the step's end
    if inputs.overlap:
        exposed = max(0.0, f * (tail + agree) - h * makespan)
    else:
        exposed = f * (tail + agree)
    started = float(dp_start.min()) if len(dp_time) else makespan
    total = f * (max(0.0, dp_end - started) + agree)
    return StepTimes(makespan, pipeline, dp_start, dp_time, exposed, makespan + exposed / h,
                     max(total, exposed))


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
    """Duration of each stage group's all-reduce (of one fragment; overlap: in the background,
    on links shared with the pipeline)."""
    tokens_per_step: int
    tokens_per_s: float
    dp_sync_round_s: float = 0.0
    """The round's outer syncs back to back (all fragments, store agreement): exposed + hidden."""
    dp_hidden_s: float = 0.0
    """Sync time per step hidden behind compute (amortised over H with diloco)."""
    pp_bytes_per_step: float = 0.0
    """Bytes the pipeline sends per step (activations forward, their gradients backward)."""
    dp_bytes_per_step: float = 0.0
    """Bytes the data-parallel sync puts on the wire per step (amortised over H)."""


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
        tokens_per_s=tokens_per_step / times.step_s, dp_sync_round_s=times.dp_sync_round_s,
        dp_hidden_s=times.dp_hidden_round_s / inputs.inner_steps,
        pp_bytes_per_step=inputs.pp_bytes,
        dp_bytes_per_step=inputs.dp_bytes_round / inputs.inner_steps)
