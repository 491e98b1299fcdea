"""The hivemind backend's shared outer state (modules.sync.hivemind_outer's HivemindOuter):
what a replica publishes for peers that load state, how a failed round is recovered from a
peer that completed it, --join, and lingering after the last step. A mixin: the state it
reads (deadlines, roster, averager) is HivemindOuter's."""

from __future__ import annotations

import time

import torch

from modules.comm import PeerError
from modules.sync.diloco import OuterRoundSkipped, OuterState
from modules.sync.hivemind_checks import MAX_COUNT
from modules.sync.hivemind_dht import dht_call

JOIN_ATTEMPTS = 3
"""Tries at loading the state from a peer before a joiner gives up."""


class SharedStateMixin:
    """HivemindOuter's shared state: publishing, recovering, joining, lingering."""

    # -- recovering and joining --------------------------------------------------------------
    def _recover(self, index: int) -> OuterRoundSkipped:
        """After a failed round: another replica's state if one completed it, else skip."""
        wait_until = time.monotonic() + self.deadlines.averaging_s
        while self._best_peer_rounds() <= index and time.monotonic() < wait_until:
            time.sleep(0.5)
        if self._best_peer_rounds() > index:
            loaded = self.load_state(after_round=index)
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
        got = self._checked_state()
        if got is None:
            return None
        rounds = list(got[0].get("results", []))
        return rounds, list(got[1][2:2 + len(rounds)])

    def _checked_state(self, after_round: int = -1) -> tuple[dict, list[torch.Tensor]] | None:
        """The shared state of the most advanced live peer of my part whose state agrees with
        what this run knows (hivemind_checks.state_fault: my identity, parameter count, a
        round past `after_round`, finite values); the peers refused are named in the log.
        None when no peer's state passed in time."""
        self.roster.live()
        peers = sorted(self.roster.peers(sharing=True))
        check = {"identity": self.identity, "numel": self.numel, "after_round": after_round}
        try:
            meta, tensors, refused = self.averager.load_checked_state(
                check, peers, self.deadlines.averaging_s)
        except TimeoutError:
            return None
        for peer, why in refused:
            self.log(f"{self.what}: did not take the shared outer state of peer {peer}: {why}")
        if meta is None:
            return None
        # the checks counted values: a peer's 2-D or fp16 tensor of that size is taken flat, fp32
        return meta, [t.reshape(-1).float() if isinstance(t, torch.Tensor) else t
                      for t in tensors]

    def _declared(self, live_only: bool = False, sharing: bool = False) -> dict[bytes, float]:
        """Peer id -> the rounds that peer of my stage declared done, me excluded, of the
        peers whose roster entry proved them members (`roster.trusted`); `live_only`: only
        peers in the roster as `roster.live` last read it (`sharing`: and not in
        --client-mode)."""
        found = dht_call(self.dht, "get", f"{self.averager.prefix}.all_averagers", latest=True)
        mine = self.averager.peer_id.to_bytes()
        if found is None or not isinstance(found.value, dict):
            return {}
        # an outsider's declaration (any peer may write one) would make every replica look
        # for a state nobody has; so would a member's NaN, infinity or 2^60
        peers = self.roster.peers(sharing) if live_only else self.roster.trusted()
        known = {_peer_bytes(p) for p in peers}
        return {k: float(v.value) for k, v in found.value.items()
                if k != mine and k in known and isinstance(getattr(v, "value", None), int | float)
                and 0 <= v.value < MAX_COUNT}

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

    def load_state(self, after_round: int = -1) -> OuterState | None:
        """The outer state of the most advanced peer whose state passes the checks, past round
        `after_round` (None when none did in time: `_checked_state`)."""
        got = self._checked_state(after_round)
        if got is None:
            return None
        meta, tensors = got
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
        meta = {"run": self.cfg.run, "identity": self.identity, "outer_count": outer.outer_count,
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


def _peer_bytes(peer: str) -> bytes:
    """A peer id's bytes (the DHT's subkeys) from its base58 text (the roster's)."""
    from hivemind.p2p import PeerID

    return PeerID.from_base58(peer).to_bytes()
