"""The coordinator: the rendezvous store and the generation leader as their own small process,
so that no training host is a single point of failure (`python scripts/coordinator.py`).

By default rank 0 hosts the TCPStore and leads the generations, so losing rank 0 ends every
run. With a coordinator, every rank connects to it as a client (`--coordinator tcp://H:P`):
nobody among the ranks hosts the store and nobody leads, rank 0 included, so a DiLoCo run
survives losing any training host like any other replica loss. The coordinator
- hosts the store and writes `coord/info` (host, pid, the plan's pipelines and sync mode);
- takes the run settings it leads by (`RunSettings`: replicas that start, --min-replicas,
  the heartbeat timeout) from the first rank that checks in; every other rank checks that its
  plan and settings agree (`check_in`, a mismatch is an exit-2 error naming the flag);
- publishes generation 0, watches every member's heartbeat from the first beat on
  (modules.control.fault.HeartbeatWatch) and, in DiLoCo, decides the next generations with the same
  `Leader` rank 0 uses otherwise (modules.control.leader);
- exits 0 once every member of the newest generation finished, 1 when the run stopped or
  every member was lost. One coordinator serves one launch: restart it with the ranks.
Losing the coordinator is survived by nobody: every rank's heartbeat finds the store silent,
saves a checkpoint and exits 1 naming it; restart it and the ranks with --resume.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from formats.errors import UserError
from formats.plan import Plan
from modules.comm import PeerError
from modules.comm.errors import first_line
from modules.config import ResolvedRun
from modules.control.auth import Auth, AuthStore, host_store, load_secret
from modules.control.fault import HeartbeatWatch, describe_rank, is_done, parse_beat
from modules.control.leader import Departures, Generation, Leader, first_generation, publish
from modules.control.protocol import COORDINATOR_INFO, RUN_SETTINGS, heartbeat_key

STORE_TIMEOUT_S = 30.0
"""Timeout of the coordinator's own client of the store it hosts (local calls)."""


@dataclass(frozen=True)
class RunSettings:
    """The run settings the coordinator leads by; every rank must have the same."""

    replicas: tuple[int, ...]
    """Replicas that start now (--replicas; all of the plan's by default)."""
    min_replicas: int
    """DiLoCo: below this many live replicas the run stops (--min-replicas, resolved)."""
    heartbeat_timeout_s: float
    """A member silent this long is gone (--heartbeat-timeout-s)."""

    def to_json(self) -> str:
        """Serialised for the store."""
        return json.dumps({"replicas": self.replicas, "min_replicas": self.min_replicas,
                           "heartbeat_timeout_s": self.heartbeat_timeout_s})

    @staticmethod
    def of(run: ResolvedRun) -> RunSettings:
        """A rank's settings, as its resolved run has them."""
        start = run.start_replicas
        return RunSettings(start if start is not None else tuple(range(run.plan.num_replicas)),
                           run.min_replicas, run.cfg.elastic.heartbeat_timeout_s)

    @staticmethod
    def from_json(text: str | bytes) -> RunSettings:
        """Parse what to_json wrote."""
        d = json.loads(text)
        return RunSettings(tuple(d["replicas"]), int(d["min_replicas"]),
                           float(d["heartbeat_timeout_s"]))


def plan_record(plan: Plan) -> dict[str, object]:
    """What a rank's plan must share with the coordinator's: devices per replica, sync mode."""
    return {"pipelines": [list(p) for p in plan.pipelines], "sync": plan.sync.mode}


# -- the ranks' side -----------------------------------------------------------------------------
def check_in(store: AuthStore, plan: Plan, mine: RunSettings, join: bool, url: str,
             timeout_s: float) -> None:
    """A rank's first words with the coordinator at `url`: its plan must be the coordinator's
    and its settings the run's (the first rank's, which the coordinator leads by; a joiner's
    --replicas is not compared). UserError naming the flag when not; PeerError when `url`
    hosts no coordinator (e.g. it is a rank 0's --dist-url) or stops answering."""
    try:
        theirs, run = _read_run(store, mine, join, timeout_s)
    except RuntimeError as e:
        raise PeerError(f"--coordinator {url}: {first_line(e)}") from None
    if {k: theirs[k] for k in plan_record(plan)} != plan_record(plan):
        raise UserError(f"--plan: this rank's plan (pipelines {plan_record(plan)['pipelines']}, "
                        f"sync {plan.sync.mode}) is not the one the coordinator at {url} runs "
                        f"(pipelines {theirs['pipelines']}, sync {theirs['sync']}, "
                        f"{theirs['plan']}); give every rank and the coordinator the same plan")
    for flag, a, b in (("--replicas", mine.replicas, run.replicas),
                       ("--min-replicas", mine.min_replicas, run.min_replicas),
                       ("--heartbeat-timeout-s", mine.heartbeat_timeout_s,
                        run.heartbeat_timeout_s)):
        if a != b and not (join and flag == "--replicas"):
            raise UserError(f"{flag}: this rank has {a!r} but the run has {b!r} (set by the "
                            "first rank that reached the coordinator); give every rank the "
                            "same value")


def _read_run(store: AuthStore, mine: RunSettings, join: bool,
              timeout_s: float) -> tuple[dict[str, Any], RunSettings]:
    """(the coordinator's record, the run's settings); a non-joining rank offers `mine` as the
    run's (the first signed offer wins; a forged one is replaced). RuntimeError saying what is
    missing."""
    info = _wait(store, COORDINATOR_INFO, timeout_s)
    if info is None:
        raise RuntimeError(f"the store there has no coordinator record signed with this run's "
                           f"secret after {timeout_s:g} s; start scripts/coordinator.py there "
                           "with the ranks' ST_RUN_SECRET (a rank 0's --dist-url is no "
                           "coordinator)")
    theirs = json.loads(info)
    if not join:
        return theirs, RunSettings.from_json(store.claim(RUN_SETTINGS, mine.to_json()))
    run = _wait(store, RUN_SETTINGS, timeout_s)
    if run is None:
        raise RuntimeError(f"--join: no rank of a run checked in within {timeout_s:g} s")
    return theirs, RunSettings.from_json(run)


def _wait(store: AuthStore, key: str, timeout_s: float | None) -> str | None:
    """The signed record at `key` once it appears (a forged one is ignored), None after
    `timeout_s` (None: wait forever); RuntimeError if the store stops answering."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while (value := store.read(key)) is None:
        if deadline is not None and time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return value


# -- the coordinator's side ----------------------------------------------------------------------
@dataclass
class CoordinatorConfig:
    """Where the coordinator listens, for which plan, and how long it waits for a start."""

    host: str
    """Address the ranks reach it at; the store listens there only."""
    port: int
    """TCP port of the store (0: any free one)."""
    plan: Plan
    plan_path: str = ""
    """The plan's file, named in messages."""
    start_timeout_s: float = 600.0
    """Give up (exit 1) when no rank started training this long after the first checked in."""
    log: Callable[[str], None] = print
    secret: bytes | None = None
    """The run secret (None: from the environment, modules.control.auth.load_secret)."""


class Coordinator:
    """Hosts the store of one launch and leads its generations (see the module docstring)."""

    def __init__(self, cfg: CoordinatorConfig) -> None:
        self.cfg = cfg
        self.store: AuthStore | None = None
        self.elastic = cfg.plan.sync.rule.local_steps
        """DiLoCo: drop lost replicas, admit joiners; allreduce: only host and watch."""
        self.lost: dict[int, str] = {}
        """rank -> description, for members found gone."""
        self.departures = Departures(cfg.plan)
        """Dropped ranks to let read their drop before this process exits."""
        self._quiet_since: float | None = None
        """When no member was left running (the end waits a while for `departures`)."""
        self._info: dict[int, dict[str, object]] = {}

    def listen(self) -> int:
        """Bind the store and announce this coordinator; returns the port (UserError when it
        cannot listen)."""
        cfg = self.cfg
        try:
            raw = host_store(cfg.host, cfg.port, None, timedelta(seconds=STORE_TIMEOUT_S))
        except (RuntimeError, OSError) as e:
            raise UserError(f"--listen: cannot listen on {cfg.host}:{cfg.port} "
                            f"({first_line(e)})") from None
        secret = cfg.secret if cfg.secret is not None else load_secret()
        self.store = AuthStore(raw, Auth(secret, cfg.log))
        self.store.put(COORDINATOR_INFO, json.dumps({
            "host": socket.gethostname(), "pid": os.getpid(), "plan": cfg.plan_path,
            **plan_record(cfg.plan)}))
        return self.store.port

    def serve(self) -> int:
        """Wait for the run, lead it to its end; returns the exit status (0: finished)."""
        store, plan = self.store, self.cfg.plan
        assert store is not None, "listen() first"
        # a service: wait for the first rank (polling, so that Ctrl+C is not held up)
        run = RunSettings.from_json(_wait(store, RUN_SETTINGS, None))
        self.cfg.log(f"run settings from the first rank: replicas {list(run.replicas)}, "
                     f"--min-replicas {run.min_replicas}, heartbeat timeout "
                     f"{run.heartbeat_timeout_s:g} s")
        current = first_generation(plan, run.replicas)
        if self.elastic:
            publish(store, current)
        if not self._first_beat(current.members):
            return 1
        return self._lead(current, run)

    def _first_beat(self, members: tuple[int, ...]) -> bool:
        """Wait until a member started training (its heartbeat counts), as rank 0's own
        monitor would; False after cfg.start_timeout_s."""
        store, deadline = self.store, time.monotonic() + self.cfg.start_timeout_s
        while not any(parse_beat(store.read(heartbeat_key(r))) for r in members):
            if time.monotonic() > deadline:
                self.cfg.log(f"error: no rank of {list(members)} started training within "
                             f"{self.cfg.start_timeout_s:g} s of the first one's check-in; "
                             "see the ranks' logs")
                return False
            time.sleep(0.1)
        self.cfg.log(f"watching ranks {list(members)}")
        return True

    def _lead(self, current: Generation, run: RunSettings) -> int:
        """Watch the members' heartbeats and publish generations until the run ends."""
        store, log = self.store, self.cfg.log
        watch = HeartbeatWatch(run.heartbeat_timeout_s)
        leader = Leader(self.cfg.plan, run.min_replicas)
        interval = min(1.0, run.heartbeat_timeout_s / 4)
        while True:
            now = time.monotonic()
            gone = watch.silent(store, [r for r in current.members if r not in self.lost], now)
            for r in gone:
                self.lost[r] = describe_rank(store, r, self._info)
                log(f"{self.lost[r]} is gone: no heartbeat for {run.heartbeat_timeout_s:g} s")
            if self.elastic and not current.stop:
                g = leader.decide(store, current, gone, self.lost)
                if g is not None:
                    current = g
                    self.departures.note(g, self.lost)
                    watch.restart(g.members)
                    for r in g.members:  # a lost rank that rejoined is watched again
                        self.lost.pop(r, None)
                    log(f"generation {g.gen}: replicas {list(g.replicas)} ({g.reason})"
                        + ("; stopping: fewer than --min-replicas" if g.stop else ""))
            status = self._end(current, run.heartbeat_timeout_s)
            if status is not None:
                return status
            time.sleep(interval)

    def _end(self, current: Generation, grace_s: float) -> int | None:
        """The exit status once no member of `current` is still running and the dropped ranks
        read their drop (or `grace_s` passed), else None."""
        store = self.store
        running = [r for r in current.members
                   if r not in self.lost and not is_done(store, r)]
        if running:
            return None
        self._quiet_since = self._quiet_since or time.monotonic()
        if (self.departures.waiting(store)
                and time.monotonic() - self._quiet_since < grace_s):
            return None
        lost = [r for r in self.lost if r in current.members]  # in the order they were lost
        if not lost and not current.stop:
            self.cfg.log(f"run finished: every rank of replicas {list(current.replicas)} is "
                         "done")
            return 0
        why = (f"generation {current.gen} stopped it ({current.reason})" if current.stop
               else f"rank(s) {sorted(lost)} stopped without finishing (the first: "
                    f"{self.lost[lost[0]]})")
        self.cfg.log(f"error: the run ended without finishing: {why}")
        return 1
