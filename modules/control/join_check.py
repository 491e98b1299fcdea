"""`--join` of a replica that is still running: refused at once, by name.

A joiner asks the leader to admit its replica; while that replica is a live member of the
run, nobody ever admits it, so the joiner used to wait for the whole --timeout-s and end with
"not admitted" (and C++ warnings). Here the joiner looks first: when the run's newest
generation still lists its replica and this rank's heartbeat key moves under a nonce that is
not its own monitor's (another process with this rank is beating), the replica is live.
"""

from __future__ import annotations

import time
from typing import Any

from formats.errors import UserError
from modules.control.fault import parse_beat
from modules.control.leader import newest_generation, read_generation
from modules.control.protocol import heartbeat_key


def other_beats(store: Any, rank: int, mine: str, window_s: float, poll_s: float = 0.05) -> bool:
    """Whether a process other than the one with nonce `mine` beats as `rank` within
    `window_s` (its count moves: a dead rank's last beat does not count)."""
    seen: dict[str, int] = {}
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        beat = parse_beat(store.read(heartbeat_key(rank)))
        if beat is not None and beat[0] != mine:
            nonce, count = beat
            if nonce in seen and count > seen[nonce]:
                return True
            seen.setdefault(nonce, count)
        time.sleep(poll_s)
    return False


def refuse_live_join(store: Any, rank: int, replica: int, mine: str, window_s: float) -> None:
    """UserError when my replica is in the run's newest generation and another process beats
    as my rank (the replica is running; a join would wait forever)."""
    newest = newest_generation(store)
    g = read_generation(store, newest) if newest >= 0 else None
    if g is None or replica not in g.replicas:
        return
    if other_beats(store, rank, mine, window_s):
        raise UserError(f"--join: replica {replica} is still running (rank {rank} of it sends "
                        "heartbeats): only a replica that left the run can join; stop its "
                        "ranks first, or start this rank without --join")
