"""The hivemind outer backend's named errors (modules.sync.hivemind_outer)."""

from __future__ import annotations

from modules.comm import PeerError


class BackendClosed(PeerError):
    """A round cut short because the rank is stopping (`HivemindOuter.close`, e.g. Ctrl+C)."""

    def __init__(self, index: int, what: str) -> None:
        super().__init__(f"outer round {index + 1} of {what} stopped: the rank is shutting "
                         "down its hivemind outer sync")


class AttemptCancelled(PeerError):
    """A matchmaking attempt given up by this rank before its deadline: the round was completed
    by others, or fewer replicas are live than the attempt waited for (no deadline's fault)."""
