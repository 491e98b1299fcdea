"""The communicators of one generation: which groups a plan needs and how they are formed.

A generation's members are every device of its live replicas. Generation 0's default process
group comes from the rendezvous (modules.dist); a later one is re-formed among the members
under a fresh store prefix. On it, every member creates the same groups in the same order (a
torch.distributed.new_group rule): the data-parallel group of each stage, then the
tied-embedding pair (first and last stage) of each replica.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from formats.plan import Plan
from modules.comm import CommStats, Communicator, GlooCommunicator, PeerError, build_communicators
from modules.comm.errors import first_line
from modules.dist import Topology, members_of
from modules.protocol import generation_prefix


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

    def close(self) -> None:
        """Release every communicator (before a new generation replaces them)."""
        for comm in {id(c): c for c in (self.world, self.pipeline, self.stage, self.tied)
                     if c is not None}.values():
            comm.close()


class GroupBuilder:
    """Forms the communicators of a generation, the same calls in the same order on every
    member; every communicator has the run's timeout and adds to one `CommStats`."""

    def __init__(self, plan: Plan, topo: Topology, store: dist.Store, tie_embeddings: bool,
                 timeout_s: float, stats: CommStats) -> None:
        self.plan, self.topo, self.store = plan, topo, store
        self.tie_embeddings = tie_embeddings
        self.timeout_s = timeout_s
        self.stats = stats

    def build(self, gen: int, replicas: Sequence[int]) -> Groups:
        """Groups of generation `gen` over the live `replicas` (re-forms the default process
        group first for gen > 0; generation 0's is the rendezvous'). PeerError when a member
        does not come within the timeout."""
        plan, topo = self.plan, self.topo
        replicas = sorted(replicas)
        members = members_of(plan, replicas)
        if gen > 0:
            self._reform_default_group(gen, members)
        stage_groups = [[plan.pipelines[r][s] for r in replicas] for s in range(plan.num_stages)]
        stage_groups = [g for g in stage_groups if len(g) > 1]
        tied_groups = [[plan.pipelines[r][0], plan.pipelines[r][-1]] for r in replicas] \
            if self.tie_embeddings and plan.num_stages > 1 else []
        comms = build_communicators(stage_groups + tied_groups, topo.rank, "gloo",
                                    timeout_s=self.timeout_s,
                                    rank_of={d: i for i, d in enumerate(members)},
                                    stats=self.stats)
        world = GlooCommunicator(None, self.timeout_s, ids=members, stats=self.stats)
        chain = plan.pipelines[topo.replica]
        mine = tuple(sorted(plan.pipelines[r][topo.stage] for r in replicas))
        return Groups(world=world, pipeline=world if plan.num_stages > 1 else None,
                      stage=comms.get(mine), tied=comms.get(tuple(sorted((chain[0], chain[-1])))))

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
