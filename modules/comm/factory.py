"""Build the communicators of many groups in one fixed order on every rank, and the standalone
compressed mean all-reduce (over a communicator or a torch process group)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from modules.comm.base import CommStats, Communicator
from modules.comm.compressed import mean_all_reduce
from modules.comm.errors import CommError
from modules.comm.gloo import GlooCommunicator
from modules.comm.nccl import CupyNcclCommunicator
from modules.quant.allreduce import SEGMENT
from modules.quant.blocks import DEFAULT_BLOCK

BACKENDS = ("gloo", "nccl")
STANDALONE_TIMEOUT_S = 1800.0
"""Timeout of a communicator made around a bare process group (the runtime passes its own)."""


def build_communicators(groups: Sequence[Sequence[int]], rank: int,
                        backend: str | Sequence[str] = "gloo", store: dist.Store | None = None,
                        device: torch.device | None = None, name: str = "group",
                        timeout_s: float = 300.0, rank_of: Mapping[int, int] | None = None,
                        stats: CommStats | None = None,
                        on_failure: Callable[[CommError], None] | None = None,
                        ) -> dict[tuple[int, ...], Communicator]:
    """Call on EVERY rank with the same `groups` list; returns {ranks: comm} for my groups.

    Groups are given by the global ranks peers are named by; keys are those sorted ascending
    (the communicator's `ranks`). `rank_of` maps them to ranks of the current default group
    (default: the same numbers). `backend`: one for all groups, or one per group.
    gloo: dist.new_group for each gloo group, on every rank in list order (a torch rule).
    nccl: a CupyNcclCommunicator per nccl group this rank is in, created after the gloo groups
    in list order (a total order, so the blocking NCCL inits and connections cannot wait on each
    other in a cycle), each connected to its peers before the next is made; needs the
    rendezvous `store` and this rank's CUDA `device`. Groups of one member are included.
    Communicators share `stats` when given. `on_failure`: called by an NCCL communicator's
    watchdog right after it aborted a failed operation (e.g. to end the run).
    """
    backends = [backend] * len(groups) if isinstance(backend, str) else list(backend)
    if len(backends) != len(groups):
        raise ValueError(f"build_communicators: {len(backends)} backends for {len(groups)} "
                         "groups")
    for b in backends:
        if b not in BACKENDS:
            raise ValueError(f"backend: {b!r} is not one of {', '.join(BACKENDS)}")
    rank_of = rank_of or {}
    keys = [tuple(sorted(int(r) for r in ranks)) for ranks in groups]
    out: dict[tuple[int, ...], Communicator] = {}
    for key, b in zip(keys, backends):
        if b == "gloo":
            g = dist.new_group(ranks=[rank_of.get(r, r) for r in key], backend="gloo")
            if rank in key:
                out[key] = GlooCommunicator(g, timeout_s, ids=key, stats=stats)
    for i, (key, b) in enumerate(zip(keys, backends)):
        if b == "nccl" and rank in key:
            if store is None or device is None:
                raise ValueError("build_communicators(backend='nccl') needs store and device")
            comm = out[key] = CupyNcclCommunicator(key, rank, store, f"{name}{i}", device,
                                                   timeout_s, stats, on_failure)
            comm.connect()  # now, in the same order on every member
    return out


def as_communicator(comm_or_group: Communicator | dist.ProcessGroup | None,
                    timeout_s: float = STANDALONE_TIMEOUT_S) -> Communicator:
    """A Communicator as is; a torch process group (None = the default group) wrapped in a
    GlooCommunicator with `timeout_s`."""
    if comm_or_group is None or isinstance(comm_or_group, dist.ProcessGroup):
        return GlooCommunicator(comm_or_group, timeout_s)
    return comm_or_group


def compressed_all_reduce_mean(tensor: torch.Tensor,
                               comm_or_group: Communicator | dist.ProcessGroup | None = None,
                               compression: str = "int8", block: int = DEFAULT_BLOCK,
                               segment: int = SEGMENT) -> int:
    """Average a contiguous fp32 tensor in place over the group; return the bytes this rank sent.

    `comm_or_group`: a Communicator, or a torch.distributed process group (None = the default
    group) used through gloo. `compression`: none, fp16 or int8 (modules.comm.compressed).
    """
    return mean_all_reduce(tensor, as_communicator(comm_or_group), compression, block, segment)
