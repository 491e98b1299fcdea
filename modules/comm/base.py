"""The `Communicator` protocol shared by the gloo and the cupy-NCCL implementations."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

REDUCE_OPS = ("sum", "max", "min")


class CommError(RuntimeError):
    """A peer did not answer within the timeout, or the backend failed; names the operation."""


@runtime_checkable
class Communicator(Protocol):
    """Point-to-point and collective calls over a fixed group of global ranks.

    Every call is made by all members (collectives) or by the two peers (send/recv) with
    tensors on `device`. On gloo a call returns when it is done; on NCCL it is enqueued on the
    CUDA stream (torch's current stream unless one is given) and is ordered with the kernels
    on it, as torch's own collectives are. `bytes_sent` counts what this rank put on the wire:
    p2p payloads exactly, collectives as a ring sends them.
    """

    ranks: tuple[int, ...]
    """Global ranks of the group, ascending (group rank i = ranks[i]), as torch orders them."""
    rank: int
    """This process's global rank."""
    device: torch.device
    """Where tensors passed to this communicator live (cpu for gloo, cuda:N for NCCL)."""
    bytes_sent: int

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        ...

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send a contiguous tensor to global rank `dst`."""
        ...

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into a contiguous tensor from global rank `src`; returns it."""
        ...

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]],
                 recvs: Sequence[tuple[torch.Tensor, int]]) -> None:
        """Run many sends (tensor, dst) and receives (tensor, src) concurrently (no deadlock)."""
        ...

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """In-place reduction (`sum`, `max` or `min`) over the group."""
        ...

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """outputs[i] <- the `tensor` of group rank i (same shape and dtype everywhere)."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """In place: every member ends with global rank `src`'s tensor."""
        ...

    def barrier(self) -> None:
        """Return once every member has called barrier (NCCL: and the stream is drained)."""
        ...


class GroupMembership:
    """Group bookkeeping shared by the implementations."""

    ranks: tuple[int, ...]
    rank: int

    def _init_membership(self, ranks: Sequence[int], rank: int) -> None:
        ranks = tuple(sorted(int(r) for r in ranks))  # torch's new_group order
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"communicator ranks {list(ranks)}: need distinct global ranks")
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not a member of the group {list(ranks)}")
        self.ranks, self.rank, self.bytes_sent = ranks, rank, 0

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)

    @property
    def group_rank(self) -> int:
        """This rank's index in `ranks`."""
        return self.ranks.index(self.rank)

    def group_index(self, global_rank: int) -> int:
        """Index of `global_rank` in the group; ValueError when it is not a member."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"rank {global_rank} is not in this communicator's group "
                             f"{list(self.ranks)}") from None

    def _ring_bytes(self, tensor: torch.Tensor) -> int:
        w = self.size
        return int(2 * (w - 1) / w * tensor.numel() * tensor.element_size())


def check_op(op: str) -> None:
    """ValueError for a reduction other than sum/max/min."""
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op {op!r} is not one of {', '.join(REDUCE_OPS)}")
