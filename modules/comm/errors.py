"""The runtime's failure types for peers and communication (exit status 1 in dist_runner)."""

from __future__ import annotations

from collections.abc import Sequence


class PeerError(RuntimeError):
    """A peer, a group or the rendezvous did not answer within the timeout, or left the run
    (dist_runner exits with status 1 and this message)."""

    def __init__(self, message: str, *, diagnosed: bool = False) -> None:
        super().__init__(message)
        self.diagnosed = diagnosed
        """True when the message already names the lost peer: nobody needs to wait for the
        heartbeat's verdict."""


class CommError(PeerError):
    """A communicator call failed or timed out; the message and fields name the operation and
    the peer(s) it waited for."""

    def __init__(self, message: str, *, op: str = "", peers: Sequence[int] = (),
                 diagnosed: bool = False) -> None:
        super().__init__(message, diagnosed=diagnosed)
        self.op = op
        """What was being done, e.g. `activations of micro-batch 2`."""
        self.peers = tuple(peers)
        """Global ranks that did not answer (all other members for a collective)."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's text (at most 300 characters), else its type name."""
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def no_answer(op: str, peers: Sequence[int], timeout_s: float,
              cause: BaseException | str | None = None) -> CommError:
    """The error of an operation whose peer(s) did not answer within `timeout_s`."""
    who = f"rank {peers[0]}" if len(peers) == 1 else f"rank(s) {list(peers)}"
    reason = first_line(cause) if isinstance(cause, BaseException) else cause
    tail = f" ({reason})" if reason else ""
    return CommError(f"{op}: no answer from {who} within {timeout_s:g} s{tail}", op=op,
                     peers=peers)
