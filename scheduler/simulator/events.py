"""The discrete-event engine: tasks on devices and links, and the step replayed on it.

A general engine (any task graph), a few hundred times slower than the vectorised replay
(replay.py); it draws the timeline and checks the fast path (the tests assert that they agree).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduler.simulator.kernel import StepInputs, StepTimes, step_times


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
        resource_of, ordered = self.resource_of, self._res_ordered
        dependents, remaining, program = self._wiring()
        queue: list[list[tuple[float, int]]] = [[] for _ in range(n_res)]
        ready = [False] * (n + 1)
        start = [float("nan")] * n
        end = [float("nan")] * n
        # (time, kind, id): kind 0 = task `id` ended, 1 = resource `id` free, 2 = both at once
        # (a task without latency; id is the task). Ends sort before frees at equal times.
        events: list[tuple[float, int, int]] = []
        pop = heapq.heappop
        try_start, finished, busy = _handlers(self, program, queue, ready, start, end, events,
                                              dependents, remaining)
        for t in range(n):
            if remaining[t] == 0:
                ready[t] = True
                if not ordered[resource_of[t]]:
                    heapq.heappush(queue[resource_of[t]], (0.0, t))
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

    def _wiring(self) -> tuple[list[list[int]], list[int], list[list[int]]]:
        """(dependents of each task, its count of unfinished dependencies, each resource's
        program of task ids ending in the sentinel -1)."""
        n, n_res = len(self.duration), len(self._res_ordered)
        dependents: list[list[int]] = [[] for _ in range(n)]
        remaining = [len(d) for d in self.deps]
        for t, ds in enumerate(self.deps):
            for d in ds:
                dependents[d].append(t)
        program: list[list[int]] = [[] for _ in range(n_res)]
        for t, res in enumerate(self.resource_of):
            program[res].append(t)
        for prog in program:
            prog.append(-1)  # sentinel: program finished
        return dependents, remaining, program


def _handlers(graph: EventEngine, program: list[list[int]], queue: list[list[tuple[float, int]]],
              ready: list[bool], start: list[float], end: list[float],
              events: list[tuple[float, int, int]], dependents: list[list[int]],
              remaining: list[int]) -> tuple[Callable[[int, float], None],
                                             Callable[[int, float], None], list[bool]]:
    """The replay's two event handlers over its state (closures: the hot loop reads cells, not
    attributes): (try_start(resource, now), finished(task, now), busy flag per resource)."""
    duration, latency, resource_of = graph.duration, graph.latency, graph.resource_of
    ordered = graph._res_ordered
    pointer = [0] * len(ordered)
    busy = [False] * len(ordered)
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

    return try_start, finished, busy


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


def _device(eng: EventEngine, d: int) -> int:
    return eng.resource(("dev", int(d)), ordered=True)


def _link(eng: EventEngine, a: int, b: int) -> int:
    return eng.resource(("link", int(a), int(b)), ordered=False)


def _add_forwards(eng: EventEngine, inputs: StepInputs, r: int, tasks: list[int]) -> None:
    """Replica r's forwards, stage by stage in micro-batch order, and its activation sends."""
    chain = inputs.pipelines[r].tolist()
    t_fwd, tx, lat = inputs.t_fwd[r].tolist(), inputs.fwd_tx[r].tolist(), inputs.fwd_lat[r].tolist()
    s_count = len(chain)
    sent: list[int] = []
    for s, d in enumerate(chain):
        now_sent = []
        res_d = _device(eng, d)
        res_l = _link(eng, d, chain[s + 1]) if s < s_count - 1 else -1
        for m in range(inputs.num_micro_batches):
            f = eng.task(res_d, t_fwd[s], [sent[m]] if s else [], row=d, kind="fwd",
                         label=f"F{m}")
            tasks.append(f)
            if s < s_count - 1:
                x = eng.task(res_l, tx[s], [f], lat[s], row=d, kind="send", label=f"a{m}")
                tasks.append(x)
                now_sent.append(x)
        sent = now_sent


def _add_backwards(eng: EventEngine, inputs: StepInputs, r: int, tasks: list[int],
                   last_bwd: dict[tuple[int, int], int]) -> None:
    """Replica r's backwards, last stage first, micro-batches in reverse, and its gradient
    sends; records the last backward of each stage in `last_bwd[(r, s)]`."""
    chain = inputs.pipelines[r].tolist()
    t_bwd, tx, lat = inputs.t_bwd[r].tolist(), inputs.bwd_tx[r].tolist(), inputs.bwd_lat[r].tolist()
    s_count = len(chain)
    grads: dict[int, int] = {}
    for s in range(s_count - 1, -1, -1):
        d = chain[s]
        now_grads = {}
        res_d = _device(eng, d)
        res_l = _link(eng, d, chain[s - 1]) if s > 0 else -1
        for m in range(inputs.num_micro_batches - 1, -1, -1):
            b = eng.task(res_d, t_bwd[s], [grads[m]] if s < s_count - 1 else [], row=d,
                         kind="bwd", label=f"B{m}")
            tasks.append(b)
            last_bwd[(r, s)] = b
            if s > 0:
                x = eng.task(res_l, tx[s - 1], [b], lat[s - 1], row=d, kind="send",
                             label=f"g{m}")
                tasks.append(x)
                now_grads[m] = x
        grads = now_grads


def _add_tied_sums(eng: EventEngine, inputs: StepInputs, last_bwd: dict[tuple[int, int], int],
                   after: dict[tuple[int, int], list[int]]) -> list[int]:
    """Tied embeddings: a 2-rank all-reduce between each replica's end stages, 2 steps both
    ways; the end stages' rings wait for it (modules/train/trainer.py orders them so): `after` is
    updated. Returns the tasks."""
    r_count, s_count = inputs.pipelines.shape
    if inputs.tied_tx is None or inputs.tied_lat is None or s_count < 2:
        return []
    tied_tx, tied_lat = inputs.tied_tx.tolist(), inputs.tied_lat.tolist()
    gloo = inputs.tied_gloo_bytes is not None
    if gloo:  # gloo's segmented all-reduce: one box per direction, as long as the whole sum
        tied_s = inputs.tied_s
        assert tied_s is not None
        tied_tx, tied_lat = [[t, t] for t in tied_s.tolist()], [[0.0, 0.0]] * r_count
    tasks: list[int] = []
    for r in range(r_count):
        pair = (int(inputs.pipelines[r, 0]), int(inputs.pipelines[r, -1]))
        prev = [last_bwd[(r, 0)], last_bwd[(r, s_count - 1)]]
        for step in range(1 if gloo else 2):
            prev = [eng.task(_link(eng, pair[k], pair[1 - k]), tied_tx[r][k], prev,
                             tied_lat[r][k], row=pair[k], kind="tied", label=f"tied {step}")
                    for k in range(2)]
            tasks += prev
        after[(r, 0)] = after[(r, s_count - 1)] = prev
    return tasks


def _add_rings(eng: EventEngine, inputs: StepInputs, after: dict[tuple[int, int], list[int]]
               ) -> list[tuple[list[int], list[int]]]:
    """Each stage group's ring all-reduce after what its replicas wait for; per stage, (the
    tasks it waited for, its last step's tasks)."""
    r_count, s_count = inputs.pipelines.shape
    spans = []
    gloo_s = None if inputs.gloo_bytes is None else inputs.dp_times().tolist()
    for s in range(s_count):
        ring = inputs.rings[s].tolist()
        tx, lat = inputs.ring_tx[s].tolist(), inputs.ring_lat[s].tolist()
        n = len(ring)
        first = prev = [t for r in range(r_count) for t in after[(r, s)]]
        steps = 2 * (n - 1)
        if gloo_s is not None:  # gloo's segmented all-reduce: one box per link, the whole of it
            tx, lat, steps = [gloo_s[s]] * n, [0.0] * n, min(1, n - 1)
        label = "gloo all-reduce" if gloo_s is not None else "ring {}"
        if inputs.direct_tx is not None and n > 1:
            assert inputs.direct_lat is not None and inputs.direct_sender is not None
            prev = _add_direct_reduce_scatter(eng, s, inputs.direct_sender[s],
                                              inputs.direct_tx[s], inputs.direct_lat[s], prev)
            steps = n - 1  # then the ring all-gather
        for step in range(steps):
            prev = [eng.task(_link(eng, ring[i], ring[(i + 1) % n]), tx[i], prev, lat[i],
                             row=ring[i], kind="allreduce", label=label.format(step))
                    for i in range(n)]
        spans.append((first, prev if n > 1 else []))
    return spans


def _add_direct_reduce_scatter(eng: EventEngine, group: int, senders: np.ndarray,
                               tx: np.ndarray, lat: np.ndarray, deps: list[int]) -> list[int]:
    """The compressed all-reduce's direct reduce-scatter of data-parallel group `group`: one
    task per direct link (a sender's link into a region, collectives.direct_links; the ones that
    can be the slowest), each on a link of its own; returns the tasks."""
    return [eng.task(eng.resource(("direct", group, k), ordered=False), float(tx[k]), deps,
                     float(lat[k]), row=int(senders[k]), kind="allreduce",
                     label="reduce-scatter")
            for k in range(len(tx))]


def replay_events(inputs: StepInputs, timeline: bool = True
                  ) -> tuple[StepTimes, list[TimelineBox]]:
    """The same step as `replay_fast`, by the discrete-event engine, with its timeline."""
    eng = EventEngine()
    pipeline_tasks: list[int] = []
    last_bwd: dict[tuple[int, int], int] = {}
    for r in range(inputs.pipelines.shape[0]):
        _add_forwards(eng, inputs, r, pipeline_tasks)
        _add_backwards(eng, inputs, r, pipeline_tasks, last_bwd)
    after = {(r, s): [t] for (r, s), t in last_bwd.items()}
    tied_tasks = _add_tied_sums(eng, inputs, last_bwd, after)
    spans = _add_rings(eng, inputs, after)
    start, end = eng.run()
    b_done = np.zeros(inputs.pipelines.shape)
    for (r, s), t in last_bwd.items():
        b_done[r, s] = end[t]
    # A ring runs from the end of what it waited for (last backwards, tied sums) to its last step.
    dp_time = np.array([float(end[last].max() - end[first].max()) if last else 0.0
                        for first, last in spans])
    times = step_times(b_done, dp_time, inputs)
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
