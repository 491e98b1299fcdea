"""A sharded rank's checkpoint: its local shards as plain tensors (ckpt/2 files as before, one
per rank, so one per shard), put back into the DTensor parameters and optimizer state.

Resuming needs the same shard degree D: a shard's rows depend on D. The meta records D and
the shard index; modules/train/checkpoint.py's loader refuses another D, naming both.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from modules.shard.fsdp import local


def local_state(obj: Any) -> Any:
    """Nested dicts/lists/tuples with every DTensor replaced by its local shard."""
    if isinstance(obj, DTensor):
        return local(obj)
    if isinstance(obj, dict):
        return {k: local_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [local_state(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(local_state(v) for v in obj)
    return obj


@torch.no_grad()
def load_local_model(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Copy the saved local shards into the model's parameters (and persistent buffers)."""
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    missing = [k for k in model.state_dict() if k not in saved]
    if missing:
        raise KeyError(f"model shard lacks {missing[0]}")
    for name, value in saved.items():
        if name not in own:
            raise KeyError(f"unexpected {name}")
        target = local(own[name])
        if target.shape != value.shape:
            raise ValueError(f"{name}: shard of shape {tuple(value.shape)}, this run's is "
                             f"{tuple(target.shape)}")
        target.copy_(value)


def inner_to_dtensors(opt_state: dict[str, Any], params: list[torch.Tensor]) -> dict[str, Any]:
    """An optimizer state_dict saved with local shards -> one whose per-parameter tensors are
    DTensors again, laid out like `params` (the optimizer's parameters, in its order)."""
    state = {}
    for index, entry in opt_state["state"].items():
        p = params[int(index)]
        state[index] = {k: _like(v, p) for k, v in entry.items()}
    return {**opt_state, "state": state}


def _like(value: Any, p: torch.Tensor) -> Any:
    """`value` as a DTensor shaped and placed like `p` when it is p's local shard."""
    if not (isinstance(p, DTensor) and isinstance(value, torch.Tensor)
            and value.dim() > 0 and value.shape == local(p).shape):
        return value
    return DTensor.from_local(value.to(local(p).device), p.device_mesh, p.placements,
                              run_check=False, shape=p.shape, stride=p.stride())


def shard_meta(degree: int, shard: int) -> dict[str, int]:
    """What a sharded rank's checkpoint records (and must match on resume)."""
    return {"shard_degree": degree, "shard": shard}
