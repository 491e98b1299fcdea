"""FSDP2 on a stage's module: `fully_shard` per transformer block, then the stage root (the
embedding, final norm and head, whichever the stage has), over the shard group's mesh.

The pipeline is untouched: a stage still takes and returns full activations; FSDP2 gathers a
block's parameters around its forward and backward and reduce-scatters (averages) its
gradients over the shard group. What the rest of the runtime touches directly (optimizer state,
DiLoCo's anchors, checkpoints) is each device's local shard: `local` gives it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)
from torch.distributed.tensor import DTensor

from modules.comm import CommStats


@dataclass
class FsdpClock:
    """Seconds spent inside FSDP2's collectives (the rank's `fsdp_s` metric). On CPU (gloo)
    they are synchronous, so this is their whole time; on CUDA it is the time to issue them
    (NCCL runs them on FSDP2's streams)."""

    seconds: float = 0.0


class CountingAllGather(DefaultAllGather):
    """FSDP2's all-gather, adding what a ring sends to `stats`: (D-1) x my shard's bytes, and
    its time to `clock`."""

    def __init__(self, stats: CommStats, degree: int, clock: FsdpClock) -> None:
        self.stats, self.degree, self.clock = stats, degree, clock

    def __call__(self, output_tensor, input_tensor, group, async_op=False):  # noqa: ANN001, ANN204
        self.stats.bytes_sent += (self.degree - 1) * input_tensor.numel() * \
            input_tensor.element_size()
        t0 = time.perf_counter()
        try:
            return super().__call__(output_tensor, input_tensor, group, async_op)
        finally:
            self.clock.seconds += time.perf_counter() - t0


class CountingReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter (on gloo: ring_reduce_scatter), adding what a ring sends: (D-1) x
    my output shard's bytes, and its time to `clock`."""

    def __init__(self, stats: CommStats, degree: int, clock: FsdpClock) -> None:
        self.stats, self.degree, self.clock = stats, degree, clock

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001, ANN204
        self.stats.bytes_sent += (self.degree - 1) * output_tensor.numel() * \
            output_tensor.element_size()
        t0 = time.perf_counter()
        try:
            if not async_op and op == dist.ReduceOp.SUM and dist.get_backend(group) == "gloo":
                return ring_reduce_scatter(output_tensor, input_tensor, group)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        finally:
            self.clock.seconds += time.perf_counter() - t0


def ring_reduce_scatter(output: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup
                        ) -> None:
    """Sum `flat` (D equal chunks, chunk i for group rank i) over the group into `output` (my
    chunk) by a ring: D - 1 steps, each sending one chunk to the next rank and adding the one
    from the previous. gloo's own reduce_scatter runs a whole all-reduce: twice these bytes
    and steps (tests/test_gloo_scatter_bytes.py). `flat` is overwritten (FSDP2's scratch)."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    nxt = dist.get_global_rank(group, (me + 1) % size)
    prev = dist.get_global_rank(group, (me - 1) % size)
    acc = flat.view(size, -1)
    incoming = torch.empty_like(acc[0])
    # chunk c starts at rank c + 1 and collects every rank's share on its way round to rank c
    for step in range(size - 1):
        sending = dist.isend(acc[(me - step - 1) % size], nxt, group=group)
        dist.recv(incoming, prev, group=group)
        acc[(me - step - 2) % size] += incoming
        sending.wait()
    output.copy_(acc[me])


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool) -> None:
    """Shard `model` (a StageModel, possibly compiled) over `mesh`, block by block, gradients
    summed over the group; then make FSDP2 set up its buffers now, so the local shards `local`
    returns stay the ones trained."""
    root = getattr(model, "_orig_mod", model)  # torch.compile wraps the module
    for block in root.blocks.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(root, mesh=mesh, reshard_after_forward=reshard_after_forward)
    for module in fsdp_modules(model):
        # sum, not average, over the group: the last stage already divides each loss by the
        # replica's L lanes (stage.loss_divisor), whatever this stage's D (docs/hierarchical.md)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    fully_shard.state(root)._lazy_init()  # noqa: SLF001 - else done at the first forward


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """Every module `apply_fsdp` sharded (the blocks, then the root)."""
    return [m for m in getattr(model, "_orig_mod", model).modules() if isinstance(m, FSDPModule)]


def count_collectives(model: nn.Module, stats: CommStats, degree: int) -> FsdpClock:
    """Count FSDP2's collectives' bytes into `stats` (the rank's, so metrics include them);
    the clock their time adds up on."""
    clock = FsdpClock()
    for module in fsdp_modules(model):
        module.set_custom_all_gather(CountingAllGather(stats, degree, clock))
        module.set_custom_reduce_scatter(CountingReduceScatter(stats, degree, clock))
    return clock


def local(t: torch.Tensor) -> torch.Tensor:
    """This device's shard of a DTensor (a view: writing it writes the parameter), else `t`."""
    return t._local_tensor if isinstance(t, DTensor) else t  # noqa: SLF001 - no public view


def reshard(model: nn.Module) -> None:
    """Free every gathered parameter (after a forward-only pass such as evaluation, which
    leaves them gathered when reshard_after_forward is off)."""
    for module in fsdp_modules(model):
        module.reshard()
