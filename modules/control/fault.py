"""Failure detection: heartbeats through the rendezvous TCPStore.

Every rank runs a `Monitor` thread with its own TCPStore client (clients are not thread-safe):
every `interval` s it bumps its heartbeat counter and reads everybody else's. A peer whose
counter has not moved for `timeout_s` (measured on this host's clock, so host clocks need not
agree: `HeartbeatWatch`, which the coordinator uses too) is gone; the log names its rank, host
and role from the info record every rank writes at start. A rank that finished says so and is
not missed. If the store itself stops answering for `timeout_s`, the diagnosis names whoever
hosts it: rank 0, or the coordinator process. (Store keys: modules.control.protocol.)

Membership (DiLoCo) is a sequence of generations (modules.control.leader). Rank 0's monitor leads
them when rank 0 hosts the store (it is alive whenever anybody can read it); with an external
coordinator (`--coordinator`) the coordinator leads and no rank does. Every monitor follows the
newest generation: the training thread re-forms its groups at its next outer step
(modules.control.elastic); a rank that is no longer a member leaves at once with a message.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from formats.plan import Plan
from modules.comm.errors import first_line
from modules.control.auth import Auth, AuthStore, load_secret
from modules.control.dist import members_of
from modules.control.leader import (
    Departures,
    Generation,
    Leader,
    newest_generation,
    publish,
    read_generation,
)
from modules.control.protocol import (
    COORDINATOR_INFO,
    done_key,
    heartbeat_key,
    info_key,
    left_key,
)

__all__ = ["Generation", "HeartbeatWatch", "Monitor", "MonitorConfig", "describe_rank",
           "members_of", "newest_generation", "publish", "read_generation", "register"]

STOP_READ_PREFIX = "ckpt/stop-read/"
"""A rank's key once it read the checkpoint stop (the store's host waits for all of them)."""


def register(store: AuthStore, rank: int, replica: int, stage: int) -> None:
    """Record this rank's host, pid and role in the store (named in failure messages)."""
    store.put(info_key(rank), json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                          "replica": replica, "stage": stage}))


def describe_rank(store: AuthStore | None, rank: int, cache: dict[int, dict[str, Any]]) -> str:
    """'rank R (host H, replica r, stage s)' from the store's info records (kept in `cache`)."""
    info = cache.get(rank)
    if info is None and store is not None:
        try:
            text = store.read(info_key(rank))
            info = json.loads(text) if text is not None else None
            if not isinstance(info, dict) or not {"host", "replica", "stage"} <= set(info):
                info = None
            else:
                cache[rank] = info
        except (RuntimeError, ValueError):
            info = None
    if not info:
        return f"rank {rank}"
    return f"rank {rank} (host {info['host']}, replica {info['replica']}, stage {info['stage']})"


def beat_value(nonce: str, count: int) -> str:
    """A heartbeat record: this process's random nonce and its beat count."""
    return f"{nonce}:{count}"


def parse_beat(value: str | None) -> tuple[str, int] | None:
    """(nonce, count) of a heartbeat record; None when absent or malformed."""
    nonce, _, count = (value or "").partition(":")
    return (nonce, int(count)) if nonce and count.isdigit() else None


def is_done(store: AuthStore, rank: int) -> bool:
    """Whether `rank` said (signed) that it finished its run."""
    return store.read(done_key(rank)) == "1"


class HeartbeatWatch:
    """Which ranks went silent: their signed heartbeat records compared over time on this
    host's clock. A beat counts only when its count grows (per process nonce), so a replayed
    old record is no sign of life. A rank's clock (re)starts when it is first watched or
    `restart`ed."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._since: dict[int, float] = {}
        """rank -> time.monotonic() when its heartbeat last moved."""
        self._counts: dict[int, dict[str, int]] = {}
        """rank -> {process nonce: highest count seen}."""

    def restart(self, ranks: Iterable[int]) -> None:
        """Start the clock of `ranks` anew (a new generation, or their first beat)."""
        for r in ranks:
            self._since.pop(r, None)

    def _moved(self, rank: int, beat: tuple[str, int] | None) -> bool:
        if beat is None:
            return False
        counts = self._counts.setdefault(rank, {})
        if beat[1] <= counts.get(beat[0], -1):
            return False
        counts[beat[0]] = beat[1]
        return True

    def silent(self, store: AuthStore, ranks: Iterable[int], now: float) -> list[int]:
        """Those of `ranks` whose heartbeat has not moved for timeout_s and that did not say
        they finished."""
        gone = []
        for r in ranks:
            moved = self._moved(r, parse_beat(store.read(heartbeat_key(r))))
            if moved or r not in self._since:
                self._since[r] = now
            elif now - self._since[r] > self.timeout_s and not is_done(store, r):
                gone.append(r)
        return gone


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
    """DiLoCo: drop lost replicas and admit joiners (the leader decides); else a loss is
    fatal."""
    min_replicas: int = 1
    members: tuple[int, ...] = ()
    """Ranks to watch at start (generation 0)."""
    coordinator: bool = False
    """An external coordinator at host:port hosts the store and leads: no rank leads, and
    rank 0 is an ordinary rank."""
    auth: Auth | None = None
    """The run secret's signer (control records; None: a new one from the environment)."""
    log: Callable[[str], None] = print
    on_fatal: Callable[[str], None] = field(default=lambda reason: os._exit(1))
    """Called once with the reason when the run cannot go on for this rank (must not return)."""
    ckpt_stop: Any = None
    """A CheckpointStop (modules.train.ckpt_stop): a rank's failed checkpoint stops every rank."""

    @property
    def hosts_store(self) -> bool:
        """This rank hosts the rendezvous store (rank 0 without a coordinator)."""
        return self.rank == 0 and not self.coordinator


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
        """Rank 0 hosting the store only: its replica was dropped; it keeps hosting the store
        until the end."""
        self.lost: dict[int, str] = {}
        """rank -> description, for peers found gone."""
        self.changed = threading.Event()
        """Set whenever a new generation or a lost peer is seen (wakes waiting threads)."""
        self.detect_s: dict[int, float] = {}
        """rank -> time.monotonic() when this rank decided it was gone."""
        self.leader = (Leader(cfg.plan, cfg.min_replicas) if cfg.elastic and cfg.hosts_store
                       else None)
        """Rank 0 hosting the store in DiLoCo: it publishes the generations."""
        self.departures = Departures(cfg.plan)
        """Rank 0 hosting the store: dropped ranks to let read their drop before it exits."""
        self._watch = HeartbeatWatch(cfg.timeout_s)
        self._halt = threading.Event()
        self._info: dict[int, dict[str, Any]] = {}
        self._coordinator: dict[str, Any] = {}
        """The coordinator's record (host, pid), read at connect: named if it is lost."""
        self._fatal_once = threading.Lock()
        self._client: AuthStore | None = None
        self._nonce = secrets.token_hex(4)
        self._beats = 0
        self._last_ok = (time.monotonic(), time.time())
        """When the store last answered a whole beat (monotonic, wall clock)."""

    # -- public ------------------------------------------------------------------------------
    @property
    def nonce(self) -> str:
        """This process's heartbeat nonce (another process beating as my rank has another)."""
        return self._nonce

    def describe(self, rank: int) -> str:
        """'rank R (host H, replica r, stage s)' from the store's records."""
        return describe_rank(self._client, rank, self._info)

    def describe_store(self, cached: bool = False) -> str:
        """Who hosts the rendezvous store, for the message when it stops answering (`cached`:
        from what was read before only, no store call)."""
        cfg = self.cfg
        if not cfg.coordinator:
            host = describe_rank(None, 0, self._info) if cached else self.describe(0)
            return f"the rendezvous store (hosted by {host}, {cfg.host}:{cfg.port})"
        info = self._coordinator
        where = f", host {info['host']} pid {info['pid']}" if info else ""
        return (f"the coordinator tcp://{cfg.host}:{cfg.port} (rendezvous store and membership "
                f"leader{where})")

    def stop(self) -> None:
        """End the thread (at the end of a run)."""
        self._halt.set()

    def fatal(self, reason: str) -> None:
        """Report `reason` once and hand over to cfg.on_fatal (which exits the process)."""
        if self._fatal_once.acquire(blocking=False):
            self.cfg.on_fatal(reason)
        else:  # another thread is already exiting
            time.sleep(3600)

    def _stop_read(self, c: Any) -> None:
        """Say I read the checkpoint stop; the store's host first waits (at most a heartbeat
        timeout) until every member said so: leaving earlier takes the store, and the stop
        record with it, from the ranks that have not read it yet."""
        try:
            c.put(f"{STOP_READ_PREFIX}{self.cfg.rank}", "1")
            if not self.cfg.hosts_store:
                return
            end = time.monotonic() + self.cfg.timeout_s + 2 * self.cfg.interval_s
            waiting = [r for r in self.members if r != self.cfg.rank and r not in self.lost]
            while waiting and time.monotonic() < end:
                waiting = [r for r in waiting if c.read(f"{STOP_READ_PREFIX}{r}") is None]
                time.sleep(0.1)
        except (RuntimeError, OSError):  # the store is gone already: nobody to wait for
            pass

    def _say_left(self, gen: int) -> None:
        """Tell the store's host that I read generation `gen`, which dropped me (it waits for
        that before it exits)."""
        try:
            assert self._client is not None
            self._client.put(left_key(self.cfg.rank), str(gen))
        except (RuntimeError, OSError):  # the host is gone already: nobody waits
            pass

    # -- the thread --------------------------------------------------------------------------
    def _connect(self) -> AuthStore:
        raw = dist.TCPStore(self.cfg.host, self.cfg.port, is_master=False,
                            timeout=timedelta(seconds=max(1.0, self.cfg.timeout_s)),
                            wait_for_workers=False)
        auth = self.cfg.auth or Auth(load_secret(), self.cfg.log)
        client = AuthStore(raw, auth)
        info = client.read(COORDINATOR_INFO) if self.cfg.coordinator else None
        self._coordinator = json.loads(info) if info is not None else {}
        describe_rank(client, 0, self._info)  # named (from this cache) if the store freezes
        return client

    def run(self) -> None:
        cfg = self.cfg
        last_ok = time.monotonic()
        try:
            self._client = self._connect()
        except (RuntimeError, OSError) as e:
            self.fatal(f"heartbeat: cannot reach the rendezvous store ({first_line(e)})")
            return
        self._last_ok = (time.monotonic(), time.time())
        if not cfg.hosts_store:  # a frozen or cut-off store may block a call for good
            threading.Thread(target=self._watch_store, name=f"store-watch-{cfg.rank}",
                             daemon=True).start()
        while not self._halt.is_set():
            try:
                self._beat()
                last_ok = time.monotonic()
                self._last_ok = (last_ok, time.time())
            except (RuntimeError, OSError) as e:  # the store (rank 0 or coordinator) is silent
                if time.monotonic() - last_ok > cfg.timeout_s:
                    self.fatal(f"{self.describe_store()} is gone: no answer for "
                               f"{cfg.timeout_s:g} s ({first_line(e)})")
                    return
            except Exception as e:  # a bug here must not go unnoticed
                print(f"rank {cfg.rank}: heartbeat thread failed: {e!r}\n", end="",
                      file=sys.stderr, flush=True)
                raise
            self._halt.wait(cfg.interval_s)

    def _watch_store(self) -> None:
        """Stop this rank (checkpoint, exit 1) once the store has not answered a beat for the
        heartbeat timeout, even while a store call hangs (a SIGSTOPped host, DROPped packets:
        the connection stays open and nothing times out)."""
        cfg = self.cfg
        while not self._halt.wait(min(cfg.interval_s, 0.5)):
            mono, wall = self._last_ok
            silent = time.monotonic() - mono
            if silent > cfg.timeout_s + cfg.interval_s:
                since = time.strftime("%H:%M:%S", time.gmtime(wall))
                self.fatal(f"{self.describe_store(cached=True)} does not answer: no reply since "
                           f"{since} UTC ({silent:.1f} s, over the heartbeat timeout "
                           f"{cfg.timeout_s:g} s): frozen, cut off or gone; stopping with a "
                           "checkpoint (restart with --resume once it is back)")
                return

    def _beat(self) -> None:
        cfg, c = self.cfg, self._client
        assert c is not None
        self._beats += 1
        c.put(heartbeat_key(cfg.rank), beat_value(self._nonce, self._beats))
        stop = cfg.ckpt_stop.poll(c, self.members) if cfg.ckpt_stop is not None else None
        if stop is not None:  # some rank's checkpoint could not be written: every rank stops
            self._stop_read(c)
            self.fatal(stop)
            return
        newest = max(0, newest_generation(c))
        if newest > self.gen:
            g = read_generation(c, newest)
            if g is not None:  # None: forged (logged) or not written yet
                self._new_generation(g)
        watch = [r for r in self.members if r != cfg.rank and r not in self.lost]
        now = time.monotonic()
        gone = self._watch.silent(c, watch, now)
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
        if self.leader is not None:
            g = self.leader.decide(c, self._current(), gone, self.lost)
            if g is not None:
                self._new_generation(g)

    def _current(self) -> Generation:
        """The generation this rank follows (generation 0 before any other was read)."""
        if self.generation is not None:
            return self.generation
        replicas = tuple(sorted({self.cfg.plan.stage_of(r)[0] for r in self.members}))
        return Generation(0, replicas, self.members, reason="start")

    def _new_generation(self, g: Generation) -> None:
        cfg = self.cfg
        self.gen, self.generation, self.members = g.gen, g, g.members
        self._watch.restart(g.members)  # (re)start the clock of every member now
        for r in g.members:  # a lost rank is a member again only once its replica rejoined
            self.lost.pop(r, None)
        self.departures.note(g, self.lost)
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
            if cfg.hosts_store:  # the others still need the store: stay up, train no more
                self.dropped = True
                cfg.log(f"my replica {replica} was dropped from the run at generation {g.gen} "
                        f"({g.reason}); staying up only to host the rendezvous store")
                return
            self._say_left(g.gen)
            self.fatal(f"my replica {replica} was dropped from the run at generation {g.gen} "
                       f"({g.reason}); leaving, the other replicas continue")
