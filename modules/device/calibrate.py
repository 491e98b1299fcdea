"""Measure what FLOP/s this machine's CPU reaches on a model preset (for the simulator's tflops).

The simulator predicts compute as FLOPs / (tflops x mfu). On a CPU lab the honest tflops is
the one measured for the model and micro-batch at hand, with the thread count each rank gets;
`measure_train_flops` returns it (then plan and simulate with --mfu 1.0).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

import torch

from formats.models import ModelSpec
from modules.train.model import StageModel


def measure_train_flops(spec: ModelSpec, micro_batch_size: int, threads: int = 1,
                        repeats: int = 7, seed: int = 0, barrier: Any = None) -> float:
    """Forward + backward FLOP/s of the whole model on one micro-batch (median of `repeats`).

    FLOPs counted as the simulator does without recomputation: 3 x the forward FLOPs of every
    layer and the head. Runs with `threads` torch threads and restores the previous count.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = StageModel(spec, 0, spec.num_layers, seed=seed)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randint(0, spec.vocab_size, (micro_batch_size, spec.seq_len), generator=gen)
        y = torch.randint(0, spec.vocab_size, (micro_batch_size, spec.seq_len), generator=gen)
        times = []
        for i in range(repeats + 2):  # two warm-up rounds (allocator, kernels' first calls)
            if i == 2 and barrier is not None:
                barrier.wait()  # concurrent measurements overlap: every process is warm
            t0 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            model(x, y).backward()
            if i >= 2:
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    flops = 3.0 * spec.stage_flops_per_token(0, spec.num_layers) * micro_batch_size * spec.seq_len
    return flops / statistics.median(times)


def _worker(spec: ModelSpec, micro_batch_size: int, repeats: int, barrier: Any,
            out: Any) -> None:
    out.put(measure_train_flops(spec, micro_batch_size, 1, repeats, barrier=barrier))


def measure_train_flops_shared(spec: ModelSpec, micro_batch_size: int, processes: int,
                               repeats: int = 7) -> float:
    """Mean per-process FLOP/s when `processes` single-thread processes train at once.

    This is the speed each rank of a run sees when that many ranks share this machine's
    cores (8 ranks on 2 cores get about a quarter of a core's speed each).
    """
    ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited torch thread pools
    barrier, out = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(spec, micro_batch_size, repeats, barrier, out))
             for _ in range(processes)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return statistics.fmean(results)
