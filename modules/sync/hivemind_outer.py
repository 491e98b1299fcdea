"""DiLoCo's outer sync over hivemind (--outer-backend hivemind): the stage group's average of
the pseudo-gradient goes through a hivemind averager over a DHT, with no central store; inside
a replica torch.distributed stays (a store local to the replica).

One `HivemindOuter` per rank: its DHT node (started before the rendezvous, so the addresses
to pass as --initial-peers are printed early), the roster of live replicas of its stage
(modules.sync.hivemind_dht), and an `ExactAverager` (modules.sync.hivemind_exact: the store
backend's codes and arithmetic, so every replica ends bit-identical). Every roster entry and
every matchmaking gather carries the peer's membership proof (modules.sync.hivemind_auth,
from the run secret): a peer without one never enters the roster, an average or a state
download. Rounds:
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
import functools
import logging
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from formats.addresses import parse_maddrs
from formats.cluster import Cluster
from formats.plan import Plan
from modules.comm import PeerError
from modules.sync.diloco import OuterState
from modules.sync.hivemind_auth import PeerProof
from modules.sync.hivemind_background import BackgroundRounds, background_attempt
from modules.sync.hivemind_checks import part_identity, run_fingerprint
from modules.sync.hivemind_dht import (
    LOOPBACK_LISTEN,
    Roster,
    SplitGuard,
    default_listen,
    install_orphan_guard,
    run_id,
    start_dht,
    stop_now,
)
from modules.sync.hivemind_dht import visible_maddrs as dht_addresses
from modules.sync.hivemind_errors import AttemptCancelled, BackendClosed
from modules.sync.hivemind_offenders import Offenders
from modules.sync.hivemind_rounds import ROUND_BITS, RoundsMixin, same_round
from modules.sync.hivemind_state import SharedStateMixin
from modules.sync.outer_deadlines import OuterDeadlines, derive

if TYPE_CHECKING:
    from modules.config import ResolvedRun

__all__ = ["AttemptCancelled", "BackendClosed", "BackgroundRounds", "HivemindOuter",
           "HivemindSettings", "background_attempt", "same_round", "settings_of"]

KEEP_RESULTS = 2
"""Overlap: the last averaged results a replica shares (a peer that failed round k fetches
it while this replica may already have completed round k + 1)."""
AVERAGER_CALL_S = 30.0
"""Longest a setting sent to the averager's process may take to apply (it takes milliseconds;
an averager whose p2pd died never answers)."""


@dataclass(frozen=True)
class HivemindSettings:
    """What the backend reads from the run's flags, resolved."""

    initial_peers: tuple[str, ...]
    host_maddrs: tuple[str, ...]
    announce_maddrs: tuple[str, ...]
    client_mode: bool
    run: str
    """Run id (modules.sync.hivemind_dht.run_id)."""
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
    fingerprint: str = ""
    """The model's and plan's (modules.sync.hivemind_checks.run_fingerprint): every record a
    replica writes carries it, with its part's parameter count."""
    secret: bytes = field(default=b"", repr=False)
    """The run secret (modules.control.auth.load_secret): every replica proves it holds it
    (modules.sync.hivemind_auth); empty only in tests that never start an averager."""

    @property
    def dht_flags(self) -> tuple[bool, float]:
        """start_dht's client mode and startup timeout."""
        return self.client_mode, self.timeout_s



class HivemindOuter(RoundsMixin, SharedStateMixin):
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
                             list(settings.announce_maddrs), *settings.dht_flags)
        self.addresses = dht_addresses(self.dht)
        log(self._started_line())  # before the rendezvous: the addresses to pass, early
        self.numel, self.identity = 0, ""  # `attach`: my part's size and identity (part_identity)
        self.offenders = Offenders(self.what, log, me=str(self.dht.peer_id))
        """Per peer its contributions left out here, and the peers excluded (`_note_rejected`)."""
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

    @functools.cached_property
    def proof(self) -> PeerProof:
        """Makes and checks the membership proofs of this run (my roster entry, my gather)."""
        assert self.cfg.secret, "a hivemind replica needs the run secret (settings_of)"
        return PeerProof(self.cfg.secret, self.cfg.run)

    def _started_line(self) -> str:
        """The line that says the DHT is up and how other replicas join through it."""
        if self.cfg.client_mode:  # it accepts no connections: its addresses lead nowhere
            return (f"hivemind DHT up (run id {self.cfg.run}) in --client-mode: other replicas "
                    "cannot join through this one; give them a full peer's --initial-peers")
        # the addresses end the line: launchers and people copy them from there
        local = (", listening on this host's loopback only (give --host-maddrs "
                 "/ip4/0.0.0.0/tcp/0 to take replicas from other hosts)"
                 if self.cfg.host_maddrs == (LOOPBACK_LISTEN,) else "")
        return (f"hivemind DHT up (run id {self.cfg.run}){local}; other replicas can join "
                f"with --initial-peers {','.join(self.addresses)}")

    def attach(self, numel: int, outer: OuterState, joining: bool = False) -> None:
        """Create the averager for a stage of `numel` values whose outer state is `outer` now;
        a joiner enters the roster only once it has loaded the state (`join`)."""
        from modules.sync.hivemind_exact import CodecWire, ExactAverager

        cfg = self.cfg
        self.numel, self.identity = numel, part_identity(cfg.fingerprint, self.part, numel)
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
            state_fn=self._shared, proof=self.proof,
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
                             self.log, client_mode=cfg.client_mode, identity=self.identity,
                             proof=self.proof)
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
        self._need_full_peer()

    def _need_full_peer(self) -> None:
        """--client-mode: PeerError unless a replica that accepts connections is in the
        roster (a client alone averages with nobody, and would train solo to exit 0)."""
        if self.cfg.client_mode and not self.roster.peers(sharing=True):
            given = ",".join(self.cfg.initial_peers) or "(none)"
            raise PeerError(f"--client-mode: no replica without --client-mode of run "
                            f"{self.cfg.run} {self.what} is in the DHT (waited "
                            f"{self.cfg.timeout_s:g} s, --timeout-s); a client averages only "
                            "through such a peer: start one, and pass its address as "
                            f"--initial-peers (given: {given})")

    def _note_rejected(self, index: int, gathered: dict) -> None:
        """Name each replica whose contribution to round `index` my averager left out
        (ExactAverager marks it in the gathered data: wrong size, non-finite, norm bound), and
        tell the averager's process of the peers excluded now (hivemind_offenders): its
        reducers leave their parts out from the next round on. Not waited for (as `_reach`):
        the pipe's commands start in order, so the next round's sees it, and the round that
        just completed must not fail here on a slow averager process."""
        excluded = self.offenders.note(index, gathered)
        if excluded and self.averager is not None:
            self.averager._outer_pipe.send(("_exclude_peers", [excluded], {}))

    def _reach(self, index: int) -> None:
        """Tell the averager this rank is at round `index` or past it: roster groups' parts
        for it or an earlier round are refused at once from now (ExactAverager._round_reached)."""
        self.averager._outer_pipe.send(("_reach_round", [index], {}))

    def _set_group_size(self, size: int, minimum: int) -> None:
        """Groups form once `size` replicas are in, at the deadline with `minimum` or more."""
        self._in_averager("_set_group_size", size=size, minimum=minimum)

    def _in_averager(self, method: str, **kwargs: Any) -> None:
        """Run the averager's `method` in its process (through its control pipe, as hivemind
        runs its own) and wait for it to finish (at most AVERAGER_CALL_S); PeerError naming the
        averager's process when it does not answer (it died, or its p2pd did: seen)."""
        from hivemind.utils.mpfuture import MPFuture

        future = MPFuture()
        self.averager._outer_pipe.send((method, [], {**kwargs, "future": future}))
        try:
            future.result(timeout=AVERAGER_CALL_S)
        except FutureTimeout:
            proc = self.averager
            how = (f"ended (exit code {proc.exitcode})" if not proc.is_alive() else
                   "is alive but stuck (its p2pd or the DHT process may have died)")
            raise PeerError(f"this replica's hivemind averager process (pid {proc.pid}) did not "
                            f"answer {method.strip('_')} within {AVERAGER_CALL_S:g} s: it "
                            f"{how}; its outer sync cannot go on") from None

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

    def abort(self) -> None:
        """The rank's emergency exit (it os._exits next; any thread, no lock): the DHT and
        averager processes and their p2pd stop now, silently
        (modules.sync.hivemind_dht.stop_now)."""
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



def quiet_hivemind() -> None:
    """hivemind's own log lines (a traceback per failed matchmaking attempt) off unless
    $HIVEMIND_LOGLEVEL asks for them: this backend says what failed, and why, in one line."""
    if "HIVEMIND_LOGLEVEL" not in os.environ:
        from hivemind.utils.logging import get_logger

        get_logger("hivemind")  # its handler and level are set up once, here, not later
        logging.getLogger("hivemind").setLevel(logging.CRITICAL)
        # hivemind's own asyncio tasks end with exceptions nobody retrieves when a peer dies
        # mid-round ("Task exception was never retrieved", a traceback each, seen 4 times on
        # the survivor of a killed replica); the DHT and averager processes inherit this
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)


def settings_of(run: ResolvedRun, secret: bytes) -> HivemindSettings:
    """HivemindSettings from a resolved run (its settings' `hivemind` component and plan) and
    the run secret (modules.control.auth.load_secret)."""
    cfg, plan = run.cfg, run.plan
    hv = cfg.hivemind
    agreed = {"plan": plan.to_dict(), "compression": plan.sync.compression}
    peers = parse_maddrs(hv.initial_peers, "--initial-peers")
    return HivemindSettings(
        initial_peers=tuple(peers),
        host_maddrs=tuple(parse_maddrs(hv.host_maddrs, "--host-maddrs", need_peer_id=False)
                          or default_listen(peers)),
        announce_maddrs=tuple(parse_maddrs(hv.announce_maddrs, "--announce-maddrs",
                                           need_peer_id=False)),
        client_mode=hv.client_mode, run=run_id(agreed, hv.run_id), timeout_s=cfg.timeout_s,
        heartbeat_s=cfg.elastic.heartbeat_timeout_s, min_replicas=run.min_replicas,
        compression=plan.sync.compression,
        fingerprint=run_fingerprint(plan.to_dict(), plan.sync.compression),
        starting=len(run.start_replicas or range(plan.num_replicas)),
        matchmaking_s=hv.matchmaking_timeout_s, averaging_s=hv.averaging_timeout_s,
        secret=secret)
