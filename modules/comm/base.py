"""The `Communicator` interface shared by the gloo and the cupy-NCCL implementations, and the
bookkeeping they share: membership, byte and wait-time accounting, the compressed mean."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from modules.comm.compressed import mean_all_reduce
from modules.comm.errors import CommError
from modules.quant.allreduce import SEGMENT
from modules.quant.blocks import DEFAULT_BLOCK

REDUCE_OPS = ("sum", "max", "min")

__all__ = ["REDUCE_OPS", "CommError", "CommStats", "Communicator", "GroupMembership", "Posted",
           "agree_int", "agree_range", "check_op"]


@dataclass
class CommStats:
    """What the communicators of one rank did, added up (they can share one instance)."""

    bytes_sent: int = 0
    """Bytes put on the wire: p2p payloads exactly, collectives as a ring sends them
    (2 (W-1)/W x payload per all-reduce), compressed means their codes and scales."""
    wait_s: float = 0.0
    """Seconds spent waiting on communication (waiting for a slow peer included). NCCL's
    operations are timed on their stream by CUDA events: call `settle` before reading."""
    pending: list = field(default_factory=list, repr=False)
    """NCCL: (start event, end event, communicator) spans not yet added to wait_s."""

    def time_on_stream(self, start: Any, end: Any, owner: GroupMembership) -> None:
        """Count the stream time between two recorded CUDA events (at the next `settle`) into
        these stats and `owner.wait_s`."""
        self.pending.append((start, end, owner))
        if len(self.pending) >= 256:  # stats nobody settles (a background thread's) stay small
            self.settle(finished_only=True)

    def settle(self, finished_only: bool = False) -> None:
        """Add the spans timed on CUDA streams so far to wait_s (waits for their end events:
        call it where the step syncs anyway, e.g. after reading the loss). `finished_only`:
        only the spans already over, without waiting."""
        keep = []
        for start, end, owner in self.pending:
            if finished_only and not end.query():
                keep.append((start, end, owner))
                continue
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
            self.wait_s += seconds
            owner.wait_s += seconds
        self.pending = keep


@dataclass
class Posted:
    """A send or receive started with `isend`/`irecv`; finish it with the communicator's `wait`."""

    peer: int
    """Global rank of the other side."""
    kind: str
    """`send` or `recv`."""
    handle: Any
    """The backend's own handle (gloo: a torch Work; NCCL: None, or the receive to enqueue)."""
    buffer: torch.Tensor
    """What travels on the wire (a host copy of the caller's tensor when it is staged)."""
    target: torch.Tensor | None = None
    """Receive into a staged tensor: the caller's tensor, filled from `buffer` on wait."""


@runtime_checkable
class Communicator(Protocol):
    """Point-to-point and collective calls over a fixed group of global ranks.

    Peers are named by global rank (in the runtime: the plan's device id). Every call is made by
    all members (collectives) or by the two peers (p2p). On gloo a call returns when it is done;
    on NCCL it is enqueued on torch's current CUDA stream and ordered with the kernels on it.
    Every wait is bounded by `timeout_s` and fails with `CommError` naming the operation and the
    peer(s). `bytes_sent` counts what this communicator put on the wire; `stats` adds up every
    communicator of the rank that shares it (bytes and seconds spent waiting).
    """

    ranks: tuple[int, ...]
    """Global ranks of the group, ascending (group rank i = ranks[i])."""
    rank: int
    """This process's global rank."""
    device: torch.device
    """Where the backend wants tensors (cpu for gloo, which stages CUDA tensors; cuda:N)."""
    timeout_s: float
    """How long any wait may take."""
    bytes_sent: int
    stats: CommStats

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        ...

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Posted:
        """Start sending a contiguous tensor to global rank `dst`; finish with `wait`."""
        ...

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Posted:
        """Post a receive into a contiguous tensor from `src` now (gloo's p2p is a rendezvous:
        a receive posted early saves a round trip); finish with `wait`."""
        ...

    def wait(self, posted: Posted, what: str | None = None) -> torch.Tensor:
        """Finish a posted send/receive within the timeout; returns its tensor."""
        ...

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, what: str | None = None) -> None:
        """Send a contiguous tensor to global rank `dst`."""
        ...

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0,
             what: str | None = None) -> torch.Tensor:
        """Receive into a contiguous tensor from global rank `src`; returns it."""
        ...

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]],
                 recvs: Sequence[tuple[torch.Tensor, int]], what: str | None = None) -> None:
        """Run many sends (tensor, dst) and receives (tensor, src) concurrently (no deadlock)."""
        ...

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", what: str | None = None) -> None:
        """In-place reduction (`sum`, `max` or `min`) over the group."""
        ...

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor,
                   what: str | None = None) -> None:
        """outputs[i] <- the `tensor` of group rank i (same shape and dtype everywhere)."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int, what: str | None = None) -> None:
        """In place: every member ends with global rank `src`'s tensor."""
        ...

    def barrier(self, what: str | None = None) -> None:
        """Return once every member has called barrier (NCCL: and the stream is drained)."""
        ...

    def mean_all_reduce(self, tensor: torch.Tensor, compression: str = "int8",
                        what: str | None = None) -> int:
        """Average a contiguous fp32 tensor in place; fp16/int8 codes on the wire (`none`:
        fp32). Returns the bytes this rank sent; every rank ends with the same bytes."""
        ...

    def synchronize(self, what: str | None = None) -> None:
        """Block until everything enqueued so far is done (gloo: already is)."""
        ...

    def close(self) -> None:
        """Release the backend's resources (NCCL: flushing pending operations first)."""
        ...

    def abort(self) -> None:
        """Release them without waiting for pending operations (a group that lost a peer)."""
        ...


class GroupMembership:
    """Group bookkeeping shared by the implementations: who is in it, what was sent and waited."""

    ranks: tuple[int, ...]
    rank: int
    device: torch.device

    def _init_membership(self, ranks: Sequence[int], rank: int, timeout_s: float = 300.0,
                         stats: CommStats | None = None) -> None:
        ranks = tuple(sorted(int(r) for r in ranks))  # torch's new_group order
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"communicator ranks {list(ranks)}: need distinct global ranks")
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not a member of the group {list(ranks)}")
        self.ranks, self.rank, self.bytes_sent = ranks, rank, 0
        self.timeout_s = timeout_s
        self.stats = stats if stats is not None else CommStats()
        self.wait_s = 0.0
        """Seconds this communicator spent waiting (stats.wait_s adds up all of the rank's;
        NCCL: after `stats.settle()`)."""

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

    def others(self) -> tuple[int, ...]:
        """Every member but this rank (whom a collective waits for)."""
        return tuple(r for r in self.ranks if r != self.rank)

    def mean_all_reduce(self, tensor: torch.Tensor, compression: str = "int8",
                        what: str | None = None, block: int = DEFAULT_BLOCK,
                        segment: int = SEGMENT) -> int:
        """Average a contiguous fp32 tensor in place over the group (modules.comm.compressed);
        returns the bytes this rank sent. Its whole duration counts as waiting, codec included,
        as the reduction inside an fp32 all-reduce does."""
        t0, wait0, own0 = time.perf_counter(), self.stats.wait_s, self.wait_s
        try:
            return mean_all_reduce(tensor, self, compression, block, segment,
                                   what or f"mean all-reduce over ranks {list(self.ranks)}")
        finally:  # replaces the waits of the calls inside, which overlap the codec
            elapsed = time.perf_counter() - t0
            self.stats.wait_s, self.wait_s = wait0 + elapsed, own0 + elapsed

    def _count_sent(self, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.stats.bytes_sent += nbytes

    def _count_wait(self, seconds: float) -> None:
        self.wait_s += seconds
        self.stats.wait_s += seconds

    def _ring_bytes(self, tensor: torch.Tensor) -> int:
        w = self.size
        return int(2 * (w - 1) / w * tensor.numel() * tensor.element_size())


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's payload."""
    return tensor.numel() * tensor.element_size()


def check_op(op: str) -> None:
    """ValueError for a reduction other than sum/max/min."""
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op {op!r} is not one of {', '.join(REDUCE_OPS)}")


def agree_int(comm: Communicator, value: int, op: str, what: str,
              timeout_s: float | None = None) -> int:
    """`value` reduced with `op` (`min` or `max`) over every rank of `comm`: what all of them
    agree on (a checkpoint step, the step a replica goes on from). `timeout_s`: wait that long
    for the others here when they may be busy for longer than the communicator's timeout
    (gloo's communicators read it at each wait; others keep their own)."""
    t = torch.tensor([value], dtype=torch.int64)
    _all_reduce_waiting(comm, t, op, what, timeout_s)
    return int(t[0])


def agree_range(comm: Communicator, value: int, what: str,
                timeout_s: float | None = None) -> tuple[int, int]:
    """The least and the largest `value` over every rank of `comm`, in one all-reduce (the
    MAX of (-value, value)); `timeout_s` as in `agree_int`."""
    t = torch.tensor([-value, value], dtype=torch.int64)
    _all_reduce_waiting(comm, t, "max", what, timeout_s)
    return -int(t[0]), int(t[1])


def _all_reduce_waiting(comm: Communicator, t: torch.Tensor, op: str, what: str,
                        timeout_s: float | None) -> None:
    """`comm.all_reduce` waiting at least `timeout_s` for the others."""
    saved = comm.timeout_s
    comm.timeout_s = max(saved, timeout_s or 0.0)
    try:
        comm.all_reduce(t, op, what)
    finally:
        comm.timeout_s = saved
