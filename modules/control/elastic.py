"""A rank's membership in the run, as an object the Trainer owns (the Trainer holds a
`Membership` as torchft's DiLoCo holds a Manager): heartbeats, generations, the groups of each
generation, join, and DiLoCo's outer-step protocol.

Inputs are explicit: the rendezvous store, the plan and this rank's topology, the run settings
it reads (`MembershipSettings`, taken from the resolved run), a `GroupBuilder` that forms a
generation's communicators and the `CommStats` its store waits count into. Every change of
membership comes out as one `GenerationChange` (groups, live replicas, and on a joiner the
state it received) that the Trainer applies in one place. What it does:
- start the heartbeat thread (modules.control.fault.Monitor), which calls the Trainer's `on_fatal`
  when the run cannot go on for this rank (a peer or the store lost in allreduce mode, the
  replica dropped, fewer than --min-replicas left);
- DiLoCo: follow the generations the leader publishes (rank 0, or the coordinator process
  with --coordinator; modules.control.leader), re-form the groups over the live replicas,
  wait for every member at each outer step, average, and commit only if every member of every
  stage got the average (else retry in the next generation), so that no rank ever takes an
  outer step alone;
- `--join`: be admitted, receive the outer model and Nesterov state of my stage from a live
  peer point-to-point, and take part in the next outer step with weight 0.
Store keys and tags: modules.control.protocol.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from formats.plan import Plan
from modules.comm import CommStats, PeerError
from modules.comm.errors import first_line
from modules.config import ResolvedRun
from modules.control.auth import AuthStore
from modules.control.dist import Topology, members_of, wait_for_peers
from modules.control.fault import Monitor, MonitorConfig, is_done
from modules.control.flag_wait import FlagWaiter
from modules.control.groups import GroupBuilder, Groups
from modules.control.hidden import hidden_store
from modules.control.join_check import refuse_live_join
from modules.control.leader import first_generation, publish
from modules.control.protocol import (
    JOIN_TAG,
    commit_decision_key,
    commit_done_key,
    commit_prefix,
    done_key,
    join_key,
    join_source_key,
    outer_arrival_prefix,
)
from modules.sync.average import GroupAverage, complete
from modules.sync.diloco import OuterState


@dataclass(frozen=True)
class MembershipSettings:
    """The run settings membership reads, resolved for this run (`of` builds them)."""

    timeout_s: float
    """How long any wait on a peer or the store may take (--timeout-s)."""
    heartbeat_timeout_s: float
    """A peer whose heartbeat is older than this is gone (--heartbeat-timeout-s)."""
    min_replicas: int
    """DiLoCo: below this many live replicas the run stops (--min-replicas, resolved)."""
    wait_for_peers: bool
    """DiLoCo: keep waiting (and logging) for a missing peer instead of failing."""
    store_addr: tuple[str, int] | None
    """(host, port) of the rendezvous store for the heartbeat thread (None: no heartbeat)."""
    start_replicas: tuple[int, ...] | None
    """Replicas that start now (None: all); the others may come later with --join."""
    join: bool
    """This rank's replica joins a running job (state fetched from a live peer)."""
    coordinator: bool = False
    """The store is the coordinator process's (--coordinator): no rank hosts it or leads the
    generations, rank 0 included."""

    @staticmethod
    def of(run: ResolvedRun, store_addr: tuple[str, int] | None) -> MembershipSettings:
        """The membership settings of a resolved run."""
        el, target = run.cfg.elastic, run.target
        return MembershipSettings(
            timeout_s=run.cfg.timeout_s, heartbeat_timeout_s=el.heartbeat_timeout_s,
            min_replicas=run.min_replicas, wait_for_peers=el.wait_for_peers,
            store_addr=store_addr, start_replicas=run.start_replicas, join=el.join,
            coordinator=target is not None and target.coordinator)


@dataclass
class Handover:
    """What a live rank of my stage hands to a joining one."""

    step: int
    """The step the joiner continues from (the one after the next outer step's)."""
    outer: OuterState


@dataclass
class GenerationChange:
    """One change of membership, applied by the Trainer in one place."""

    gen: int
    replicas: tuple[int, ...]
    """Live replicas of the generation."""
    groups: Groups
    """The generation's communicators (the previous ones must not be used again)."""
    handover: Handover | None
    """On a joiner: the state received from a live peer of its stage; else None."""
    reason: str


class Membership:
    """Who this rank trains with, and DiLoCo's outer-step protocol (see the module docstring)."""

    def __init__(self, store: dist.Store, plan: Plan, topo: Topology, cfg: MembershipSettings,
                 builder: GroupBuilder, stats: CommStats, log: Callable[[str], None] = print,
                 ) -> None:
        self.store, self.plan, self.topo, self.cfg = store, plan, topo, cfg
        self.builder, self.stats, self.log = builder, stats, log
        self.elastic = plan.sync.rule.local_steps
        """DiLoCo: a lost replica is dropped and the rest go on; allreduce: a loss is fatal."""
        start = cfg.start_replicas if cfg.start_replicas is not None else range(plan.num_replicas)
        self.replicas: tuple[int, ...] = tuple(sorted(start))
        """Live replicas of the generation whose groups this rank holds."""
        self.active: set[int] = set() if cfg.join else set(self.replicas)
        """Replicas that took part in the last outer step (a joiner is not one yet)."""
        self.gen = -1 if cfg.join else 0
        """Generation whose groups this rank holds (-1: none yet, a joiner)."""
        self.groups: Groups | None = None
        """The communicators of that generation (the Trainer gets them in a GenerationChange)."""
        self.monitor: Monitor | None = None
        """The heartbeat thread (None before `start`, or without cfg.store_addr)."""
        self.waiter: FlagWaiter | None = None
        """DiLoCo's arrival and commit waits, on store connections of their own (made with the
        monitor: a new generation, which the monitor reads, cuts them short)."""

    # -- lifecycle ---------------------------------------------------------------------------
    def first_generation(self) -> GenerationChange:
        """Generation 0's groups over the replicas that start now (not on a joiner)."""
        assert not self.cfg.join and self.groups is None
        self.groups = self.builder.build(0, self.replicas)
        return GenerationChange(0, self.replicas, self.groups, None, "start")

    @property
    def hosts_store(self) -> bool:
        """This rank hosts the rendezvous store and leads (rank 0 without a coordinator)."""
        return self.topo.rank == 0 and not self.cfg.coordinator

    def start(self, on_fatal: Callable[[str], None], ckpt_stop: Any = None) -> None:
        """Start the heartbeat thread (its own store connection); rank 0 publishes generation 0
        when it hosts the store (else the coordinator does). `on_fatal(reason)` is called (from
        any thread) when the run cannot go on for this rank; it must not return. `ckpt_stop`:
        the CheckpointStop the heartbeat publishes and reads (modules.train.ckpt_stop)."""
        cfg, plan = self.cfg, self.plan
        if cfg.store_addr is None:
            return
        members = members_of(plan, self.replicas)
        if self.hosts_store and not cfg.join:
            publish(self.store, first_generation(plan, self.replicas))
        self.monitor = Monitor(MonitorConfig(
            rank=self.topo.rank, host=cfg.store_addr[0], port=cfg.store_addr[1], plan=plan,
            timeout_s=cfg.heartbeat_timeout_s,
            interval_s=min(1.0, cfg.heartbeat_timeout_s / 4), elastic=self.elastic,
            min_replicas=cfg.min_replicas, members=() if cfg.join else members,
            coordinator=cfg.coordinator, auth=getattr(self.store, "auth", None), log=self.log,
            on_fatal=on_fatal, ckpt_stop=ckpt_stop))
        self.monitor.start()
        self.waiter = FlagWaiter(self._flag_connection)

    def _flag_connection(self) -> Any:
        """A store connection of FlagWaiter's own, naming keys as hidden_store(self.store)."""
        assert self.cfg.store_addr is not None
        host, port = self.cfg.store_addr
        raw = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                            timeout=timedelta(seconds=max(1.0, self.cfg.timeout_s)))
        auth = getattr(self.store, "auth", None)
        return hidden_store(AuthStore(raw, auth)) if auth is not None else raw

    @property
    def reads_settled(self) -> bool:
        """Whether finish's `last_reads` sees every rank's last writes: after a barrier, or on
        the store's host once every rank is done (not on DiLoCo's other ranks)."""
        return self.monitor is None or not self.elastic or self.hosts_store

    @property
    def dropped(self) -> bool:
        """Rank 0 hosting the store only: its replica was dropped; it keeps hosting the store
        until the end."""
        return self.monitor is not None and self.monitor.dropped

    def await_verdict(self) -> None:
        """After a PeerError: give the heartbeat time to name the lost peer (it exits then)."""
        mon = self.monitor
        if mon is None:
            return
        deadline = time.monotonic() + self.cfg.heartbeat_timeout_s + 3
        gen = self.gen
        while time.monotonic() < deadline and not mon.dropped:
            if mon.gen > gen and self.elastic:
                time.sleep(0.5)  # the monitor exits if my replica was dropped
            mon.changed.wait(0.2)
            mon.changed.clear()

    def finish(self, last_reads: Callable[[], None] | None = None) -> None:
        """End of the run: the store's host (rank 0 without a coordinator) leaves only after
        every rank is done. `last_reads`: this rank's last use of the store (the checkpoint
        floor), run while the store is sure to be up: before a rank says it is done, on the
        host once every rank has (a rank reading after its done mark raced the host's exit:
        c10d printed a C++ traceback at the end of a normal run)."""
        mon, reads = self.monitor, last_reads or (lambda: None)
        if (mon is None or not self.elastic) and self.groups is not None:
            self.groups.world.barrier("final barrier with every rank")
        if mon is None:
            reads()
            if last_reads is not None and self.groups is not None:
                self.groups.world.barrier("barrier after the last reads of the store")
            return
        if not self.hosts_store:
            mon.stop()
            mon.join(timeout=5)
            reads()
            self.store.put(done_key(self.topo.rank), "1")
            return
        self.store.put(done_key(0), "1")
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:  # members that are lost meanwhile are dropped by the monitor
            left = [r for r in mon.members if r != 0 and not is_done(self.store, r)]
            if not left:
                break
            if time.monotonic() > deadline and not self.elastic:
                raise PeerError(f"end of run: rank(s) {left} did not finish within "
                                f"{self.cfg.timeout_s:g} s")
            time.sleep(0.1)
        deadline = time.monotonic() + self.cfg.heartbeat_timeout_s
        while mon.departures.waiting(self.store) and time.monotonic() < deadline:
            time.sleep(0.1)
        mon.stop()
        reads()

    # -- generations -------------------------------------------------------------------------
    def join(self, handover: Callable[[], Handover]) -> GenerationChange:
        """--join: ask to be admitted, wait for the generation that admits me, form its groups
        and receive the outer state of my stage (see `poll` for `handover`)."""
        mon = self.monitor
        assert mon is not None and self.cfg.join
        # a live replica is never admitted: say so now (two beats' time), not after timeout_s
        refuse_live_join(self.store, self.topo.rank, self.topo.replica, mon.nonce,
                         2.5 * min(1.0, self.cfg.heartbeat_timeout_s / 4) + 0.5)
        t0 = time.monotonic()
        try:
            self.store.put(join_key(self.topo.rank), "1")
        except RuntimeError as e:
            raise PeerError(f"--join: the rendezvous store does not answer (the run is over or "
                            f"its host is gone): {str(e).strip()[:200]}") from None
        self.log(f"asking to join the run with replica {self.topo.replica}")
        while mon.generation is None or self.topo.rank not in mon.generation.members:
            if time.monotonic() - t0 > self.cfg.timeout_s:
                raise PeerError(f"--join: not admitted within {self.cfg.timeout_s:g} s (is the "
                                "run alive, did every rank of my replica start with --join, and "
                                "does this rank have the run's secret? docs/security.md)")
            mon.changed.wait(0.2)
            mon.changed.clear()
        change = self.poll(handover)
        assert change is not None and change.handover is not None
        return change

    def poll(self, handover: Callable[[], Handover]) -> GenerationChange | None:
        """The change to a newer generation, if the leader published one: its groups formed, and
        the outer state handed over to joiners. `handover()` is this rank's current state: a
        live rank sends it; a joiner receives into buffers shaped like it. PeerError when the
        new generation does not continue with me."""
        mon = self.monitor
        if mon is None or mon.generation is None or mon.gen <= self.gen:
            return None
        g = mon.generation
        if self.topo.rank not in g.members or g.stop:
            if not mon.dropped:
                mon.changed.wait(self.cfg.heartbeat_timeout_s)  # the monitor is exiting
            raise PeerError(f"generation {g.gen} does not continue with me ({g.reason})")
        t0 = time.monotonic()
        if self.groups is not None:
            self._release(self.groups, set(self.replicas) - set(g.replicas))
        self.groups = self.builder.build(g.gen, g.replicas)
        self.replicas, self.gen = tuple(sorted(g.replicas)), g.gen
        self.log(f"generation {g.gen}: groups re-formed over replicas {list(self.replicas)} in "
                 f"{time.monotonic() - t0:.2f} s ({g.reason})")
        if len(self.replicas) == 1:
            self.log(f"warning: replica {self.replicas[0]} is the only one left; outer steps "
                     f"average over it alone (--min-replicas {self.cfg.min_replicas})")
        received = self._hand_over(handover)
        return GenerationChange(g.gen, self.replicas, self.groups, received, g.reason)

    def _release(self, groups: Groups, lost: set[int]) -> None:
        """Let go of the previous generation's communicators: abort them when a replica was
        lost (NCCL's destroy would flush operations that involve the dead peer and can hang),
        close them when the generation only admitted joiners."""
        if lost:
            self.log(f"aborting the communicators of generation {self.gen} (lost replica(s) "
                     f"{sorted(lost)})")
            groups.abort()
        else:
            groups.close()

    def _hand_over(self, handover: Callable[[], Handover]) -> Handover | None:
        """After re-forming: a live peer of my stage sends the outer state to each joiner."""
        joiners = [r for r in self.replicas if r not in self.active]
        if not joiners:
            return None
        stage, shard = self.topo.stage, self.topo.shard  # shard groups: shard by shard
        key = join_source_key(self.gen, stage, shard)
        if self.topo.replica in joiners:
            try:
                src = int(self.store.wait_signed(key, self.cfg.timeout_s))
            except (RuntimeError, ValueError) as e:
                raise PeerError(f"--join: no source of the outer state of stage {stage} "
                                f"({first_line(e)})") from None
            return self._recv_handover(src, handover())
        source = self.plan.shard_group(min(set(self.replicas) & self.active), stage)[shard]
        if self.topo.rank == source:
            self.store.put(key, str(source))
            state = handover()
            for r in joiners:
                self._send_handover(self.plan.shard_group(r, stage)[shard], state)
        return None

    def _send_handover(self, dst: int, state: Handover) -> None:
        """Header (step, outer count, momentum?, active replicas), outer model, momentum."""
        outer = state.outer
        active = sorted(self.active) + [-1] * (self.plan.num_replicas - len(self.active))
        header = torch.tensor([state.step, outer.outer_count, int(outer.momentum is not None),
                               *active], dtype=torch.int64, device=outer.anchor.device)
        mom = outer.momentum if outer.momentum is not None else torch.zeros_like(outer.anchor)
        comm = self.groups.stage
        t0 = time.monotonic()
        posted = [comm.isend(t, dst, JOIN_TAG + i) for i, t in enumerate((header, outer.anchor,
                                                                          mom))]
        for p in posted:
            comm.wait(p, "sending the outer state to a joining rank")
        self.log(f"sent the outer state of stage {self.topo.stage} to joining rank {dst} in "
                 f"{time.monotonic() - t0:.2f} s")

    def _recv_handover(self, src: int, like: Handover) -> Handover:
        """Receive what _send_handover sent; the active replicas become the sender's."""
        comm, anchor = self.groups.stage, like.outer.anchor
        header = comm.recv(torch.empty(3 + self.plan.num_replicas, dtype=torch.int64,
                                       device=anchor.device), src, JOIN_TAG, "outer state header")
        outer = comm.recv(torch.empty_like(anchor), src, JOIN_TAG + 1, "outer model")
        mom = comm.recv(torch.empty_like(anchor), src, JOIN_TAG + 2, "outer momentum")
        header = header.tolist()
        self.active = {r for r in header[3:] if r >= 0}
        state = Handover(header[0], OuterState(outer, mom if header[2] else None, header[1]))
        self.log(f"received the outer model and momentum of stage {self.topo.stage} from rank "
                 f"{src} (outer step {state.outer.outer_count}, continuing at step "
                 f"{state.step})")
        return state

    # -- DiLoCo's outer step -----------------------------------------------------------------
    def outer_round(self, flat: torch.Tensor, average: GroupAverage, outer: int,
                    stats: CommStats | None = None) -> int | None:
        """One attempt at averaging outer sync `outer + 1`'s pseudo-gradient `flat` over the
        live replicas of my stage: wait for every member, average, and commit only if every
        rank of every stage got its average. Returns the bytes sent, or None when the
        membership changed first: `poll`, apply the change, restore `flat` and call again
        (every stage then re-forms at the same outer step, so no pipeline waits on a partner
        in another group). A joiner contributes zeros and the mean is over the others.
        `stats`: where the arrival wait counts (default the rank's; the background thread of
        an overlapped run passes its own). With fragments, `outer` numbers every fragment
        sync of the run (the same on every stage), so each has its own keys and commit."""
        stage, ranks = self.topo.stage, self.stage_ranks()
        what = f"DiLoCo outer step {outer + 1} of stage {stage}"
        if self.monitor is None:  # no heartbeat: fixed groups, nothing to commit
            if len(ranks) > 1:
                self._timed_wait(outer_arrival_prefix(stage, outer), ranks, what, None, stats)
            return average(flat)
        if self.topo.replica not in self.active:
            flat.zero_()
        sent = 0
        if len(ranks) > 1:
            gen = self.gen
            assert self.waiter is not None  # made with the monitor
            abandon = (self.waiter, lambda: self.monitor.gen > gen)
            if not self._timed_wait(outer_arrival_prefix(stage, outer, gen), ranks, what,
                                    abandon, stats):
                return None
            try:
                sent = average(flat)
                complete(average, what)  # NCCL: enqueued only; commit what has arrived
            except PeerError:
                if not self._await_generation(gen):
                    raise
                return None
        members = members_of(self.plan, self.replicas)
        if len(members) > 1 and not self._commit(commit_prefix(self.gen, outer), members, what):
            return None
        n_active = len(set(self.replicas) & self.active)
        if n_active < len(self.replicas):  # joiners sent zeros: average over the others
            flat.mul_(len(self.replicas) / n_active)
        self.active = set(self.replicas)
        return sent

    def _confirmations(self, keys: list[str], what: str) -> str:
        """"commit" once every member confirmed (`keys`), "abort" when a new generation came
        first; PeerError when neither within --timeout-s (+ a heartbeat timeout)."""
        mon, waiter = self.monitor, self.waiter
        assert mon is not None and waiter is not None
        try:  # one whole wait, on a connection of its own (modules.control.flag_wait)
            ok = waiter.wait(keys, self.cfg.timeout_s + self.cfg.heartbeat_timeout_s,
                             abandon=lambda: mon.gen > self.gen)
            return "commit" if ok else "abort"
        except RuntimeError as e:
            if mon.gen > self.gen:
                return "abort"
            raise PeerError(f"{what}: not every member confirmed the average within "
                            f"{self.cfg.timeout_s:g} s ({first_line(e)})") from None

    def stage_ranks(self) -> tuple[int, ...]:
        """Devices of my stage in every live replica."""
        peers = self.plan.shard_peers(self.topo.stage, self.topo.shard)
        return tuple(peers[r] for r in self.replicas)

    def _timed_wait(self, prefix: str, ranks: tuple[int, ...], what: str,
                    abandon: tuple[FlagWaiter, Callable[[], bool]] | None,
                    stats: CommStats | None = None) -> bool:
        """Wait for every member's arrival (counted as communication time)."""
        t0 = time.perf_counter()
        try:
            return wait_for_peers(self.store, prefix, self.topo.rank, ranks, self.cfg.timeout_s,
                                  self.cfg.wait_for_peers, self.log, what, abandon=abandon)
        finally:
            (stats or self.stats).wait_s += time.perf_counter() - t0

    def _await_generation(self, gen: int) -> bool:
        """Wait (heartbeat timeout + 5 s) for a generation newer than `gen`; True if one came."""
        mon = self.monitor
        deadline = time.monotonic() + self.cfg.heartbeat_timeout_s + 5
        while mon is not None and time.monotonic() < deadline:
            if mon.gen > gen:
                return True
            mon.changed.wait(0.2)
            mon.changed.clear()
        return False

    def _commit(self, prefix: str, ranks: tuple[int, ...], what: str) -> bool:
        """Every member (all stages) finished its all-reduce -> commit; the membership changed
        first -> abort (everybody retries with the new groups). One decision per outer step,
        first writer wins."""
        assert self.monitor is not None
        # the confirmations are flags under hidden keys (modules.control.hidden): an outsider
        # cannot fake one, and waiting for them all is one store round trip (a signed value
        # would need a read after the wait: two more round trips per outer step)
        flags = hidden_store(self.store)
        flags.set(commit_done_key(prefix, self.topo.rank), "1")
        keys = [commit_done_key(prefix, r) for r in ranks]
        decision = self._confirmations(keys, what)
        got = self.store.claim(commit_decision_key(prefix), decision)
        if got != "commit":
            self.log(f"{what}: aborted at generation {self.gen} (membership changed); "
                     "retrying with the live replicas")
        return got == "commit"
