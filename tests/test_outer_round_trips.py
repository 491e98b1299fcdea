"""How many store round trips DiLoCo's outer round costs a rank (modules/control/elastic.py),
counted with TCPStore's client costs, and those costs checked against a real TCPStore behind a
slow link. The simulator charges `outer_store_round_trips` (scheduler/simulator/config.py) per
outer sync: the count here must be that figure."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from formats.plan import load_plan
from modules.comm import CommStats
from modules.control.auth import Auth, AuthStore
from modules.control.dist import topology
from modules.control.elastic import Membership, MembershipSettings
from modules.control.flag_wait import FlagWaiter
from modules.control.hidden import hidden_store
from modules.control.leader import Departures
from scheduler.simulator.config import RUNTIME_PROFILES
from testkit.fault_harness import write_trial_plan

ROUND_TRIPS = {"set": 0, "wait": 1, "check": 1, "compare_set": 1, "add": 1, "get": 2,
               "multi_get": 2}
"""Round trips of each TCPStore client call (torch 2.x): `set` sends without a reply; `get`
and `multi_get` wait for their keys first (checked by test_the_cost_table_is_tcpstores)."""


class CountingStore:
    """A store that adds up the round trips its calls would cost on a TCPStore."""

    def __init__(self, store: dist.Store) -> None:
        self.store, self.trips, self.calls = store, 0, []

    def __getattr__(self, name: str):
        call = getattr(self.store, name)
        if name not in ROUND_TRIPS:
            return call

        def counted(*args, **kwargs):
            self.trips += ROUND_TRIPS[name]
            self.calls.append(name)
            return call(*args, **kwargs)
        return counted


def member(store: dist.Store, plan, rank: int) -> tuple[Membership, CountingStore]:
    """Rank `rank` of the plan at generation 0 with a stand-in heartbeat (no thread)."""
    counting = CountingStore(store)
    cfg = MembershipSettings(timeout_s=10, heartbeat_timeout_s=5, min_replicas=1,
                             wait_for_peers=False, store_addr=None, start_replicas=None,
                             join=False)
    m = Membership(AuthStore(counting, Auth(b"k" * 32)), plan, topology(plan, rank, 2), cfg,
                   builder=None, stats=CommStats(), log=lambda _: None)
    m.monitor = SimpleNamespace(gen=0, changed=threading.Event(), departures=Departures(plan))
    m.waiter = FlagWaiter(lambda: hidden_store(m.store))  # its waits counted like the rest
    return m, counting


@pytest.mark.timeout(60)
def test_an_outer_round_costs_a_rank_as_many_round_trips_as_the_simulator_charges(tmp_path):
    plan = load_plan(write_trial_plan(tmp_path / "plan.json", 2, 1, "diloco"))
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=10))
    members = [member(store, plan, r) for r in (0, 1)]
    results: dict[int, object] = {}

    def run(rank: int) -> None:
        m, _ = members[rank]
        results[rank] = [m.outer_round(torch.zeros(4), lambda flat: 16, outer) for outer in
                         range(3)]

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {0: [16] * 3, 1: [16] * 3}  # every round committed
    per_round = [c.trips / 3 for _, c in members]
    # arrival: set + wait; commit: set + wait (flags under hidden keys); decision: compare_set
    assert per_round == [3, 3], [c.calls for _, c in members]
    for runtime, profile in RUNTIME_PROFILES.items():
        assert profile.outer_store_round_trips == per_round[0], runtime


class SlowLink:
    """A TCP proxy to `port` that holds every chunk for `delay_s` each way."""

    def __init__(self, port: int, delay_s: float) -> None:
        self.port, self.delay_s = port, delay_s
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.listen_port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.sock.accept()
            server = socket.create_connection(("127.0.0.1", self.port))
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                time.sleep(self.delay_s)
                b.sendall(data)
        except OSError:
            pass


@pytest.mark.timeout(60)
def test_the_cost_table_is_tcpstores():
    """Each call timed through a link of 2 x 60 ms round trip: the measured round trips
    match ROUND_TRIPS (to a third of one, whatever the machine's load adds)."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    link = SlowLink(server.port, 0.06)
    client = dist.TCPStore("127.0.0.1", link.listen_port, None, False,
                           timeout=timedelta(seconds=10), wait_for_workers=False)
    server.set("a", "1")
    server.set("b", "2")
    calls = {"set": lambda: client.set("x", "1"), "wait": lambda: client.wait(["a", "b"]),
             "check": lambda: client.check(["a"]), "add": lambda: client.add("n", 1),
             "compare_set": lambda: client.compare_set("c", "", "1"),
             "get": lambda: client.get("a"), "multi_get": lambda: client.multi_get(["a", "b"])}
    client.check(["a"])  # connected and warm
    measured = {}
    for name, call in calls.items():
        t0 = time.perf_counter()
        for _ in range(3):
            call()
        measured[name] = (time.perf_counter() - t0) / 3 / 0.12
    for name, trips in ROUND_TRIPS.items():
        assert abs(measured[name] - trips) < 0.34, measured


@pytest.mark.timeout(60)
def test_the_last_store_reads_come_before_the_done_mark_and_after_everyone_elses(tmp_path):
    """A rank that read the store (the checkpoint floor) after saying it was done raced the
    store host's exit (c10d's 'Connection was likely closed' traceback at a normal end): a
    rank reads before its done mark, the host only once every member's is there."""
    from modules.control.fault import is_done

    plan = load_plan(write_trial_plan(tmp_path / "plan.json", 2, 1, "diloco"))  # ranks 0, 1
    store = dist.HashStore()
    seen = []
    for rank in (1, 0):
        m, _ = member(store, plan, rank)
        m.monitor.members, m.monitor.stop, m.monitor.join = [0, 1], lambda: None, \
            lambda timeout: None
        m.finish(last_reads=lambda m=m: seen.append((m.topo.rank, is_done(m.store, 1))))
    assert seen == [(1, False), (0, True)]
