"""FSDP2 on a stage's module: `fully_shard` per transformer block, then the stage root (the
embedding, final norm and head, whichever the stage has), over the shard group's mesh.

The pipeline is untouched: a stage still takes and returns full activations; FSDP2 gathers a
block's parameters around its forward and backward and reduce-scatters (averages) its
gradients over the shard group. What the rest of the runtime touches directly (optimizer state,
DiLoCo's anchors, checkpoints) is each device's local shard: `local` gives it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool) -> None:
    """Shard `model` (a StageModel, possibly compiled) over `mesh`, block by block; then make
    FSDP2 set up its buffers now, so the local shards `local` returns stay the ones trained."""
    root = getattr(model, "_orig_mod", model)  # torch.compile wraps the module
    for block in root.blocks.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(root, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard.state(root)._lazy_init()  # noqa: SLF001 - else done at the first forward


def local(t: torch.Tensor) -> torch.Tensor:
    """This device's shard of a DTensor (a view: writing it writes the parameter), else `t`."""
    return t._local_tensor if isinstance(t, DTensor) else t  # noqa: SLF001 - no public view


def reshard(model: nn.Module) -> None:
    """Free every gathered parameter (after a forward-only pass such as evaluation, which
    leaves them gathered when reshard_after_forward is off)."""
    for module in getattr(model, "_orig_mod", model).modules():
        if isinstance(module, FSDPModule):
            module.reshard()
