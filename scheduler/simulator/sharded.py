"""The step of a plan with shard groups (plan/2, hierarchical replicas): FSDP2 inside a replica,
the data-parallel sync across replicas shard by shard. See docs/hierarchical.md.

What the runtime does and the model charges (R replicas, S stages, D devices per shard group):

- Lanes. Device i of every stage of replica r forms lane r*D + i (Plan.lanes): it runs its own
  micro-batches (m of micro_batch_size sequences per step, as a D = 1 replica does) and sends
  its activations to device i of the next stage. A replica therefore processes D x the
  sequences of a D = 1 replica per step; the planner's cost per sequence is step / (R x D).
  The pipeline replay is the kernel's, over the R x D lanes.
- FSDP2 inside a shard group. Each device keeps 1/D of the stage's parameters. Per micro-batch
  and block the forward all-gathers the block's fp32 parameters, the backward all-gathers them
  again (reshard_after_forward) and reduce-scatters the fp32 gradients. An all-gather or a
  reduce-scatter of B bytes over the group's ring (ring_order, as the data-parallel rings) is
  (D-1) steps of max over ring links (latency x collective_latency_factor + B/D * 8 / bw):
  half an all-reduce (ring_gather_s). FSDP2 prefetches the next block's gather while the
  current block computes, so per micro-batch a device's forward takes
  max(compute, gather) + gather / blocks (the first block's gather is not hidden) and its
  backward max(compute, gather + scatter) + scatter / blocks (the last block's scatter is not
  hidden). A stage's gather is one collective per block plus one for the root (fsdp_units),
  each paying the ring's (D-1) latencies. On the CPU runtime (SimConfig.runtime "cpu") nothing
  is hidden: gloo's collectives run on the cores the ranks compute on, so a micro-batch takes
  compute + its gathers and scatters (measured on the badlink lab: reshard_after_forward off
  ran 2.3x faster than on, where an overlapped model predicted 1.07x). Without
  reshard_after_forward the stage's parameters are gathered once per step and
  the gradients reduce-scattered once per step (amortised over the m micro-batches, same rule).
  The shard group's links are not shared with the pipeline's in the model (a group sits inside
  one site, its pipeline messages go to other devices).
- Across replicas, per shard: device i of stage s averages its shard with device i of stage s
  of every other replica (Plan.shard_peers): S x D rings of R devices, each carrying 1/D of the
  stage's payload, all at once on different links. Everything else of the kernel's sync
  (allreduce every step or DiLoCo's H, fragments, overlap and its link sharing, the store
  agreement) applies to each ring as to a D = 1 stage group. Tied embeddings: lane i's first
  and last devices sum their 1/D shard of the embedding gradient.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from formats.models import ModelSpec
from formats.plan import Entry, SyncConfig, as_group
from scheduler.simulator.collectives import LinkTables, RingTable, ring_order
from scheduler.simulator.config import SimConfig
from scheduler.simulator.kernel import (
    StepInputs,
    optimizer_flops,
    outer_round_flops,
    payload_bytes_per_param,
    plan_links,
    step_inputs,
)
from scheduler.simulator.sharing import core_slowdown

FSDP_BYTES_PER_PARAM = 4.0
"""FSDP2 gathers fp32 parameters and reduce-scatters fp32 gradients (no MixedPrecisionPolicy)."""


def is_sharded(pipelines: object) -> bool:
    """Whether a pipelines array (list or numpy) holds shard groups."""
    if isinstance(pipelines, np.ndarray):
        return pipelines.ndim == 3
    return any(isinstance(e, list) for chain in pipelines for e in chain)  # type: ignore[union-attr]


def shard_array(pipelines: list[list[Entry]] | np.ndarray) -> np.ndarray:
    """(R, S, L) device of each lane: [r, s, i] = the device of stage s running lane i of
    replica r (Plan.lane_device; L = the largest D, 1 for plain ids). A stage of D < L devices
    repeats each of them in L / D consecutive lanes."""
    if isinstance(pipelines, np.ndarray):
        return pipelines if pipelines.ndim == 3 else pipelines[:, :, None]
    rows = [[as_group(e) for e in chain] for chain in pipelines]
    lanes = max(len(g) for chain in rows for g in chain)
    return np.array([[[g[i * len(g) // lanes] for i in range(lanes)] for g in chain]
                     for chain in rows], dtype=np.int64)


def stage_degrees(groups: np.ndarray) -> np.ndarray:
    """(S,) D of every stage of a (R, S, L) lane array (its distinct devices per replica)."""
    return np.array([len(set(groups[0, s].tolist())) for s in range(groups.shape[1])])


def shard_groups(groups: np.ndarray) -> list[list[list[int]]]:
    """The plan's shard groups [r][s] = its D device ids, from a (R, S, L) lane array."""
    per = groups.shape[2] // stage_degrees(groups)
    return [[groups[r, s, ::per[s]].tolist() for s in range(groups.shape[1])]
            for r in range(groups.shape[0])]


def ring_gather_s(payload_bytes: float, lat_s: np.ndarray, sec_per_bit: np.ndarray,
                  units: int = 1) -> float:
    """Seconds of a ring all-gather (or reduce-scatter) of `payload_bytes` over n devices whose
    ring links have these latencies and seconds per bit: (n-1) steps of B/n bytes, each as
    long as its slowest link. Half the ring all-reduce's 2(n-1) steps. `units`: the payload is
    gathered as that many separate collectives (FSDP2: one per block and one for the root),
    each paying the steps' latency."""
    n = len(lat_s)
    if n <= 1:
        return 0.0
    return (n - 1) * float((units * np.asarray(lat_s) + payload_bytes / n * 8.0
                            * np.asarray(sec_per_bit)).max())


def fsdp_collective_s(tables: LinkTables, group: np.ndarray, payload_bytes: float,
                      units: int = 1) -> float:
    """All-gathers (= reduce-scatters) of `payload_bytes` in `units` collectives over a shard
    group's ring."""
    if len(group) <= 1:
        return 0.0
    order = ring_order(group, tables.lat_s, tables.bits_per_s, payload_bytes / len(group))
    nxt = np.roll(order, -1)
    return ring_gather_s(payload_bytes, tables.collective_lat_s[order, nxt],
                         tables.sec_per_bit[order, nxt], units)


def fsdp_units(model: ModelSpec, start: int, end: int) -> int:
    """FSDP2 collectives per gather of a stage [start, end): one per block, one for the root
    when it holds parameters (the embedding on the first stage, final norm and head on the
    last)."""
    return end - start + (1 if start == 0 or end == model.num_layers else 0)


def fsdp_stage_times(tables: LinkTables, model: ModelSpec, stages: list[tuple[int, int]],
                     groups: np.ndarray) -> np.ndarray:
    """(R, S) seconds of one all-gather of each shard group's full stage parameters (the same
    as one reduce-scatter of its gradients); `groups` (R, S, L) lanes."""
    r_count, s_count, _ = groups.shape
    real = shard_groups(groups)
    out = np.zeros((r_count, s_count))
    for s, (a, b) in enumerate(stages):
        payload = model.stage_params(a, b) * FSDP_BYTES_PER_PARAM
        for r in range(r_count):
            out[r, s] = fsdp_collective_s(tables, np.array(real[r][s]), payload,
                                          fsdp_units(model, a, b))
    return out


def fsdp_compute(t_fwd: np.ndarray, t_bwd: np.ndarray, collective: np.ndarray,
                 blocks: np.ndarray, num_micro_batches: int,
                 reshard_after_forward: bool, lanes_per_device: np.ndarray | None = None,
                 overlap: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Per-micro-batch forward and backward seconds with FSDP's collectives overlapped as FSDP2
    prefetches them (module docstring), or added to the compute when not `overlap` (the CPU
    runtime: gloo's collectives run on the cores the ranks compute on); `collective` is one
    stage gather (= one scatter). `lanes_per_device` (S,): a device of stage s runs
    k_s = L / D_s lanes one after the other, so a lane's micro-batch waits for k_s of that
    device's (1 everywhere by default)."""
    k = np.ones(t_fwd.shape[1]) if lanes_per_device is None else lanes_per_device
    gather = collective if reshard_after_forward else collective / (num_micro_batches * k)
    scatter = gather
    back_gather = gather if reshard_after_forward else 0.0
    if not overlap:
        return (t_fwd + gather) * k, (t_bwd + back_gather + scatter) * k
    fwd = np.maximum(t_fwd, gather) + gather / blocks
    bwd = np.maximum(t_bwd, back_gather + scatter) + scatter / blocks
    return fwd * k, bwd * k


def fsdp_bytes_per_step(model: ModelSpec, stages: list[tuple[int, int]], groups: np.ndarray,
                        num_micro_batches: int, reshard_after_forward: bool) -> float:
    """Bytes FSDP puts on the wire per step in all shard groups: a gather or scatter of B bytes
    over D devices moves (D-1) x B; 3 per micro-batch with reshard_after_forward (a device of
    stage s runs L / D_s lanes' micro-batches), else 2 per step."""
    r_count, _, lanes = groups.shape
    total = 0.0
    for (a, b), degree in zip(stages, stage_degrees(groups), strict=True):
        count = 3 * num_micro_batches * lanes // degree if reshard_after_forward else 2
        total += (degree - 1) * model.stage_params(a, b) * FSDP_BYTES_PER_PARAM * count
    return float(r_count * total)


def _interleave(arrays: list[np.ndarray]) -> np.ndarray:
    """D arrays (R, ...) of shard i -> (R x D, ...) with row r*D + i (Plan.lanes' order)."""
    stacked = np.stack(arrays, axis=1)
    return stacked.reshape(stacked.shape[0] * stacked.shape[1], *stacked.shape[2:])


def _joined(per_shard: list[StepInputs], field: str) -> list[np.ndarray] | None:
    """Every shard's per-group arrays of `field`, one list (None where the shards have none)."""
    parts = [getattr(x, field) for x in per_shard]
    return None if parts[0] is None else [g for groups in parts for g in groups]


def merge_shards(per_shard: list[StepInputs], t_fwd: np.ndarray,
                 t_bwd: np.ndarray) -> StepInputs:
    """One StepInputs over the R x D lanes from each shard's (its lanes and its S per-shard
    rings); t_fwd and t_bwd (R x D, S) with FSDP's collectives in."""
    first, degree = per_shard[0], len(per_shard)
    s_count = first.t_fwd.shape[1]
    tied_tx = tied_lat = None
    if first.tied_tx is not None and first.tied_lat is not None:
        tied_tx = _interleave([x.tied_tx for x in per_shard]) / degree  # type: ignore[misc]
        tied_lat = _interleave([x.tied_lat for x in per_shard])  # type: ignore[misc]
    tied_gloo = None if first.tied_gloo_bytes is None else first.tied_gloo_bytes / degree
    gloo_bytes = None
    if first.gloo_bytes is not None:
        gloo_bytes = np.concatenate([x.gloo_bytes for x in per_shard])  # type: ignore[misc]
    busy = None
    if first.ring_pp_busy is not None:
        busy = [b for x in per_shard for b in x.ring_pp_busy]  # type: ignore[union-attr]
    return StepInputs(
        _interleave([x.pipelines for x in per_shard]), t_fwd, t_bwd,
        *(_interleave([getattr(x, k) for x in per_shard])
          for k in ("fwd_tx", "fwd_lat", "bwd_tx", "bwd_lat")),
        rings=[g for x in per_shard for g in x.rings],
        ring_tx=[g for x in per_shard for g in x.ring_tx],
        ring_lat=[g for x in per_shard for g in x.ring_lat],
        direct_tx=_joined(per_shard, "direct_tx"), direct_lat=_joined(per_shard, "direct_lat"),
        direct_sender=_joined(per_shard, "direct_sender"), gloo_bytes=gloo_bytes,
        tied_gloo_bytes=tied_gloo,
        num_micro_batches=first.num_micro_batches, inner_steps=first.inner_steps,
        tied_tx=tied_tx, tied_lat=tied_lat, agree_s=first.agree_s, overlap=first.overlap,
        fragments=first.fragments, ring_pp_busy=busy,
        pp_bytes=sum(x.pp_bytes for x in per_shard),
        dp_bytes_round=sum(x.dp_bytes_round for x in per_shard),
        group_stage=np.tile(np.arange(s_count), degree))


def build_sharded_inputs(tables: LinkTables, model: ModelSpec, stages: list[tuple[int, int]],
                         groups: np.ndarray, sync: SyncConfig, micro_batch_size: int,
                         num_micro_batches: int, config: SimConfig,
                         pipeline_compression: str = "none",
                         reshard_after_forward: bool = True) -> tuple[StepInputs, np.ndarray]:
    """The step inputs of a plan with shard groups, `groups` (R, S, L) lanes (shard_array):
    the kernel's per-link arrays for each lane and its rings, merged, FSDP's collectives in
    the compute; and FSDP's exposed seconds per step, (R x L, S) (lane r*L + i, as
    Plan.lanes).
    Stage s has D_s devices: lane i's ring of stage s carries shard i / k_s's 1/D_s of the
    payload when i is the first of its device's k_s = L / D_s lanes, else nothing (one ring
    per shard, not per lane)."""
    lanes = groups.shape[2]
    degrees = stage_degrees(groups)
    per_device = lanes // degrees
    rings = RingTable(tables, model, sync.compression, config)
    tokens = micro_batch_size * model.seq_len
    flops = np.array([model.stage_flops_per_token(a, b) for a, b in stages]) * tokens
    per_param = payload_bytes_per_param(sync.compression, config.int8_block)
    payload = np.array([model.stage_params(a, b) * per_param for a, b in stages]) / degrees
    flops = flops + lane_cpu_flops(model, stages, lanes, config, sync, groups.shape[0],
                                   num_micro_batches, degrees, reshard_after_forward)
    alone = replace(config, shared_cores=0.0)  # the cores are shared over all lanes: below
    per_shard = [step_inputs(plan_links(tables, model, groups[:, :, i], sync, micro_batch_size,
                                        config, rings, pipeline_compression),
                             flops, np.where(i % per_device == 0, payload, 0.0), alone,
                             num_micro_batches, sync)
                 for i in range(lanes)]
    collective = np.repeat(fsdp_stage_times(tables, model, stages, groups), lanes, axis=0)
    blocks = np.array([b - a for a, b in stages], dtype=float)
    raw_fwd = _interleave([x.t_fwd for x in per_shard])
    raw_bwd = _interleave([x.t_bwd for x in per_shard])
    def with_fsdp(k: float) -> tuple[np.ndarray, np.ndarray]:
        return fsdp_compute(raw_fwd * k, raw_bwd * k, collective, blocks, num_micro_batches,
                            reshard_after_forward, per_device.astype(float),
                            overlap=config.runtime != "cpu")

    t_fwd, t_bwd = with_fsdp(1.0)
    merged = merge_shards(per_shard, t_fwd, t_bwd)
    k = 1.0
    if config.shared_cores > 0:  # the CPU lab: every lane's ranks share the host's cores
        k = core_slowdown(t_fwd, t_bwd, merged.fwd_tx, merged.fwd_lat, merged.bwd_tx,
                          merged.bwd_lat, num_micro_batches, config.shared_cores,
                          config.background_load, config.core_contention)
        t_fwd, t_bwd = with_fsdp(k)
        merged = replace(merged, t_fwd=t_fwd, t_bwd=t_bwd)
    exposed = (t_fwd + t_bwd - (raw_fwd + raw_bwd) * k * per_device) * num_micro_batches
    return merged, exposed


def lane_cpu_flops(model: ModelSpec, stages: list[tuple[int, int]], lanes: int,
                   config: SimConfig, sync: SyncConfig, replicas: int,
                   num_micro_batches: int, degrees: np.ndarray | None = None,
                   reshard_after_forward: bool = True) -> np.ndarray:
    """(S,) forward FLOPs per micro-batch a lane adds for its device's optimizer step and
    (DiLoCo, R > 1) outer round: on 1/D of the stage's parameters, which the device's L / D
    lanes share (so params / L per lane); and, on stages of D > 1 (`degrees`), FSDP2's own
    CPU per unit and micro-batch (SimConfig.fsdp_flops_per_unit or, without
    reshard_after_forward, fsdp_gathered_flops_per_unit), spread over the forward and the
    backward as the optimizer's; 0 unless calibrated (the CPU lab)."""
    params = np.array([model.stage_params(a, b) for a, b in stages], dtype=float) / lanes
    extra = optimizer_flops(params, config, num_micro_batches)
    if replicas > 1:
        extra = extra + outer_round_flops(params, config, sync, num_micro_batches)
    if degrees is not None:
        per_unit = (config.fsdp_flops_per_unit if reshard_after_forward
                    else config.fsdp_gathered_flops_per_unit)
        units = np.array([fsdp_units(model, a, b) for a, b in stages], dtype=float)
        extra = extra + np.where(np.asarray(degrees) > 1, units * per_unit, 0.0) / (
            1.0 + config.backward_factor)
    return extra
