"""Measure what FLOP/s this machine's CPU reaches on a model preset (for the simulator's tflops).

The simulator predicts compute as FLOPs / (tflops x mfu). On a CPU lab the honest tflops is
the one measured for the model and micro-batch at hand, with the thread count each rank gets;
`measure_train_flops` returns it (then plan and simulate with --mfu 1.0).

The lab's ranks share the machine's cores, and how many compute at once depends on the plan
(a pipeline's ranks take turns, a 1 x N data-parallel step's all compute together), so
`measure_core_sharing` measures both ends, side by side in the same processes: one rank
computing alone and all N at once, for several rounds. Their ratio gives the cores the ranks
effectively share (the simulator's `shared_cores`: scheduler/simulator/sharing.py), and the
spread between rounds says whether the machine was quiet enough to judge by. Then all N join
one gloo group and run the runtime's own DiLoCo outer round per payload, timing each process's
CPU (the simulator's outer_*flops_per_param). `measure_fsdp_cpu` times FSDP2's own CPU beside
its collectives (the simulator's fsdp_*flops_per_unit), for plans with shard groups.

It lives beside testkit/lab.py, its user, rather than in modules/device: it builds and checks
the runtime's own model and step (modules.train), which the device layer sits below.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from formats.models import ModelSpec
from modules.model.decoder import StageModel
from modules.train.checkpoint import check_finite_state
from scheduler.simulator.sharing import slowdown_at


def _train_step(spec: ModelSpec, micro_batch_size: int, seed: int, micro_batches: int = 1
                ) -> tuple[Callable[[], float], float, torch.nn.Module]:
    """(a function timing one training step of the whole model, its FLOPs, the model): the
    runtime's GPipe order over `micro_batches` micro-batches (every forward, then every
    backward, gradients accumulating: modules/pipeline/stage.py), which is slower per FLOP than
    one micro-batch at a time (the activations of all of them live at once: 15-20% on the
    lab's 2-core Xeon, gpt-tiny, 4 x 4). FLOPs counted as the simulator does without
    recomputation, 3 x the forward FLOPs of every layer and the head."""
    model = StageModel(spec, 0, spec.num_layers, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    shape = (micro_batch_size, spec.seq_len)
    xs = [torch.randint(0, spec.vocab_size, shape, generator=gen) for _ in range(micro_batches)]
    ys = [torch.randint(0, spec.vocab_size, shape, generator=gen) for _ in range(micro_batches)]

    def step() -> float:
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        losses = [model(x, y) / micro_batches for x, y in zip(xs, ys)]
        for loss in losses:
            loss.backward()
        return time.perf_counter() - t0

    flops = (3.0 * spec.stage_flops_per_token(0, spec.num_layers) * micro_batch_size
             * spec.seq_len * micro_batches)
    return step, flops, model


def _optimizer_step(model: torch.nn.Module) -> Callable[[], float]:
    """A function timing what the runtime does per parameter after backward
    (modules/train/trainer.py): the finite check of parameters and gradients
    (check_finite_state, 1.4% of a real step) and one AdamW step, gradients in place."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1)

    def step() -> float:
        t0 = time.perf_counter()
        check_finite_state(None, model.named_parameters())
        opt.step()
        return time.perf_counter() - t0

    return step


def measure_train_flops(spec: ModelSpec, micro_batch_size: int, threads: int = 1,
                        repeats: int = 7, seed: int = 0, barrier: Any = None) -> float:
    """Forward + backward FLOP/s of the whole model on one micro-batch (median of `repeats`).

    Runs with `threads` torch threads and restores the previous count.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        step, flops, _ = _train_step(spec, micro_batch_size, seed)
        for _ in range(2):  # two warm-up rounds (allocator, kernels' first calls)
            step()
        if barrier is not None:
            barrier.wait()  # concurrent measurements overlap: every process is warm
        times = [step() for _ in range(repeats)]
    finally:
        torch.set_num_threads(before)
    return flops / statistics.median(times)


def usable_cores() -> int:
    """The cores this process (and the ranks it launches, which inherit it) may run on: its
    CPU affinity (`taskset -c 0,1` makes a 2-core lab on a bigger machine), else the count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class CoreSharing:
    """What `measure_core_sharing` measured: per round, one rank alone and all at once."""

    processes: int
    alone_flops: list[float]
    """Per round: FLOP/s of one process computing while the others wait."""
    shared_flops: list[float]
    """Per round: mean per-process FLOP/s with all `processes` computing at once."""
    cpu_count: int
    pair_flops: list[float] = field(default_factory=list)
    """Per round: mean per-process FLOP/s with 2 computing at once (empty: not measured)."""
    optimizer_s: list[float] = field(default_factory=list)
    """Per round: seconds of one AdamW step over the whole model, one process alone."""
    params: int = 0
    """The model's parameters."""
    outer_cpu_s: dict[str, float] = field(default_factory=dict)
    """By payload (none, fp16, int8): CPU seconds (all of a process's threads) one rank spent
    on a DiLoCo outer round over the whole model with all `processes` in one gloo group on
    loopback (pseudo-gradient, codec, all-reduce, Nesterov, merge), mean over ranks, median
    over rounds (empty: not measured)."""

    def outer_flops_per_param(self, compression: str) -> float:
        """An outer round's CPU per parameter in FLOPs at the speed of a core to itself (the
        simulator's outer_*flops_per_param): CPU seconds x core_flops / params (0: not
        measured)."""
        if compression not in self.outer_cpu_s or not self.params:
            return 0.0
        return self.outer_cpu_s[compression] * self.core_flops / self.params

    @property
    def optimizer_flops_per_param(self) -> float:
        """The optimizer step's CPU per parameter in FLOPs at the training speed alone (the
        simulator's `optimizer_flops_per_param`): median seconds x alone FLOP/s / params."""
        if not self.optimizer_s or not self.params:
            return 0.0
        return statistics.median(self.optimizer_s) * self.alone / self.params

    @property
    def alone(self) -> float:
        """The robust figure: median over rounds."""
        return statistics.median(self.alone_flops)

    @property
    def pair(self) -> float:
        """The robust figure of 2 at once: median over rounds (0: not measured)."""
        return statistics.median(self.pair_flops) if self.pair_flops else 0.0

    @property
    def shared(self) -> float:
        """The robust figure: median over rounds."""
        return statistics.median(self.shared_flops)

    @property
    def shared_cores(self) -> float:
        """Cores the processes share (the fit's C: the machine's, or fewer when its cores do
        not add up, e.g. cache contention)."""
        return self.fit()[1]

    @property
    def background_load(self) -> float:
        """Other tasks that always ran beside them (the fit's L)."""
        return self.fit()[2]

    @property
    def contention(self) -> float:
        """What each other process computing at once costs one beyond its share of the cores
        (the fit's g: the simulator's core_contention)."""
        return self.fit()[3]

    @property
    def core_flops(self) -> float:
        """FLOP/s of one process with a core to itself (the fit's s)."""
        return self.fit()[0]

    def fit(self) -> tuple[float, float, float, float]:
        """(s, C, L, g) of `_fitted` (computed once: every property reads it)."""
        return self._fitted

    @cached_property
    def _fitted(self) -> tuple[float, float, float, float]:
        """(s, C, L, g): speed(n) = s min(1, C / (n + L)) / (1 + g (n - 1)) fitted (least
        squares in logs, s in closed form) to the medians of 1, 2 and all processes at once,
        in one of three forms, whichever fits best: C = the machine's cores and the L that
        fits (other work beside), C fitted (L = g = 0: the cores do not add up), or C = the
        machine's cores and the g that fits (L = 0: each process computing beside the others
        slows them, e.g. cache refills between more runnable processes; the quiet lab's case:
        2 at once 3% slower than alone, 8 at once 7% slower than 2 cores' share). Without the
        2-at-once figure: L = g = 0, C = processes x shared / alone."""
        cpu = float(self.cpu_count)
        if not self.pair_flops:
            return (self.alone, min(max(self.processes * self.shared / self.alone, 0.05), cpu),
                    0.0, 0.0)
        n = np.array([1.0, 2.0, self.processes])
        y = np.log([self.alone, self.pair, self.shared])
        loads = np.linspace(0.0, 64.0, 1281)
        cores = np.linspace(0.05, cpu, 400)
        gs = np.linspace(0.0, 0.5, 1001)
        zero = np.zeros_like
        grid = np.concatenate([  # (C, L, g) rows: the three forms
            np.stack([np.full_like(loads, cpu), loads, zero(loads)], 1),
            np.stack([cores, zero(cores), zero(cores)], 1),
            np.stack([np.full_like(gs, cpu), zero(gs), gs], 1)])
        # log speed(n) / s: minus the simulator's own slowdown f(n) at each (C, L, g) row
        shape = -np.log(slowdown_at(n[None], grid[:, :1], grid[:, 1:2], grid[:, 2:]))
        log_s = np.mean(y[None] - shape, axis=1, keepdims=True)
        err = np.sum((y[None] - shape - log_s) ** 2, axis=1)
        err[len(loads):] += 1e-4  # at a tie, the machine's own cores and no contention
        i = int(np.argmin(err))
        return (float(np.exp(log_s[i, 0])), float(grid[i, 0]), float(grid[i, 1]),
                float(grid[i, 2]))

    @property
    def spread(self) -> float:
        """Largest max/min ratio between rounds of any figure (1 = perfectly steady)."""
        figures = [self.alone_flops, self.shared_flops] + ([self.pair_flops] if self.pair_flops
                                                            else [])
        return max(max(v) / min(v) for v in figures)


def _sharing_worker(index: int, spec: ModelSpec, micro_batch_size: int, rounds: int,
                    repeats: int, barrier: Any, out: Any, store: str = "",
                    micro_batches: int = 1) -> None:
    # A session of its own, as scripts/launch_local.py gives each rank: with the kernel's
    # autogroup scheduling (sched_autogroup_enabled), CPU is shared between sessions first,
    # so 8 processes of one session get one session's share beside other work, 8 sessions
    # eight shares (measured: 4x apart under a load of 30).
    os.setsid()
    torch.set_num_threads(1)
    step, flops, model = _train_step(spec, micro_batch_size, 0, micro_batches)
    opt_step = _optimizer_step(model)
    for _ in range(2):  # warm-up: allocator, kernels' first calls, AdamW's state
        step()
        opt_step()
    def steps() -> tuple[float, float]:  # (forward+backward, optimizer) seconds, medians
        # interleaved as the runtime runs them: AdamW on its own, its state hot in the cache,
        # took 0.0027 s here; after each backward 0.0042 (a real step's: 0.005)
        times = [(step(), opt_step()) for _ in range(repeats)]
        return tuple(statistics.median(t[i] for t in times) for i in (0, 1))

    for r in range(rounds):
        barrier.wait()
        out.put(("shared", r, flops / steps()[0]))
        barrier.wait()
        if index < 2:  # two at once; the others wait at the barrier: no CPU
            out.put(("pair", r, flops / steps()[0]))
        barrier.wait()
        if index == 0:  # the others wait at the barrier: no CPU
            train_s, opt_s = steps()
            out.put(("alone", r, flops / train_s))
            out.put(("optimizer", r, opt_s))
        barrier.wait()
    if store:
        _outer_rounds(index, barrier.parties, model, store, rounds, out)


OUTER_PAYLOADS = ("none", "fp16", "int8")
"""The payloads whose outer round's CPU the calibration measures."""


def _outer_rounds(index: int, processes: int, model: torch.nn.Module, store: str, rounds: int,
                  out: Any) -> None:
    """All processes in one gloo group on loopback (as a 1 x N DiLoCo lab run): per payload and
    round, the CPU seconds (time.process_time: every thread of the process, gloo's included) of
    one outer round through the runtime's own code (DiLoCoOptimizer over CommAverage)."""
    import torch.distributed as dist

    from modules.comm.gloo import GlooCommunicator
    from modules.sync.average import CommAverage
    from modules.sync.diloco import DiLoCoOptimizer

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the lab's ranks talk on loopback
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=index,
                            world_size=processes)
    try:
        comm = GlooCommunicator(None, 120.0)
        params = list(model.parameters())
        inner = torch.optim.SGD(params, lr=0.0)
        for payload in OUTER_PAYLOADS:
            opt = DiLoCoOptimizer(params, inner, inner_steps=1,
                                  all_reduce_fn=CommAverage(comm, payload, "calibration"))
            opt.outer_step()  # warm-up: the outer momentum's state, the codec's first calls
            for r in range(rounds):
                dist.barrier()
                t0 = time.process_time()
                opt.outer_step()
                out.put((f"outer-{payload}", r, time.process_time() - t0))
    finally:
        dist.destroy_process_group()


def measure_core_sharing(spec: ModelSpec, micro_batch_size: int, processes: int,
                         rounds: int = 3, repeats: int = 5, outer: bool = True,
                         micro_batches: int = 1) -> CoreSharing:
    """Per round: FLOP/s of one single-thread process training alone and the mean per-process
    FLOP/s with `processes` of them at once, measured in the same warm processes, each step
    `micro_batches` micro-batches in the runtime's order; with `outer` (and more than one
    process) the CPU of a DiLoCo outer round per payload, all at once."""
    ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited torch thread pools
    barrier, out = ctx.Barrier(processes), ctx.Queue()
    outer = outer and processes > 1
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store") if outer else ""
        procs = [ctx.Process(target=_sharing_worker, args=(i, spec, micro_batch_size, rounds,
                                                           repeats, barrier, out, store,
                                                           micro_batches))
                 for i in range(processes)]
        for p in procs:
            p.start()
        count = rounds * (processes + min(processes, 2) + 2
                          + (len(OUTER_PAYLOADS) * processes if outer else 0))
        got = [out.get(timeout=600) for _ in range(count)]
        for p in procs:
            p.join()
    alone = [f for kind, r, f in sorted(got) if kind == "alone"]
    opt = [f for kind, r, f in sorted(got) if kind == "optimizer"]
    mean = [{kind: statistics.fmean(f for k, r2, f in got if k == kind and r2 == r)
             for kind in ("shared", "pair")} for r in range(rounds)]
    params = spec.stage_params(0, spec.num_layers)
    outer_s = {p: statistics.median(statistics.fmean(f for k, r2, f in got
                                                     if k == f"outer-{p}" and r2 == r)
                                    for r in range(rounds))
               for p in OUTER_PAYLOADS if outer}
    return CoreSharing(processes, alone, [m["shared"] for m in mean], usable_cores(),
                       [m["pair"] for m in mean], opt, params, outer_s)


def measure_fsdp_cpu(spec: ModelSpec, micro_batch_size: int, micro_batches: int,
                     repeats: int = 15) -> dict[str, float]:
    """Seconds FSDP2 adds to a training step per FSDP unit (each block, and the root) and
    micro-batch, with reshard_after_forward ("reshard") and without ("gathered"): one fresh
    single-thread process, the whole model sharded as the runtime shards a stage
    (modules.shard.fsdp.apply_fsdp) over a gloo group of one, whose collectives are mere
    copies, against the same model unsharded; medians of `repeats` steps, interleaved so that
    the machine's drift touches all three alike. What is left is FSDP2's hooks and its copies
    into and out of its buffers, which the runtime counts as compute (its collectives' own
    time is fsdp_s). Measured on the lab's 2-core machine, gpt-tiny, 2 x 2: 1.4-2.7 ms per
    unit and micro-batch alone."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_fsdp_worker, args=(spec, micro_batch_size, micro_batches,
                                                  repeats, out))
    proc.start()
    got = out.get(timeout=600)
    proc.join()
    return got


def _fsdp_worker(spec: ModelSpec, micro_batch_size: int, micro_batches: int, repeats: int,
                 out: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from modules.shard.fsdp import apply_fsdp, fsdp_modules

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0,
                                world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,))
            steps = {}
            for kind in ("plain", "reshard", "gathered"):
                step, _, model = _train_step(spec, micro_batch_size, 0, micro_batches)
                if kind != "plain":
                    apply_fsdp(model, mesh, kind == "reshard")
                    units = len(fsdp_modules(model))
                for _ in range(3):  # warm-up: FSDP2's buffers, the allocator
                    step()
                steps[kind] = step
            times = {k: [] for k in steps}
            for _ in range(repeats):
                for kind, step in steps.items():
                    times[kind].append(step())
        finally:
            dist.destroy_process_group()
    med = {k: statistics.median(v) for k, v in times.items()}
    out.put({k: max(0.0, med[k] - med["plain"]) / (units * micro_batches)
             for k in ("reshard", "gathered")})
