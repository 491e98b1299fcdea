"""What the Trainer does differently for a stage held by a shard group (issue 22), in one
place: build the shard group, shard the stage with FSDP2, and hand the rest of the runtime the
local shards it works on (DiLoCo, the per-step all-reduce, tied embeddings, checkpoints).

Semantics (docs/hierarchical.md): replica r's stage s is held by D devices; device i of every
stage forms lane r*D + i, which reads its own micro-batches and pipelines them like a replica
of a plan without shard groups. FSDP2 averages the gradients over the shard group, so a
replica's step is the mean over its D lanes. Across replicas, device i of stage s averages only
its shard with device i of stage s in the other replicas (the stage group of shard i:
modules.control.groups), so each device moves 1/D of its stage's outer sync.
A device lost inside a replica ends that replica: its shard group's collectives fail, its
peers stop with "my replica was dropped" (DiLoCo) and the other replicas go on.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from modules.comm import CommStats
from modules.control.dist import Topology
from modules.shard.fsdp import apply_fsdp, count_collectives, fsdp_modules, local, reshard
from modules.shard.groups import ShardGroup, build_shard_group
from modules.shard.state import inner_to_dtensors, load_local_model, local_state, shard_meta

GroupAverage = Callable[[torch.Tensor], int]


class ShardRuntime:
    """This rank's shard group and its FSDP2-sharded stage."""

    def __init__(self, topo: Topology, store: dist.Store, model: nn.Module,
                 device: torch.device, timeout_s: float, reshard_after_forward: bool,
                 stats: CommStats) -> None:
        """Form the shard group (every member at once) and shard `model` over it; FSDP2's
        collectives count their bytes into `stats`."""
        self.topo = topo
        self.group: ShardGroup = build_shard_group(
            store, f"r{topo.replica}s{topo.stage}", topo.shard_group, topo.rank, device,
            timeout_s)
        apply_fsdp(model, self.group.mesh, reshard_after_forward)
        self.clock = count_collectives(model, stats, topo.shard_degree)
        """Seconds in FSDP2's collectives so far (the `fsdp_s` metric)."""
        self.model = model
        self.device = device
        self.reshard_after_forward = reshard_after_forward

    def before_backward(self, last: bool) -> None:
        """Before each micro-batch's backward (the pipeline calls it): without
        reshard_after_forward the stage stays gathered and its gradients unsharded until the
        step's last backward, which reduce-scatters once (one gather, one scatter a step)."""
        if self.reshard_after_forward:
            return  # gather again in backward, reduce-scatter per micro-batch (less memory)
        for module in fsdp_modules(self.model):
            module.set_requires_gradient_sync(last, recurse=False)
            module.set_reshard_after_backward(last, recurse=False)

    def meta(self) -> dict[str, int]:
        """Checkpoint meta fields of a sharded rank (D and my shard index)."""
        return shard_meta(self.topo.shard_degree, self.topo.shard)

    def refresh(self) -> None:
        """After a generation change re-formed the default group (which forgets names)."""
        self.group.register()

    @staticmethod
    def local_params(params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of the local shards for DiLoCo (writing them writes the parameters)."""
        return [local(p).detach().requires_grad_(True) for p in params]

    @staticmethod
    def tied(pair: list[torch.Tensor]) -> list[SimpleNamespace]:
        """The tied copies as objects whose `.grad` is the local gradient shard: the shards of
        lane i's two copies hold the same rows (same D, same even split), so summing the
        shards pairwise sums the matrices."""
        return [SimpleNamespace(grad=local(p.grad)) for p in pair]

    def named_local(self) -> list[tuple[str, torch.Tensor]]:
        """(name, local shard with `.grad` its local gradient) of every parameter: what the
        finiteness check reads."""
        out = []
        for name, p in self.model.named_parameters():
            view = local(p).detach()
            view.grad = local(p.grad) if p.grad is not None else None
            out.append((name, view))
        return out

    @staticmethod
    @torch.no_grad()
    def average_grads(params: list[torch.Tensor], average: GroupAverage) -> int:
        """Allreduce mode: average my gradient shards over my shard's stage group."""
        grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p))
                 for p in params]
        flat = _flatten_dense_tensors(grads)
        sent = average(flat)
        for g, avg in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(avg)
        return sent

    def mean_loss(self, loss: float | None) -> float | None:
        """The replica's loss on its last stage: the mean over the D lanes' losses."""
        if loss is None:
            return None
        t = torch.tensor([loss], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group.group)
        return float(t[0]) / self.topo.shard_degree

    def agree_max(self, flag: torch.Tensor) -> None:
        """In-place MAX of `flag` over my shard group (e.g. the fp16 overflow flag)."""
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group.group)

    def after_eval(self) -> None:
        """Free what a forward-only pass left gathered."""
        reshard(self.model)

    @staticmethod
    def state(state: dict[str, Any]) -> dict[str, Any]:
        """The Trainer's state with local shards in place of DTensors (what is saved)."""
        return local_state(state)

    def load(self, state: dict[str, Any], opt: Any, params: list[torch.Tensor]) -> None:
        """Put a saved sharded state back: model shards in place, the inner optimizer's
        state as DTensors again (DiLoCo's anchors and momentum are local already)."""
        load_local_model(self.model, state["model"])
        saved = dict(state["opt"])
        if "inner" in saved:  # DiLoCo: {"inner": AdamW's, "outer": ..., "anchor": ...}
            saved["inner"] = inner_to_dtensors(saved["inner"], params)
        else:
            saved = inner_to_dtensors(saved, params)
        opt.load_state_dict(saved)
