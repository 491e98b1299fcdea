"""The store's host waits at the end of a run until the ranks of a dropped replica read that
they were dropped (modules.control.leader.Departures): a rank whose shard peer died in a
collective otherwise found the store gone before its heartbeat read the verdict (CI, once in
three runs of test_shard_runtime's lost-device test)."""

from __future__ import annotations

import torch.distributed as dist

from formats.plan import Plan, SyncConfig
from modules.control.auth import Auth, AuthStore
from modules.control.leader import Departures, Generation
from modules.control.protocol import left_key


def _plan() -> Plan:
    """2 replicas, each one stage sharded over 2 devices: ranks 0, 1 | 2, 3."""
    return Plan("local", "", "gpt-tiny", [(0, 4)], [[[0, 1]], [[2, 3]]], micro_batch_size=2,
                num_micro_batches=1, sync=SyncConfig("diloco", 2))


def test_the_host_waits_for_a_dropped_rank_until_it_read_its_drop():
    store = AuthStore(dist.HashStore(), Auth(b"k" * 32))
    dep = Departures(_plan())
    # rank 3 is gone: replica 1 is dropped; rank 2 is alive and still has to read that
    dep.note(Generation(1, (0,), (0, 1), dropped=(1,), reason="rank 3 gone"), lost={3})
    assert dep.waiting(store) == [2]
    store.put(left_key(2), "0")  # an older drop (an earlier incarnation) does not count
    assert dep.waiting(store) == [2]
    store.put(left_key(2), "1")
    assert dep.waiting(store) == []


def test_a_replica_that_rejoined_is_not_waited_for():
    store = AuthStore(dist.HashStore(), Auth(b"k" * 32))
    dep = Departures(_plan())
    dep.note(Generation(1, (0,), (0, 1), dropped=(1,)), lost=set())
    assert dep.waiting(store) == [2, 3]
    dep.note(Generation(2, (0, 1), (0, 1, 2, 3), joined=(1,)), lost=set())
    assert dep.waiting(store) == []
