"""One outer round of the hivemind backend (modules.sync.hivemind_outer's HivemindOuter):
the roster's group first, matchmaking attempts after, until a group averaged the round or
--timeout-s passed. A mixin: the state it reads (deadlines, roster, averager) is
HivemindOuter's."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from modules.comm import PeerError
from modules.sync.hivemind_checks import STATE_SOURCES
from modules.sync.hivemind_dht import RunMismatch, first
from modules.sync.hivemind_errors import AttemptCancelled, BackendClosed
from modules.sync.hivemind_state import JOIN_ATTEMPTS
from modules.sync.outer_deadlines import OuterDeadlines

ROUND_BITS = 16
"""Group bits carrying the round number (mod 2^16): peers of different rounds never match."""


class RoundsMixin:
    """HivemindOuter's rounds: `_round` and the attempts it makes (`_fixed`, `_step`)."""

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
                    raise self._too_few(index, live)
                time.sleep(0.5)
                continue
            if live == {self.replica} and self.whole and not self.catching_up:
                self._need_full_peer()  # a client alone averages with nobody
                if self.last_group != live or not self.rounds_s:
                    self.log(f"outer round {index + 1} of {self.what}: alone in the DHT "
                             "roster; my rounds are the mean of my own until others join")
                return [self.replica]
            t1, deadlines = time.monotonic(), self.deadlines
            try:
                if fixed:
                    return self._fixed(index, live, weight)
                return self._matchmade(index, live, weight, len(live) if every_live else 2)
            except RunMismatch:  # another run in the group: no attempt can succeed
                raise
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

    def _matchmade(self, index: int, live: set[int], weight: float, need: int) -> list[int]:
        """Round `index` averaged in a group matched by hivemind, of at least `need` of the
        `live` replicas: its replicas (raises when no such group averaged it)."""
        d = self.deadlines
        gathered = self._matched(index, self._step(index, live, weight, need, wait=False,
                                                   timeout=d.matchmaking_s + d.averaging_s),
                                 need)
        group = same_round(gathered, index, self.identity)
        self._note_rejected(index, gathered)
        return group

    @property
    def longest_wait_s(self) -> float:
        """The longest this part of a replica can spend in one outer round (attempts until
        --timeout-s, one more, its recovery or a background fetch until --timeout-s again) or
        in --join: how long the other parts of its replica wait for it to agree on a step."""
        if self.deadlines is None:  # not attached yet: nothing derived
            return self.cfg.timeout_s
        d = self.deadlines.widest
        attempt = d.matchmaking_s + d.averaging_s + 5.0  # a fixed group's result waits +5 s
        # a state download tries up to STATE_SOURCES peers, each within the averaging deadline
        download = STATE_SOURCES * d.averaging_s + 1.0
        rounds = 2 * self.cfg.timeout_s + attempt + 2 * d.averaging_s + download
        return max(rounds, JOIN_ATTEMPTS * (download + min(5.0, d.matchmaking_s)))

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
        self._note_rejected(index, gathered)
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

    def _too_few(self, index: int, live: set[int]) -> PeerError:
        """Round `index` found fewer live replicas than --min-replicas for --timeout-s."""
        cfg, strangers = self.cfg, len(self.roster.unproven)
        hint = (f"; {strangers} roster entr(ies) there prove no membership (another run "
                "secret?): start every replica with the same ST_RUN_SECRET" if strangers else "")
        return PeerError(f"outer round {index + 1} of {self.what}: only replicas "
                         f"{sorted(live)} were live in the DHT for {cfg.timeout_s:g} s "
                         f"(--timeout-s), fewer than --min-replicas {cfg.min_replicas}{hint}")

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
        me = str(self.dht.peer_id)
        return self.averager.step(gather={"replica": self.replica, "round": index,
                                          "id": self.identity, "proof": self.proof.of(me)},
                                  weight=weight, allow_retries=False, **kwargs)


def same_round(gathered: dict, index: int, identity: str | None = None) -> list[int]:
    """The replicas of a matched group of round `index`; PeerError when a member was at
    another round. Every member gets every member's gathered data, so each refuses the
    same group and none applies its average. Why: a joiner whose host had given up on a
    round (its peers completed it without it) still had that round's step in its averager's
    matchmaking, and the others' next round matched it (seen: {'replica': 2, 'round': 31}
    in round 32's group, whose three members then held different outer models)."""
    if identity is not None:
        other = [v for v in gathered.values() if v.get("id") != identity]
        if other:
            raise RunMismatch(f"replica {other[0].get('replica')} of the group that formed is "
                              f"another run on --run-id (fingerprint "
                              f"{str(other[0].get('id'))[:16]}, this one {identity}): a "
                              "different model, plan or sync settings; give each run its own "
                              "--run-id")
    rounds = sorted({int(v.get("round", -1)) for v in gathered.values()})
    if rounds != [index]:
        raise PeerError(f"the group that formed mixed rounds {[r + 1 for r in rounds]}; "
                        "its average is not applied")
    return [int(v["replica"]) for v in gathered.values()]
