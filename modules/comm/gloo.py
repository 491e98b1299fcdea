"""`Communicator` over a torch.distributed (gloo) process group, for CPU tensors."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from modules.comm.base import CommError, GroupMembership, check_op

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class GlooCommunicator(GroupMembership):
    """Wraps an existing process group (None = the world); every wait is bounded by timeout_s.

    Build the group with dist.new_group(ranks) on every rank of the world in the same order
    (a torch rule), or let modules.comm.build_communicators do it.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, timeout_s: float = 300.0,
                 tag: int = 0) -> None:
        if not dist.is_initialized():
            raise CommError("GlooCommunicator: torch.distributed is not initialised "
                            "(call dist.init_process_group first)")
        self.group = group
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self._init_membership(ranks, dist.get_rank())
        self.device = torch.device("cpu")
        self.timeout_s, self.tag = timeout_s, tag

    def _wait(self, works: Sequence[dist.Work], what: str) -> None:
        timeout = timedelta(seconds=self.timeout_s)
        for work in works:
            try:
                ok = work.wait(timeout=timeout)
            except RuntimeError as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                raise CommError(f"{what}: no answer within {self.timeout_s:g} s ({first})") \
                    from None
            if ok is False:
                raise CommError(f"{what}: no answer within {self.timeout_s:g} s")

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send a contiguous tensor to global rank `dst`."""
        self.exchange([(tensor, dst)], [])

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into a contiguous tensor from global rank `src`; returns it."""
        self.exchange([], [(tensor, src)])
        return tensor

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]],
                 recvs: Sequence[tuple[torch.Tensor, int]]) -> None:
        """Run many sends (tensor, dst) and receives (tensor, src) concurrently."""
        works = []
        for t, dst in sends:
            self.group_index(dst)
            works.append(dist.isend(t, dst=dst, group=self.group, tag=self.tag))
            self.bytes_sent += t.numel() * t.element_size()
        for t, src in recvs:
            self.group_index(src)
            works.append(dist.irecv(t, src=src, group=self.group, tag=self.tag))
        peers = sorted({p for _, p in sends} | {p for _, p in recvs})
        self._wait(works, f"point-to-point with rank(s) {peers}")

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """In-place reduction (`sum`, `max` or `min`) over the group."""
        check_op(op)
        self.bytes_sent += self._ring_bytes(tensor)
        work = dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=True)
        self._wait([work], f"all_reduce over ranks {list(self.ranks)}")

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """outputs[i] <- the `tensor` of group rank i."""
        self.bytes_sent += (self.size - 1) * tensor.numel() * tensor.element_size()
        work = dist.all_gather(outputs, tensor, group=self.group, async_op=True)
        self._wait([work], f"all_gather over ranks {list(self.ranks)}")

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """In place: every member ends with global rank `src`'s tensor."""
        self.group_index(src)
        if self.rank == src:
            self.bytes_sent += tensor.numel() * tensor.element_size()
        work = dist.broadcast(tensor, src=src, group=self.group, async_op=True)
        self._wait([work], f"broadcast from rank {src}")

    def barrier(self) -> None:
        """Return once every member has called barrier."""
        work = dist.barrier(group=self.group, async_op=True)
        self._wait([work], f"barrier over ranks {list(self.ranks)}")
