"""Generations: the membership record of a DiLoCo run in the rendezvous store, and the one
writer that decides the next one.

A generation (JSON: members, replicas, dropped, joined, reason, stop) sits under
`ft/gen/{g}`; the counter `ft/gen` holds the newest g (keys: modules.control.protocol). Exactly one
process writes them, the `Leader`: rank 0's heartbeat thread when rank 0 hosts the store (the
default), or the coordinator process (modules.control.coordinator) when it does, so that no training
host is special. Both call the same `Leader.decide`: when a watched rank is gone its whole
replica is dropped; when every rank of a missing replica asked to join, it is added; below
--min-replicas the generation says stop.
"""

from __future__ import annotations

import json
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field

from formats.plan import Plan
from modules.control.auth import AuthStore
from modules.control.dist import members_of
from modules.control.protocol import GENERATION_COUNTER, generation_key, join_key, left_key


@dataclass(frozen=True)
class Generation:
    """One membership of the run: which replicas (and so which ranks) take part."""

    gen: int
    replicas: tuple[int, ...]
    members: tuple[int, ...]
    """Device ids (global ranks) of every live replica's every stage, ascending."""
    dropped: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    reason: str = ""
    stop: bool = False
    """Fewer replicas than --min-replicas: every member checkpoints and exits."""

    def to_json(self) -> str:
        """Serialised for the store."""
        return json.dumps({"gen": self.gen, "replicas": self.replicas, "members": self.members,
                           "dropped": self.dropped, "joined": self.joined,
                           "reason": self.reason, "stop": self.stop})

    @staticmethod
    def from_json(text: str | bytes) -> Generation:
        """Parse what to_json wrote."""
        d = json.loads(text)
        return Generation(int(d["gen"]), tuple(d["replicas"]), tuple(d["members"]),
                          tuple(d["dropped"]), tuple(d["joined"]), d["reason"], bool(d["stop"]))


def first_generation(plan: Plan, replicas: Sequence[int]) -> Generation:
    """Generation 0 over the replicas that start now."""
    start = tuple(sorted(replicas))
    return Generation(0, start, members_of(plan, start), reason="start")


def publish(store: AuthStore, g: Generation) -> None:
    """Write generation g, then advance the counter that announces it (both signed)."""
    store.put(generation_key(g.gen), g.to_json())
    store.put(GENERATION_COUNTER, str(g.gen))


def read_generation(store: AuthStore, g: int) -> Generation | None:
    """Generation g from the store; None when absent, forged (logged) or malformed."""
    text = store.read(generation_key(g))
    if text is None:
        return None
    try:
        gen = Generation.from_json(text)
    except (ValueError, KeyError, TypeError) as e:
        store.auth.log(f"warning: ignored a malformed generation {g} record ({e!r})")
        return None
    return gen if gen.gen == g else None


def newest_generation(store: AuthStore) -> int:
    """The newest published generation number (-1 when none is, or the counter is forged)."""
    return store.read_int(GENERATION_COUNTER, -1)


@dataclass(frozen=True)
class Leader:
    """Decides and publishes the generations of a DiLoCo run (see the module docstring)."""

    plan: Plan
    min_replicas: int
    """Below this many live replicas the new generation says stop (--min-replicas)."""

    def decide(self, store: AuthStore, current: Generation, gone: Sequence[int],
               lost: Mapping[int, str]) -> Generation | None:
        """The generation after `current` given the ranks newly found `gone` (`lost` describes
        them) and the joiners waiting in the store; published, or None when nothing changed."""
        plan = self.plan
        replicas = set(current.replicas)
        dropped = sorted({plan.stage_of(r)[0] for r in gone} & replicas)
        joined = [k for k in range(plan.num_replicas) if k not in replicas and
                  all(store.read(join_key(d)) == "1" for d in members_of(plan, [k]))]
        if not dropped and not joined:
            return None
        new = sorted((replicas - set(dropped)) | set(joined))
        parts = []
        if dropped:
            parts.append("dropped replica(s) " + ", ".join(str(k) for k in dropped) + ": " +
                         "; ".join(lost[r] for r in gone) + " gone")
        if joined:
            parts.append("replica(s) " + ", ".join(str(k) for k in joined) + " joined")
        g = Generation(current.gen + 1, tuple(new), members_of(plan, new), tuple(dropped),
                       tuple(joined), "; ".join(parts), stop=len(new) < self.min_replicas)
        for d in members_of(plan, joined):
            store.put(join_key(d), "0")  # consumed: a replica dropped later must ask again
        publish(store, g)
        return g


@dataclass
class Departures:
    """Ranks of dropped replicas that may still be running, for the store's host (rank 0 or
    the coordinator): at the end of the run it waits, at most a heartbeat timeout, until each
    has read the generation that dropped it (its `left_key`). Without the wait a dropped rank
    whose peer died in a collective could find the store gone before its next heartbeat read
    the verdict, and stop with a broken connection instead of saying why (seen in CI)."""

    plan: Plan
    pending: dict[int, int] = field(default_factory=dict)
    """rank -> the generation that dropped it."""

    def note(self, g: Generation, lost: Container[int]) -> None:
        """Generation g was published; `lost`: ranks known gone (nobody to wait for)."""
        for r in members_of(self.plan, g.dropped):
            if r not in g.members and r not in lost:
                self.pending[r] = g.gen
        for r in g.members:  # rejoined
            self.pending.pop(r, None)

    def waiting(self, store: AuthStore) -> list[int]:
        """The pending ranks that have not yet said they read their drop."""
        return [r for r, gen in self.pending.items() if store.read_int(left_key(r), -1) < gen]
