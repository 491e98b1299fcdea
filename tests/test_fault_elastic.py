"""Kill -9 of a rank at a random step: DiLoCo drops that replica and finishes with the others;
allreduce stops every rank cleanly (exit 1, the lost rank named) within heartbeat + 5 s; the
store's host (rank 0) dying is diagnosed as such; no process is left behind. A replica started
later with --join holds bit-identical parameters after the next outer step."""

from __future__ import annotations

import random

import pytest
import torch

from modules.data.dataset import DEFAULT_CORPUS
from modules.train.checkpoint import load_checkpoint, step_path
from modules.train.metrics import read_metrics, replica_metrics_path
from testkit.fault_harness import (
    Ranks,
    free_port,
    kill_trial,
    poll_exits,
    soak_seeds,
    write_trial_plan,
)

HB = 2.0  # heartbeat timeout of the trials (s)
AFTER_KILL = 40
"""Steps the survivors of a DiLoCo trial train after the kill (20 outer steps): enough to show
they go on, few enough that a loaded machine finishes them well inside the trial's deadline."""


def _diloco_trial(tmp_path, seed: int, replicas: int = 3, stages: int = 1,
                  extra: tuple[str, ...] = ()) -> None:
    rng = random.Random(seed)
    n = replicas * stages
    victim = rng.randrange(1, n)  # not rank 0: it hosts the store (tested apart)
    kill_step = rng.randrange(2, 40)
    steps = kill_step + AFTER_KILL
    res = kill_trial(tmp_path / f"t{seed}", "diloco", replicas, stages, victim,
                     kill_step=kill_step, steps=steps, heartbeat_s=HB, extra=extra)
    logs = "\n".join(f"[rank {r}] {t[-1500:]}" for r, t in res.outputs.items())
    assert res.orphans == [], logs
    assert res.codes[victim] == -9, logs
    lost = victim // stages
    dropped = set(range(lost * stages, (lost + 1) * stages))
    for r in range(n):
        if r == 0 and r in dropped:  # replica 0 lost a stage: rank 0 only hosts the store
            assert res.codes[r] == 1, logs
            assert "staying up only to host the rendezvous store" in res.outputs[r], logs
        elif r in dropped - {victim}:  # alive rank of the dropped replica: leaves, says why
            assert res.codes[r] == 1, logs
            assert "was dropped from the run" in res.outputs[r], logs
        elif r not in dropped:
            assert res.codes[r] == 0, logs
            assert f"{r}: done" in res.outputs[r], logs
            assert "Traceback" not in res.outputs[r], logs
    assert f"dropped replica(s) {lost}: rank {victim} (host " in res.outputs[0], logs
    if lost != 0:
        assert f"step {steps}/{steps}" in res.outputs[stages - 1], logs  # replica 0 finished


def _allreduce_trial(tmp_path, seed: int) -> None:
    rng = random.Random(seed)
    victim = rng.randrange(0, 2)
    res = kill_trial(tmp_path / f"a{seed}", "allreduce", 2, 1, victim,
                     kill_step=rng.randrange(2, 40), steps=400, heartbeat_s=HB,
                     extra=("--ckpt-dir", str(tmp_path / f"a{seed}" / "ck"), "--ckpt-every",
                            "5"))
    logs = "\n".join(f"[rank {r}] {t[-1500:]}" for r, t in res.outputs.items())
    other = 1 - victim
    assert res.orphans == [], logs
    assert res.codes[other] == 1, logs
    assert res.exit_s[other] < HB + 5, (res.exit_s, logs)
    text = res.outputs[other]
    assert "Traceback" not in text, logs
    if victim == 0:
        assert "rendezvous store (hosted by rank 0" in text, logs
    else:
        assert "error: rank 1 (host " in text and "replica 1, stage 0) is gone" in text, logs
        assert "checkpoint:" in text, logs


@pytest.mark.timeout(240)
@pytest.mark.parametrize("seed", [0, 1])
def test_diloco_kill_drops_the_replica_and_finishes(tmp_path, seed):
    _diloco_trial(tmp_path, seed)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("seed,stages", [(0, 1), pytest.param(3, 2, marks=pytest.mark.slow)])
def test_diloco_kill_with_overlap_and_fragments(tmp_path, seed, stages):
    """A replica lost while fragments are in flight in the background: the survivors redo
    those rounds among themselves and finish."""
    _diloco_trial(tmp_path, seed, stages=stages, extra=("--overlap", "on", "--fragments", "2"))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_diloco_kill_trials(tmp_path):
    for seed in soak_seeds(100, 10):  # each trial with its own deadline
        _diloco_trial(tmp_path, seed, stages=2 if seed % 3 == 0 else 1)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("seed", [0, 3])
def test_allreduce_kill_stops_every_rank_with_the_reason(tmp_path, seed):
    _allreduce_trial(tmp_path, seed)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_allreduce_kill_trials(tmp_path):
    for seed in soak_seeds(200, 10):
        _allreduce_trial(tmp_path, seed)


@pytest.mark.timeout(240)
def test_store_host_lost_every_diloco_rank_exits_with_that_diagnosis(tmp_path):
    res = kill_trial(tmp_path / "s", "diloco", 3, 1, 0, kill_step=5, steps=400, heartbeat_s=HB)
    logs = "\n".join(f"[rank {r}] {t[-1500:]}" for r, t in res.outputs.items())
    assert res.orphans == [], logs
    for r in (1, 2):
        assert res.codes[r] == 1, logs
        assert "error: the rendezvous store (hosted by rank 0" in res.outputs[r], logs
        assert res.exit_s[r] < HB + 5, (res.exit_s, logs)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("overlap", [(), ("--overlap", "on", "--fragments", "2")],
                         ids=["plain", "overlap"])
def test_diloco_below_min_replicas_stops_with_a_clear_message(tmp_path, overlap):
    ck = tmp_path / "m" / "ck"
    res = kill_trial(tmp_path / "m", "diloco", 2, 1, 1, kill_step=6, steps=400, heartbeat_s=HB,
                     extra=("--min-replicas", "2", "--ckpt-dir", str(ck), "--ckpt-every", "4",
                            *overlap))
    logs = "\n".join(f"[rank {r}] {t[-1500:]}" for r, t in res.outputs.items())
    assert res.orphans == [], logs
    assert res.codes[0] == 1, logs
    assert "fewer than --min-replicas 2; stopping" in res.outputs[0], logs
    assert "checkpoint: newest complete one is step" in res.outputs[0], logs
    assert res.exit_s[0] < HB + 5, (res.exit_s, logs)


@pytest.mark.timeout(300)
def test_join_a_third_replica_mid_run_bit_identical_after_the_next_outer_step(tmp_path):
    if not DEFAULT_CORPUS.exists():
        pytest.skip("Debian fortunes not installed (apt-get install fortunes fortunes-min)")
    plan = write_trial_plan(tmp_path / "plan.json", 3, 1, "diloco", inner_steps=4,
                            micro_batch_size=2)
    ranks = Ranks(plan, f"tcp://127.0.0.1:{free_port()}", tmp_path)
    common = ("--steps", "240", "--timeout-s", "60", "--heartbeat-timeout-s", "5",
              "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "240", "--log-every", "10",
              "--metrics", str(tmp_path / "m.jsonl"))
    try:
        for r in (0, 1):
            ranks.start(r, "--replicas", "0,1", *common)
        assert ranks.wait_for_text(0, "step 30/240", 120), ranks.output(0)
        ranks.start(2, "--join", *common)
        poll_exits(ranks, 240)
    finally:
        left = ranks.stop()
    logs = "\n".join(f"[rank {r}] {ranks.output(r)[-2000:]}" for r in range(3))
    assert left == [], logs
    assert {r: p.returncode for r, p in ranks.procs.items()} == {0: 0, 1: 0, 2: 0}, logs
    assert "received the outer model and momentum of stage 0 from rank 0" in ranks.output(2)
    joined = read_metrics(replica_metrics_path(tmp_path / "m.jsonl", 2))
    first = joined[0]["step"]
    assert 30 < first < 240 and (first - 1) % 4 == 0  # starts right after an outer step
    # the outer step right after joining: every replica has the same parameters
    states = [load_checkpoint(step_path(tmp_path / "ck", r, 240), {})["model"] for r in range(3)]
    for k in states[0]:
        assert all(torch.equal(states[0][k], s[k]) for s in states[1:]), k
    losses = [r["loss"] for r in joined]
    assert sum(losses[-20:]) / 20 < losses[0], losses  # the joiner's loss falls
    zero = [r["loss"] for r in read_metrics(tmp_path / "m.jsonl")]
    assert sum(zero[-20:]) / 20 < sum(zero[:5]) / 5


@pytest.mark.parametrize("value, want", [("", range(5, 8)), ("full", range(5, 15)),
                                         ("2", range(5, 7)), (" 4 ", range(5, 9))])
def test_soak_seeds_follow_soak_trials(monkeypatch, value, want) -> None:
    """SOAK_TRIALS unset: 3 seeds; `full`: all of them; N: N."""
    monkeypatch.setenv("SOAK_TRIALS", value)
    assert soak_seeds(5, 10) == want


@pytest.mark.parametrize("value", ["0", "three", "-2", "1.5"])
def test_soak_seeds_refuse_a_garbled_soak_trials(monkeypatch, value) -> None:
    """A typo in SOAK_TRIALS is an error naming the variable, not a quiet 3-seed run."""
    monkeypatch.setenv("SOAK_TRIALS", value)
    with pytest.raises(ValueError, match="SOAK_TRIALS"):
        soak_seeds(5, 10)
