"""Failure detection and membership: heartbeats through the rendezvous TCPStore, generations.

Every rank runs a `Monitor` thread with its own TCPStore client (clients are not thread-safe):
every `interval` s it bumps its heartbeat counter and reads everybody else's. A peer whose
counter has not moved for `timeout_s` (measured on this rank's clock, so host clocks need not
agree) is gone; the log names its rank, host and role from the info record every rank writes
at start. A rank that finished says so and is not missed. If the store itself stops answering
for `timeout_s` (rank 0 hosts it), the diagnosis is that. (Store keys: modules.protocol.)

Membership (DiLoCo) is a sequence of generations (JSON: members, replicas, dropped, joined,
reason) and a counter holding the newest. Only rank 0, which hosts the store and so is alive
whenever anybody can read it, writes generations: when a peer is gone its whole replica is
dropped; when every rank of a replica asked to join, it is added. The training thread re-forms
its groups at its next outer step (modules.elastic); a rank that is no longer a member leaves
at once with a message.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from formats.plan import Plan
from modules.dist import members_of
from modules.protocol import (
    GENERATION_COUNTER,
    done_key,
    generation_key,
    heartbeat_key,
    info_key,
    join_key,
)

__all__ = ["Generation", "Monitor", "MonitorConfig", "members_of", "newest_generation",
           "publish", "read_generation", "register"]


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


def register(store: dist.Store, rank: int, replica: int, stage: int) -> None:
    """Record this rank's host, pid and role in the store (named in failure messages)."""
    store.set(info_key(rank), json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                              "replica": replica, "stage": stage}))


def publish(store: dist.Store, g: Generation) -> None:
    """Write generation g, then advance the counter that announces it."""
    store.set(generation_key(g.gen), g.to_json())
    store.set(GENERATION_COUNTER, str(g.gen))


def read_generation(store: dist.Store, g: int) -> Generation:
    """Generation g from the store."""
    return Generation.from_json(store.get(generation_key(g)))


def newest_generation(store: dist.Store) -> int:
    """The newest published generation number (-1 when none is)."""
    return int(store.get(GENERATION_COUNTER)) if store.check([GENERATION_COUNTER]) else -1


@dataclass
class MonitorConfig:
    """What the monitor watches and how it reacts."""

    rank: int
    host: str
    port: int
    plan: Plan
    timeout_s: float = 5.0
    interval_s: float = 1.0
    elastic: bool = False
    """DiLoCo: drop lost replicas and admit joiners (rank 0 decides); else a loss is fatal."""
    min_replicas: int = 1
    members: tuple[int, ...] = ()
    """Ranks to watch at start (generation 0)."""
    log: Callable[[str], None] = print
    on_fatal: Callable[[str], None] = field(default=lambda reason: os._exit(1))
    """Called once with the reason when the run cannot go on for this rank (must not return)."""


class Monitor(threading.Thread):
    """Heartbeat and watcher thread of one rank (see the module docstring)."""

    def __init__(self, cfg: MonitorConfig) -> None:
        super().__init__(name=f"heartbeat-{cfg.rank}", daemon=True)
        self.cfg = cfg
        self.gen = 0
        """Newest generation number this rank has seen."""
        self.generation: Generation | None = None
        self.members: tuple[int, ...] = cfg.members
        self.was_member = cfg.rank in cfg.members
        self.dropped = False
        """Rank 0 only: its replica was dropped; it keeps hosting the store until the end."""
        self.lost: dict[int, str] = {}
        """rank -> description, for peers found gone."""
        self.changed = threading.Event()
        """Set whenever a new generation or a lost peer is seen (wakes waiting threads)."""
        self.detect_s: dict[int, float] = {}
        """rank -> time.monotonic() when this rank decided it was gone."""
        self._halt = threading.Event()
        self._info: dict[int, dict[str, Any]] = {}
        self._seen: dict[int, tuple[int, float]] = {}
        self._fatal_once = threading.Lock()
        self._client: dist.Store | None = None

    # -- public ------------------------------------------------------------------------------
    def describe(self, rank: int) -> str:
        """'rank R (host H, replica r, stage s)' from the store's records."""
        info = self._info.get(rank)
        if info is None and self._client is not None:
            try:
                if self._client.check([info_key(rank)]):
                    info = self._info[rank] = json.loads(self._client.get(info_key(rank)))
            except RuntimeError:
                info = None
        if not info:
            return f"rank {rank}"
        return (f"rank {rank} (host {info['host']}, replica {info['replica']}, "
                f"stage {info['stage']})")

    def stop(self) -> None:
        """End the thread (at the end of a run)."""
        self._halt.set()

    def fatal(self, reason: str) -> None:
        """Report `reason` once and hand over to cfg.on_fatal (which exits the process)."""
        if self._fatal_once.acquire(blocking=False):
            self.cfg.on_fatal(reason)
        else:  # another thread is already exiting
            time.sleep(3600)

    # -- the thread --------------------------------------------------------------------------
    def _connect(self) -> dist.Store:
        return dist.TCPStore(self.cfg.host, self.cfg.port, is_master=False,
                             timeout=timedelta(seconds=max(1.0, self.cfg.timeout_s)),
                             wait_for_workers=False)

    def run(self) -> None:
        cfg = self.cfg
        last_ok = time.monotonic()
        try:
            self._client = self._connect()
        except (RuntimeError, OSError) as e:
            self.fatal(f"heartbeat: cannot reach the rendezvous store ({_first_line(e)})")
            return
        while not self._halt.is_set():
            try:
                self._beat()
                last_ok = time.monotonic()
            except (RuntimeError, OSError) as e:  # the store (hosted by rank 0) does not answer
                if time.monotonic() - last_ok > cfg.timeout_s:
                    self.fatal(f"the rendezvous store (hosted by {self.describe(0)}, "
                               f"{cfg.host}:{cfg.port}) is gone: no answer for "
                               f"{cfg.timeout_s:g} s ({_first_line(e)})")
                    return
            except Exception as e:  # a bug here must not go unnoticed
                print(f"rank {cfg.rank}: heartbeat thread failed: {e!r}", file=sys.stderr,
                      flush=True)
                raise
            self._halt.wait(cfg.interval_s)

    def _beat(self) -> None:
        cfg, c = self.cfg, self._client
        assert c is not None
        c.add(heartbeat_key(cfg.rank), 1)
        now = time.monotonic()
        newest = max(0, newest_generation(c))
        if newest > self.gen:
            self._new_generation(read_generation(c, newest))
        watch = [r for r in self.members if r != cfg.rank and r not in self.lost]
        gone = []
        for r in watch:
            count = c.add(heartbeat_key(r), 0)
            prev = self._seen.get(r)
            if prev is None or prev[0] != count:
                self._seen[r] = (count, now)
            elif now - prev[1] > cfg.timeout_s and c.add(done_key(r), 0) == 0:
                gone.append(r)
        for r in gone:
            self.detect_s[r] = now
            self.lost[r] = self.describe(r)
            self.changed.set()
            cfg.log(f"{self.lost[r]} is gone: no heartbeat for {cfg.timeout_s:g} s")
        if not cfg.elastic:
            if gone:
                self.fatal(f"{', '.join(self.lost[r] for r in gone)} is gone (no heartbeat for "
                           f"{cfg.timeout_s:g} s); sync mode allreduce cannot continue without "
                           "it")
            return
        if cfg.rank == 0:
            self._lead(c, gone)

    def _new_generation(self, g: Generation) -> None:
        cfg = self.cfg
        self.gen, self.generation, self.members = g.gen, g, g.members
        for r in g.members:
            self._seen.pop(r, None)  # (re)start the clock of every member now
        self.changed.set()
        cfg.log(f"generation {g.gen}: replicas {list(g.replicas)} ({g.reason})")
        if g.stop and cfg.rank in g.members:
            self.fatal(f"only {len(g.replicas)} replica(s) left ({g.reason}), fewer than "
                       f"--min-replicas {cfg.min_replicas}; stopping")
        if cfg.rank in g.members:
            self.was_member = True
        elif self.was_member:
            replica, _ = cfg.plan.stage_of(cfg.rank)
            self.was_member = False
            if cfg.rank == 0:  # the others still need the store: stay up, train no more
                self.dropped = True
                cfg.log(f"my replica {replica} was dropped from the run at generation {g.gen} "
                        f"({g.reason}); staying up only to host the rendezvous store")
                return
            self.fatal(f"my replica {replica} was dropped from the run at generation {g.gen} "
                       f"({g.reason}); leaving, the other replicas continue")

    def _lead(self, c: dist.Store, gone: list[int]) -> None:
        """Rank 0: publish a new generation when replicas are lost or complete joiners wait."""
        plan, cfg = self.cfg.plan, self.cfg
        current = self.generation
        replicas = list(current.replicas) if current else sorted(
            {plan.stage_of(r)[0] for r in self.members})
        dropped = sorted({plan.stage_of(r)[0] for r in gone} & set(replicas))
        joined = [k for k in range(plan.num_replicas) if k not in replicas and
                  all(c.add(join_key(d), 0) > 0 for d in plan.pipelines[k])]
        if not dropped and not joined:
            return
        new = sorted((set(replicas) - set(dropped)) | set(joined))
        parts = []
        if dropped:
            parts.append("dropped replica(s) " + ", ".join(str(k) for k in dropped) + ": " +
                         "; ".join(self.lost[r] for r in gone) + " gone")
        if joined:
            parts.append("replica(s) " + ", ".join(str(k) for k in joined) + " joined")
        g = Generation(self.gen + 1, tuple(new), members_of(plan, new), tuple(dropped),
                       tuple(joined), "; ".join(parts), stop=len(new) < cfg.min_replicas)
        for d in members_of(plan, joined):
            c.set(join_key(d), "0")  # consumed: a replica dropped later must ask again
        publish(c, g)
        self._new_generation(g)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
