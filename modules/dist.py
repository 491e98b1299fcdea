"""Rendezvous, process groups and timed point-to-point / collective calls (gloo on CPU).

Everything that waits on a peer goes through `Comm`, which applies one timeout and turns a
silent peer into a `PeerError` naming it. All process groups are built in `build_groups`, in
the same order on every rank (a torch.distributed.new_group requirement).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from formats.errors import UserError
from formats.plan import Plan


class PeerError(RuntimeError):
    """A peer or the rendezvous did not answer within the timeout (exit status 1)."""


@dataclass(frozen=True)
class Topology:
    """Where this rank sits in the plan."""

    rank: int
    world_size: int
    replica: int
    stage: int
    num_stages: int
    num_replicas: int
    stage_ranks: tuple[int, ...]
    """Devices holding my stage in every replica (my data-parallel group), by replica."""
    prev_rank: int | None
    """Device of the previous stage of my replica (None on the first stage)."""
    next_rank: int | None
    """Device of the next stage of my replica (None on the last stage)."""
    ends: tuple[int, int]
    """(first-stage device, last-stage device) of my replica: they hold the tied embeddings."""

    @property
    def is_first(self) -> bool:
        """Whether this rank runs stage 0 (reads input tokens)."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (computes the loss)."""
        return self.stage == self.num_stages - 1


def check_world(plan: Plan, world_size: int) -> None:
    """The plan must use device ids 0..world_size-1 exactly (rank = device id)."""
    devices = sorted(plan.devices())
    if len(devices) != world_size:
        raise UserError(f"world size {world_size} disagrees with the plan, which has "
                        f"{len(devices)} devices ({plan.num_replicas} replicas x "
                        f"{plan.num_stages} stages); pass --world-size {len(devices)}")
    if devices != list(range(world_size)):
        raise UserError(f"plan devices {devices} are not 0..{world_size - 1}; rank = device id, "
                        "so the plan must use every id from 0 to world_size-1")


def topology(plan: Plan, rank: int, world_size: int) -> Topology:
    """Place `rank` in the plan (UserError when it is not there or sizes disagree)."""
    check_world(plan, world_size)
    replica, stage = plan.stage_of(rank)
    chain = plan.pipelines[replica]
    return Topology(
        rank=rank, world_size=world_size, replica=replica, stage=stage,
        num_stages=plan.num_stages, num_replicas=plan.num_replicas,
        stage_ranks=tuple(p[stage] for p in plan.pipelines),
        prev_rank=chain[stage - 1] if stage > 0 else None,
        next_rank=chain[stage + 1] if stage + 1 < plan.num_stages else None,
        ends=(chain[0], chain[-1]),
    )


def parse_dist_url(url: str) -> tuple[str, int]:
    """`tcp://HOST:PORT` -> (host, port); UserError otherwise."""
    u = urlparse(url)
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme != "tcp" or not u.hostname or port is None:
        raise UserError(f"--dist-url: expected tcp://HOST:PORT, got {url!r}")
    return u.hostname, port


def rendezvous(url: str, rank: int, world_size: int, timeout_s: float,
               agent_store: bool = False, members: tuple[int, ...] | None = None,
               on_store: Callable[[dist.Store], None] | None = None) -> dist.Store:
    """Connect to the TCPStore at `url` (rank 0 hosts it) and init the gloo world group.

    Fails with PeerError within about `timeout_s` when the address is unreachable or not every
    rank joins. `agent_store`: torchrun's agent already hosts the store, so nobody binds it.
    `members`: the ranks that start now (default all); when fewer, the group is formed among
    them under the store prefix `gen0` with ranks renumbered in ascending order, and a rank
    not among them (a later --join) only connects to the store. `on_store` runs as soon as the
    store is reachable (before the group is formed).
    """
    host, port = parse_dist_url(url)
    timeout = timedelta(seconds=timeout_s)
    try:
        # the client retries a failed connect once after a pause as long as its timeout: half
        # the budget each keeps the whole attempt within timeout_s
        store = dist.TCPStore(host, port, world_size, is_master=(rank == 0 and not agent_store),
                              timeout=timedelta(seconds=timeout_s / 2), wait_for_workers=False)
        store.set_timeout(timeout)
    except (RuntimeError, OSError) as e:
        what = "cannot listen on" if rank == 0 and not agent_store else "cannot reach"
        raise PeerError(f"rendezvous: {what} {url} within {timeout_s:g} s "
                        f"({_first_line(e)})") from None
    if on_store is not None:
        on_store(store)
    if members is not None and rank not in members:
        return store
    try:
        if members is None or list(members) == list(range(world_size)):
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)
        else:
            world_size = len(members)
            dist.init_process_group("gloo", store=dist.PrefixStore("gen0", store),
                                    rank=members.index(rank), world_size=world_size,
                                    timeout=timeout)
    except (RuntimeError, OSError) as e:
        raise PeerError(f"rendezvous: not all {world_size} ranks joined at {url} within "
                        f"{timeout_s:g} s ({_first_line(e)})") from None
    return store


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


@dataclass
class Groups:
    """The process groups this rank takes part in (None where the group has one member)."""

    stage: dist.ProcessGroup | None
    """Data-parallel group of my stage (gradient / pseudo-gradient averaging)."""
    tied: dist.ProcessGroup | None
    """First and last stage of my replica, which hold the two tied embedding copies."""


def build_groups(plan: Plan, topo: Topology, tie_embeddings: bool,
                 replicas: list[int] | tuple[int, ...] | None = None,
                 rank_of: dict[int, int] | None = None) -> Groups:
    """Create every group on every rank in one fixed order; return the ones this rank uses.

    `replicas`: the live replicas (default all); `rank_of`: device id -> rank in the current
    default group (default: the same number).
    """
    replicas = list(range(plan.num_replicas)) if replicas is None else sorted(replicas)
    rank_of = rank_of or {}
    stage_group = tied_group = None
    for s in range(plan.num_stages):  # 1) data-parallel groups, stage by stage
        ranks = [rank_of.get(plan.pipelines[r][s], plan.pipelines[r][s]) for r in replicas]
        if len(ranks) > 1:
            g = dist.new_group(ranks=ranks, backend="gloo")
            if s == topo.stage:
                stage_group = g
    if tie_embeddings and plan.num_stages > 1:  # 2) tied-embedding pairs, replica by replica
        for r in replicas:
            chain = plan.pipelines[r]
            g = dist.new_group(ranks=[rank_of.get(chain[0], chain[0]),
                                      rank_of.get(chain[-1], chain[-1])], backend="gloo")
            if r == topo.replica and (topo.is_first or topo.is_last):
                tied_group = g
    return Groups(stage=stage_group, tied=tied_group)


class Comm:
    """Timed p2p and collectives: every wait has the timeout and names the peer it waits for."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.wait_s = 0.0
        """Seconds spent waiting on communication (includes waiting for a slow peer)."""
        self.bytes_sent = 0
        """Bytes this rank sent: p2p payloads, and 2 (W-1)/W x payload per ring all-reduce."""

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for `work` at most the timeout; PeerError(`what`) otherwise."""
        t0 = time.perf_counter()
        try:
            ok = work.wait(timeout=self.timeout)
        except RuntimeError as e:
            raise PeerError(f"{what}: no answer within {self.timeout_s:g} s "
                            f"({_first_line(e)})") from None
        finally:
            self.wait_s += time.perf_counter() - t0
        if ok is False:
            raise PeerError(f"{what}: no answer within {self.timeout_s:g} s")

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work:
        """Start sending `tensor` to global rank `dst`; wait on the result with `wait`."""
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return dist.isend(tensor, dst=dst, tag=tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> dist.Work:
        """Post a receive into `tensor` from `src` now; wait on the result with `wait`."""
        return dist.irecv(tensor, src=src, tag=tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int, what: str) -> torch.Tensor:
        """Receive into `tensor` from global rank `src` within the timeout."""
        self.wait(dist.irecv(tensor, src=src, tag=tag), f"{what} from rank {src}")
        return tensor

    def all_reduce_sum(self, tensor: torch.Tensor, group: dist.ProcessGroup,
                       what: str) -> None:
        """In-place sum over `group` within the timeout (bytes counted as a ring sends them)."""
        w = dist.get_world_size(group)
        self.bytes_sent += int(2 * (w - 1) / w * tensor.numel() * tensor.element_size())
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        self.wait(work, what)


def wait_for_peers(store: dist.Store, key: str, rank: int, peers: tuple[int, ...],
                   timeout_s: float, wait_forever: bool = False, log=print,
                   what: str | None = None) -> None:
    """Announce `key` for `rank` in the store and wait until every peer announced it too.

    Raises PeerError naming the peers that did not arrive within `timeout_s`; with
    `wait_forever` it logs them every `timeout_s` and keeps waiting.
    """
    what = what or key
    store.set(f"{key}/{rank}", "1")
    keys = [f"{key}/{p}" for p in peers]
    while True:
        try:
            store.wait(keys, timedelta(seconds=timeout_s))
            return
        except RuntimeError as e:  # timeout, or the store (on rank 0) is gone
            try:
                missing = [p for p, k in zip(peers, keys) if not store.check([k])]
            except RuntimeError:
                raise PeerError(f"{what}: the rendezvous store (hosted by rank 0) is gone "
                                f"({_first_line(e)})") from None
            if not missing:
                return
            msg = (f"{what}: rank(s) {missing} of my group {list(peers)} did not arrive within "
                   f"{timeout_s:g} s")
            if not wait_forever:
                raise PeerError(msg + "; not stepping alone (pass --wait-for-peers to wait)") \
                    from None
            log(f"warning: {msg}; still waiting (--wait-for-peers)")
