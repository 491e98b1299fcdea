"""The runtime's wire protocol outside the tensors: every key it reads or writes in the
rendezvous TCPStore (hosted by rank 0, or by the coordinator process with `--coordinator`) and
every point-to-point tag, named once. Control records (generations and their counter, info,
heartbeats, done, join, the coordinator's and the run's records, commit confirmations and
decisions, a joiner's source, checkpoint steps) are signed with the run secret
(modules.control.auth); arrival flags, commit confirmations, device records, NCCL ids and
process-group keys go under names only the run can compute (modules.control.hidden).

Ranks are device ids of the plan. Keys by who writes them:
- every rank: `ft/info/{rank}` (host, pid, role; named in failure messages), `ft/hb/{rank}`
  (heartbeat counter), `ft/done/{rank}` (finished: not missed), `ft/join/{rank}` (asks to join),
  `comm/device/{rank}` (device kind, GPU and host: the backend choice per group);
- the leader only (rank 0, or the coordinator): the generations `ft/gen/{g}` (JSON) and the
  counter `ft/gen` (the newest g);
- with --stop-at-loss, at each evaluation step N: `run/stop/{N}` (the decision), claimed by the
  reporting rank of the lowest live replica, or by a rank that waited for it in vain;
- the coordinator: `coord/info` (its host, pid and plan) when it starts; the first rank that
  reaches it: `coord/run` (the run settings the coordinator leads by; the others check theirs);
- the members of a DiLoCo outer step: arrival `.../stage{s}/outer{k}/{rank}` and the commit
  keys `.../outer{k}/done/{rank}` and `.../outer{k}/decision`; the live rank that hands the
  outer state to a joiner: `ft/src/g{g}/s{s}`;
- process groups: generation g's default group under the prefix `gen{g}`; an NCCL
  communicator's members meet under `comm/{name}/{ranks}/arrived/{rank}`, then read its unique
  id from `comm/{name}/{ranks}/nccl-unique-id`.

The communicators' own keys (`comm/...`, and `member_key` for any arrival) are named in
modules.comm.keys, below this layer, so modules.comm never imports modules.control.
"""

from __future__ import annotations

# -- point-to-point tags (gloo matches a pair's messages by tag; NCCL by order) ----------------
FWD_TAG = 0
"""Activations of micro-batch m: FWD_TAG + m."""
BWD_TAG = 1 << 20
"""Gradients of micro-batch m: BWD_TAG + m."""
JOIN_TAG = 1 << 22
"""Outer state to a joining replica: header, outer model, momentum = JOIN_TAG + 0, 1, 2."""

# -- failure detection and membership (control.fault, control.leader, control.elastic) ----
GENERATION_COUNTER = "ft/gen"
"""The newest published generation number."""
COORDINATOR_INFO = "coord/info"
"""JSON of the coordinator process: host, pid and the pipelines of its plan."""
RUN_SETTINGS = "coord/run"
"""JSON of the run settings the coordinator leads by (set once, by the first rank to arrive)."""
RUN_AGREED = "run/agreed"
"""JSON of the per-rank settings every rank must share (tokenizer identity, pipeline payload,
the DiLoCo schedule's overrides): set once, by the first rank whose store answers
(modules.control.agreement)."""


def stop_key(step: int) -> str:
    """--stop-at-loss: JSON of the decision at evaluation step `step` (stop, the validation
    loss and replica that decided it), claimed once (the first signed record is the run's;
    modules.train.stopping)."""
    return f"run/stop/{step}"


def info_key(rank: int) -> str:
    """JSON record of a rank's host, pid, replica and stage."""
    return f"ft/info/{rank}"


def heartbeat_key(rank: int) -> str:
    """A rank's heartbeat counter (bumped about every second)."""
    return f"ft/hb/{rank}"


def done_key(rank: int) -> str:
    """Counter > 0 once a rank finished its run (its silence is then not a loss)."""
    return f"ft/done/{rank}"


def left_key(rank: int) -> str:
    """The generation at which a rank of a dropped replica read that it was dropped (it
    leaves then): the store's host waits for it before it exits (leader.Departures)."""
    return f"ft/left/{rank}"


def join_key(rank: int) -> str:
    """Counter > 0 while a rank asks to join (the leader resets it to 0 once admitted)."""
    return f"ft/join/{rank}"


def checkpoint_key(rank: int) -> str:
    """A rank's newest complete checkpoint step (-1: none): the oldest over the live ranks
    is never pruned (modules.train.checkpoint.shared_floor)."""
    return f"ckpt/last/{rank}"


def generation_key(gen: int) -> str:
    """JSON of generation `gen` (members, replicas, dropped, joined, reason, stop)."""
    return f"ft/gen/{gen}"


def generation_prefix(gen: int) -> str:
    """PrefixStore of generation `gen`'s default process group."""
    return f"gen{gen}"


def join_source_key(gen: int, stage: int, shard: int = 0) -> str:
    """Device id of the live rank that sends the outer state of `stage` (its shard `shard`,
    with shard groups) to joiners in `gen`."""
    return f"ft/src/g{gen}/s{stage}" + (f".{shard}" if shard else "")


# -- DiLoCo outer steps (modules.control.elastic) ------------------------------------------
def outer_arrival_prefix(stage: int, outer: int, gen: int | None = None) -> str:
    """Prefix of the arrival keys of outer step `outer` of `stage` (per generation when
    elastic); a rank announces itself under `modules.comm.keys.member_key(prefix, rank)`."""
    where = f"g{gen}/" if gen is not None else ""
    return f"diloco/{where}stage{stage}/outer{outer}"


def commit_prefix(gen: int, outer: int) -> str:
    """Prefix of the commit of outer step `outer` in generation `gen` (every stage together)."""
    return f"diloco/g{gen}/outer{outer}"


def commit_done_key(prefix: str, rank: int) -> str:
    """A rank finished its all-reduce of the outer step."""
    return f"{prefix}/done/{rank}"


def commit_decision_key(prefix: str) -> str:
    """`commit` or `abort`, written once by whoever decides first (compare_set)."""
    return f"{prefix}/decision"
