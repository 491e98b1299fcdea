"""Matchmaking and averaging deadlines of the hivemind outer backend, from the plan.

The simulator's kernel predicts one outer all-reduce of this stage's payload (its fp32, fp16 or
int8 bytes) over the stage group's ring on the cluster's links
(scheduler.simulator.collectives.ring_allreduce_time over ring_order): `predicted_s`. Then

    averaging   = max(AVERAGING_FLOOR_S,   AVERAGING_FACTOR   x predicted_s)
    matchmaking = max(MATCHMAKING_FLOOR_S, MATCHMAKING_FACTOR x predicted_s)

Why these numbers: hivemind's butterfly all-reduce puts the same bytes on each link as a ring
(2 (W-1)/W of the payload per peer), so the prediction is the right order; the factor 4 covers
what the kernel does not model (protobuf framing, the codec on the CPU, TCP slow start on a
fresh stream, one retry of a lost part) and keeps a link that has become 4x slower than the
cluster file says from failing rounds. Matchmaking is DHT round trips, not bytes: on loopback a
bare averager of gpt-tiny took 0.29-0.99 s per round here (issue 23), most of it matchmaking,
and several seconds on a loaded 2-core machine, so its floor (5 s) is 5x the slowest measured
round; the averaging floor (10 s) keeps tiny payloads from timing out on a busy host. Without
a cluster file (no --cluster) there is no prediction and the floors apply; the start line says
which. --matchmaking-timeout-s / --averaging-timeout-s override either.

An attempt that failed after waiting out its matchmaking deadline widens both deadlines (and
the request timeout) WIDEN_FACTOR times for the next attempt, up to MAX_WIDEN times the
derived ones and never so far that one attempt outlasts --timeout-s
(`OuterDeadlines.widened`); a completed round narrows them back one step when it took under
half of what the narrower deadlines allow (`narrowed`). Why: the
deadlines are derived from the links, but what stretches a round in practice is the host's
load (a 2-core host at load 47 failed every matchmaking of a round for 90 s with the floors);
an attempt that failed for that reason fails again with the same deadlines, one twice as
long gets through, and narrowing only with that headroom keeps a loaded host from failing
every other round. An attempt that failed at once (a dead replica still in the roster) is no
deadline's fault: widening then only made the survivors' next group wait twice as long for
the dead one (the fault row's stall went from 5.3 to 12.3 s).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from formats.cluster import Cluster
from formats.plan import Plan
from scheduler.simulator import (
    LinkTables,
    SimConfig,
    payload_bytes_per_param,
    ring_allreduce_time,
    ring_order,
)

MATCHMAKING_FLOOR_S = 5.0
MATCHMAKING_FACTOR = 4.0
AVERAGING_FLOOR_S = 10.0
AVERAGING_FACTOR = 4.0
REQUEST_TIMEOUT_S = 3.0
"""hivemind's wait for a leader's answer in matchmaking (at most half the matchmaking
deadline: hivemind asks for it to be smaller), widened with the deadlines."""
WIDEN_FACTOR = 2.0
MAX_WIDEN = 8.0


@dataclass(frozen=True)
class OuterDeadlines:
    """The two deadlines of one outer round and where they came from."""

    matchmaking_s: float
    """Longest wait for the round's group to form (one attempt)."""
    averaging_s: float
    """Longest all-reduce once the group is formed."""
    predicted_s: float | None
    """The simulator's outer all-reduce time (None: no cluster file)."""
    source: str
    """How they were chosen, for the start line."""
    widen: float = 1.0
    """How many times the derived deadlines these are (after failed attempts)."""
    max_widen: float = 1.0
    """The most `widened` goes to (1: never; `derive` sets it from --timeout-s)."""

    def describe(self) -> str:
        """The start line's text."""
        widening = (f"; widened up to {self.max_widen:g}x when an attempt misses them"
                    if self.max_widen > 1 else "; never widened: --timeout-s leaves no room")
        return (f"matchmaking deadline {self.matchmaking_s:.2f} s, averaging deadline "
                f"{self.averaging_s:.2f} s ({self.source}{widening})")

    @property
    def request_s(self) -> float:
        """hivemind's request timeout in matchmaking under these deadlines."""
        return min(REQUEST_TIMEOUT_S * self.widen, self.matchmaking_s / 2)

    @property
    def widest(self) -> OuterDeadlines:
        """These deadlines widened as far as they go."""
        return self._at(self.max_widen)

    def widened(self) -> OuterDeadlines:
        """The next attempt's deadlines after a failed one (self when at the widest)."""
        return self._at(min(self.max_widen, self.widen * WIDEN_FACTOR))

    def narrowed(self, took_s: float) -> OuterDeadlines:
        """The next round's deadlines after one that completed in `took_s`: one step
        narrower when that took under half the narrower ones' matchmaking + averaging."""
        if self.widen <= 1.0:
            return self
        narrower = self._at(max(1.0, self.widen / WIDEN_FACTOR))
        return narrower if took_s < (narrower.matchmaking_s + narrower.averaging_s) / 2 else self

    def _at(self, widen: float) -> OuterDeadlines:
        """These deadlines at `widen` times the derived ones."""
        scale = widen / self.widen
        return replace(self, matchmaking_s=self.matchmaking_s * scale,
                       averaging_s=self.averaging_s * scale, widen=widen)


def predicted_outer_s(plan: Plan, cluster: Cluster, stage: int, numel: int,
                      compression: str, shard: int = 0) -> float:
    """Seconds the kernel predicts for one all-reduce of `numel` values of stage `stage` (its
    shard `shard` with shard groups) over that group's ring on `cluster`'s links."""
    config = SimConfig()
    tables = LinkTables(cluster, config)
    group = np.array(plan.shard_peers(stage, shard), dtype=np.int64)
    if len(group) < 2:
        return 0.0
    payload = numel * payload_bytes_per_param(compression, config.int8_block)
    order = ring_order(group, tables.lat_s, tables.bits_per_s, payload / len(group))
    nxt = np.roll(order, -1)
    return ring_allreduce_time(tables.collective_lat_s[order, nxt],
                               tables.bits_per_s[order, nxt], payload)


def derive(plan: Plan, cluster: Cluster | None, stage: int, numel: int, compression: str,
           matchmaking_s: float | None = None, averaging_s: float | None = None,
           shard: int = 0, timeout_s: float | None = None) -> OuterDeadlines:
    """The deadlines of this stage's (shard's) rounds (overrides win), widening after failed
    attempts up to MAX_WIDEN x but no attempt longer than `timeout_s` (--timeout-s; None: no
    widening). See the module docstring."""
    predicted = (predicted_outer_s(plan, cluster, stage, numel, compression, shard)
                 if cluster is not None else None)
    base = predicted or 0.0
    match = max(MATCHMAKING_FLOOR_S, MATCHMAKING_FACTOR * base)
    avg = max(AVERAGING_FLOOR_S, AVERAGING_FACTOR * base)
    if predicted is None:
        source = "no --cluster: floors"
    else:
        source = (f"predicted outer all-reduce {predicted:.3f} s of {numel} values "
                  f"({compression}) x {AVERAGING_FACTOR:g}, floors {MATCHMAKING_FLOOR_S:g}/"
                  f"{AVERAGING_FLOOR_S:g} s")
    if matchmaking_s is not None or averaging_s is not None:
        source += "; overridden by flag"
    match = matchmaking_s if matchmaking_s is not None else match
    avg = averaging_s if averaging_s is not None else avg
    most = 1.0 if timeout_s is None else min(MAX_WIDEN, max(1.0, timeout_s / (match + avg)))
    return OuterDeadlines(match, avg, predicted, source, max_widen=most)
