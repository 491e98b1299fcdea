"""DiLoCo's outer sync over hivemind (--outer-backend hivemind): the stage group's average of
the pseudo-gradient goes through a hivemind averager over a DHT, with no central store; inside
a replica torch.distributed stays (a store local to the replica).

One `HivemindOuter` per rank: its DHT node (started before the rendezvous, so the addresses
to pass as --initial-peers are printed early), the roster of live replicas of its stage
(modules.control.dht), and an `ExactAverager` (modules.sync.hivemind_exact: the store
backend's codes and arithmetic, so every replica ends bit-identical). Rounds:
- round k's first attempt needs no matchmaking: every replica forms the group of the live
  replicas in the roster it reads anyway, the same members and group id on each (`_fixed`),
  and starts the all-reduce as it reaches the round. Should that group not average it (a
  member died, or the replicas read different rosters: a joiner), matchmaking follows;
- in matchmaking, round k of stage s matches only peers of the same run id, stage and round
  (the averager's prefix is `<run id>_s<stage>`, its group bits the round number), so a late
  or stale peer never averages with another round's; the group forms as soon as every
  replica of the roster is in it (target size = live replicas), else after the matchmaking
  deadline with those that came: a replica that died is dropped from the next round once
  its roster entry expires; but after a failed attempt of the round, only with every live
  replica (a member may have completed the failed attempt, and a subset must not redo the
  round apart from it: `_round`);
- a round that fails for this rank (no group before --timeout-s, or a peer left mid-way and
  hivemind's retries among the rest did not finish it) is never applied half: if another
  replica completed it, this rank loads that replica's outer state (parameters = its outer
  model, bit-identical again); if nobody did, the round is skipped with the local
  pseudo-gradient kept (the next round's carries both), the same choice on every replica
  that saw it fail, so they stay equal;
- with sync.overlap (BackgroundRounds, below) the rounds run on a background thread
  that never touches the model: a round that failed here is completed with the average of a
  live replica that completed it (downloaded from that replica's shared state), or, when no
  live replica completed it, ends as skipped, and the training thread skips the outer step
  at the next round boundary (the local pseudo-gradient stays: the next one carries both
  rounds' drift);
- every attempt of a round sets the round's group bits again (hivemind moves them on once a
  group is assembled); after its last step a replica lingers until the others declared its
  last round (`linger`), so that one whose side of it failed can take it from it;
- a replica started with --join loads the outer model, momentum and round count from the
  most advanced peer (bounded attempts, each within the averaging deadline, with a message
  per attempt), then takes part in the next round with weight 0 and continues bit-identical.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from formats.cluster import Cluster
from formats.plan import Plan
from modules.comm import CommStats, PeerError
from modules.control.dht import (
    Roster,
    SplitGuard,
    first,
    install_orphan_guard,
    parse_maddrs,
    run_id,
    start_dht,
    stop_now,
)
from modules.control.dht import visible_maddrs as dht_addresses
from modules.sync.diloco import OuterRoundSkipped, OuterState
from modules.sync.outer_deadlines import OuterDeadlines, derive
from modules.sync.overlap import OuterJob, OverlapSync

if TYPE_CHECKING:
    from modules.config import ResolvedRun

ROUND_BITS = 16
"""Group bits carrying the round number (mod 2^16): peers of different rounds never match."""
JOIN_ATTEMPTS = 3
"""Tries at loading the state from a peer before a joiner gives up."""
KEEP_RESULTS = 2
"""Overlap: the last averaged results a replica shares (a peer that failed round k fetches
it while this replica may already have completed round k + 1)."""


@dataclass(frozen=True)
class HivemindSettings:
    """What the backend reads from the run's flags, resolved."""

    initial_peers: tuple[str, ...]
    host_maddrs: tuple[str, ...]
    announce_maddrs: tuple[str, ...]
    client_mode: bool
    run: str
    """Run id (modules.control.dht.run_id)."""
    timeout_s: float
    """--timeout-s: how long a round may wait for its peers to arrive in all."""
    heartbeat_s: float
    """--heartbeat-timeout-s: the roster entry's lifetime."""
    min_replicas: int
    starting: int
    """Replicas that start now (--replicas, default the plan's): round 1 waits for them."""
    compression: str
    matchmaking_s: float | None
    averaging_s: float | None


class BackendClosed(PeerError):
    """A round cut short because the rank is stopping (`HivemindOuter.close`, e.g. Ctrl+C)."""

    def __init__(self, index: int, what: str) -> None:
        super().__init__(f"outer round {index + 1} of {what} stopped: the rank is shutting "
                         "down its hivemind outer sync")


class AttemptCancelled(PeerError):
    """A matchmaking attempt given up by this rank before its deadline: the round was completed
    by others, or fewer replicas are live than the attempt waited for (no deadline's fault)."""


class HivemindOuter:
    """This rank's hivemind outer sync (see the module docstring)."""

    def __init__(self, settings: HivemindSettings, plan: Plan, cluster: Cluster | None,
                 replica: int, stage: int, log: Callable[[str], None] = print,
                 shard: int = 0) -> None:
        """`shard`: my index in my stage's shard group (plan/2): each shard is averaged with
        the same shard of the other replicas, in a round of its own (0 without shard groups)."""
        self.cfg, self.plan, self.cluster, self.log = settings, plan, cluster, log
        self.replica, self.stage, self.shard = replica, stage, shard
        sharded = plan.is_sharded
        self.part = f"{stage}_{shard}" if sharded else f"{stage}"  # ("." not in a prefix)
        """What my averager's prefix and roster are keyed by: my stage, and shard."""
        self.what = f"stage {stage} shard {shard}" if sharded else f"stage {stage}"
        """How messages name what my rounds average."""
        self.whole = plan.num_stages == 1 and not sharded
        """My replica is this one rank: alone in the roster, a round is the mean of my own
        (as the store backend's group of one) at once. A replica of several parts (stages,
        shards) matches instead: its parts read their rosters apart, and one part's round
        completed alone while its sibling matched a joiner past --timeout-s (seen)."""
        quiet_hivemind()
        install_orphan_guard()  # a rank killed with -9 leaves no DHT process or p2pd behind
        self.dht = start_dht(list(settings.initial_peers), list(settings.host_maddrs),
                             list(settings.announce_maddrs), settings.client_mode,
                             settings.timeout_s)
        self.addresses = dht_addresses(self.dht)
        log(f"hivemind DHT up (run id {settings.run}); other replicas can join with "
            f"--initial-peers {','.join(self.addresses)}")
        self.averager = None
        self.roster: Roster | None = None
        self.deadlines: OuterDeadlines | None = None
        self.completed = 0
        """Rounds this rank's outer model has completed (averaged, or loaded from a peer that
        had); skipped rounds do not count. Its state-sharing priority: a peer that failed a
        round loads only from one that completed it."""
        self.snapshot: tuple[dict, list[torch.Tensor]] | None = None
        """The outer state a loading peer gets (`publish`); never the training thread's
        tensors, so sharing it waits for no lock and no round."""
        self.catching_up = False
        """The next round is a joiner's first: weight 0 (contributes nothing, gets the mean)."""
        self.live: set[int] = set()
        """Replicas in the roster when the last round's group formed."""
        self.started = False
        """The start barrier (every replica of the plan in the roster) was passed."""
        self.rounds_s: list[float] = []
        """Seconds of every completed round (matchmaking included)."""
        self.lock = threading.Lock()
        self.closing = threading.Event()
        """Set by `close`: a round still running on the background thread (Ctrl+C) then ends
        with BackendClosed, quietly, as the averager and DHT under it stop."""
        self.background = False
        """sync.overlap: rounds run on the background thread (the only one that calls the
        averager); a failed round takes a peer's average of it, never a peer's state."""
        self.results: dict[int, torch.Tensor] = {}
        """Overlap: round -> its average, the last KEEP_RESULTS completed (shared with peers)."""
        self.fixed_rounds = 0
        """Rounds averaged in the roster's group (`_fixed`); the rest through matchmaking."""
        self.last_group: set[int] = set()
        """The replicas of the last round averaged here (or all that started): a round whose
        roster is this group again starts in the roster's group (a dead replica still listed:
        that group fails at once), one whose roster changed (a replica joined, or a dead one's
        entry expired) goes to matchmaking."""

    def attach(self, numel: int, outer: OuterState, joining: bool = False) -> None:
        """Create the averager for a stage of `numel` values whose outer state is `outer` now;
        a joiner enters the roster only once it has loaded the state (`join`)."""
        from modules.sync.hivemind_exact import CodecWire, ExactAverager

        cfg = self.cfg
        self.deadlines = derive(self.plan, self.cluster, self.stage, numel, cfg.compression,
                                cfg.matchmaking_s, cfg.averaging_s, self.shard, cfg.timeout_s)
        self.log(f"hivemind outer sync of {self.what}: {self.deadlines.describe()}")
        avg_s = self.deadlines.averaging_s
        self.publish(outer)
        # hivemind's run_in_background sets SIGINT to SIG_IGN in this (the host) process, not
        # only in the averager's: put Ctrl+C back afterwards, or a replica ignores it
        on_int = signal.getsignal(signal.SIGINT)
        self.averager = ExactAverager(
            [torch.zeros(numel)], self.dht, wire=CodecWire(cfg.compression),
            state_fn=self._shared,
            start=True, prefix=f"{cfg.run}_s{self.part}", target_group_size=self.plan.num_replicas,
            min_group_size=2, min_matchmaking_time=self.deadlines.matchmaking_s,
            request_timeout=self.deadlines.request_s, allreduce_timeout=avg_s,
            sender_timeout=avg_s / 2, reducer_timeout=avg_s,
            next_chunk_timeout=avg_s,  # hivemind's per-chunk wait when loading state
            initial_group_bits="0" * ROUND_BITS,
            client_mode=cfg.client_mode, declare_state_period=max(2.0, cfg.heartbeat_s))
        if threading.current_thread() is threading.main_thread() and on_int is not None:
            signal.signal(signal.SIGINT, on_int)
        self.averager.state_sharing_priority = float(self.completed)
        self.roster = Roster(self.dht, cfg.run, self.part, self.replica, cfg.heartbeat_s,
                             self.log, client_mode=cfg.client_mode)
        if not joining:
            self.roster.start()
        self.guard = SplitGuard(cfg.starting, self.deadlines.matchmaking_s,
                                list(cfg.initial_peers), self.log)
        if not joining:  # the start barrier before step 1, as the store's rendezvous
            self._await_start()

    # -- one round ---------------------------------------------------------------------------
    def all_reduce(self, flat: torch.Tensor, index: int) -> int:
        """Average `flat` (round `index`) in place over the live replicas of my stage; the
        bytes sent. OuterRoundSkipped when the round failed here (see the module docstring)."""
        weight = 0.0 if self.catching_up else 1.0
        if not self.started and not self.catching_up:
            self._await_start()
        t0 = time.monotonic()
        with self.averager.get_tensors() as tensors:
            tensors[0].copy_(flat)
        if self.background:
            return self._background_round(flat, index, t0)
        group = self._round(index, weight)
        if group is None:
            raise self._recover(index)
        return self._averaged(flat, index, group, t0)

    def _background_round(self, flat: torch.Tensor, index: int, t0: float) -> int:
        """Overlap (the worker thread): round `index`, a failed one taken from a peer
        (`_recover_background`). Weight 1 always: --join, whose first round has weight 0, is
        refused with overlap."""
        group = self._round(index, 1.0)
        if group is None:
            return self._recover_background(flat, index)
        return self._averaged(flat, index, group, t0)

    def _averaged(self, flat: torch.Tensor, index: int, group: list[int], t0: float) -> int:
        """Round `index` averaged by `group`: the average into `flat`; the bytes sent."""
        with self.averager.get_tensors() as tensors:
            flat.copy_(tensors[0])
        took = time.monotonic() - t0
        self.rounds_s.append(took)
        self.last_group = set(group)
        self._report(index, took, sorted(group))
        self._set_deadlines(self.deadlines.narrowed(took), index, f"after {took:.2f} s")
        self._completed(index, flat)
        return self._bytes_sent(flat.numel(), group)

    def _completed(self, index: int, average: torch.Tensor) -> None:
        """Round `index` is done here; with overlap, share its average and say so in the DHT
        at once (the state-sharing priority: the rounds completed)."""
        self.completed = index + 1
        if not self.background:
            return  # publish, on the training thread, declares it with the outer state
        with self.lock:
            self.results[index] = average.detach().cpu().float().clone()
            for old in sorted(self.results)[:-KEEP_RESULTS]:
                del self.results[old]
        if not self.cfg.client_mode:  # a client shares nothing
            self.averager.state_sharing_priority = float(self.completed)

    def _round(self, index: int, weight: float) -> list[int] | None:
        """Round `index` in the roster's group (`_fixed`) when the roster is the last round's
        group, then matchmaking attempts until a group averaged it or --timeout-s passed; the
        replicas of the group, or None."""
        cfg = self.cfg
        give_up = time.monotonic() + cfg.timeout_s
        fixed = True  # the first attempt: the roster's group, if the roster did not change
        every_live = False  # after a failed attempt: only groups of every live replica
        while True:
            live = self._live(index, cfg.heartbeat_s / 2 if fixed else 0.0)
            fixed = fixed and live == self.last_group
            if len(live) < cfg.min_replicas:  # the others may still be starting
                if time.monotonic() > give_up:
                    raise PeerError(f"outer round {index + 1} of {self.what}: only "
                                    f"replicas {sorted(live)} were live in the DHT for "
                                    f"{cfg.timeout_s:g} s (--timeout-s), fewer than "
                                    f"--min-replicas {cfg.min_replicas}")
                time.sleep(0.5)
                continue
            if live == {self.replica} and self.whole and not self.catching_up:
                if self.last_group != live or not self.rounds_s:
                    self.log(f"outer round {index + 1} of {self.what}: alone in the DHT "
                             "roster; my rounds are the mean of my own until others join")
                return [self.replica]
            t1, deadlines = time.monotonic(), self.deadlines
            try:
                if fixed:
                    return self._fixed(index, live, weight)
                need = len(live) if every_live else 2
                gathered = self._matched(index, self._step(
                    index, live, weight, need, wait=False,
                    timeout=deadlines.matchmaking_s + deadlines.averaging_s), need)
                return same_round(gathered, index)
            except Exception as e:  # noqa: BLE001 - hivemind raises many types for one failure
                if self.closing.is_set():
                    raise BackendClosed(index, self.what) from e
                waited = time.monotonic() - t1
                how = "the roster's group" if fixed else "matchmaking"
                self.log(f"outer round {index + 1} of {self.what}: no completed average "
                         f"in {how} within the deadlines ({deadlines.matchmaking_s:.2f} s "
                         f"matchmaking + {deadlines.averaging_s:.2f} s averaging; measured "
                         f"{waited:.2f} s, live replicas {sorted(live)}): {first(e)}")
                if waited >= deadlines.matchmaking_s and not isinstance(e, AttemptCancelled):
                    # it ran into its deadline, not a dead peer
                    self._set_deadlines(deadlines.widened(), index, "after a failed attempt")
                # An all-reduce's means can reach some members and not others (one dies or
                # gives up mid-send): two members whose sides failed then completed the round
                # among themselves while a third had completed it with everyone, and the outer
                # models went apart (seen with a sharded joiner). A group of every live replica
                # cannot form without a completer, which has moved on: the others match until
                # it declares the round (`_matched`), then take it from it.
                every_live = True
            fixed = False
            # others completed it without me: take their state (with overlap, a live one's)
            done = self._best_peer_rounds(live_only=self.background) > index
            if time.monotonic() > give_up or done:
                return None

    @property
    def longest_wait_s(self) -> float:
        """The longest this part of a replica can spend in one outer round (attempts until
        --timeout-s, one more, its recovery or a background fetch until --timeout-s again) or
        in --join: how long the other parts of its replica wait for it to agree on a step."""
        if self.deadlines is None:  # not attached yet: nothing derived
            return self.cfg.timeout_s
        d = self.deadlines.widest
        attempt = d.matchmaking_s + d.averaging_s + 5.0  # a fixed group's result waits +5 s
        rounds = 2 * self.cfg.timeout_s + attempt + 3 * d.averaging_s
        return max(rounds, JOIN_ATTEMPTS * (d.averaging_s + min(5.0, d.matchmaking_s)))

    def _set_deadlines(self, new: OuterDeadlines, index: int, why: str) -> None:
        """Round `index` changed the deadlines to `new` (`why`): say so, and pass them to the
        averager's process (its matchmaking and all-reduce read them from there)."""
        old = self.deadlines
        if new == old:
            return
        self.deadlines = new
        if self.averager is not None:
            self._in_averager("_set_deadlines", matchmaking_s=new.matchmaking_s,
                              averaging_s=new.averaging_s, request_s=new.request_s)
            # step() schedules a round min_matchmaking_time ahead in this process
            self.averager.matchmaking_kwargs["min_matchmaking_time"] = new.matchmaking_s
        how = "widened" if new.widen > old.widen else "narrowed"
        self.log(f"outer round {index + 1} of {self.what}: deadlines {how} {why} to "
                 f"{new.matchmaking_s:.2f} s matchmaking + {new.averaging_s:.2f} s averaging "
                 f"({new.widen:g}x the derived ones, at most {new.max_widen:g}x)")

    def _fixed(self, index: int, live: set[int], weight: float) -> list[int]:
        """Round `index` averaged in the group of the `live` replicas, formed without
        matchmaking: every replica reads the same roster, so each forms the same members
        and group id and starts the all-reduce when it reaches the round (a replica up to the
        matchmaking deadline late is waited for). The replicas of the group; raises when
        the group did not average it (a member gone or seeing another roster: matchmaking
        follows). Matchmaking alone took 0.2-0.7 s a round on the lab, against the
        all-reduce's 0.1-0.4 s (docs/hivemind.md)."""
        from hivemind.utils.mpfuture import MPFuture

        from modules.sync.hivemind_exact import fixed_group_id

        members = self.roster.members(live, str(self.dht.peer_id), self.cfg.client_mode)
        if len(members) < 2:
            raise PeerError(f"the roster has no peer id for replicas {sorted(live)}")
        text = "|".join([self.averager.prefix] + [f"{r}:{p}" for p, r, _ in members])
        d, future = self.deadlines, MPFuture()
        self.averager._outer_pipe.send(("_fixed_round", [], dict(
            index=index, group_id=fixed_group_id(index, text), members=members, weight=weight,
            wait_s=d.matchmaking_s, future=future)))
        gathered = future.result(timeout=d.matchmaking_s + d.averaging_s + 5.0)
        self.fixed_rounds += 1
        return [int(v["replica"]) for v in gathered.values()]

    def _matched(self, index: int, control: Any, need: int = 2) -> Any:
        """The result of a matchmaking step (hivemind's StepControl) of round `index` whose
        groups need `need` replicas; raises PeerError at once when another live replica
        declared the round done meanwhile (this one then takes it from them: a replica whose
        side of a round failed matched alone for the whole deadline, 15 s on the lab, while the
        others had completed it), or when fewer than `need` replicas are live now (a replica
        killed mid-round: its entry expires within a heartbeat, and the next attempt needs one
        fewer instead of waiting out this one's deadline for it)."""
        while True:
            try:
                return control.result(timeout=0.5)
            except TimeoutError:
                why = ""
                if self._best_peer_rounds(live_only=self.background) > index:
                    why = "other replicas completed it without me"
                elif len(self._live(index, max_age_s=1.0)) < need:
                    why = f"fewer than the {need} replicas it waited for are live now"
                if why:
                    with contextlib.suppress(Exception):  # already over
                        control.cancel()
                    raise AttemptCancelled(why) from None

    def _step(self, index: int, live: set[int], weight: float, need: int = 2,
              **kwargs: Any) -> Any:
        """One averager step of round `index` among the `live` replicas, in a group of at least
        `need` (hivemind's `step` with `kwargs`: its result, or its StepControl with
        wait=False). The round's key is set again at every attempt, and hivemind never
        retries inside a step: it moves a peer's group bits on as soon as a group is assembled
        (update_key_on_group_assembled), each member to other bits, so after a group that
        failed mid-way (a replica killed in it) the survivors' retries never met again and the
        round failed on all of them after --timeout-s."""
        self._set_group_size(max(2, len(live)), need)
        self._reach(index)
        self.averager.set_group_bits(format(index % (1 << ROUND_BITS), f"0{ROUND_BITS}b"))
        return self.averager.step(gather={"replica": self.replica, "round": index},
                                  weight=weight, allow_retries=False, **kwargs)

    def _live(self, index: int, max_age_s: float = 0.0) -> set[int]:
        """The live replicas of my stage now (the roster, read at most `max_age_s` ago),
        saying which left since the last look (round `index` goes on without them)."""
        live = self.roster.live(max_age_s)
        self.guard.check(live)
        if self.live - live:
            self.log(f"outer round {index + 1} of {self.what}: replica(s) "
                     f"{sorted(self.live - live)} left the DHT roster (no heartbeat for "
                     f"{self.cfg.heartbeat_s:g} s); the rounds go on without them")
        self.live = live
        return live

    def _await_start(self) -> None:
        """Before step 1 (`attach`): wait (at most --timeout-s) until every replica that starts
        is in the roster, as the store's rendezvous waits for every rank, so that a replica
        slower to start is not left out of round 1 and round 1 does not carry the wait (with
        overlap: on the background thread, where the training thread would wait for it)."""
        expected, t0 = self.cfg.starting, time.monotonic()
        live = self.roster.live()
        if len(live) < expected:
            self.log(f"waiting for {expected} replicas to appear in the DHT (have "
                     f"{sorted(live)}; at most {self.cfg.timeout_s:g} s)")
        while len(live) < expected and time.monotonic() - t0 < self.cfg.timeout_s:
            time.sleep(0.5)
            live = self.roster.live()
        self.started = True
        self.last_group = live if len(live) >= expected else set()

    def _reach(self, index: int) -> None:
        """Tell the averager this rank is at round `index` or past it: roster groups' parts
        for it or an earlier round are refused at once from now (ExactAverager._round_reached)."""
        self.averager._outer_pipe.send(("_reach_round", [index], {}))

    def _set_group_size(self, size: int, minimum: int) -> None:
        """Groups form once `size` replicas are in, at the deadline with `minimum` or more."""
        self._in_averager("_set_group_size", size=size, minimum=minimum)

    def _in_averager(self, method: str, **kwargs: Any) -> None:
        """Run the averager's `method` in its process (through its control pipe, as hivemind
        runs its own) and wait for it to finish (at most 30 s)."""
        from hivemind.utils.mpfuture import MPFuture

        future = MPFuture()
        self.averager._outer_pipe.send((method, [], {**kwargs, "future": future}))
        future.result(timeout=30)

    def _report(self, index: int, took: float, group: list[int]) -> None:
        """Log a round that overran its deadlines (with the measured time), or a small group."""
        d = self.deadlines
        if took > d.matchmaking_s + d.averaging_s:
            self.log(f"outer round {index + 1} of {self.what}: took {took:.2f} s, over the "
                     f"deadlines {d.matchmaking_s:.2f} + {d.averaging_s:.2f} s")
        if len(group) < len(self.live):  # a replica of the roster was left out
            self.log(f"outer round {index + 1} of {self.what}: averaged over replicas "
                     f"{group} of {self.plan.num_replicas} in {took:.2f} s")

    def _bytes_sent(self, numel: int, group: list[int]) -> int:
        """What this peer put on the wire, counted as the store backend counts it: its
        encoding of every other owner's chunks, and its own chunks' encoded means to each of
        the other peers (modules.comm.compressed's reduce-scatter and all-gather)."""
        from modules.quant.allreduce import SEGMENT, chunk_bounds, segment_bounds

        world, me, block = len(group), sorted(group).index(self.replica), 256

        def encoded(c: int) -> int:
            return {"none": 4 * c, "fp16": 2 * c}.get(self.cfg.compression,
                                                     c + 4 * -(-c // block))

        total = 0
        for lo, hi in segment_bounds(numel, SEGMENT, block):
            for j, (a, b) in enumerate(chunk_bounds(hi - lo, world, block)):
                if b > a:
                    total += encoded(b - a) * ((world - 1) if j == me else 1)
        return total

    # -- recovering and joining --------------------------------------------------------------
    def _recover(self, index: int) -> OuterRoundSkipped:
        """After a failed round: another replica's state if one completed it, else skip."""
        wait_until = time.monotonic() + self.deadlines.averaging_s
        while self._best_peer_rounds() <= index and time.monotonic() < wait_until:
            time.sleep(0.5)
        if self._best_peer_rounds() > index:
            loaded = self.load_state()
            if loaded is not None and loaded.outer_count > index:
                self.log(f"outer round {index + 1} of {self.what} failed here; took the "
                         f"outer state of a replica that completed it (round "
                         f"{loaded.outer_count})")
                return OuterRoundSkipped(loaded)
        self.log(f"outer round {index + 1} of {self.what} failed on every replica that "
                 "tried it; skipped, keeping the local pseudo-gradient for the next round")
        return OuterRoundSkipped(None)

    def _recover_background(self, flat: torch.Tensor, index: int) -> int:
        """Overlap, after round `index` failed here (the background thread): put the average of
        a live replica that completed it into `flat` (0 bytes sent), or raise
        OuterRoundSkipped(None) once no live replica has declared it done for the averaging
        deadline in a row (nobody alive has it: every survivor skips it); PeerError when live
        replicas declared it done and none shared it within --timeout-s.

        Only live replicas (the roster) count: a replica that completed the round and died
        at once (killed mid-round, the others' parts already in) left a declaration that
        outlives it, and waiting for its average made every survivor stop after --timeout-s.
        A survivor that did take the average from it declares it in turn, and the others
        take it from that survivor."""
        give_up = time.monotonic() + self.cfg.timeout_s
        quiet_since = time.monotonic()
        while True:
            self.roster.live()  # refreshes who counts
            if self._best_peer_rounds(live_only=True) > index:
                quiet_since = time.monotonic()
                got = self._fetch()
                if got is not None and index in got[0]:
                    flat.copy_(got[1][got[0].index(index)].to(flat.dtype))
                    self.log(f"outer round {index + 1} of {self.what} failed here; took "
                             "its average from a replica that completed it")
                    self._completed(index, flat)
                    return 0
                if got is not None and all(r > index for r in got[0]):
                    raise PeerError(self._average_gone(index, got[0]))
            elif time.monotonic() - quiet_since > self.deadlines.averaging_s:
                self.log(f"outer round {index + 1} of {self.what} failed on every live "
                         "replica that tried it; skipped at the next round boundary, keeping "
                         "the local pseudo-gradient for the next round")
                raise OuterRoundSkipped(None)
            if time.monotonic() > give_up:
                raise PeerError(f"outer round {index + 1} of {self.what}: a replica "
                                f"completed it but none shared its average within "
                                f"{self.cfg.timeout_s:g} s (--timeout-s); stopping rather than "
                                "leaving the outer models apart")
            time.sleep(0.5)

    def _average_gone(self, index: int, kept: list[int]) -> str:
        """Why round `index` cannot be taken from the replica that completed it: it keeps only
        the averages of rounds `kept` (the last KEEP_RESULTS; none since its --resume)."""
        return (f"outer round {index + 1} of {self.what}: the replica that completed it no "
                f"longer holds its average (it keeps rounds {[r + 1 for r in kept]}, none "
                "from before its --resume): this replica is behind the others, e.g. resumed "
                "from an older checkpoint than theirs. With --overlap on a replica cannot "
                "catch up on its own: resume every replica from the same step (the newest "
                "checkpoint all of them have), or run without --overlap")

    def _fetch(self) -> tuple[list[int], list[torch.Tensor]] | None:
        """Overlap: the rounds and averages the most advanced peer shares (None: no answer)."""
        try:
            got = self.averager.load_state_from_peers(timeout=self.deadlines.averaging_s)
        except TimeoutError:
            return None
        if got is None or got[0].get("run") != self.cfg.run:
            return None
        rounds = [int(r) for r in got[0].get("results", [])]
        return rounds, list(got[1][2:2 + len(rounds)])

    def _declared(self, live_only: bool = False, sharing: bool = False) -> dict[bytes, float]:
        """Peer id -> the rounds that peer of my stage declared done, me excluded;
        `live_only`: only peers in the roster as `roster.live` last read it (`sharing`: and
        not in --client-mode)."""
        found = self.dht.get(f"{self.averager.prefix}.all_averagers", latest=True)
        mine = self.averager.peer_id.to_bytes()
        if found is None or not isinstance(found.value, dict):
            return {}
        live = {_peer_bytes(p) for p in self.roster.peers(sharing)} if live_only else set()
        return {k: float(v.value) for k, v in found.value.items()
                if k != mine and isinstance(v.value, (int, float))
                and (not live_only or k in live)}

    def _best_peer_rounds(self, live_only: bool = False) -> float:
        """The most rounds any other peer of my stage declared done (-1: none declared)."""
        return max(self._declared(live_only).values(), default=-1.0)

    def linger(self) -> None:
        """After the last step, before `close`: stay (sharing my state and averages) until
        every live replica that shares state declared the rounds I completed, at most one
        failed attempt and one download (matchmaking + 2 x averaging deadline).

        Why: a replica leaves as soon as its last round completed here; a peer whose side of
        that round failed (the leaver's last means were still on the wire when its p2pd
        stopped: seen in the kill test, 0.3 s into the round) then found nobody to take the
        round from, and skipped it (or, before, exited 1 after --timeout-s) while the leaver
        had applied it. Clients declare nothing and are not waited for."""
        if (self.averager is None or self.deadlines is None or self.cfg.client_mode
                or not self.completed):
            return
        d, waiting = self.deadlines, set()
        until = time.monotonic() + d.matchmaking_s + 2 * d.averaging_s
        while time.monotonic() < until:
            self.roster.live()
            declared = self._declared(live_only=True, sharing=True)
            waiting = {p for p in self.roster.peers(sharing=True)
                       if declared.get(_peer_bytes(p), -1.0) < self.completed}
            if not waiting:
                return
            time.sleep(0.5)
        self.log(f"leaving before replica peer(s) {sorted(waiting)} declared round "
                 f"{self.completed} of {self.what} done")

    def load_state(self) -> OuterState | None:
        """The outer state of the most advanced peer (None when none answered in time)."""
        try:
            got = self.averager.load_state_from_peers(timeout=self.deadlines.averaging_s)
        except TimeoutError:
            return None
        if got is None:
            return None
        meta, tensors = got
        if meta.get("run") != self.cfg.run or not tensors:
            return None
        momentum = tensors[1] if len(tensors) > 1 and meta.get("momentum") else None
        self.completed = int(meta["completed"])
        self._reach(int(meta["outer_count"]) - 1)  # the rounds before it are over here
        return OuterState(tensors[0].clone(), momentum.clone() if momentum is not None else None,
                          int(meta["outer_count"]))

    def resumed(self, outer: OuterState) -> None:
        """After --resume: my outer model has completed the checkpoint's rounds. Declare them
        and share that state at once, so that a replica resumed from an older checkpoint (its
        newest one lost) finds its first round completed by me and takes my state, as a
        replica whose round failed does, instead of matching a round nobody else is in."""
        # with overlap the last round is still in flight (resume runs it again)
        self.completed = max(0, outer.outer_count - 1) if self.background else outer.outer_count
        if self.averager is None:
            return
        if self.completed:
            self._reach(self.completed - 1)  # the rounds before it are over here
        self.publish(outer)  # (blocking: declares it too)
        if self.background and not self.cfg.client_mode:  # overlap declares in its rounds
            self.averager.state_sharing_priority = float(self.completed)

    def publish(self, outer: OuterState) -> None:
        """The training thread, after each outer step: what peers loading state now get."""
        has_momentum = outer.momentum is not None
        tensors = [outer.anchor.detach().cpu().float().clone(),
                   outer.momentum.detach().cpu().float().clone() if has_momentum
                   else torch.zeros(0)]
        meta = {"run": self.cfg.run, "outer_count": outer.outer_count,
                "momentum": has_momentum, "completed": self.completed}
        with self.lock:
            self.snapshot = (meta, tensors)
        if self.background:  # the background thread declares its rounds (_completed)
            return
        if self.averager is not None and not self.cfg.client_mode:  # a client shares no state
            self.averager.state_sharing_priority = float(self.completed)

    def _shared(self) -> tuple[dict, list[torch.Tensor]]:
        """What a loading peer gets: the outer state and (overlap) the last rounds' averages."""
        with self.lock:
            assert self.snapshot is not None
            meta, tensors = self.snapshot
            rounds = sorted(self.results)
            return {**meta, "results": rounds}, tensors + [self.results[r] for r in rounds]

    def join(self) -> OuterState:
        """--join: the state of a live peer, in at most JOIN_ATTEMPTS tries (PeerError after)."""
        for attempt in range(1, JOIN_ATTEMPTS + 1):
            t0 = time.monotonic()
            state = self.load_state()
            if state is not None:
                self.log(f"--join: loaded the outer model, momentum and round count "
                         f"{state.outer_count} of {self.what} from a peer in "
                         f"{time.monotonic() - t0:.2f} s")
                self.catching_up = True
                self.roster.start()
                return state
            self.log(f"--join: attempt {attempt}/{JOIN_ATTEMPTS}: no peer of run "
                     f"{self.cfg.run} {self.what} shared its state within "
                     f"{self.deadlines.averaging_s:.2f} s; "
                     + ("retrying" if attempt < JOIN_ATTEMPTS else "giving up"))
            time.sleep(min(5.0, self.deadlines.matchmaking_s))
        raise PeerError(f"--join: no live replica of run {self.cfg.run} shared the state of "
                        f"{self.what} in {JOIN_ATTEMPTS} attempts (initial peers "
                        f"{','.join(self.cfg.initial_peers) or '(none)'}); is the run alive?")

    def abort(self) -> None:
        """The rank's emergency exit (it os._exits next; any thread, no lock): the DHT and
        averager processes and their p2pd stop now, silently (modules.control.dht.stop_now)."""
        stop_now([p.pid for p in (self.averager, self.dht) if p is not None and p.pid])

    def close(self) -> None:
        """Stop the roster, the averager and the DHT (and their p2pd); idempotent."""
        self.closing.set()
        if self.rounds_s and self.averager is not None:
            self.log(f"hivemind outer sync of {self.what}: {len(self.rounds_s)} rounds "
                     f"averaged here, {self.fixed_rounds} in the roster's group (the rest "
                     f"through matchmaking); median {statistics.median(self.rounds_s):.2f} s "
                     "from the round's start to its average")
        with self.lock:
            if self.roster is not None:
                self.roster.close()
            for part in (self.averager, self.dht):
                if part is not None:
                    with contextlib.suppress(Exception):  # already gone
                        part.shutdown()
            self.averager = self.dht = self.roster = None


class BackgroundRounds(OverlapSync):
    """sync.overlap over hivemind: the rounds run on OverlapSync's worker thread, which never
    touches the model; a round that failed there (nobody completed it: the attempt returned
    None) is not redone, `finish` raises OuterRoundSkipped(None) on the training thread at the
    next round boundary and DiLoCo skips that outer step (a round that failed only here was
    already completed on the worker with a peer's average: HivemindOuter._recover_background)."""

    def finish(self, job: OuterJob) -> None:
        """Block until `job` is over; OuterRoundSkipped(None) when nobody completed it."""
        t0 = time.perf_counter()
        try:
            job.done.wait()
        finally:
            self.wait_s += time.perf_counter() - t0
        self.jobs.remove(job)
        if job.error is not None:
            raise job.error
        if not job.ok:
            raise OuterRoundSkipped(None)

    def drain(self) -> None:
        """Wait for every job in flight; results (or skips) stay for `finish`."""
        t0 = time.perf_counter()
        try:
            for j in list(self.jobs):
                j.done.wait()
        finally:
            self.wait_s += time.perf_counter() - t0
        for j in self.jobs:
            if j.error is not None:
                raise j.error


def background_attempt(hivemind: HivemindOuter, stats: CommStats | None
                       ) -> Callable[[torch.Tensor, int], int | None]:
    """BackgroundRounds' attempt: one hivemind round on the worker thread; the bytes sent
    (counted into `stats`, the background accounting), or None when nobody completed it."""
    hivemind.background = True

    def attempt(flat: torch.Tensor, index: int) -> int | None:
        try:
            sent = hivemind.all_reduce(flat, index)
        except OuterRoundSkipped:
            return None
        except Exception as e:
            if hivemind.closing.is_set():  # whatever the stopped DHT raised: not a failure
                raise BackendClosed(index, hivemind.what) from e
            raise
        if stats is not None:
            stats.bytes_sent += sent
        return sent
    return attempt


def same_round(gathered: dict, index: int) -> list[int]:
    """The replicas of a matched group of round `index`; PeerError when a member was at
    another round. Every member gets every member's gathered data, so each refuses the
    same group and none applies its average. Why: a joiner whose host had given up on a
    round (its peers completed it without it) still had that round's step in its averager's
    matchmaking, and the others' next round matched it (seen: {'replica': 2, 'round': 31}
    in round 32's group, whose three members then held different outer models)."""
    rounds = sorted({int(v.get("round", -1)) for v in gathered.values()})
    if rounds != [index]:
        raise PeerError(f"the group that formed mixed rounds {[r + 1 for r in rounds]}; "
                        "its average is not applied")
    return [int(v["replica"]) for v in gathered.values()]


def _peer_bytes(peer: str) -> bytes:
    """A peer id's bytes (the DHT's subkeys) from its base58 text (the roster's)."""
    from hivemind.p2p import PeerID

    return PeerID.from_base58(peer).to_bytes()


def quiet_hivemind() -> None:
    """hivemind's own log lines (a traceback per failed matchmaking attempt) off unless
    $HIVEMIND_LOGLEVEL asks for them: this backend says what failed, and why, in one line."""
    if "HIVEMIND_LOGLEVEL" not in os.environ:
        from hivemind.utils.logging import get_logger

        get_logger("hivemind")  # its handler and level are set up once, here, not later
        logging.getLogger("hivemind").setLevel(logging.CRITICAL)


def settings_of(run: ResolvedRun) -> HivemindSettings:
    """HivemindSettings from a resolved run (its settings' `hivemind` component and plan)."""
    cfg, plan = run.cfg, run.plan
    hv = cfg.hivemind
    agreed = {"plan": plan.to_dict(), "compression": plan.sync.compression}
    return HivemindSettings(
        initial_peers=tuple(parse_maddrs(hv.initial_peers, "--initial-peers")),
        host_maddrs=tuple(parse_maddrs(hv.host_maddrs, "--host-maddrs", need_peer_id=False)),
        announce_maddrs=tuple(parse_maddrs(hv.announce_maddrs, "--announce-maddrs",
                                           need_peer_id=False)),
        client_mode=hv.client_mode, run=run_id(agreed, hv.run_id), timeout_s=cfg.timeout_s,
        heartbeat_s=cfg.elastic.heartbeat_timeout_s, min_replicas=run.min_replicas,
        compression=plan.sync.compression,
        starting=len(run.start_replicas or range(plan.num_replicas)),
        matchmaking_s=hv.matchmaking_timeout_s, averaging_s=hv.averaging_timeout_s)
