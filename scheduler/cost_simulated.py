"""The `simulated` objective: predicted step time of a candidate, layer split included.

For a candidate (R, S) array of device ids it
1. chooses the layers of each stage (layer_split.split_layers): stage s costs
   m x (forward + backward) of its layers on the slowest device of its group, plus its group's
   all-reduce of those layers' parameters (/ H with diloco), and cannot exceed the smallest
   memory of the group (memory.py);
2. replays the step with the simulator's kernel and vectorised replay (the recurrences the
   event simulator is checked against) for that split and for the even split, and keeps the
   faster one, so the chosen split is never worse than the even one;
3. returns the step time in seconds, or inf when no split fits in memory (the search then
   avoids the candidate).

Ring orders of stage groups are cached by group; one `cost` call on a 64-device, 8 x 8,
61-micro-batch GPT3-XL candidate takes about a millisecond (see benchmarks/simulated_planning.py).
"""

from __future__ import annotations

import copy
import math
import time

import numpy as np

from formats.cluster import Cluster
from formats.errors import UserError
from formats.models import ModelSpec
from formats.plan import PIPELINE_COMPRESSIONS, SyncConfig
from scheduler.layer_split import even_split, flops_table, params_table, split_layers
from scheduler.memory import memory_table
from scheduler.objective import CostBreakdown
from scheduler.simulator.collectives import (
    LinkTables,
    RingTable,
    direct_allreduce_s,
    gloo_allreduce_s,
    ring_allreduce_s,
    ring_step_s,
    runs_gloo_allreduce,
)
from scheduler.simulator.config import SimConfig
from scheduler.simulator.kernel import (
    PlanLinks,
    StepInputs,
    StepTimes,
    no_transfers,
    optimizer_flops,
    outer_round_flops,
    payload_bytes_per_param,
    plan_links,
    step_breakdown,
    step_inputs,
)
from scheduler.simulator.replay import replay_fast

Step = tuple[StepInputs, StepTimes]
"""A replayed step: its inputs and its times."""


class SimulatedObjective:
    """Predicted step time of a plan (Objective protocol) for a fixed cluster, model and batch."""

    name = "simulated"

    def __init__(self, cluster: Cluster, model: ModelSpec, sync: SyncConfig | None = None,
                 micro_batch_size: int = 1, num_micro_batches: int = 1,
                 config: SimConfig | None = None,
                 stages: list[tuple[int, int]] | None = None,
                 pipeline_compression: str = "none") -> None:
        """`stages` fixes the layer split (else it is chosen per candidate);
        `pipeline_compression` is how activations cross stage boundaries (Plan's field)."""
        self.cluster, self.model = cluster, model
        if micro_batch_size < 1 or num_micro_batches < 1:
            raise UserError(f"micro_batch_size ({micro_batch_size}) and num_micro_batches "
                            f"({num_micro_batches}) must be >= 1")
        self.micro_batch_size, self.num_micro_batches = micro_batch_size, num_micro_batches
        self.config = config or SimConfig()
        self.fixed_stages = list(stages) if stages is not None else None
        self.tables = LinkTables(cluster, self.config)
        self.tokens = micro_batch_size * model.seq_len
        self.flops = flops_table(model) * self.tokens  # forward FLOPs per micro-batch
        self.flops = self.flops + optimizer_flops(params_table(model), self.config,
                                                  num_micro_batches)
        # What depends on the sync configuration, by its key; shared with with_sync's copies.
        self._rings: dict[str, RingTable] = {}
        self._mem_need: dict[bool, np.ndarray] = {}
        self._set_sync(sync or SyncConfig(), pipeline_compression)

    def _set_sync(self, sync: SyncConfig, pipeline_compression: str) -> None:
        sync.validate()
        if pipeline_compression not in PIPELINE_COMPRESSIONS:
            raise UserError(f"pipeline_compression: {pipeline_compression!r} is not one of "
                            f"{', '.join(PIPELINE_COMPRESSIONS)}")
        self.sync, self.pipeline_compression = sync, pipeline_compression
        if sync.compression not in self._rings:
            self._rings[sync.compression] = RingTable(self.tables, self.model, sync.compression,
                                                      self.config)
        self.rings = self._rings[sync.compression]
        self.diloco = sync.rule.local_steps
        self.inner_steps = sync.inner_steps if self.diloco else 1
        per_param = payload_bytes_per_param(sync.compression, self.config.int8_block)
        self.payload = params_table(self.model) * per_param
        values, index = np.unique(self.payload, return_inverse=True)
        self._payload_values, self._payload_index = values, index.reshape(self.payload.shape)
        if self.diloco not in self._mem_need:
            self._mem_need[self.diloco] = memory_table(
                self.model, self.micro_batch_size, self.num_micro_batches, self.diloco,
                self.config.memory())
        self.mem_need = self._mem_need[self.diloco]
        self.outer_flops = outer_round_flops(params_table(self.model), self.config, sync,
                                             self.num_micro_batches)
        """DiLoCo's outer round's CPU per micro-batch (charged with more than one replica)."""

    def _flops(self, replicas: int) -> np.ndarray:
        """Forward FLOPs per micro-batch by layer range: compute, optimizer, outer round."""
        return self.flops + self.outer_flops if replicas > 1 else self.flops

    def with_sync(self, sync: SyncConfig, pipeline_compression: str = "none"
                  ) -> SimulatedObjective:
        """The same objective under another sync configuration and pipeline compression; the
        link tables, ring orders and memory tables are shared (the planner's sync search scores
        hundreds of configurations)."""
        other = copy.copy(self)
        other._set_sync(sync, pipeline_compression)
        return other

    # ---------------------------------------------------------------- per-candidate pieces

    def _candidate(self, pipelines: np.ndarray) -> PlanLinks:
        return plan_links(self.tables, self.model, pipelines, self.sync, self.micro_batch_size,
                          self.config, self.rings, self.pipeline_compression)

    def _dp_split(self, cand: PlanLinks) -> list[tuple[int, int]]:
        """The layer split of layer_split.split_layers for this candidate ([] if none fits)."""
        n = cand.pipelines.shape[0]
        slowest = cand.flops_per_s.min(axis=0)  # (S,)
        compute = self._flops(n)[None] * (1.0 + self.config.backward_factor) \
            * self.num_micro_batches / slowest[:, None, None]
        if n > 1:
            # Payloads take few distinct values (k layers, +- embedding, +- head): evaluate the
            # rings on those only. (S, R, U) -> (S, U) -> (S, L+1, L+1).
            busy = ring_step_s(self._payload_values[None, None], n,
                               cand.ring_sec_per_bit[:, :, None])
            if runs_gloo_allreduce(self.config, self.sync.compression):
                dp = gloo_allreduce_s(busy, cand.ring_lat[:, :, None],
                                      self._payload_values[None], axis=1)
            elif self.sync.compression == "none":
                dp = ring_allreduce_s(busy, cand.ring_lat[:, :, None], axis=1)
            else:  # (S, U, K) direct links and (S, U, R) ring links
                assert cand.direct_sec_per_bit is not None and cand.direct_lat is not None
                direct = ring_step_s(self._payload_values[None, :, None], n,
                                     cand.direct_sec_per_bit[:, None]) + cand.direct_lat[:, None]
                ring = np.swapaxes(busy + cand.ring_lat[:, :, None], 1, 2)
                dp = direct_allreduce_s(direct, ring)
            compute = compute + dp[:, self._payload_index] / self.inner_steps
        fits = self.mem_need[None] <= cand.memory_bytes[:, None, None]
        stages, _ = split_layers(np.where(fits, compute, np.inf))
        return stages

    def _step(self, cand: PlanLinks, stages: list[tuple[int, int]]) -> tuple[float, Step | None]:
        """Step time of the candidate with this split (inf if a stage does not fit)."""
        a = np.array([st[0] for st in stages])
        b = np.array([st[1] for st in stages])
        if (self.mem_need[a, b] > cand.memory_bytes).any():
            return np.inf, None
        flops = self._flops(cand.pipelines.shape[0])[a, b]
        inputs = step_inputs(cand, flops, self.payload[a, b], self.config,
                             self.num_micro_batches, self.sync)
        times = replay_fast(inputs)
        return times.step_s, (inputs, times)

    def _best(self, cand: PlanLinks) -> tuple[float, list[tuple[int, int]], Step | None]:
        s_count = cand.pipelines.shape[1]
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
        best: tuple[float, list[tuple[int, int]], Step | None] = (np.inf, options[0], None)
        for stages in options:
            cost, detail = self._step(cand, stages)
            if cost < best[0]:
                best = (cost, stages, detail)
        return best

    def least_stage_memory(self, num_stages: int) -> float:
        """Bytes the fullest stage needs at least, over every split into `num_stages` stages:
        more than every device's memory means that no plan of this many stages fits."""
        need = np.broadcast_to(self.mem_need, (num_stages, *self.mem_need.shape))
        return split_layers(need)[1]

    # ---------------------------------------------------------------- Objective protocol

    def cost(self, pipelines: np.ndarray) -> float:
        """Predicted step time in seconds (inf when the candidate cannot fit in memory)."""
        return float(self._best(self._candidate(pipelines))[0])

    def choose_stages(self, pipelines: np.ndarray) -> list[tuple[int, int]]:
        """The layer split `cost` assumes for this candidate."""
        return list(self._best(self._candidate(pipelines))[1])

    def breakdown(self, pipelines: np.ndarray) -> CostBreakdown:
        """Step time with compute / bubble / exposed PP and DP parts and the chosen split."""
        cost, stages, detail = self._best(self._candidate(pipelines))
        return self._breakdown(cost, stages, detail)

    def polish(self, pipelines: np.ndarray, max_replays: int = 2000,
               deadline: float = math.inf) -> CostBreakdown:
        """`breakdown` after a local search on the split: move one stage boundary by one layer
        while the replayed step gets shorter (steepest descent, at most `max_replays` replays,
        none once time.perf_counter() passes `deadline`).
        Never worse than `breakdown`; meant for a final plan (the DP split of `cost` is within
        a few percent of it), not for the search's hot path. A fixed split is kept as it is."""
        cand = self._candidate(pipelines)
        cost, stages, detail = self._best(cand)
        if detail is None or self.fixed_stages is not None:
            return self._breakdown(cost, stages, detail)
        bounds = [0] + [b for _, b in stages]
        replays = 0
        while replays < max_replays and time.perf_counter() < deadline:
            best_move = None
            for i in range(1, len(bounds) - 1):
                if time.perf_counter() > deadline:
                    break
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
        return self._breakdown(cost, list(zip(bounds[:-1], bounds[1:])), detail)

    def _breakdown(self, cost: float, stages: list[tuple[int, int]],
                   detail: Step | None) -> CostBreakdown:
        if detail is None:
            return CostBreakdown(self.name, float("inf"), {}, list(stages))
        inputs, times = detail
        free = replay_fast(no_transfers(inputs)).makespan_s
        tokens = inputs.pipelines.shape[0] * self.num_micro_batches * self.tokens
        step = step_breakdown(inputs, times, free, tokens)
        parts = {
            "step_s": step.step_s,
            "compute_s": step.compute_s,
            "bubble_s": step.bubble_s,
            "pp_comm_s": step.pp_comm_s,
            "tied_comm_s": step.tied_comm_s,
            "dp_comm_s": step.dp_comm_s,
            "dp_comm_per_round_s": step.dp_comm_round_s,
            "dp_hidden_s": step.dp_hidden_s,
            "dp_sync_per_round_s": step.dp_sync_round_s,
            "dp_allreduce_max_s": max(step.dp_allreduce_s, default=0.0),
            "tokens_per_s": step.tokens_per_s,
            "pp_bytes_per_step": step.pp_bytes_per_step,
            "dp_bytes_per_step": step.dp_bytes_per_step,
        }
        return CostBreakdown(self.name, float(cost), parts, list(stages))
