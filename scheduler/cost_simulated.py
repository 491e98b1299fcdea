"""The `simulated` objective: predicted step time of a candidate, layer split included.

For a candidate (R, S) array of device ids it
1. chooses the layers of each stage (layer_split.split_layers): stage s costs
   m x (forward + backward) of its layers on the slowest device of its group, plus its group's
   all-reduce of those layers' parameters (/ H with diloco), and cannot exceed the smallest
   memory of the group (memory.py);
2. replays the step with simulator.fast_replay (the same recurrences the event simulator is
   checked against) for that split and for the even split, and keeps the faster one, so the
   chosen split is never worse than the even one;
3. returns the step time in seconds, or inf when no split fits in memory (the search then
   avoids the candidate).

Ring orders of stage groups are cached by group; one `cost` call on a 64-device, 8 x 8,
61-micro-batch GPT3-XL candidate takes about a millisecond (see benchmarks/simulated_planning.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from formats.cluster import Cluster
from formats.errors import UserError
from formats.models import ModelSpec
from formats.plan import SyncConfig
from scheduler.layer_split import even_split, flops_table, params_table, split_layers
from scheduler.memory import memory_table
from scheduler.objective import CostBreakdown
from scheduler.simulator import (
    LinkTables,
    SimConfig,
    fast_replay,
    outer_agreement_time,
    payload_bytes_per_param,
    ring_chunk_bytes,
    ring_order,
    step_times,
    tied_sum_times,
)

if TYPE_CHECKING:  # planning imports the objectives, not the other way round
    from scheduler.planning import PlanRequest

_RING_CACHE_LIMIT = 200_000


@dataclass
class _Candidate:
    """One candidate's per-device arrays, shared by the splits tried on it."""

    pipe: np.ndarray
    speed: np.ndarray
    fwd_tx: np.ndarray
    fwd_lat: np.ndarray
    bwd_tx: np.ndarray
    bwd_lat: np.ndarray
    ring_lat: np.ndarray
    """(S, R) latency of each ring link."""
    ring_inv_bw: np.ndarray
    """(S, R) seconds per bit of each ring link."""
    memcap: np.ndarray
    """(S,) smallest memory of each group, bytes."""
    tied_s: np.ndarray | None = None
    """(R,) seconds of each replica's tied-embedding gradient sum (None: not tied)."""
    splits: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


class SimulatedObjective:
    """Predicted step time of a plan (Objective protocol) for a fixed cluster, model and batch."""

    name = "simulated"

    def __init__(self, cluster: Cluster, model: ModelSpec, sync: SyncConfig | None = None,
                 micro_batch_size: int = 1, num_micro_batches: int = 1,
                 config: SimConfig | None = None,
                 stages: list[tuple[int, int]] | None = None) -> None:
        """`stages` fixes the layer split (else it is chosen per candidate)."""
        self.cluster, self.model = cluster, model
        self.sync = sync or SyncConfig()
        self.sync.validate()
        if micro_batch_size < 1 or num_micro_batches < 1:
            raise UserError(f"micro_batch_size ({micro_batch_size}) and num_micro_batches "
                            f"({num_micro_batches}) must be >= 1")
        self.micro_batch_size, self.num_micro_batches = micro_batch_size, num_micro_batches
        self.config = config or SimConfig()
        self.fixed_stages = list(stages) if stages is not None else None
        self.tables = LinkTables(cluster, self.config)
        self.diloco = self.sync.mode == "diloco"
        self.inner_steps = self.sync.inner_steps if self.diloco else 1
        self.tokens = micro_batch_size * model.seq_len
        self.flops = flops_table(model) * self.tokens  # forward FLOPs per micro-batch
        per_param = payload_bytes_per_param(self.sync.compression, self.config.int8_block)
        self.payload = params_table(model) * per_param
        values, index = np.unique(self.payload, return_inverse=True)
        self._payload_values, self._payload_index = values, index.reshape(self.payload.shape)
        self.mem_need = memory_table(model, micro_batch_size, num_micro_batches, self.diloco,
                                     self.config.memory())
        self.msg_bits = (model.activation_bytes_per_sequence(self.config.activation_bytes)
                         * micro_batch_size * 8.0)
        self._rings: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    # ---------------------------------------------------------------- per-candidate pieces

    def ring(self, group: np.ndarray, num_stages: int) -> tuple[np.ndarray, np.ndarray,
                                                                 np.ndarray]:
        """(ring order, link latencies s, link seconds per bit) of a stage group, cached."""
        key = tuple(sorted(int(d) for d in group))
        hit = self._rings.get(key)
        if hit is None:
            if len(self._rings) > _RING_CACHE_LIMIT:
                self._rings.clear()
            chunk = ring_chunk_bytes(self.model, num_stages, len(group), self.sync.compression,
                                     self.config.int8_block)
            order = ring_order(np.array(key), self.tables.lat_s, self.tables.bits_per_s, chunk)
            nxt = np.roll(order, -1)
            hit = (order, self.tables.lat_s[order, nxt] * self.config.collective_latency_factor,
                   1.0 / self.tables.bits_per_s[order, nxt])
            self._rings[key] = hit
        return hit

    def _candidate(self, pipelines: np.ndarray) -> _Candidate:
        pipe = np.asarray(pipelines, dtype=np.int64)
        t = self.tables
        src, dst = pipe[:, :-1], pipe[:, 1:]
        rings = [self.ring(pipe[:, s], pipe.shape[1]) for s in range(pipe.shape[1])]
        return _Candidate(
            pipe, t.flops_per_s[pipe],
            self.msg_bits / t.bits_per_s[src, dst], t.lat_s[src, dst],
            self.msg_bits / t.bits_per_s[dst, src], t.lat_s[dst, src],
            np.array([r[1] for r in rings]), np.array([r[2] for r in rings]),
            t.memory_bytes[pipe].min(axis=0),
            tied_sum_times(pipe, t.lat_s * self.config.collective_latency_factor, t.bits_per_s,
                           self.model))

    def _dp_times(self, cand: _Candidate, payload: np.ndarray) -> np.ndarray:
        """(S,) all-reduce seconds of each group for per-stage payload bytes (S,)."""
        n = cand.pipe.shape[0]
        if n <= 1:
            return np.zeros(len(payload))
        bits = payload[:, None] / n * 8.0
        return 2.0 * (n - 1) * (cand.ring_lat + bits * cand.ring_inv_bw).max(axis=1)

    def _dp_split(self, cand: _Candidate) -> list[tuple[int, int]]:
        """The layer split of layer_split.split_layers for this candidate ([] if none fits)."""
        n = cand.pipe.shape[0]
        slowest = cand.speed.min(axis=0)  # (S,)
        compute = self.flops[None] * (1.0 + self.config.backward_factor) \
            * self.num_micro_batches / slowest[:, None, None]
        if n > 1:
            # Payloads take few distinct values (k layers, +- embedding, +- head): evaluate the
            # ring's bottleneck on those only. (S, R, U) -> (S, U) -> (S, L+1, L+1).
            bits = self._payload_values / n * 8.0
            dp = (cand.ring_lat[:, :, None] + bits[None, None] * cand.ring_inv_bw[:, :, None]
                  ).max(axis=1)
            dp = dp[:, self._payload_index]
            compute = compute + 2.0 * (n - 1) * dp / self.inner_steps
        fits = self.mem_need[None] <= cand.memcap[:, None, None]
        stages, _ = split_layers(np.where(fits, compute, np.inf))
        return stages

    def _step(self, cand: _Candidate, stages: list[tuple[int, int]]) -> tuple[float, object]:
        """Step time of the candidate with this split (inf if a stage does not fit)."""
        a = np.array([st[0] for st in stages])
        b = np.array([st[1] for st in stages])
        if (self.mem_need[a, b] > cand.memcap).any():
            return np.inf, None
        t_fwd = self.flops[a, b][None, :] / cand.speed
        t_bwd = t_fwd * self.config.backward_factor
        _, done = fast_replay(t_fwd, t_bwd, cand.fwd_tx, cand.fwd_lat, cand.bwd_tx,
                              cand.bwd_lat, self.num_micro_batches)
        times = step_times(done, self._dp_times(cand, self.payload[a, b]), self.inner_steps,
                           cand.tied_s, outer_agreement_time(cand.pipe, self.tables.lat_s,
                                                             self.sync, self.config))
        return times.step_s, (times, t_fwd, t_bwd)

    def _best(self, cand: _Candidate) -> tuple[float, list[tuple[int, int]], object]:
        s_count = cand.pipe.shape[1]
        if self.fixed_stages is not None:
            if len(self.fixed_stages) != s_count:
                raise UserError(f"stages: the fixed split has {len(self.fixed_stages)} stages "
                                f"but the plan has {s_count}")
            options = [self.fixed_stages]
        else:
            options = [even_split(self.model.num_layers, s_count)]
            chosen = self._dp_split(cand)
            if chosen and chosen != options[0]:
                options.append(chosen)
        best: tuple[float, list[tuple[int, int]], object] = (np.inf, options[0], None)
        for stages in options:
            cost, detail = self._step(cand, stages)
            if cost < best[0]:
                best = (cost, stages, detail)
        return best

    # ---------------------------------------------------------------- Objective protocol

    def cost(self, pipelines: np.ndarray) -> float:
        """Predicted step time in seconds (inf when the candidate cannot fit in memory)."""
        return float(self._best(self._candidate(pipelines))[0])

    def choose_stages(self, pipelines: np.ndarray) -> list[tuple[int, int]]:
        """The layer split `cost` assumes for this candidate."""
        return list(self._best(self._candidate(pipelines))[1])

    def breakdown(self, pipelines: np.ndarray) -> CostBreakdown:
        """Step time with compute / bubble / exposed PP and DP parts and the chosen split."""
        cand = self._candidate(pipelines)
        return self._breakdown(cand, *self._best(cand))

    def polish(self, pipelines: np.ndarray, max_replays: int = 2000) -> CostBreakdown:
        """`breakdown` after a local search on the split: move one stage boundary by one layer
        while the replayed step gets shorter (steepest descent, at most `max_replays` replays).
        Never worse than `breakdown`; meant for a final plan (the DP split of `cost` is within
        a few percent of it), not for the search's hot path. A fixed split is kept as it is."""
        cand = self._candidate(pipelines)
        cost, stages, detail = self._best(cand)
        if detail is None or self.fixed_stages is not None:
            return self._breakdown(cand, cost, stages, detail)
        bounds = [0] + [b for _, b in stages]
        replays = 0
        while replays < max_replays:
            best_move = None
            for i in range(1, len(bounds) - 1):
                for step in (-1, 1):
                    moved = list(bounds)
                    moved[i] += step
                    if not moved[i - 1] < moved[i] < moved[i + 1]:
                        continue
                    trial = list(zip(moved[:-1], moved[1:]))
                    c, d = self._step(cand, trial)
                    replays += 1
                    if c < cost - 1e-12:
                        cost, detail, best_move = c, d, moved
            if best_move is None:
                break
            bounds = best_move
        return self._breakdown(cand, cost, list(zip(bounds[:-1], bounds[1:])), detail)

    def _breakdown(self, cand: _Candidate, cost: float, stages: list[tuple[int, int]],
                   detail: object) -> CostBreakdown:
        if detail is None:
            return CostBreakdown(self.name, float("inf"), {}, list(stages))
        times, t_fwd, t_bwd = detail
        a = np.array([st[0] for st in stages])
        b = np.array([st[1] for st in stages])
        zero = np.zeros_like(cand.fwd_tx)
        _, done0 = fast_replay(t_fwd, t_bwd, zero, zero, zero, zero, self.num_micro_batches)
        free_makespan = float(done0.max())
        compute = float(((t_fwd + t_bwd) * self.num_micro_batches).max())
        tokens = cand.pipe.shape[0] * self.num_micro_batches * self.tokens
        dp_each = self._dp_times(cand, self.payload[a, b])
        parts = {
            "step_s": times.step_s,
            "compute_s": compute,
            "bubble_s": free_makespan - compute,
            "pp_comm_s": times.pipeline_s - free_makespan,
            "tied_comm_s": times.makespan_s - times.pipeline_s,
            "dp_comm_s": times.step_s - times.makespan_s,
            "dp_comm_per_round_s": times.dp_exposed_round_s,
            "dp_allreduce_max_s": float(dp_each.max()) if len(dp_each) else 0.0,
            "tokens_per_s": tokens / times.step_s,
        }
        return CostBreakdown(self.name, float(cost), parts, list(stages))


def make_simulated(cluster: Cluster, model: ModelSpec, req: PlanRequest) -> SimulatedObjective:
    """Factory for planning.OBJECTIVES: the simulated objective for a request's sync and batch."""
    return SimulatedObjective(cluster, model, req.sync, req.micro_batch_size,
                              req.num_micro_batches, req.sim)
