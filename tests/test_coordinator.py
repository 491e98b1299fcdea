"""The coordinator process (scripts/coordinator.py): no training host is a single point of
failure. Behind a coordinator rank 0 is an ordinary rank: SIGKILL of it in a DiLoCo run is
survived like any replica loss. Losing the coordinator makes every rank save the state of its
last outer step and exit 1 naming it; restarted, --resume continues bit-identically. The leader
logic is the one rank 0 runs otherwise; plans and settings are checked against the run's."""

from __future__ import annotations

import os
import random
import re
import time

import pytest
import torch.distributed as dist

from formats.errors import UserError
from formats.plan import Plan, SyncConfig, save_plan
from modules.control.auth import Auth, AuthStore
from modules.control.coordinator import Coordinator, CoordinatorConfig, RunSettings, check_in
from modules.control.leader import Generation, Leader, first_generation, read_generation
from modules.control.protocol import RUN_SETTINGS, join_key
from modules.train.checkpoint import complete_steps
from modules.train.metrics import read_metrics
from testkit.fault_harness import Ranks, free_port, kill_trial, soak_seeds, write_trial_plan
from tests.conftest import run_entry

HB = 2.0  # heartbeat timeout of the trials (s)
SECRET = b"test-secret-0123456789"
DILOCO_3X1 = Plan("local", "", "gpt-tiny", [(0, 4)], [[0], [1], [2]], micro_batch_size=1,
                  sync=SyncConfig(mode="diloco", inner_steps=2))


# -- the leader and the check-in, in one process --------------------------------------------------
def test_leader_drops_lost_replicas_admits_complete_joiners_and_stops_below_min():
    store, plan = AuthStore(dist.HashStore(), Auth(SECRET)), plan_3x2()
    g0 = first_generation(plan, (0, 1))
    leader = Leader(plan, min_replicas=2)
    assert leader.decide(store, g0, [], {}) is None  # nothing changed: nothing published
    store.put(join_key(4), "1")  # replica 2 = ranks 4, 5: only half of it asks
    assert leader.decide(store, g0, [], {}) is None
    store.put(join_key(5), "1")
    g1 = leader.decide(store, g0, [], {})
    assert g1 == read_generation(store, 1)
    assert (g1.replicas, g1.members, g1.joined, g1.stop) == ((0, 1, 2), (0, 1, 2, 3, 4, 5),
                                                             (2,), False)
    assert store.read(join_key(4)) == "0"  # consumed
    g2 = leader.decide(store, g1, [0], {0: "rank 0 (host h, replica 0, stage 0)"})
    assert (g2.gen, g2.replicas, g2.dropped, g2.stop) == (2, (1, 2), (0,), False)
    assert "dropped replica(s) 0: rank 0 (host h, replica 0, stage 0) gone" in g2.reason
    g3 = leader.decide(store, g2, [3], {3: "rank 3"})
    assert (g3.replicas, g3.stop) == ((2,), True)  # 1 < --min-replicas 2


def plan_3x2() -> Plan:
    return Plan("local", "", "gpt-tiny", [(0, 2), (2, 4)], [[0, 1], [2, 3], [4, 5]],
                micro_batch_size=1, sync=SyncConfig(mode="diloco", inner_steps=2))


def test_check_in_names_the_flag_that_differs_from_the_coordinator_or_the_run():
    plan = plan_3x2()
    coord = Coordinator(CoordinatorConfig("127.0.0.1", 0, plan, "plan.json", log=lambda m: None,
                                          secret=SECRET))
    port = coord.listen()
    url = f"tcp://127.0.0.1:{port}"
    client = AuthStore(dist.TCPStore("127.0.0.1", port, None, False, wait_for_workers=False),
                       Auth(SECRET))
    first = RunSettings((0, 1, 2), 2, 5.0)
    check_in(client, plan, first, False, url, 5)  # the first rank sets the run's settings
    assert RunSettings.from_json(client.read(RUN_SETTINGS)) == first
    check_in(client, plan, first, False, url, 5)
    with pytest.raises(UserError, match=r"--min-replicas: this rank has 1 but the run has 2"):
        check_in(client, plan, RunSettings((0, 1, 2), 1, 5.0), False, url, 5)
    with pytest.raises(UserError, match=r"--heartbeat-timeout-s: this rank has 2.0"):
        check_in(client, plan, RunSettings((0, 1, 2), 2, 2.0), False, url, 5)
    with pytest.raises(UserError, match=r"--replicas: this rank has \(0, 1\)"):
        check_in(client, plan, RunSettings((0, 1), 2, 5.0), False, url, 5)
    check_in(client, plan, RunSettings((2,), 2, 5.0), True, url, 5)  # a joiner's --replicas
    other = Plan("local", "", "gpt-tiny", [(0, 4)], [[0], [1]], micro_batch_size=1,
                 sync=SyncConfig(mode="diloco", inner_steps=2))
    with pytest.raises(UserError, match=r"--plan: this rank's plan \(pipelines \[\[0\], \[1\]\]"):
        check_in(client, other, RunSettings((0, 1), 2, 5.0), False, url, 5)


def test_a_rank_0_store_is_no_coordinator():
    port = free_port()
    host = AuthStore(dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False),
                     Auth(SECRET))
    with pytest.raises(RuntimeError, match="no coordinator record signed with this run's secret "
                       "after 1 s"):
        check_in(host, DILOCO_3X1, RunSettings((0, 1, 2), 2, 5.0), False,
                 f"tcp://127.0.0.1:{port}", 1)


def test_bad_coordinator_flags_are_exit_2(tmp_path):
    save_plan(DILOCO_3X1, tmp_path / "plan.json")
    both = run_entry("dist_runner.py", "--plan", str(tmp_path / "plan.json"), "--steps", "2",
                     "--rank", "0", "--fake-data", "--dist-url", "tcp://127.0.0.1:1",
                     "--coordinator", "tcp://127.0.0.1:2")
    assert both.returncode == 2 and "error: --coordinator and --dist-url exclude each other" \
        in both.stderr, both.stderr
    bad = run_entry("dist_runner.py", "--plan", str(tmp_path / "plan.json"), "--steps", "2",
                    "--rank", "0", "--fake-data", "--coordinator", "http://x")
    assert bad.returncode == 2 and "error: --coordinator: expected tcp://HOST:PORT" \
        in bad.stderr, bad.stderr
    # the coordinator publishes its own plan: a rank's overrides of it are refused by name
    from dist_runner import parse_args, resolve_run
    with pytest.raises(UserError, match="--coordinator runs its own plan"):
        resolve_run(*parse_args(["--plan", str(tmp_path / "plan.json"), "--rank", "0",
                                 "--fake-data", "--coordinator", "tcp://127.0.0.1:2",
                                 "--inner-steps", "4"]))
    listen = run_entry("scripts/coordinator.py", "--listen", "nowhere", "--plan",
                       str(tmp_path / "plan.json"))
    assert listen.returncode == 2 and "error: --listen: expected HOST:PORT" in listen.stderr
    for r in (both, bad, listen):
        assert "Traceback" not in r.stderr


@pytest.mark.timeout(120)
def test_a_rank_with_another_plan_is_refused_naming_the_flag(tmp_path):
    save_plan(DILOCO_3X1, tmp_path / "plan.json")
    write_trial_plan(tmp_path / "other.json", 2, 1, "diloco")
    ranks = Ranks(tmp_path / "plan.json", f"tcp://127.0.0.1:{free_port()}", tmp_path)
    try:
        ranks.start_coordinator()
        r = run_entry("dist_runner.py", "--plan", str(tmp_path / "other.json"), "--steps", "2",
                      "--rank", "0", "--fake-data", "--coordinator", ranks.url, timeout=100,
                      env=dict(os.environ, ST_RUN_SECRET=ranks.secret))  # the run's secret
    finally:
        ranks.stop()
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error: --plan: this rank's plan (pipelines [[0], [1]], sync diloco) is not the one " \
        "the coordinator" in r.stderr and "Traceback" not in r.stderr, r.stderr


# -- losing rank 0 behind a coordinator -----------------------------------------------------------
def _rank0_trial(tmp_path, seed: int, replicas: int = 3, stages: int = 1) -> None:
    rng = random.Random(seed)
    kill_step = rng.randrange(2, 40)
    steps = kill_step + 40  # the survivors train 40 steps (20 outer steps) after the kill
    res = kill_trial(tmp_path / f"c{seed}", "diloco", replicas, stages, 0,
                     kill_step=kill_step, steps=steps, heartbeat_s=HB, coordinator=True)
    logs = "\n".join(f"[rank {r}] {t[-1500:]}" for r, t in res.outputs.items())
    logs += "\n[coordinator] " + res.coordinator_output[-1500:]
    assert res.orphans == [], logs
    assert res.codes[0] == -9, logs
    for r in range(1, stages):  # the rest of replica 0: dropped, leaves saying why
        assert res.codes[r] == 1 and "was dropped from the run" in res.outputs[r], logs
        assert "staying up" not in res.outputs[r], logs
    for r in range(stages, replicas * stages):
        assert res.codes[r] == 0, logs
        assert f"{r}: done" in res.outputs[r] and "Traceback" not in res.outputs[r], logs
    assert f"step {steps}/{steps}" in res.outputs[2 * stages - 1], logs  # replica 1 logs now
    assert "dropped replica(s) 0: rank 0 (host " in res.coordinator_output, logs
    assert "run finished: every rank of replicas" in res.coordinator_output, logs
    assert res.coordinator_code == 0, logs


@pytest.mark.timeout(240)
def test_rank0_lost_behind_a_coordinator_the_other_replicas_finish(tmp_path):
    _rank0_trial(tmp_path, 0)


@pytest.mark.timeout(240)
def test_rank0_lost_in_a_pipeline_behind_a_coordinator(tmp_path):
    _rank0_trial(tmp_path, 1, replicas=2, stages=2)


@pytest.mark.timeout(240)
def test_the_lost_rank_0_comes_back_with_join(tmp_path):
    plan = write_trial_plan(tmp_path / "plan.json", 3, 1, "diloco", inner_steps=4)
    ranks = Ranks(plan, f"tcp://127.0.0.1:{free_port()}", tmp_path)
    common = ("--fake-data", "--steps", "400", "--timeout-s", "30", "--heartbeat-timeout-s",
              str(HB), "--min-replicas", "1", "--log-every", "10")
    try:
        ranks.start_coordinator()
        for r in (0, 1, 2):
            ranks.start(r, *common)
        assert ranks.wait_for_text(0, "step 20/400", 100), ranks.output(0)[-2000:]
        ranks.kill(0)
        assert ranks.procs[0].wait(timeout=10) == -9
        assert ranks.wait_for_text(1, "groups re-formed over replicas [1, 2]", 30), \
            ranks.output(1)[-2000:]
        ranks.start(0, "--join", *common)  # the same host comes back
        codes = ranks.wait(180)
        coord_code = ranks.wait_coordinator(15)
    finally:
        left = ranks.stop()
    logs = "\n".join(f"[rank {r}] {ranks.output(r)[-1500:]}" for r in range(3))
    logs += "\n[coordinator] " + ranks.coordinator_output()[-1500:]
    assert left == [] and codes == {0: 0, 1: 0, 2: 0}, logs
    assert "received the outer model and momentum of stage 0 from rank 1" in ranks.output(0), logs
    coord = ranks.coordinator_output()
    assert "generation 1: replicas [1, 2] (dropped replica(s) 0" in coord, logs
    assert "generation 2: replicas [0, 1, 2] (replica(s) 0 joined)" in coord, logs
    assert "run finished: every rank of replicas [0, 1, 2] is done" in coord, logs
    assert coord_code == 0, logs


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_rank0_kill_trials_behind_a_coordinator(tmp_path):
    for seed in soak_seeds(300, 8):
        _rank0_trial(tmp_path, seed, stages=2 if seed % 3 == 0 else 1)


@pytest.mark.timeout(150)
def test_launcher_with_a_coordinator_survives_losing_rank_0(tmp_path):
    save_plan(DILOCO_3X1, tmp_path / "plan.json")
    # rank 0 (replica 0) dies with status 1 before step 3; replicas 1 and 2 drop it and finish
    proc = run_entry("scripts/launch_local.py", "--plan", str(tmp_path / "plan.json"),
                     "--threads-per-rank", "1", "--keep-going", "--coordinator", "--",
                     "--steps", "8", "--fake-data", "--timeout-s", "30",
                     "--heartbeat-timeout-s", "2", "--min-replicas", "2",
                     "--debug-vanish", "0:3:1", timeout=140)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    assert re.search(r"^\[coordinator\] listening on port \d+ ", out, re.M), out[-3000:]
    assert "[rank 0] debug: vanishing before step 3" in out
    assert "[coordinator] generation 1: replicas [1, 2] (dropped replica(s) 0: rank 0 (host " \
        in out, out[-3000:]
    assert re.search(r"^\[rank 1\] step 8/8 loss", out, re.M), out[-3000:]
    assert "launch: ranks [0] failed; replicas [1, 2] finished" in out
    assert "launch: the coordinator exited with status 0" in out


# -- losing the coordinator -----------------------------------------------------------------------
def _run(tmp_path, name: str, plan, steps: int, *extra: str, kill_at: int | None = None,
         timeout: float = 150) -> tuple[Ranks, dict[int, int | None], float | None]:
    """Coordinator + 2 ranks; with kill_at, SIGKILL the coordinator once rank 0 logged that
    step. Returns the ranks, their statuses and kill -> last exit (s)."""
    out = tmp_path / name
    out.mkdir()
    ranks = Ranks(plan, f"tcp://127.0.0.1:{free_port()}", out)
    t_kill = None
    try:
        ranks.start_coordinator()
        for r in (0, 1):
            ranks.start(r, "--fake-data", "--steps", str(steps), "--timeout-s", "30",
                        "--heartbeat-timeout-s", str(HB), "--ckpt-dir", str(tmp_path / "ck"),
                        "--ckpt-every", "1000", "--metrics", str(out / "m.jsonl"), *extra)
        if kill_at is not None:
            assert ranks.wait_for_text(0, f"step {kill_at}/", 100), ranks.output(0)[-2000:]
            t_kill = ranks.kill_coordinator()
        codes = ranks.wait(timeout)
        took = time.monotonic() - t_kill if t_kill is not None else None
        if t_kill is None:
            ranks.wait_coordinator(15)  # it exits once it saw every rank done
    finally:
        left = ranks.stop()
    assert not left, f"ranks {left} still running: " + ranks.output(0)[-2000:]
    return ranks, codes, took


@pytest.mark.timeout(400)
def test_coordinator_lost_every_rank_saves_and_exits_then_resume_continues(tmp_path):
    plan = write_trial_plan(tmp_path / "plan.json", 2, 1, "diloco", inner_steps=3)
    full, codes, _ = _run(tmp_path, "full", plan, 60, "--log-every", "1")
    assert codes == {0: 0, 1: 0}, full.output(0)[-2000:]
    assert "run finished" in full.coordinator_output()
    for r in (0, 1):  # a fresh run has no checkpoint but the last
        assert complete_steps(tmp_path / "ck", r) == [60]
        for f in (tmp_path / "ck" / f"rank{r}").iterdir():
            f.unlink()

    crash, codes, took = _run(tmp_path, "crash", plan, 400, "--log-every", "1", kill_at=12)
    logs = crash.output(0)[-2000:] + crash.output(1)[-2000:]
    assert codes == {0: 1, 1: 1}, logs
    assert took < HB + 8, (took, logs)
    saved = set()
    for r in (0, 1):
        text = crash.output(r)
        # the heartbeat's failed call, or (a call hung on the loaded host) the store watcher
        assert f"error: the coordinator {crash.url} (rendezvous store and membership leader, " \
            "host " in text and ("is gone: no answer for 2 s" in text or re.search(
                r"does not answer: no reply since \S+ UTC \([\d.]+ s, over the heartbeat "
                r"timeout 2 s\): frozen, cut off or gone", text)), logs
        assert "Traceback" not in text, logs
        m = re.search(r"checkpoint: newest complete one is step (\d+); step (\d+) \(right after "
                      r"outer step (\d+)", text)
        assert m, logs
        saved.add(int(m.group(2)))
        assert int(m.group(2)) == 3 * int(m.group(3))  # the state of an outer step (H = 3)
    assert len(saved) == 1, (saved, logs)  # the same step on every rank
    step = saved.pop()
    assert 12 <= step < 60, logs
    for r in (0, 1):  # --ckpt-every 1000: the emergency checkpoint is the only one
        assert complete_steps(tmp_path / "ck", r) == [step]

    resumed, codes, _ = _run(tmp_path, "resume", plan, 60, "--resume", "--log-every", "1")
    logs = resumed.output(0)[-2000:] + resumed.output(1)[-2000:]
    assert codes == {0: 0, 1: 0}, logs
    assert f"resumed from step {step}" in resumed.output(0), logs
    want = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "full" / "m.jsonl")}
    got = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "resume" / "m.jsonl")}
    assert sorted(got) == list(range(step + 1, 61))
    assert got == {s: want[s] for s in got}  # bit-identical from the resumed step


def test_generation_json_round_trip():
    g = Generation(3, (1, 2), (1, 2), (0,), (), "dropped replica(s) 0", stop=False)
    assert Generation.from_json(g.to_json()) == g
