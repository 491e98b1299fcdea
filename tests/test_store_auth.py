"""Outsiders cannot steer a run through its rendezvous store (modules/control/auth.py).

Each test attacks a real 1 x 3 DiLoCo run (3 replicas of one stage, fake data) with a bare
`torch.distributed.TCPStore` client, as anyone who can reach the port could: the forged
records are named in the ranks' logs and ignored, and every rank finishes (exit 0). The store
listens only on the address the run was given."""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from modules.comm.keys import device_key, member_key
from modules.control.auth import Auth, AuthStore, host_store
from modules.control.coordinator import RunSettings
from modules.control.hidden import hidden_store
from modules.control.leader import Generation
from modules.control.protocol import (
    GENERATION_COUNTER,
    RUN_SETTINGS,
    commit_done_key,
    commit_prefix,
    done_key,
    generation_key,
    outer_arrival_prefix,
)
from testkit.fault_harness import Ranks, free_port, write_trial_plan

STEPS = 40
HB = 2.0
FORGED = "ignored a forged store record at"


def outsider(url: str) -> dist.TCPStore:
    """A bare client of the run's store: no secret, just the address."""
    host, port = url.removeprefix("tcp://").split(":")
    return dist.TCPStore(host, int(port), None, False, timeout=timedelta(seconds=10),
                         wait_for_workers=False)


def start_run(tmp_path: Path, coordinator: bool = False, replicas: str | None = None,
              steps: int = STEPS) -> Ranks:
    """The 1 x 3 DiLoCo run, started (behind a coordinator when asked)."""
    plan = write_trial_plan(tmp_path / "plan.json", 3, 1, "diloco")
    ranks = Ranks(plan, f"tcp://127.0.0.1:{free_port()}", tmp_path)
    if coordinator:
        ranks.start_coordinator()
    started = (0, 1, 2) if replicas is None else tuple(int(r) for r in replicas.split(","))
    for r in started:
        ranks.start(r, "--fake-data", "--steps", str(steps), "--timeout-s", "30",
                    "--heartbeat-timeout-s", str(HB), "--min-replicas", "2",
                    *(("--replicas", replicas) if replicas else ()))
    return ranks


def finish(ranks: Ranks, ranks_expected: tuple[int, ...] = (0, 1, 2),
           timeout: float = 150, steps: int = STEPS) -> str:
    """Wait for the run; every expected rank exits 0 having trained every step. Their logs."""
    codes = ranks.wait(timeout)
    logs = "\n".join(f"[rank {r}] {ranks.output(r)}" for r in ranks.procs)
    tails = "\n".join(f"[rank {r}] {ranks.output(r)[-3000:]}" for r in ranks.procs)
    for r in ranks_expected:
        assert codes[r] == 0, tails
        assert "Traceback" not in ranks.output(r), tails
    assert f"step {steps}/{steps}" in ranks.output(0), tails
    return logs


def wait_step(ranks: Ranks, step: int = 4) -> None:
    assert ranks.wait_for_text(0, f"step {step}/", 90), ranks.output(0)[-3000:]


@pytest.mark.timeout(240)
def test_a_forged_generation_dropping_two_replicas_is_ignored(tmp_path):
    ranks = start_run(tmp_path)
    try:
        wait_step(ranks)
        c = outsider(ranks.url)
        fake = Generation(1, (0,), (0,), dropped=(1, 2), reason="maintenance")
        c.set(generation_key(1), fake.to_json())
        c.set(GENERATION_COUNTER, "1")
        logs = finish(ranks)
    finally:
        ranks.stop()
    assert f"{FORGED} 'ft/gen'" in logs and "maintenance" not in logs.replace(
        "maintenance\"", ""), logs
    assert "was dropped" not in logs, logs


@pytest.mark.timeout(240)
def test_a_forged_stop_is_ignored(tmp_path):
    ranks = start_run(tmp_path)
    try:
        wait_step(ranks)
        c = outsider(ranks.url)
        c.set(generation_key(1), Generation(1, (0, 1, 2), (0, 1, 2), reason="x",
                                            stop=True).to_json())
        c.set(GENERATION_COUNTER, "1")
        logs = finish(ranks)
    finally:
        ranks.stop()
    assert f"{FORGED} 'ft/gen" in logs and "stopping" not in logs, logs


@pytest.mark.timeout(240)
def test_a_garbage_generation_counter_kills_no_thread(tmp_path):
    ranks = start_run(tmp_path)
    try:
        wait_step(ranks)
        c = outsider(ranks.url)
        c.set(GENERATION_COUNTER, "banana")
        time.sleep(2)
        c.set(GENERATION_COUNTER, b"\xff\x00" * 40)
        logs = finish(ranks)
    finally:
        ranks.stop()
    assert f"{FORGED} 'ft/gen'" in logs and "heartbeat thread failed" not in logs, logs


@pytest.mark.timeout(240)
def test_a_replica_marked_done_by_an_outsider_is_still_missed_when_it_dies(tmp_path):
    ranks = start_run(tmp_path)
    try:
        wait_step(ranks)
        c = outsider(ranks.url)
        c.set(done_key(2), "1")
        t_kill = ranks.kill(2)
        logs = finish(ranks, (0, 1))
    finally:
        ranks.stop()
    assert f"{FORGED} 'ft/done/2'" in logs, logs
    assert "rank 2 (host" in logs and "is gone: no heartbeat" in logs, logs
    assert "dropped replica(s) 2" in logs, logs
    assert t_kill > 0


@pytest.mark.timeout(240)
def test_a_pre_set_coordinator_run_record_is_replaced(tmp_path):
    plan = write_trial_plan(tmp_path / "plan.json", 3, 1, "diloco")
    ranks = Ranks(plan, f"tcp://127.0.0.1:{free_port()}", tmp_path)
    try:
        ranks.start_coordinator()
        c = outsider(ranks.url)
        c.set(RUN_SETTINGS, RunSettings((0,), 1, 99.0).to_json())  # before any rank
        for r in range(3):
            ranks.start(r, "--fake-data", "--steps", str(STEPS), "--timeout-s", "30",
                        "--heartbeat-timeout-s", str(HB), "--min-replicas", "2")
        logs = finish(ranks)
        assert ranks.wait_coordinator(30) == 0, ranks.coordinator_output()
    finally:
        ranks.stop()
    assert f"{FORGED} 'coord/run'" in logs + ranks.coordinator_output(), logs
    assert "--min-replicas 2, heartbeat timeout 2 s" in ranks.coordinator_output()


@pytest.mark.timeout(300)
def test_a_join_without_the_secret_is_not_admitted(tmp_path):
    ranks = start_run(tmp_path, replicas="0,1", steps=1000)
    intruder = Ranks(ranks.plan, ranks.url, tmp_path / "intruder", secret="0" * 64)
    intruder.out_dir.mkdir()
    try:
        wait_step(ranks)
        intruder.start(2, "--fake-data", "--steps", str(STEPS), "--timeout-s", "15",
                       "--heartbeat-timeout-s", str(HB), "--min-replicas", "2", "--join",
                       "--replicas", "0,1", "--lr", "1.0")
        code = intruder.wait(60)[2]
        logs = "\n".join(ranks.output(r) for r in (0, 1))
        assert all(ranks.procs[r].poll() is None for r in (0, 1)), logs  # still training
    finally:
        intruder.stop()
        ranks.stop()
    out = intruder.output(2)
    assert code == 1 and "not admitted" in out and "secret" in out, out
    assert f"{FORGED} 'ft/join/2'" in logs, logs
    assert "generation 1" not in logs and "joined" not in logs, logs


def plain_flag_keys(outer_steps: int) -> list[str]:
    """The plain names of every flag and process-group key of the 1 x 3 run (as they were
    before they were hidden): gloo's addresses of generation 0's world group, arrival and
    commit flags of the outer steps, device records."""
    keys = [f"0//cpu//0/{r}" for r in range(3)] + [device_key(r) for r in range(3)]
    for k in range(outer_steps):
        arrival, commit = outer_arrival_prefix(0, k, 0), commit_prefix(0, k)
        keys += [member_key(arrival, r) for r in range(3)]
        keys += [commit_done_key(commit, r) for r in range(3)]
    return keys


class Flood:
    """An outsider rewriting `keys` with `value` every 20 ms until stopped (a thread)."""

    def __init__(self, url: str, keys: list[str], value: bytes) -> None:
        self.client, self.keys, self.value = outsider(url), keys, value
        self.stop, self.writes = threading.Event(), 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                for k in self.keys:
                    self.client.set(k, self.value)
                    self.writes += 1
            except RuntimeError:  # the store is gone: the run ended
                return
            time.sleep(0.02)

    def end(self) -> int:
        self.stop.set()
        self.thread.join(10)
        return self.writes


@pytest.mark.timeout(240)
def test_forged_process_group_addresses_and_flags_are_not_where_the_run_looks(tmp_path):
    """Behind a coordinator the store is up before any rank: the outsider keeps writing
    garbage at gloo's rendezvous keys (a forged address there points a peer at the attacker),
    at every arrival and commit flag (a fake arrival sends the others into a collective with
    a missing peer) and at the device records, from before the first rank starts."""
    plan = write_trial_plan(tmp_path / "plan.json", 3, 1, "diloco")
    ranks = Ranks(plan, f"tcp://127.0.0.1:{free_port()}", tmp_path)
    try:
        ranks.start_coordinator()
        flood = Flood(ranks.url, plain_flag_keys(STEPS), b"\xffgarbage")
        time.sleep(0.5)
        for r in range(3):
            ranks.start(r, "--fake-data", "--steps", str(STEPS), "--timeout-s", "30",
                        "--heartbeat-timeout-s", str(HB), "--min-replicas", "2")
        logs = finish(ranks)
        writes = flood.end()
        assert ranks.wait_coordinator(30) == 0, ranks.coordinator_output()
    finally:
        ranks.stop()
    assert writes > 1000 and "generation 1" not in logs, logs


def test_hidden_keys_are_the_runs_alone():
    """A hidden key is renamed with a MAC of itself: the same name for every holder of the
    secret, another for another secret, never the plain name; flags set through the hidden
    store are invisible at the plain name and a plain write does not satisfy a hidden wait."""
    store = host_store("127.0.0.1", 0, None, timedelta(seconds=5))
    a, b = Auth(b"s" * 32), Auth(b"t" * 32)
    assert a.name("k") == Auth(b"s" * 32).name("k") != b.name("k")
    assert a.name("k") != a.name("k2") and a.name("k").startswith("k/#")
    signed = AuthStore(store, a)
    hidden = hidden_store(signed)
    assert hidden is hidden_store(signed)  # one per AuthStore: torch's groups keep it
    store.set("flag", "1")  # the outsider's write at the plain name
    with pytest.raises(RuntimeError):
        hidden.wait(["flag"], timedelta(seconds=0.3))
    hidden.set("flag", "1")
    hidden.wait(["flag"], timedelta(seconds=1))
    assert hidden.check(["flag"]) and store.get(a.name("flag")) == b"1"


def test_the_store_listens_only_on_the_address_asked_for():
    store = host_store("127.0.0.1", 0, None, timedelta(seconds=5))
    port = store.port
    with socket.socket() as s:  # another address of this host: nobody listens there
        assert s.connect_ex(("127.0.0.2", port)) != 0
    client = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=5),
                           wait_for_workers=False)
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_records_verify_only_under_their_key_and_secret():
    logged: list[str] = []
    a = AuthStore(dist.HashStore(), Auth(b"a" * 32, logged.append))
    a.put("ft/gen", "3")
    assert a.read_int("ft/gen", -1) == 3
    a.raw.set("ft/gen/9", a.raw.get("ft/gen"))  # a signed record moved to another key
    assert a.read("ft/gen/9") is None
    b = AuthStore(a.raw, Auth(b"b" * 32, logged.append))
    assert b.read("ft/gen") is None and b.read_int("ft/gen", -1) == -1
    a.raw.set("ft/join/1", "1")
    assert a.read("ft/join/1") is None and a.claim("ft/join/1", "0") == "0"
    assert sum(FORGED in m for m in logged) == 3, logged
    assert json.loads(json.dumps(logged))  # plain text


def test_rank_0_given_an_address_of_another_host_is_a_user_error(tmp_path):
    from tests.conftest import run_entry

    plan = write_trial_plan(tmp_path / "plan.json", 1, 1, "diloco")
    r = run_entry("dist_runner.py", "--plan", str(plan), "--rank", "0", "--fake-data",
                  "--steps", "1", "--dist-url", f"tcp://203.0.113.5:{free_port()}",
                  timeout=120)
    assert r.returncode == 2 and "error: --dist-url: 203.0.113.5 is not an address of this " \
        "host" in r.stderr and "Traceback" not in r.stderr, r.stderr
