"""`Communicator` over a torch.distributed gloo process group. gloo reads and writes host
memory: CUDA tensors are staged through pinned host copies (modules.comm.staging), CPU tensors
are used in place."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from modules.comm.base import CommStats, GroupMembership, Posted, check_op, nbytes
from modules.comm.errors import CommError, first_line, no_answer
from modules.comm.staging import host_buffer, stage_in, to_host

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class GlooCommunicator(GroupMembership):
    """Wraps an existing process group (None = the default group); every wait is bounded by
    `timeout_s` and a silent or lost peer is a CommError naming it and the operation.

    `ids`: the global ranks peers are named by, ascending, one per member in the group's order
    (default: torch's ranks in the default group). The runtime names peers by device id while
    the default group of a later generation numbers its members 0..n-1.
    Build the group with dist.new_group(ranks) on every rank of the default group in the same
    order (a torch rule), or let modules.comm.build_communicators do it.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, timeout_s: float = 300.0,
                 ids: Sequence[int] | None = None, stats: CommStats | None = None) -> None:
        if not dist.is_initialized():
            raise CommError("GlooCommunicator: torch.distributed is not initialised "
                            "(call dist.init_process_group first)", op="GlooCommunicator")
        self.group = group
        torch_ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        ids = list(torch_ranks) if ids is None else [int(i) for i in ids]
        if len(ids) != len(torch_ranks) or ids != sorted(ids):
            raise ValueError(f"GlooCommunicator: ids {ids} must be ascending, one per member of "
                             f"the group (torch ranks {torch_ranks})")
        me = dist.get_rank(group) if group is not None else dist.get_rank()
        if me < 0:
            raise ValueError(f"GlooCommunicator: this process is not in the group {ids}")
        self._init_membership(ids, ids[me], timeout_s, stats)
        self.device = torch.device("cpu")
        """gloo's own memory; tensors elsewhere (CUDA) are staged through it."""

    # -- point to point ----------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Posted:
        """Start sending a contiguous tensor to global rank `dst`; finish with `wait`."""
        peer = self.group_index(dst)
        buf = to_host(tensor)
        work = self._start(lambda: dist.isend(buf, group=self.group, group_dst=peer, tag=tag),
                           f"sending to rank {dst}", (dst,))
        self._count_sent(nbytes(tensor))
        return Posted(dst, "send", work, buf)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Posted:
        """Post a receive into a contiguous tensor from global rank `src`; finish with `wait`."""
        peer = self.group_index(src)
        buf = host_buffer(tensor)
        work = self._start(lambda: dist.irecv(buf, group=self.group, group_src=peer, tag=tag),
                           f"receiving from rank {src}", (src,))
        return Posted(src, "recv", work, buf, None if buf is tensor else tensor)

    def wait(self, posted: Posted, what: str | None = None) -> torch.Tensor:
        """Finish a posted send/receive within the timeout; returns its tensor."""
        verb = "sending to" if posted.kind == "send" else "receiving from"
        self._wait([posted.handle], what or f"{verb} rank {posted.peer}", (posted.peer,))
        return _deliver(posted)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, what: str | None = None) -> None:
        """Send a contiguous tensor to global rank `dst`."""
        self.wait(self.isend(tensor, dst, tag), what)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0,
             what: str | None = None) -> torch.Tensor:
        """Receive into a contiguous tensor from global rank `src`; returns it."""
        return self.wait(self.irecv(tensor, src, tag), what)

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]],
                 recvs: Sequence[tuple[torch.Tensor, int]], what: str | None = None) -> None:
        """Run many sends (tensor, dst) and receives (tensor, src) concurrently."""
        posted = [self.isend(t, dst) for t, dst in sends] + [self.irecv(t, src) for t, src in recvs]
        peers = tuple(sorted({p.peer for p in posted}))
        self._wait([p.handle for p in posted], what or "point-to-point exchange", peers)
        for p in posted:
            _deliver(p)

    # -- collectives -------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", what: str | None = None) -> None:
        """In-place reduction (`sum`, `max` or `min`) over the group."""
        check_op(op)
        what = what or f"all_reduce over ranks {list(self.ranks)}"
        self._count_sent(self._ring_bytes(tensor))
        host = to_host(tensor)
        self._collective(lambda: dist.all_reduce(host, op=_OPS[op], group=self.group,
                                                 async_op=True), what)
        if host is not tensor:
            stage_in(host, tensor)

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor,
                   what: str | None = None) -> None:
        """outputs[i] <- the `tensor` of group rank i."""
        self._count_sent((self.size - 1) * nbytes(tensor))
        host, outs = to_host(tensor), [host_buffer(o) for o in outputs]
        self._collective(lambda: dist.all_gather(outs, host, group=self.group, async_op=True),
                         what or f"all_gather over ranks {list(self.ranks)}")
        for out, target in zip(outs, outputs):
            if out is not target:
                stage_in(out, target)

    def broadcast(self, tensor: torch.Tensor, src: int, what: str | None = None) -> None:
        """In place: every member ends with global rank `src`'s tensor."""
        root = self.group_index(src)
        if self.rank == src:
            self._count_sent(nbytes(tensor))
        host = to_host(tensor)
        self._collective(lambda: dist.broadcast(host, group=self.group, group_src=root,
                                                async_op=True),
                         what or f"broadcast from rank {src}")
        if host is not tensor:
            stage_in(host, tensor)

    def barrier(self, what: str | None = None) -> None:
        """Return once every member has called barrier."""
        self._collective(lambda: dist.barrier(group=self.group, async_op=True),
                         what or f"barrier over ranks {list(self.ranks)}")

    def synchronize(self, what: str | None = None) -> None:
        """Nothing to do: every gloo call returns when it is done."""

    def close(self) -> None:
        """Nothing to release: the process group belongs to torch.distributed."""

    def abort(self) -> None:
        """As close: gloo's calls already returned (or failed) within the timeout."""

    # -- waiting -----------------------------------------------------------------------------
    def _start(self, call: Callable[[], dist.Work], what: str, peers: Sequence[int]) -> dist.Work:
        """Start a backend call; a closed connection is a CommError naming the peer(s)."""
        try:
            return call()
        except RuntimeError as e:
            raise CommError(f"{what}: failed ({first_line(e)})", op=what, peers=peers) from None

    def _collective(self, call: Callable[[], dist.Work], what: str) -> None:
        self._wait([self._start(call, what, self.others())], what, self.others())

    def _wait(self, works: Sequence[dist.Work], what: str, peers: Sequence[int]) -> None:
        """Wait for every work (they run concurrently), each at most the timeout; CommError
        naming `what` and `peers` otherwise."""
        # never a zero timeout: c10d reads 0 as "the group's default" (30 min for a subgroup)
        timeout = timedelta(seconds=max(self.timeout_s, 1e-3))
        t0 = time.perf_counter()
        try:
            for work in works:
                try:
                    ok = work.wait(timeout=timeout)
                except RuntimeError as e:
                    raise no_answer(what, peers, self.timeout_s, e) from None
                if ok is False:
                    raise no_answer(what, peers, self.timeout_s)
        finally:
            self._count_wait(time.perf_counter() - t0)


def _deliver(posted: Posted) -> torch.Tensor:
    """The tensor a finished send/receive stands for; a staged receive is copied to its target."""
    if posted.target is None:
        return posted.buffer
    stage_in(posted.buffer, posted.target)
    return posted.target
