"""How a rank ends on a failure: a step that diverged, a lost peer, a fatal error on any thread
(the heartbeat's verdict, SIGTERM): say why, save what can be saved, leave with a status."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from modules.comm import PeerError
from modules.comm.errors import first_line
from modules.control.elastic import Membership
from modules.train.checkpoint import check_finite_state

if TYPE_CHECKING:
    from modules.sync.hivemind_outer import HivemindOuter


class TrainingDiverged(Exception):  # noqa: N818 - the name says what happened
    """A non-finite loss or parameter: the run stops (exit 1) after saving the last finite
    state. Not a RuntimeError, which the loop reads as a lost peer."""


def check_finite(loss: float | None, named: Iterable[tuple[str, torch.Tensor]],
                 step: int) -> None:
    """TrainingDiverged when the loss, parameters or gradients of step `step` (1-based) hold
    NaN/inf (checked before the update: the model and optimizer still hold the last finite
    state)."""
    why = check_finite_state(loss, named)
    if why is not None:
        raise TrainingDiverged(f"step {step}: {why}")


class Failures:
    """A rank's way out: the fatal exit (any thread) and the error a failed step ends with."""

    def __init__(self, rank: int, replica: int, membership: Membership,
                 emergency: Callable[[], str | None], log=print,
                 hivemind: HivemindOuter | None = None) -> None:
        """`emergency`: saves what can be saved and says what it saved (the checkpointing's
        emergency save); `hivemind`: its processes are stopped before this one exits."""
        self.rank, self.replica, self.membership = rank, replica, membership
        self.emergency, self.log, self.hivemind = emergency, log, hivemind

    def fatal(self, reason: str, status: int = 1) -> None:
        """Say why, checkpoint what can be checkpointed, and leave with `status` (any thread)."""
        print(f"rank {self.rank}: error: {reason}\n", end="", file=sys.stderr, flush=True)
        try:
            saved = self.emergency()
        except Exception as e:  # never let a failed save keep a dying rank alive
            saved = f"no checkpoint ({type(e).__name__}: {e})"
        if saved:
            self.log(saved)
        sys.stdout.flush()
        sys.stderr.flush()
        if self.hivemind is not None:  # its processes stop first, so none sees this one die
            self.hivemind.abort()
        os._exit(status)

    def peer(self, e: RuntimeError, step: int) -> PeerError:
        """The error to end the run with after a failed step (`step`: the steps done): the
        heartbeat first gets time to name the lost peer (it exits the process then)."""
        if not isinstance(e, PeerError):
            e = PeerError(f"step {step + 1}: {first_line(e)}")
        if not e.diagnosed:
            self.membership.await_verdict()
        if self.membership.dropped:
            self.membership.finish()  # rank 0: host the store until the others are done
            return PeerError(f"my replica {self.replica} was dropped at step {step}; "
                             "the store was kept up until the other replicas finished")
        return e
