"""Repeat offenders of the hivemind outer backend: a peer whose contribution to an average was
left out EXCLUDE_AFTER times here is left out of every later round here, whatever it sends.

The host (HivemindOuter, the training process) counts the offences in each round's gathered
data (`Offenders.note`) and sends the peers it excludes to its averager's process
(`ExclusionMixin._exclude_peers`, through the averager's control pipe); that process's
reducers then leave the excluded senders' parts out (`screened`). Each replica decides alone,
from what its own reducers saw: there is no vote, and nothing to agree on, since a left-out
part changes no member's result apart from the others' (every member decodes the same means).
An excluded peer stays in the groups and still receives the means (it learns the average;
keeping it out of the groups would need every replica to agree on the exclusion)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from modules.sync.hivemind_checks import contribution_faults

EXCLUDE_AFTER = 3
"""Offences (rounds in which a peer's contribution was left out here) after which it is left out
of every later round. Not 1: an honest replica can send one bad part (a garbled message, a
step that diverged once and recovered). Not more: a peer caught three times is no mishap, and
until it is excluded each poisoned part is left out anyway, so a low count costs little while a
peer that poisons now and then, then sends plausible values (under the norm bound), is
stopped after its third bad round."""
EXCLUDED = f"excluded after {EXCLUDE_AFTER} offences"
"""Why an excluded peer's part is left out (its reducer's `rejected` reason)."""


def screened(parts: dict[int, torch.Tensor | None], numel: int, me: int | None,
             excluded: set[int]) -> dict[int, str]:
    """Sender -> why its part of one chunk is left out: EXCLUDED for the `excluded` senders,
    else hivemind_checks.contribution_faults among the others (an excluded sender's part is
    no reference for the norm bound either)."""
    kept = {i: t for i, t in parts.items() if i not in excluded or i == me}
    faults = contribution_faults(kept, numel, me)
    faults.update({i: EXCLUDED for i in parts if i not in kept})
    return faults


class Offenders:
    """Per peer (base58) the rounds whose contribution was left out here, and the peers
    excluded (the host's count: HivemindOuter._note_rejected)."""

    def __init__(self, what: str, log: Callable[[str], None], me: str = "") -> None:
        """`what`: how messages name the averaged part; `me`: my own peer id (never excluded:
        with three or more parts the median can leave an honest reducer's own part out)."""
        self.what, self.log, self.me = what, log, me
        self.counts: dict[str, int] = {}
        self.excluded: set[str] = set()

    def note(self, index: int, gathered: dict) -> list[str]:
        """Name each peer whose contribution to round `index` my averager left out (it marks
        them in the gathered data: wrong size, non-finite, norm bound), count it, and say once
        when a peer reaches EXCLUDE_AFTER; the peers to exclude from now on."""
        newly = []
        for v in gathered.values():
            why = v.get("rejected") if isinstance(v, dict) else None
            if not why:
                continue
            peer = str(v.get("peer", "?"))  # set by my averager (the replica is the sender's word)
            if peer in self.excluded:  # left out as excluded: said once, when it was
                continue
            n = self.counts[peer] = self.counts.get(peer, 0) + 1
            replica = str(v.get("replica"))[:20]
            self.log(f"outer round {index + 1} of {self.what}: left out the contribution of "
                     f"replica {replica} (peer {peer}) to the chunks reduced here: "
                     f"{str(why)[:200]} ({n} time(s) so far)")
            if n >= EXCLUDE_AFTER and peer != self.me and peer != "?":
                self.excluded.add(peer)
                newly.append(peer)
                self.log(f"outer round {index + 1} of {self.what}: excluding peer {peer} "
                         f"(replica {replica}) from the average: {n} contributions left out "
                         "here; its parts are left out of every later round here, whatever "
                         "they hold (it still receives the average)")
        return newly


class ExclusionMixin:
    """ExactAverager's excluded peers, in the averager's process."""

    _excluded: frozenset[str] = frozenset()
    """(averager process) Peers (base58) whose parts my reducers leave out (`screened`)."""

    async def _exclude_peers(self, peers: list[str], future: Any = None) -> None:
        """(averager process) Leave `peers`' parts out of every later round here (`future`,
        if given, is told when done)."""
        self._excluded = self._excluded | set(peers)
        if future is not None:
            future.set_result(None)
