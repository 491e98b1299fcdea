"""Build the communicators of many groups in one fixed order on every rank."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from modules.comm.base import Communicator
from modules.comm.gloo import GlooCommunicator
from modules.comm.nccl import CupyNcclCommunicator


def build_communicators(groups: Sequence[Sequence[int]], rank: int, backend: str = "gloo",
                        store: dist.Store | None = None, device: torch.device | None = None,
                        name: str = "group", timeout_s: float = 300.0,
                        ) -> dict[tuple[int, ...], Communicator]:
    """Call on EVERY rank with the same `groups` list; returns {ranks: comm} for my groups.

    Keys are the group's global ranks sorted ascending (the communicator's `ranks`).
    backend `gloo`: dist.new_group for each group (torch requires all ranks, same order).
    backend `nccl`: a CupyNcclCommunicator per group this rank is in, created in list order
    (a total order, so the blocking NCCL inits cannot wait on each other in a cycle); needs
    the rendezvous `store` and this rank's CUDA `device`. Groups of one member are included.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: {backend!r} is not one of gloo, nccl")
    out: dict[tuple[int, ...], Communicator] = {}
    for i, ranks in enumerate(groups):
        key = tuple(sorted(int(r) for r in ranks))
        if backend == "gloo":
            g = dist.new_group(ranks=list(key), backend="gloo")
            if rank in key:
                out[key] = GlooCommunicator(g, timeout_s)
        elif rank in key:
            if store is None or device is None:
                raise ValueError("build_communicators(backend='nccl') needs store and device")
            out[key] = CupyNcclCommunicator(key, rank, store, f"{name}{i}", device, timeout_s)
    return out
