"""The process group of one shard group: FSDP2's collectives run on it.

It is built from the run's store under its own prefix, apart from the default process group:
a generation change (a replica dropped) destroys and re-forms the default group and every
group made with `dist.new_group`, while a shard group lives as long as its replica. torch's
DeviceMesh resolves a group by its registered name, and `dist.destroy_process_group()`
forgets every name and map entry, so `ShardGroup.register` is called again after each
re-formation. Each incarnation of a group (its replica dropped and rejoining with --join) meets
under a prefix of its own, claimed by counting arrivals per incarnation (`claim_incarnation`);
a formation that failed is spoiled so that the next members start a fresh one.
gloo on CPU ranks; torch's own NCCL on CUDA ranks (FSDP2 needs reduce-scatter on the device).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from modules.comm import PeerError
from modules.comm.errors import first_line
from modules.control.hidden import hidden_store


@dataclass
class ShardGroup:
    """One shard group's process group and the 1-D mesh FSDP2 shards over."""

    name: str
    """Registered group name (also the store prefix its members met under)."""
    ranks: tuple[int, ...]
    """Device ids of the members, in shard order (member i holds shard i)."""
    group: dist.ProcessGroup
    mesh: DeviceMesh
    backend: str = "gloo"
    store: dist.Store | None = None
    """The prefix store its members met under."""

    def register(self) -> None:
        """(Re-)register the group under its name and with its members' global ranks."""
        c10d._world.pg_group_ranks[self.group] = {g: i for i, g in enumerate(self._globals())}
        # in the map (c10d's error path reads the backend from it) but not among the named
        # groups that destroy_process_group() shuts down
        c10d._world.pg_map[self.group] = (self.backend, self.store)
        try:
            torch._C._distributed_c10d._resolve_process_group(self.name)
        except RuntimeError:  # forgotten (or never registered)
            torch._C._distributed_c10d._register_process_group(self.name, self.group)

    def _globals(self) -> list[int]:
        # the mesh names members by their rank in the default group, but only ever looks up
        # its own (when it is made, in generation 0): mine is the default group's rank, the
        # others get distinct placeholders (-1 - their device id), never equal to mine
        me = self.group.rank()
        own = dist.get_rank() if dist.is_initialized() else self.ranks[me]
        return [own if i == me else -1 - d for i, d in enumerate(self.ranks)]


def _backend(store: dist.Store, rank: int, size: int, device: torch.device,
             timeout_s: float) -> tuple[dist.ProcessGroup.BackendType, object]:
    """gloo (CPU) or NCCL (CUDA) over `store`."""
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroup.BackendType.NCCL, dist.ProcessGroupNCCL(store, rank, size, opts)
    # this constructor takes the interfaces of $GLOO_SOCKET_IFNAME, as init_process_group does
    # (namespace hosts: their eth0; the default device can resolve to loopback there)
    return dist.ProcessGroup.BackendType.GLOO, dist.ProcessGroupGloo(
        store, rank, size, timedelta(seconds=timeout_s))


def claim_incarnation(store: dist.Store, name: str, size: int) -> int:
    """The incarnation of group `name` this member forms: the first one with a free place
    among its `size` (each member takes one place; a full one was formed before, or spoiled)."""
    k = 0
    # one store round trip per earlier incarnation: a group re-forms only when its replica
    # rejoins, so k stays small
    while store.add(f"shard/{name}/{k}/arrivals", 1) > size:
        k += 1
    return k


def spoil_incarnation(store: dist.Store, name: str, incarnation: int, size: int) -> None:
    """Mark a formation that failed as full, so that members arriving later (the replica
    started again) claim the next incarnation instead of waiting beside a member that left."""
    # without this, the arrivals of the failed formation would stay counted and the next
    # members would split between it and the one after (each then waits for the other)
    store.add(f"shard/{name}/{incarnation}/arrivals", size)


def meet(store: dist.Store, name: str, ranks: tuple[int, ...], rank: int,
         device: torch.device, timeout_s: float
         ) -> tuple[dist.PrefixStore, dist.ProcessGroup.BackendType, object]:
    """The members of `name` meet under their incarnation's prefix of `store` and form the
    backend: (prefix, backend type, backend); PeerError naming the members when one does not
    come within `timeout_s` (that incarnation is spoiled: a restarted replica forms anew)."""
    me, size = ranks.index(rank), len(ranks)
    incarnation = claim_incarnation(store, name, size)
    prefix = dist.PrefixStore(f"shard/{name}/{incarnation}/", store)
    try:
        kind, backend = _backend(prefix, me, size, device, timeout_s)
    except (RuntimeError, OSError) as e:
        # if the store itself is gone, nobody can form under it again anyway
        with contextlib.suppress(RuntimeError, OSError):
            spoil_incarnation(store, name, incarnation, size)
        raise PeerError(f"forming shard group {name} of devices {list(ranks)}: not every "
                        f"member came within {timeout_s:g} s ({first_line(e)})") from None
    return prefix, kind, backend


def build_shard_group(store: dist.Store, name: str, ranks: tuple[int, ...], rank: int,
                      device: torch.device, timeout_s: float) -> ShardGroup:
    """Form the group `name` among `ranks` (every member calls this with the same arguments);
    PeerError naming the members when one does not come within `timeout_s`."""
    # process groups meet under keys only the run can name (modules.control.hidden); each
    # incarnation of the group (a dropped replica rejoining forms it again) meets under its own
    # prefix: gloo would otherwise read the dead incarnation's addresses
    me, size = ranks.index(rank), len(ranks)
    prefix, kind, backend = meet(hidden_store(store), name, ranks, rank, device, timeout_s)
    group = dist.ProcessGroup(prefix, me, size)
    group._set_default_backend(kind)
    group._register_backend(torch.device(device.type), kind, backend)
    group._set_group_name(name)
    shard = ShardGroup(name, ranks, group, None, device.type == "cuda" and "nccl" or "gloo",
                       prefix)  # type: ignore[arg-type]
    if not dist.is_initialized():
        # a --join replica before it is admitted: DeviceMesh needs a default group to read my
        # rank from, so my shard group's members form a stand-in one; the generation that
        # admits us destroys it and forms the real one (the shard group is registered again)
        dist.init_process_group("gloo", store=dist.PrefixStore("world/", prefix), rank=me,
                                world_size=size, timeout=timedelta(seconds=timeout_s))
    shard.register()
    shard.mesh = DeviceMesh.from_group(group, device.type)
    return shard
