"""--stop-at-loss: the one decision, per evaluation, whether every rank ends the run after it.

The validation loss is known only on a replica's last stage, and in DiLoCo each replica has its
own between outer steps, so one rank decides: the reporting rank (last stage, shard 0) of the
lowest live replica. It claims its decision in the run's store under the step's key
(modules.control.protocol.stop_key; signed, modules.control.auth); every other rank waits for
that record. A rank that waited --timeout-s in vain (the deciding replica lost or stuck) claims
"go on" instead: the first signed record is the run's, so all ranks still read one decision.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from modules.config import RunConfig
from modules.control.protocol import stop_key


@dataclass(frozen=True)
class StopDecision:
    """What the run agreed at one evaluation step."""

    stop: bool
    """Every rank ends the run after this step."""
    val_loss: float | None
    """The deciding replica's validation loss (None: nobody decided in time)."""
    replica: int | None
    """The replica whose loss decided (None: nobody decided in time)."""

    def to_json(self) -> str:
        """The store record."""
        return json.dumps({"stop": self.stop, "val_loss": self.val_loss,
                           "replica": self.replica})

    @staticmethod
    def from_json(text: str) -> StopDecision:
        """A store record back (signed by this run, so well formed)."""
        d = json.loads(text)
        return StopDecision(bool(d["stop"]), d.get("val_loss"), d.get("replica"))


class StopAtLoss:
    """One rank's side of --stop-at-loss (`target`), decided from step `min_steps` on."""

    def __init__(self, store: Any, target: float, min_steps: int, timeout_s: float,
                 log=print) -> None:
        """`store`: the run's signed store (modules.control.auth.AuthStore); `timeout_s`: how
        long a rank waits for the deciding rank's record."""
        self.store, self.target, self.min_steps = store, target, min_steps
        self.timeout_s, self.log = timeout_s, log

    def due(self, step: int) -> bool:
        """Whether an evaluation at `step` decides (every rank alike: a pure function)."""
        return step >= self.min_steps

    def decide(self, step: int, val_loss: float | None, replica: int) -> StopDecision:
        """The deciding rank: claim this step's decision from my validation loss; returns
        the run's (mine, unless a waiting rank gave up on me first). RuntimeError when the
        store does not answer."""
        mine = StopDecision(val_loss is not None and val_loss <= self.target, val_loss, replica)
        return StopDecision.from_json(self.store.claim(stop_key(step), mine.to_json()))

    def follow(self, step: int, decider: int) -> StopDecision:
        """Every other rank: the decision of `step`, waited for up to timeout_s; then "go on"
        claimed for everyone (`decider`: the replica named when it never came). RuntimeError
        when the store does not answer."""
        key = stop_key(step)
        try:
            return StopDecision.from_json(self.store.wait_signed(key, self.timeout_s))
        except RuntimeError:  # timed out (or a forged record): give up on the decider
            pass
        got = StopDecision.from_json(self.store.claim(key, StopDecision(False, None,
                                                                        None).to_json()))
        if got.replica is None:
            self.log(f"step {step}: no --stop-at-loss decision from replica {decider} within "
                     f"{self.timeout_s:g} s; going on (every rank alike)")
        return got

    def stop_line(self, step: int, decision: StopDecision) -> str:
        """The log line of a stop, the same on every rank."""
        return (f"step {step}: validation loss {decision.val_loss:.6g} <= --stop-at-loss "
                f"{self.target} (replica {decision.replica}): stopping")


def stop_at_loss(cfg: RunConfig, store: Any, log=print) -> StopAtLoss | None:
    """This rank's side of the run's --stop-at-loss (None without the flag)."""
    data = cfg.data
    if data.stop_at_loss is None:
        return None
    return StopAtLoss(store, data.stop_at_loss, data.min_steps, cfg.timeout_s, log)
