"""Replay one training step of a plan: pipeline compute, transfers and the data-parallel sync.

Model (every number in seconds, bytes, FLOP/s):

- Compute. A device's effective speed is `tflops * 1e12 * mfu` (SimConfig.mfu, 0.4 by default:
  what large-model training reaches on tensor cores). A micro-batch of `micro_batch_size`
  sequences through layers [a, b) costs model.stage_flops_per_token(a, b) x tokens forward and
  2x that backward, plus one more forward when activations are recomputed (SimConfig.recompute,
  on by default because GPipe's stored activations do not fit otherwise, see memory.py).
- Pipeline transfers. The hidden state crossing a stage boundary is fp16:
  model.activation_bytes_per_sequence(SimConfig.activation_bytes) x micro_batch_size bytes (fp32
  on the CPU runtime: --activation-bytes 4); backward sends a gradient of
  the same size from stage s+1 to s. A message on the directed link i -> j keeps the link busy
  for bytes * 8 / bandwidth and arrives latency later; a link sends one message at a time, later
  ones queue (FIFO). Sending does not stop the sender's compute (separate streams). Links are
  the cluster's directed device pairs; two pairs never share capacity.
- Schedule: GPipe. Each device runs the forwards of micro-batches 0..m-1 in order, then the
  backwards in reverse order m-1..0 (as modules/pipeline.py does).
- Data-parallel sync of stage group s (its R devices): a ring all-reduce over the devices in
  ring order (ring_order: greedy nearest neighbour, best start). It has 2(R-1) steps; in each
  step every device sends B/R bytes to its ring successor and the next step starts when the
  slowest link of the step is done, so it takes 2(R-1) x max over ring links (latency +
  B/R * 8 / bandwidth) = 2(R-1)/R * B/bw + 2(R-1) * latency for equal links (latency x
  SimConfig.collective_latency_factor: 2 for gloo's rendezvous point-to-point). B = stage parameters
  x 4 (fp32, compression none) | 2 (fp16) | 1 + 4 / int8_block (int8 with one fp32 scale per
  block). It starts when every replica of the stage has finished its last backward, so it
  overlaps with the backward of earlier stages.
- Tied embeddings (model.tie_embeddings, S > 1): the first and the last stage of a replica each
  hold a copy of the embedding matrix and sum their fp32 gradients every step (inner steps too)
  with a 2-rank all-reduce: 2 x max over the two directions (latency + B/2 * 8 / bandwidth),
  B = vocab x d_model x 4. It starts when both ends finished backward; the stage groups of the
  two end stages start their all-reduce after it (as modules/trainer.py orders them).
- DiLoCo outer steps also pay SimConfig.outer_store_round_trips round trips between the
  farthest device and the rendezvous store on device 0 (membership agreement), per round.
- Step time = max(pipeline makespan, end of the last all-reduce) with mode `allreduce`. With
  `diloco` the outer all-reduce runs once every H inner steps: its exposed time (the same overlap
  rule) is paid once per outer round and amortised as exposed / H per step.
- Not modelled: the optimizer step's compute, contention between different links of one host,
  stragglers and jitter.

Two replays of the same model: `fast_replay` (numpy max-plus recurrences, vectorised over
replicas and micro-batches; what the planner's objective and `simulate(timeline=False)` call)
and `EventEngine` (a general discrete-event engine over tasks on devices and links, a few hundred
times slower; makes the timeline and checks the fast path, tests assert that they agree).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from formats.cluster import Cluster
from formats.errors import UserError
from formats.models import ModelSpec, get_model
from formats.plan import Plan, SyncConfig, validate_plan
from scheduler.memory import MemoryConfig, check_plan_memory, stage_memory


@dataclass(frozen=True)
class SimConfig:
    """Knobs of the performance model."""

    mfu: float = 0.4
    """Fraction of a device's peak `tflops` that training reaches (model FLOPs utilisation)."""
    recompute: bool = True
    """Activation checkpointing: backward re-runs the forward (1 extra forward of FLOPs)."""
    reserved_gb: float = 1.0
    """Per-device memory overhead (CUDA context, buffers), GB."""
    int8_block: int = 256
    """Values per fp32 scale in the int8 all-reduce payload."""
    activation_bytes: int = 2
    """Bytes per value of the hidden state sent between stages: 2 for fp16/bf16 activations on
    GPUs, 4 for the fp32 CPU runtime."""
    collective_latency_factor: float = 1.0
    """One-way latencies each all-reduce step costs. 1: data leaves as soon as it is ready;
    2: gloo, whose point-to-point is a rendezvous (a step's receiver announces its buffer
    before the data flows; measured: a 2-rank all-reduce of 0.9-4 MB over a 59 ms link takes
    2 x (2 x 59 ms + transfer))."""

    outer_store_round_trips: int = 0
    """DiLoCo: sequential round trips to the rendezvous store (hosted by device 0) that each
    outer step spends agreeing on the live replicas before and after averaging. The elastic
    CPU runtime does 3: wait for every member, wait for every member's confirmation, the
    commit decision (a TCPStore `set` is one-way; `wait` and `compare_set` take one round trip,
    measured over a 67 ms link)."""

    def validate(self) -> None:
        """UserError naming the setting that is out of range."""
        if not 0.0 < self.mfu <= 1.0:
            raise UserError(f"--mfu: must be in (0, 1], got {self.mfu}")
        if not 0 <= self.outer_store_round_trips <= 100:
            raise UserError("--outer-store-round-trips: must be in [0, 100], got "
                            f"{self.outer_store_round_trips}")
        if not 1.0 <= self.collective_latency_factor <= 10.0:
            raise UserError("--collective-latency-factor: must be in [1, 10], got "
                            f"{self.collective_latency_factor}")
        if self.activation_bytes not in (1, 2, 4):
            raise UserError(f"--activation-bytes: must be 1, 2 or 4, got {self.activation_bytes}")

    def memory(self) -> MemoryConfig:
        """The memory estimate's settings."""
        return MemoryConfig(recompute=self.recompute, reserved_gb=self.reserved_gb)

    @property
    def backward_factor(self) -> float:
        """Backward compute time as a multiple of forward."""
        return 3.0 if self.recompute else 2.0


def payload_bytes_per_param(compression: str, int8_block: int = 256) -> float:
    """Bytes per parameter of the data-parallel all-reduce payload."""
    return {"none": 4.0, "fp16": 2.0, "int8": 1.0 + 4.0 / int8_block}[compression]


def ring_allreduce_time(lat_s: np.ndarray, bits_per_s: np.ndarray, payload_bytes: float) -> float:
    """Seconds of a ring all-reduce of `payload_bytes` over ring links with these latencies and
    bandwidths (link i: ring[i] -> ring[i+1]): 2(n-1) x max_i(lat_i + B/n*8/bw_i)."""
    n = len(lat_s)
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) * float(np.max(lat_s + payload_bytes / n * 8.0 / bits_per_s))


def ring_order(group: np.ndarray, lat_s: np.ndarray, bits_per_s: np.ndarray,
               chunk_bytes: float) -> np.ndarray:
    """A ring through `group` with a small bottleneck step time (lat + chunk*8/bw): greedy
    nearest neighbour from every start at once, the ring with the smallest bottleneck kept
    (first start on ties). O(n^2) numpy work for n devices."""
    group = np.asarray(group, dtype=np.int64)
    n = len(group)
    if n <= 2:
        return group.copy()
    w = lat_s[np.ix_(group, group)] + chunk_bytes * 8.0 / bits_per_s[np.ix_(group, group)]
    np.fill_diagonal(w, np.inf)
    starts = np.arange(n)
    order = np.empty((n, n), dtype=np.int64)
    order[:, 0] = starts
    used = np.eye(n, dtype=bool)  # row k: devices already on the ring started at k
    worst = np.zeros(n)
    for step in range(1, n):
        row = np.where(used, np.inf, w[order[:, step - 1]])
        nxt = row.argmin(axis=1)
        worst = np.maximum(worst, row[starts, nxt])
        used[starts, nxt] = True
        order[:, step] = nxt
    worst = np.maximum(worst, w[order[:, -1], order[:, 0]])
    return group[order[int(np.argmin(worst))]]


def ring_chunk_bytes(model: ModelSpec, num_stages: int, num_replicas: int, compression: str,
                     int8_block: int = 256) -> float:
    """Chunk size the ring order is chosen for: an even stage's payload / R (any split)."""
    per_param = payload_bytes_per_param(compression, int8_block)
    return model.total_params() * per_param / num_stages / max(1, num_replicas)


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
    rings: list[np.ndarray]
    """Per stage, its group's devices in ring order."""
    ring_tx: list[np.ndarray]
    """Per stage, (R,) busy seconds of ring link i (ring[i] -> ring[i+1]) per all-reduce step."""
    ring_lat: list[np.ndarray]
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
        return 2.0 * (self.tied_tx + self.tied_lat).max(axis=1)

    def dp_times(self) -> np.ndarray:
        """(S,) seconds of each stage group's all-reduce."""
        return np.array([2.0 * (len(tx) - 1) * float(np.max(tx + lat)) if len(tx) > 1 else 0.0
                         for tx, lat in zip(self.ring_tx, self.ring_lat)])


def fast_replay(t_fwd: np.ndarray, t_bwd: np.ndarray, fwd_tx: np.ndarray, fwd_lat: np.ndarray,
                bwd_tx: np.ndarray, bwd_lat: np.ndarray,
                num_micro_batches: int) -> tuple[np.ndarray, np.ndarray]:
    """GPipe step of every replica at once -> (end of last forward, end of last backward), each
    (R, S). Max-plus recurrences solved with cumulative maxima:
    end[m] = max(ready[m], end[m-1]) + t  <=>  end[m] = (m+1) t + cummax_k<=m(ready[k] - k t),
    and the same for a FIFO link (start[m] = max(ready[m], start[m-1] + tx)). O(R S m)."""
    r, s_count = t_fwd.shape
    k = np.arange(num_micro_batches, dtype=float)
    k1 = k + 1.0
    cummax = np.maximum.accumulate
    arrive = np.zeros((r, num_micro_batches))
    f_done = np.empty((r, s_count))
    for s in range(s_count):
        tf = t_fwd[:, s, None]
        end = k1 * tf + cummax(arrive - k * tf, axis=1)
        f_done[:, s] = end[:, -1]
        if s < s_count - 1:
            tx = fwd_tx[:, s, None]
            arrive = k * tx + cummax(end - k * tx, axis=1) + tx + fwd_lat[:, s, None]
    # Backward: index j is micro-batch m-1-j; the last stage's loss is ready after its forwards.
    arrive = np.zeros((r, num_micro_batches))
    b_done = np.empty((r, s_count))
    for s in range(s_count - 1, -1, -1):
        tb = t_bwd[:, s, None]
        ready = np.maximum(arrive, f_done[:, s, None])
        end = k1 * tb + cummax(ready - k * tb, axis=1)
        b_done[:, s] = end[:, -1]
        if s > 0:
            tx = bwd_tx[:, s - 1, None]
            arrive = k * tx + cummax(end - k * tx, axis=1) + tx + bwd_lat[:, s - 1, None]
    return f_done, b_done


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


def outer_agreement_time(pipelines: np.ndarray, lat_s: np.ndarray, sync: SyncConfig,
                         config: SimConfig) -> float:
    """Seconds of a DiLoCo outer step's store round trips (0 with allreduce or one replica)."""
    if sync.mode != "diloco" or pipelines.shape[0] < 2 or not config.outer_store_round_trips:
        return 0.0
    rtt = lat_s[pipelines.ravel(), 0] + lat_s[0, pipelines.ravel()]
    return config.outer_store_round_trips * float(rtt.max())


def tied_links(pipelines: np.ndarray, lat_s: np.ndarray, bits_per_s: np.ndarray,
               model: ModelSpec) -> tuple[np.ndarray, np.ndarray] | None:
    """(busy seconds, latency), each (R, 2), of one step of each replica's tied-embedding sum on
    the links first -> last stage and back (None: embeddings not tied or one stage)."""
    if not model.tie_embeddings or pipelines.shape[1] < 2:
        return None
    a, b = pipelines[:, 0], pipelines[:, -1]
    half_bits = model.vocab_size * model.d_model * 4 / 2 * 8.0  # each step moves half of fp32
    return (half_bits / np.stack([bits_per_s[a, b], bits_per_s[b, a]], axis=1),
            np.stack([lat_s[a, b], lat_s[b, a]], axis=1))


def tied_sum_times(pipelines: np.ndarray, lat_s: np.ndarray, bits_per_s: np.ndarray,
                   model: ModelSpec) -> np.ndarray | None:
    """(R,) seconds of each replica's 2-rank all-reduce of the tied embedding gradient: 2 steps,
    each as long as its slower direction."""
    links = tied_links(pipelines, lat_s, bits_per_s, model)
    return None if links is None else 2.0 * (links[0] + links[1]).max(axis=1)


def replay_fast(inputs: StepInputs) -> StepTimes:
    """The step time of `inputs` by the vectorised recurrences."""
    _, b_done = fast_replay(inputs.t_fwd, inputs.t_bwd, inputs.fwd_tx, inputs.fwd_lat,
                            inputs.bwd_tx, inputs.bwd_lat, inputs.num_micro_batches)
    return step_times(b_done, inputs.dp_times(), inputs.inner_steps, inputs.tied_s,
                      inputs.agree_s)


# --------------------------------------------------------------------------- event engine


class EventEngine:
    """Discrete-event replay of tasks on resources. A device runs its tasks in the order they
    were added (a program); a link serves ready messages first come, first served. A task starts
    when its dependencies have ended and its resource is free; it holds the resource for
    `duration` and ends `latency` later (a message in flight no longer occupies its link)."""

    def __init__(self) -> None:
        self._res_ordered: list[bool] = []
        self._res_names: dict[Any, int] = {}
        self.resource_of: list[int] = []
        self.duration: list[float] = []
        self.latency: list[float] = []
        self.deps: list[list[int]] = []
        self.info: list[tuple[int, str, str]] = []
        """(timeline row, kind, label) per task."""

    def resource(self, name: Any, ordered: bool) -> int:
        """Id of the resource called `name`, created on first use."""
        if name not in self._res_names:
            self._res_names[name] = len(self._res_ordered)
            self._res_ordered.append(ordered)
        return self._res_names[name]

    def task(self, resource: int, duration: float, deps: list[int], latency: float = 0.0,
             row: int = -1, kind: str = "", label: str = "") -> int:
        """Add a task; returns its id."""
        self.resource_of.append(resource)
        self.duration.append(duration)
        self.latency.append(latency)
        self.deps.append(deps)
        self.info.append((row, kind, label))
        return len(self.duration) - 1

    def run(self) -> tuple[np.ndarray, np.ndarray]:
        """Replay every task -> (start, end) arrays indexed by task id."""
        n, n_res = len(self.duration), len(self._res_ordered)
        duration, latency, resource_of = self.duration, self.latency, self.resource_of
        ordered = self._res_ordered
        dependents: list[list[int]] = [[] for _ in range(n)]
        remaining = [len(d) for d in self.deps]
        for t, ds in enumerate(self.deps):
            for d in ds:
                dependents[d].append(t)
        program: list[list[int]] = [[] for _ in range(n_res)]
        for t, res in enumerate(resource_of):
            program[res].append(t)
        for prog in program:
            prog.append(-1)  # sentinel: program finished
        pointer = [0] * n_res
        queue: list[list[tuple[float, int]]] = [[] for _ in range(n_res)]
        busy = [False] * n_res
        ready = [False] * (n + 1)
        start = [float("nan")] * n
        end = [float("nan")] * n
        # (time, kind, id): kind 0 = task `id` ended, 1 = resource `id` free, 2 = both at once
        # (a task without latency; id is the task). Ends sort before frees at equal times.
        events: list[tuple[float, int, int]] = []
        push, pop = heapq.heappush, heapq.heappop

        def try_start(res: int, now: float) -> None:
            if busy[res]:
                return
            if ordered[res]:
                t = program[res][pointer[res]]
                if not ready[t]:  # also stops at the sentinel (ready[-1] stays False)
                    return
                pointer[res] += 1
            else:
                if not queue[res]:
                    return
                t = pop(queue[res])[1]
            busy[res] = True
            start[t] = now
            free = now + duration[t]
            if latency[t] == 0.0:
                end[t] = free
                push(events, (free, 2, t))
            else:
                end[t] = free + latency[t]
                push(events, (free, 1, res))
                push(events, (end[t], 0, t))

        def finished(t: int, now: float) -> None:
            for d in dependents[t]:
                remaining[d] -= 1
                if remaining[d] == 0:
                    ready[d] = True
                    res = resource_of[d]
                    if not ordered[res]:
                        push(queue[res], (now, d))
                    try_start(res, now)

        for t in range(n):
            if remaining[t] == 0:
                ready[t] = True
                if not ordered[resource_of[t]]:
                    push(queue[resource_of[t]], (0.0, t))
        for res in range(n_res):
            try_start(res, 0.0)
        while events:
            now, kind, ident = pop(events)
            if kind == 1:
                busy[ident] = False
                try_start(ident, now)
            elif kind == 0:
                finished(ident, now)
            else:
                finished(ident, now)
                res = resource_of[ident]
                busy[res] = False
                try_start(res, now)
        start_a, end_a = np.array(start), np.array(end)
        assert not np.isnan(end_a).any(), "a task never ran: dependency cycle or program order"
        return start_a, end_a


@dataclass
class TimelineBox:
    """One box of the Gantt chart."""

    device: int
    kind: str
    """`fwd`, `bwd`, `send` (pipeline transfer, on the sender's row), `tied` (tied-embedding sum
    step, on the sender's row) or `allreduce`."""
    start_s: float
    end_s: float
    """Transfers: when the link is free again."""
    label: str
    latency_s: float = 0.0
    """Transfers: the message arrives this long after end_s."""


def replay_events(inputs: StepInputs, timeline: bool = True
                  ) -> tuple[StepTimes, list[TimelineBox]]:
    """The same step as `replay_fast`, by the discrete-event engine, with its timeline."""
    eng = EventEngine()
    pipe = inputs.pipelines.tolist()
    t_fwd, t_bwd = inputs.t_fwd.tolist(), inputs.t_bwd.tolist()
    fwd_tx, fwd_lat = inputs.fwd_tx.tolist(), inputs.fwd_lat.tolist()
    bwd_tx, bwd_lat = inputs.bwd_tx.tolist(), inputs.bwd_lat.tolist()
    r_count, s_count = inputs.pipelines.shape
    m_count = inputs.num_micro_batches
    dev = lambda d: eng.resource(("dev", int(d)), ordered=True)
    link = lambda a, b: eng.resource(("link", int(a), int(b)), ordered=False)
    pipeline_tasks: list[int] = []
    last_bwd: dict[tuple[int, int], int] = {}
    for r in range(r_count):
        sent: list[int] = []
        for s in range(s_count):
            d = pipe[r][s]
            now_sent = []
            res_d = dev(d)
            res_l = link(d, pipe[r][s + 1]) if s < s_count - 1 else -1
            for m in range(m_count):
                f = eng.task(res_d, t_fwd[r][s], [sent[m]] if s else [], row=d,
                             kind="fwd", label=f"F{m}")
                pipeline_tasks.append(f)
                if s < s_count - 1:
                    x = eng.task(res_l, fwd_tx[r][s], [f], fwd_lat[r][s], row=d, kind="send",
                                 label=f"a{m}")
                    pipeline_tasks.append(x)
                    now_sent.append(x)
            sent = now_sent
        grads: dict[int, int] = {}
        for s in range(s_count - 1, -1, -1):
            d = pipe[r][s]
            now_grads = {}
            res_d = dev(d)
            res_l = link(d, pipe[r][s - 1]) if s > 0 else -1
            for m in range(m_count - 1, -1, -1):
                b = eng.task(res_d, t_bwd[r][s], [grads[m]] if s < s_count - 1 else [],
                             row=d, kind="bwd", label=f"B{m}")
                pipeline_tasks.append(b)
                last_bwd[(r, s)] = b
                if s > 0:
                    x = eng.task(res_l, bwd_tx[r][s - 1], [b], bwd_lat[r][s - 1], row=d,
                                 kind="send", label=f"g{m}")
                    pipeline_tasks.append(x)
                    now_grads[m] = x
            grads = now_grads
    # Tied embeddings: 2-rank all-reduce between each replica's end stages, 2 steps both ways;
    # the end stages' rings wait for it (modules/trainer.py orders them so).
    after = {(r, s): [t] for (r, s), t in last_bwd.items()}
    tied_tasks: list[int] = []
    if inputs.tied_tx is not None and inputs.tied_lat is not None and s_count > 1:
        tied_tx, tied_lat = inputs.tied_tx.tolist(), inputs.tied_lat.tolist()
        for r in range(r_count):
            pair = (pipe[r][0], pipe[r][-1])
            prev = [last_bwd[(r, 0)], last_bwd[(r, s_count - 1)]]
            for step in range(2):
                prev = [eng.task(link(pair[k], pair[1 - k]), tied_tx[r][k], prev, tied_lat[r][k],
                                 row=pair[k], kind="tied", label=f"tied {step}")
                        for k in range(2)]
                tied_tasks += prev
            after[(r, 0)] = after[(r, s_count - 1)] = prev
    ring_first: list[list[int]] = []
    ring_last: list[list[int]] = []
    for s in range(s_count):
        ring = inputs.rings[s].tolist()
        tx, lat = inputs.ring_tx[s].tolist(), inputs.ring_lat[s].tolist()
        n = len(ring)
        prev = [t for r in range(r_count) for t in after[(r, s)]]
        ring_first.append(prev)
        for step in range(2 * (n - 1)):
            prev = [eng.task(link(ring[i], ring[(i + 1) % n]), tx[i], prev, lat[i],
                             row=ring[i], kind="allreduce", label=f"ring {step}")
                    for i in range(n)]
        ring_last.append(prev if n > 1 else [])
    start, end = eng.run()
    b_done = np.zeros((r_count, s_count))
    for (r, s), t in last_bwd.items():
        b_done[r, s] = end[t]
    # A ring runs from the end of what it waited for (last backwards, tied sums) to its last step.
    dp_time = np.array([float(end[last].max() - end[first].max()) if last else 0.0
                        for first, last in zip(ring_first, ring_last)])
    times = step_times(b_done, dp_time, inputs.inner_steps, inputs.tied_s, inputs.agree_s)
    # step_times adds the tied sums arithmetically; the events must end at the same time.
    for tasks, when in ((pipeline_tasks, times.pipeline_s),
                        (pipeline_tasks + tied_tasks, times.makespan_s)):
        assert abs(float(end[tasks].max()) - when) <= 1e-9 * max(1.0, when)
    if not timeline:
        return times, []
    latency = eng.latency
    starts, ends = start.tolist(), (end - np.array(latency)).tolist()
    boxes = [TimelineBox(row, kind, starts[t], ends[t], label, latency[t])
             for t, (row, kind, label) in enumerate(eng.info)]
    return times, boxes


# --------------------------------------------------------------------------- plans


class LinkTables:
    """Per-cluster arrays the simulator gathers from: latency (s), bandwidth (bit/s), speeds."""

    def __init__(self, cluster: Cluster, config: SimConfig) -> None:
        self.lat_s = np.array(cluster.latency_ms, dtype=float) / 1e3
        self.bits_per_s = np.array(cluster.bandwidth_gbps, dtype=float) * 1e9
        np.fill_diagonal(self.bits_per_s, np.inf)
        np.fill_diagonal(self.lat_s, 0.0)
        self.flops_per_s = np.array([d.tflops for d in cluster.devices]) * 1e12 * config.mfu
        self.memory_bytes = np.array([d.memory_gb for d in cluster.devices]) * 1e9


def build_inputs(tables: LinkTables, model: ModelSpec, stages: list[tuple[int, int]],
                 pipelines: np.ndarray, sync: SyncConfig, micro_batch_size: int,
                 num_micro_batches: int, config: SimConfig,
                 rings: list[np.ndarray] | None = None) -> StepInputs:
    """Turn a plan into per-device and per-link seconds (rings chosen here unless given)."""
    pipe = np.asarray(pipelines, dtype=np.int64)
    tokens = micro_batch_size * model.seq_len
    flops = np.array([model.stage_flops_per_token(a, b) for a, b in stages]) * tokens
    t_fwd = flops[None, :] / tables.flops_per_s[pipe]
    msg_bits = model.activation_bytes_per_sequence(config.activation_bytes) * micro_batch_size * 8.0
    src, dst = pipe[:, :-1], pipe[:, 1:]
    per_param = payload_bytes_per_param(sync.compression, config.int8_block)
    n = pipe.shape[0]
    chunk = ring_chunk_bytes(model, len(stages), n, sync.compression, config.int8_block)
    tied = tied_links(pipe, tables.lat_s * config.collective_latency_factor, tables.bits_per_s,
                      model)
    ring_list, ring_tx, ring_lat = [], [], []
    for s, (a, b) in enumerate(stages):
        payload = model.stage_params(a, b) * per_param
        # The ring is chosen for an even stage's chunk, as SimulatedObjective does, so both agree.
        ring = rings[s] if rings is not None else ring_order(
            np.sort(pipe[:, s]), tables.lat_s, tables.bits_per_s, chunk)
        nxt = np.roll(ring, -1)
        ring_list.append(np.asarray(ring))
        ring_tx.append(payload / n * 8.0 / tables.bits_per_s[ring, nxt])
        ring_lat.append(tables.lat_s[ring, nxt] * config.collective_latency_factor)
    return StepInputs(
        pipe, t_fwd, t_fwd * config.backward_factor,
        msg_bits / tables.bits_per_s[src, dst], tables.lat_s[src, dst],
        msg_bits / tables.bits_per_s[dst, src], tables.lat_s[dst, src],
        ring_list, ring_tx, ring_lat, num_micro_batches,
        sync.inner_steps if sync.mode == "diloco" else 1,
        *(tied or (None, None)),
        outer_agreement_time(pipe, tables.lat_s, sync, config))


def no_transfers(inputs: StepInputs) -> StepInputs:
    """The same step with free pipeline transfers and tied sums (to measure what they expose)."""
    zero = np.zeros_like(inputs.fwd_tx)
    return StepInputs(inputs.pipelines, inputs.t_fwd, inputs.t_bwd, zero, zero, zero, zero,
                      inputs.rings, inputs.ring_tx, inputs.ring_lat, inputs.num_micro_batches,
                      inputs.inner_steps, None, None, inputs.agree_s)


@dataclass
class SimResult:
    """What `simulate` prints: step time, its parts, throughput and the timeline."""

    step_s: float
    makespan_s: float
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
    sync: SyncConfig
    stages: list[tuple[int, int]]
    pipelines: list[list[int]]
    memory_gb: list[tuple[int, float, float]] = field(default_factory=list)
    """(device, needed GB, available GB) per device in the plan."""
    timeline: list[TimelineBox] = field(default_factory=list)

    def parts(self) -> dict[str, float]:
        """The breakdown in seconds; compute + bubble + pp_comm + tied_comm + dp_comm = step."""
        return {"step_s": self.step_s, "compute_s": self.compute_s, "bubble_s": self.bubble_s,
                "pp_comm_s": self.pp_comm_s, "tied_comm_s": self.tied_comm_s,
                "dp_comm_s": self.dp_comm_s}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (no timeline)."""
        out: dict[str, Any] = {k: round(v, 6) for k, v in self.parts().items()}
        out.update({
            "makespan_s": round(self.makespan_s, 6),
            "dp_comm_per_round_s": round(self.dp_comm_round_s, 6),
            "dp_allreduce_s": [round(x, 6) for x in self.dp_allreduce_s],
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "sync": {"mode": self.sync.mode, "inner_steps": self.sync.inner_steps,
                     "compression": self.sync.compression},
            "stages": [list(st) for st in self.stages],
            "memory_gb": [{"device": d, "need": round(need, 3), "have": have}
                          for d, need, have in self.memory_gb],
        })
        return out


def format_sim_table(result: SimResult) -> str:
    """Human-readable breakdown of a simulated step."""
    sync = result.sync
    mode = sync.mode + (f", H={sync.inner_steps}" if sync.mode == "diloco" else "")
    rows = [
        ("step time", result.step_s),
        ("  compute (busiest device)", result.compute_s),
        ("  pipeline bubble", result.bubble_s),
        ("  exposed pipeline transfers", result.pp_comm_s),
        ("  tied-embedding gradient sum", result.tied_comm_s),
        ("  exposed data-parallel sync", result.dp_comm_s),
    ]
    lines = [f"{name:<32}{value:>12.3f} s" for name, value in rows]
    if sync.mode == "diloco":
        lines.append(f"{'  outer sync per round (exposed)':<32}{result.dp_comm_round_s:>12.3f} s")
    lines.append(f"{'slowest stage all-reduce':<32}{max(result.dp_allreduce_s, default=0):>12.3f}"
                 f" s  ({mode}, {sync.compression})")
    lines.append(f"{'tokens per step':<32}{result.tokens_per_step:>12d}")
    lines.append(f"{'tokens/s':<32}{result.tokens_per_s:>12.1f}")
    split = " ".join(str(b - a) for a, b in result.stages)
    lines.append(f"{'layers per stage':<32}{split:>12}")
    worst = max(result.memory_gb, key=lambda x: x[1] / x[2], default=None)
    if worst:
        lines.append(f"{'fullest device memory':<32}{worst[1]:>9.2f} GB of {worst[2]:g} GB"
                     f" (device {worst[0]})")
    return "\n".join(lines)


def simulate(cluster: Cluster, model: ModelSpec, stages: list[tuple[int, int]],
             pipelines: np.ndarray | list[list[int]], sync: SyncConfig, micro_batch_size: int,
             num_micro_batches: int, config: SimConfig | None = None,
             timeline: bool = True) -> SimResult:
    """Replay one step (memory checked first: UserError naming a device that overflows): by the
    event engine when a timeline is asked for, else by the vectorised replay (same numbers)."""
    config = config or SimConfig()
    pipe = np.asarray(pipelines, dtype=np.int64)
    diloco = sync.mode == "diloco"
    check_plan_memory(cluster, model, stages, pipe, micro_batch_size, num_micro_batches, diloco,
                      config.memory())
    tables = LinkTables(cluster, config)
    inputs = build_inputs(tables, model, stages, pipe, sync, micro_batch_size,
                          num_micro_batches, config)
    times, boxes = replay_events(inputs) if timeline else (replay_fast(inputs), [])
    free = replay_fast(no_transfers(inputs))
    compute = float(((inputs.t_fwd + inputs.t_bwd) * num_micro_batches).max())
    tokens = pipe.shape[0] * num_micro_batches * micro_batch_size * model.seq_len
    mem = []
    for s, (a, b) in enumerate(stages):
        need = stage_memory(model, a, b, micro_batch_size, num_micro_batches, diloco,
                            config.memory()).total_bytes / 1e9
        mem += [(int(d), need, cluster.devices[int(d)].memory_gb) for d in pipe[:, s]]
    return SimResult(
        step_s=times.step_s, makespan_s=times.makespan_s, compute_s=compute,
        bubble_s=free.makespan_s - compute, pp_comm_s=times.pipeline_s - free.makespan_s,
        tied_comm_s=times.makespan_s - times.pipeline_s,
        dp_comm_s=times.step_s - times.makespan_s, dp_comm_round_s=times.dp_exposed_round_s,
        dp_allreduce_s=[float(x) for x in times.dp_time_s], tokens_per_step=tokens,
        tokens_per_s=tokens / times.step_s, sync=sync, stages=list(stages),
        pipelines=pipe.tolist(), memory_gb=sorted(mem), timeline=boxes)


def simulate_plan(cluster: Cluster, model: ModelSpec | None, plan: Plan,
                  config: SimConfig | None = None, timeline: bool = True) -> SimResult:
    """Validate `plan` against the cluster and model, then simulate one step of it."""
    model = model or get_model(plan.model)
    validate_plan(plan, cluster, model)
    return simulate(cluster, model, plan.stages, plan.pipelines, plan.sync,
                    plan.micro_batch_size, plan.num_micro_batches, config, timeline)
