"""The communicators of one generation: which groups a plan needs, the backend of each, and
how they are formed.

A generation's members are every device of its live replicas. Generation 0's default process
group comes from the rendezvous (modules.control.dist); a later one is re-formed among the members
under a fresh store prefix. The groups: the data-parallel group of each stage, the
tied-embedding pair (first and last stage) of each replica, and each replica's pipeline. Each
gets a backend from `CommOptions.backend` and its members' devices (modules.comm.choice, the
same answer on every rank); every member creates the gloo ones in the same order (a
torch.distributed.new_group rule), then the NCCL ones. A gloo pipeline needs no group of its
own: its point-to-point calls go through the generation's default group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from formats.plan import Plan
from modules.comm import CommStats, Communicator, GlooCommunicator, PeerError, build_communicators
from modules.comm.choice import (
    BackendChoice,
    CommOptions,
    DeviceInfo,
    announce_device,
    choose_backend,
    local_device,
    read_devices,
)
from modules.comm.errors import CommError, first_line
from modules.control.dist import Topology, members_of
from modules.control.hidden import hidden_store
from modules.control.protocol import generation_prefix


def stage_group_name(stage: int, shard: int, sharded: bool) -> str:
    """The name of the group averaging shard `shard` of `stage` across replicas."""
    return f"stage{stage}.{shard}" if sharded else f"stage{stage}"


def lane_name(replica: int, shard: int, sharded: bool) -> str:
    """The name of a lane (its tied pair and pipeline are tied<name>, pipeline<name>)."""
    return f"{replica}.{shard}" if sharded else f"{replica}"


def pipeline_groups(plan: Plan, replicas: Sequence[int]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, ranks) of every pipeline: one per lane (its chain) when every stage has the same
    D, else one per replica (all its devices: a device of a smaller shard group runs several
    lanes, so it talks to several devices of the next stage)."""
    if len(set(plan.shard_degrees())) <= 1:
        lanes = plan.lanes_per_replica
        return [(lane_name(r, i, plan.is_sharded), tuple(sorted(plan.lanes()[r * lanes + i])))
                for r in replicas for i in range(lanes)]
    return [(f"{r}", members_of(plan, [r])) for r in replicas]


def pipeline_name(plan: Plan, topo: Topology) -> str:
    """The name of my pipeline group (pipeline_groups)."""
    if len(set(plan.shard_degrees())) <= 1:
        return lane_name(topo.replica, topo.shard, plan.is_sharded)
    return f"{topo.replica}"


@dataclass
class Groups:
    """The communicators of one generation that this rank takes part in (peers: device ids)."""

    world: Communicator
    """Every member of the generation (resume agreement, final barrier)."""
    pipeline: Communicator | None
    """My replica's pipeline: activations and their gradients (None with one stage)."""
    stage: Communicator | None
    """Data-parallel group of my stage (gradient / pseudo-gradient averaging, a joiner's outer
    state); None where it has one member."""
    tied: Communicator | None
    """First and last stage of my replica, which hold the two tied embedding copies (None
    without tied embeddings or with one stage)."""
    choices: tuple[BackendChoice, ...] = ()
    """The backend of each group of more than one rank that I am in, and why."""
    outer: Communicator | None = None
    """A second communicator of my stage group, only for DiLoCo's background (overlapped)
    outer all-reduces, so they never interleave with the training thread's messages; None
    without sync.overlap or where the group has one member."""

    def close(self) -> None:
        """Release every communicator of a healthy generation (NCCL: destroy, which flushes)."""
        for comm in self._all():
            comm.close()

    def abort(self) -> None:
        """Drop every communicator without flushing (NCCL: ncclCommAbort): before a new
        generation replaces one that lost a peer, whose pending operations would hang a
        destroy."""
        for comm in self._all():
            comm.abort()

    def check_health(self, what: str) -> None:
        """CommError unless every NCCL communicator of mine completed what it was given on a
        healthy communicator (before an optimizer step or a checkpoint: an aborted operation
        ends as if done, its buffers holding garbage). The overlapped outer communicator is
        only asked what it knows now (its worker waits for its own rounds)."""
        for comm in self._all():
            check = getattr(comm, "check_health", None)  # gloo's calls return when done
            if check is not None:
                check(what, wait=comm is not self.outer)

    def _all(self) -> list[Communicator]:
        return list({id(c): c for c in (self.world, self.pipeline, self.stage, self.tied,
                                        self.outer) if c is not None}.values())


class GroupBuilder:
    """Forms the communicators of a generation, the same calls in the same order on every
    member; every communicator has the run's timeout and adds to one `CommStats`."""

    def __init__(self, plan: Plan, topo: Topology, store: dist.Store, tie_embeddings: bool,
                 timeout_s: float, stats: CommStats, options: CommOptions | None = None,
                 log: Callable[[str], None] = print, outer_stats: CommStats | None = None,
                 ) -> None:
        """`outer_stats`: build each stage group's background communicator (sync.overlap),
        counting into these stats (the background thread's own: the training thread's are
        not touched from two threads)."""
        self.plan, self.topo = plan, topo
        # process groups, NCCL ids and device records: keys only the run can name
        self.store = hidden_store(store)
        self.outer_stats = outer_stats
        self.tie_embeddings = tie_embeddings
        self.timeout_s = timeout_s
        self.stats = stats
        self.options = options or CommOptions()
        self.device = torch.device(self.options.device)
        self.log = log
        self.devices: dict[int, DeviceInfo] = {}
        """Announced devices of the ranks seen so far (a device does not change)."""
        if self.options.backend != "gloo":  # gloo for everything needs nobody's device
            announce_device(self.store, topo.rank, local_device(self.device))

    def build(self, gen: int, replicas: Sequence[int]) -> Groups:
        """Groups of generation `gen` over the live `replicas` (re-forms the default process
        group first for gen > 0; generation 0's is the rendezvous'). PeerError when a member
        does not come within the timeout; UserError when --comm nccl cannot run somewhere."""
        replicas = sorted(replicas)
        members = members_of(self.plan, replicas)
        if gen > 0:
            self._reform_default_group(gen, members)
        choices = self._choose(self._named_groups(replicas), members)
        built: dict[tuple[int, ...], str] = {}  # ranks -> backend, once per set of ranks
        for c in choices:  # (with two stages a pipeline is its tied pair)
            if not (c.group.startswith("pipeline") and c.backend == "gloo"):
                built.setdefault(c.ranks, c.backend)
        comms = build_communicators(list(built), self.topo.rank, list(built.values()),
                                    self.store, self.device,
                                    f"g{gen}/", self.timeout_s,
                                    {d: i for i, d in enumerate(members)}, self.stats,
                                    self._nccl_aborted)
        world = GlooCommunicator(None, self.timeout_s, ids=members, stats=self.stats)
        mine = {c.group: c for c in choices if self.topo.rank in c.ranks}
        sharded, topo = self.plan.is_sharded, self.topo
        lane = lane_name(topo.replica, topo.shard, sharded)
        stage, tied, chain = (mine.get(stage_group_name(topo.stage, topo.shard, sharded)),
                              mine.get(f"tied{lane}"),
                              mine.get(f"pipeline{pipeline_name(self.plan, topo)}"))
        pipeline = None if chain is None else world if chain.backend == "gloo" \
            else comms[chain.ranks]
        if self.options.backend != "gloo" and mine:
            self.log(f"generation {gen} backends: "
                     + "; ".join(c.describe() for c in mine.values()))
        return Groups(world=world, pipeline=pipeline,
                      stage=comms.get(stage.ranks) if stage else None,
                      tied=comms.get(tied.ranks) if tied else None,
                      choices=tuple(mine.values()), outer=self._outer(gen, choices, stage, members))

    def _outer(self, gen: int, choices: list[BackendChoice],
               stage: BackendChoice | None, members: tuple[int, ...]) -> Communicator | None:
        """Every stage group's background communicator (same backend as the group), made on
        every member after the others (the same calls in the same order everywhere)."""
        if self.outer_stats is None:
            return None
        groups = [c for c in choices if c.group.startswith("stage")]
        comms = build_communicators([c.ranks for c in groups], self.topo.rank,
                                    [c.backend for c in groups], self.store, self.device,
                                    f"g{gen}/outer", self.timeout_s,
                                    {d: i for i, d in enumerate(members)},
                                    self.outer_stats, self._nccl_aborted)
        return comms.get(stage.ranks) if stage else None

    def _nccl_aborted(self, error: CommError) -> None:
        """An NCCL watchdog aborted a communicator: say so at once (the training thread's
        next call on it raises the error and the run's failure handling takes over)."""
        self.log(f"NCCL communicator aborted: {error}")

    def _named_groups(self, replicas: list[int]) -> list[tuple[str, tuple[int, ...]]]:
        """Every group of the generation with more than one rank, in one fixed order."""
        plan = self.plan
        # shard groups (issue 22): one stage group per shard index, one tied pair and one
        # pipeline per lane (replica r's shard i, named r.i); D = 1 keeps the old names
        named = [(stage_group_name(s, d, plan.is_sharded),
                  tuple(sorted(plan.shard_peers(s, d)[r] for r in replicas)))
                 for s in range(plan.num_stages) for d in range(plan.shard_degree(s))]
        # tied pairs: shard i of the first and of the last stage (validated: the same D)
        if self.tie_embeddings and plan.num_stages > 1:
            last = plan.num_stages - 1
            named += [(f"tied{lane_name(r, i, plan.is_sharded)}",
                       tuple(sorted((plan.shard_group(r, 0)[i], plan.shard_group(r, last)[i]))))
                      for r in replicas for i in range(plan.shard_degree(0))]
        named += [(f"pipeline{name}", ranks) for name, ranks in pipeline_groups(plan, replicas)]
        return [(name, ranks) for name, ranks in named if len(ranks) > 1]

    def _choose(self, named: list[tuple[str, tuple[int, ...]]],
                members: tuple[int, ...]) -> list[BackendChoice]:
        """The backend of every group (reads the members' announced devices unless gloo was
        asked for everything)."""
        requested = self.options.backend
        if requested != "gloo":
            unknown = [d for d in members if d not in self.devices]
            if unknown:
                self.devices.update(read_devices(self.store, unknown, self.timeout_s))
        return [choose_backend(requested, name, ranks, self.devices) for name, ranks in named]

    def _reform_default_group(self, gen: int, members: tuple[int, ...]) -> None:
        """A fresh default process group among `members` (ranks 0..n-1 in ascending order)."""
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # the old group may hold a lost peer
                dist.destroy_process_group()
        try:
            dist.init_process_group("gloo", store=dist.PrefixStore(generation_prefix(gen),
                                                                   self.store),
                                    rank=members.index(self.topo.rank), world_size=len(members),
                                    timeout=timedelta(seconds=self.timeout_s))
        except (RuntimeError, OSError) as e:
            raise PeerError(f"re-forming the groups of generation {gen}: not every member "
                            f"{list(members)} came within {self.timeout_s:g} s "
                            f"({first_line(e)})") from None
