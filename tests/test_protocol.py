"""modules.control.protocol and modules.comm.keys: every store key and tag is named once; no two
purposes share a key."""

from __future__ import annotations

import itertools

from modules.comm import keys as c
from modules.control import protocol as p


def test_keys_of_different_purposes_never_collide():
    ranks, gens, stages, outers = range(3), range(3), range(2), range(3)
    keys: dict[str, str] = {}

    def add(purpose: str, key: str) -> None:
        assert keys.setdefault(key, purpose) == purpose, (key, purpose, keys[key])

    add("generation counter", p.GENERATION_COUNTER)
    for r in ranks:
        for purpose, fn in (("info", p.info_key), ("heartbeat", p.heartbeat_key),
                            ("done", p.done_key), ("join", p.join_key),
                            ("device", c.device_key)):
            add(purpose, fn(r))
    for g in gens:
        add("generation", p.generation_key(g))
        for s in stages:
            add("join source", p.join_source_key(g, s))
        for k in outers:
            commit = p.commit_prefix(g, k)
            add("decision", p.commit_decision_key(commit))
            for r in ranks:
                add("commit done", p.commit_done_key(commit, r))
    for g, s, k, r in itertools.product([None, *gens], stages, outers, ranks):
        add("arrival", c.member_key(p.outer_arrival_prefix(s, k, g), r))
    add("nccl id", c.nccl_unique_id_key("g1/stage", (0, 2)))
    for r in ranks:
        add("nccl arrival", c.member_key(c.nccl_arrival_prefix("g1/stage", (0, 2)), r))
    assert len(keys) > 100


def test_tags_leave_room_for_every_micro_batch():
    assert p.FWD_TAG < p.BWD_TAG < p.JOIN_TAG
    assert p.BWD_TAG - p.FWD_TAG >= 1 << 20 and p.JOIN_TAG - p.BWD_TAG >= 1 << 20
