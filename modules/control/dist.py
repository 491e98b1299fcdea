"""Where a rank sits in the plan, the rendezvous, and waiting for peers through the store.

Rank = device id. Everything that waits on a peer's tensors goes through a modules.comm
Communicator (built per generation by modules.control.groups), which applies the run's one timeout
and turns a silent peer into a `CommError` (a `PeerError`) naming it and the operation.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

from formats.errors import UserError
from formats.plan import Plan
from modules.comm import PeerError
from modules.comm.errors import first_line
from modules.comm.keys import member_key
from modules.control.auth import Auth, AuthStore, host_store, load_secret
from modules.control.flag_wait import FlagWaiter
from modules.control.hidden import hidden_store
from modules.control.protocol import generation_prefix


@dataclass(frozen=True)
class Topology:
    """Where this rank sits in the plan."""

    rank: int
    world_size: int
    replica: int
    stage: int
    num_stages: int
    num_replicas: int
    stage_ranks: tuple[int, ...]
    """Devices holding my stage in every replica (my data-parallel group), by replica."""
    prev_rank: int | None
    """Device of the previous stage of my replica (None on the first stage)."""
    next_rank: int | None
    """Device of the next stage of my replica (None on the last stage)."""
    ends: tuple[int, int]
    """(first-stage device, last-stage device) of my lane: they hold the tied embeddings."""
    shard: int = 0
    """My index in my stage's shard group (0 without shard groups)."""
    shard_group: tuple[int, ...] = ()
    """Devices holding my stage of my replica together (FSDP2); () without shard groups."""
    lanes: tuple[int, ...] = ()
    """The lanes I run (Plan.lanes_of): one, or L / D of them when my stage has fewer devices
    than the plan's largest shard group; () means (replica,) (no shard groups)."""
    prev_ranks: tuple[int | None, ...] = ()
    """Previous stage's device of each of my lanes (() : (prev_rank,))."""
    next_ranks: tuple[int | None, ...] = ()
    """Next stage's device of each of my lanes (() : (next_rank,))."""
    lanes_per_replica: int = 1
    """L: lanes a replica runs (the plan's largest D)."""

    @property
    def shard_degree(self) -> int:
        """D: devices per shard group (1 without shard groups)."""
        return max(1, len(self.shard_group))

    @property
    def lane(self) -> int:
        """My first lane (replica r's shard i runs lane r*D + i when every stage has D)."""
        return self.my_lanes[0]

    @property
    def my_lanes(self) -> tuple[int, ...]:
        """Every lane I run: which micro-batches I read, in the order I run them."""
        return self.lanes or (self.replica * self.shard_degree + self.shard,)

    @property
    def peers(self) -> tuple[tuple[int | None, int | None], ...]:
        """(previous, next) stage's device of each of my lanes."""
        prev = self.prev_ranks or (self.prev_rank,)
        nxt = self.next_ranks or (self.next_rank,)
        return tuple(zip(prev, nxt, strict=True))

    @property
    def is_first(self) -> bool:
        """Whether this rank runs stage 0 (reads input tokens)."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (computes the loss)."""
        return self.stage == self.num_stages - 1

    @property
    def reports(self) -> bool:
        """Whether this rank speaks for its replica: the last stage's first shard (it has the
        replica's loss; one metrics writer per replica, the --stop-at-loss decider)."""
        return self.is_last and self.shard == 0


def _stages_text(plan: Plan) -> str:
    """'2 stages', or with shard groups '2 stages of D = [2, 2] devices'."""
    text = f"{plan.num_stages} stages"
    return f"{text} of D = {plan.shard_degrees()} devices" if plan.is_sharded else text


def check_world(plan: Plan, world_size: int) -> None:
    """The plan must use device ids 0..world_size-1 exactly (rank = device id)."""
    devices = sorted(plan.devices())
    if len(devices) != world_size:
        raise UserError(f"world size {world_size} disagrees with the plan, which has "
                        f"{len(devices)} devices ({plan.num_replicas} replicas x "
                        f"{_stages_text(plan)}); pass --world-size {len(devices)} (under "
                        f"torchrun: --nnodes x --nproc-per-node = {len(devices)})")
    if devices != list(range(world_size)):
        raise UserError(f"plan devices {devices} are not 0..{world_size - 1}; rank = device id, "
                        "so the plan must use every id from 0 to world_size-1")


def topology(plan: Plan, rank: int, world_size: int) -> Topology:
    """Place `rank` in the plan (UserError when it is not there or sizes disagree)."""
    check_world(plan, world_size)
    replica, stage, shard = plan.locate(rank)
    lanes, every = plan.lanes_of(rank), plan.lanes()
    chains = [every[lane] for lane in lanes]
    chain = chains[0]
    return Topology(
        rank=rank, world_size=world_size, replica=replica, stage=stage,
        num_stages=plan.num_stages, num_replicas=plan.num_replicas,
        stage_ranks=tuple(plan.shard_peers(stage, shard)),
        prev_rank=chain[stage - 1] if stage > 0 else None,
        next_rank=chain[stage + 1] if stage + 1 < plan.num_stages else None,
        ends=(chain[0], chain[-1]), shard=shard,
        shard_group=tuple(plan.shard_group(replica, stage)) if plan.is_sharded else (),
        lanes=tuple(lanes),
        prev_ranks=tuple(c[stage - 1] if stage > 0 else None for c in chains),
        next_ranks=tuple(c[stage + 1] if stage + 1 < plan.num_stages else None for c in chains),
        lanes_per_replica=plan.lanes_per_replica,
    )


def parse_dist_url(url: str, flag: str = "--dist-url") -> tuple[str, int]:
    """`tcp://HOST:PORT` -> (host, port); UserError naming `flag` otherwise."""
    u = urlparse(url)
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme != "tcp" or not u.hostname or port is None:
        raise UserError(f"{flag}: expected tcp://HOST:PORT, got {url!r}")
    return u.hostname, port


def rendezvous(url: str, rank: int, world_size: int, timeout_s: float,
               agent_store: bool = False, members: tuple[int, ...] | None = None,
               on_store: Callable[[AuthStore], None] | None = None,
               auth: Auth | None = None, store_rank: int = 0) -> AuthStore:
    """Connect to the TCPStore at `url` (rank 0 hosts it unless `agent_store`) and init the
    gloo world group.

    Fails with PeerError within about `timeout_s` when the address is unreachable or not every
    rank joins. `agent_store`: someone else already hosts the store (torchrun's agent, or the
    coordinator process of `--coordinator`), so nobody here binds it; the world group then
    needs nothing more of rank 0 than of the others.
    `members`: the ranks that start now (default all); when fewer, the group is formed among
    them under generation 0's store prefix with ranks renumbered in ascending order, and a rank
    not among them (a later --join) only connects to the store. `on_store` runs as soon as the
    store is reachable (before the group is formed). Rank 0 listens on the url's address
    only. The store comes back as an `AuthStore`: control records signed with `auth` (the
    run secret; modules.control.auth), loaded from the environment when None. `store_rank`:
    the rank that hosts the store (rank 0; with --outer-backend hivemind the first device of
    each replica hosts its own).
    """
    timeout = timedelta(seconds=timeout_s)
    store = _connect(url, world_size, timeout_s, rank == store_rank and not agent_store,
                     store_rank)
    signed = AuthStore(store, auth if auth is not None else Auth(load_secret()))
    store = hidden_store(signed)  # the group meets under names an outsider cannot write
    if on_store is not None:
        on_store(signed)
    if members is not None and rank not in members:
        return signed
    try:
        if members is None or list(members) == list(range(world_size)):
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)
        else:
            world_size = len(members)
            dist.init_process_group("gloo", store=dist.PrefixStore(generation_prefix(0), store),
                                    rank=members.index(rank), world_size=world_size,
                                    timeout=timeout)
    except (RuntimeError, OSError) as e:
        raise PeerError(f"rendezvous: not all {world_size} ranks joined at {url} within "
                        f"{timeout_s:g} s ({first_line(e)})") from None
    return signed


def _connect(url: str, world_size: int, timeout_s: float, hosts: bool,
             store_rank: int) -> dist.TCPStore:
    """Host (`hosts`: on the url's address only) or reach the TCPStore at `url`; PeerError,
    or UserError when the address to host on is not this host's."""
    host, port = parse_dist_url(url)
    try:
        # the client retries a failed connect once after a pause as long as its timeout: half
        # the budget each keeps the whole attempt within timeout_s
        if hosts:
            store = host_store(host, port, world_size, timedelta(seconds=timeout_s / 2))
        else:
            store = dist.TCPStore(host, port, world_size, is_master=False,
                                  timeout=timedelta(seconds=timeout_s / 2),
                                  wait_for_workers=False)
        store.set_timeout(timedelta(seconds=timeout_s))
        return store
    except OSError as e:
        if e.errno != errno.EADDRNOTAVAIL or not hosts:
            what = "cannot listen on" if hosts else "cannot reach"
            raise PeerError(f"rendezvous: {what} {url} ({e.strerror or e})") from None
        raise UserError(f"--dist-url: {host} is not an address of this host, and rank "
                        f"{store_rank} listens only on the address it is given; give one of "
                        "this host's addresses, or tcp://0.0.0.0:PORT to listen on every "
                        "interface") from None
    except RuntimeError as e:
        what = "cannot listen on" if hosts else "cannot reach"
        raise PeerError(f"rendezvous: {what} {url} within {timeout_s:g} s "
                        f"({first_line(e)})") from None


def members_of(plan: Plan, replicas: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """Every device of the given replicas, ascending."""
    return tuple(sorted(d for r in replicas for s in range(plan.num_stages)
                        for d in plan.shard_group(r, s)))


def wait_for_peers(store: dist.Store, key: str, rank: int, peers: tuple[int, ...],
                   timeout_s: float, wait_forever: bool = False, log=print,
                   what: str | None = None,
                   abandon: tuple[FlagWaiter, Callable[[], bool]] | None = None) -> bool:
    """Announce `key` for `rank` in the store and wait until every peer announced it too.

    Returns True once all did. Raises PeerError naming the peers that did not arrive within
    `timeout_s`; with `wait_forever` it logs them every `timeout_s` and keeps waiting. With
    `abandon` = (waiter, moot) the wait runs whole on the waiter's own store connection
    (modules.control.flag_wait) and returns False as soon as `moot()` says so (the membership
    changed: the wait is moot). The flags go to the run's hidden keys (modules.control.hidden):
    an outsider cannot fake an arrival.
    """
    what = what or key
    store = hidden_store(store)
    store.set(member_key(key, rank), "1")
    keys = [member_key(key, p) for p in peers]
    while True:
        try:
            if abandon is not None:
                return abandon[0].wait(keys, timeout_s, abandon[1])
            store.wait(keys, timedelta(seconds=timeout_s))
            return True
        except RuntimeError as e:  # timeout, or the store (rank 0's or the coordinator's) is gone
            if abandon is not None and abandon[1]():
                return False
            try:
                missing = [p for p, k in zip(peers, keys) if not store.check([k])]
            except RuntimeError:
                raise PeerError(f"{what}: the rendezvous store is gone ({first_line(e)})") \
                    from None
            if not missing:
                return True
            msg = (f"{what}: rank(s) {missing} of my group {list(peers)} did not arrive within "
                   f"{timeout_s:g} s")
            if not wait_forever:
                raise PeerError(msg + "; not stepping alone (pass --wait-for-peers to wait)",
                                diagnosed=True) from None
            log(f"warning: {msg}; still waiting (--wait-for-peers)")
