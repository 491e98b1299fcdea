"""--stop-at-loss (modules/train/stopping.py): at the first evaluation whose validation loss (of
the lowest live replica) is at or below the target, every rank ends the run after that same
step, as if --steps had been that step: final checkpoint, metrics marked, one log line per
rank; --resume from there continues bit-identically to a run without the flag (allreduce and
overlapped DiLoCo, 2 stages x 2 replicas). The decision is one store record per
evaluation step; a rank that waits for it in vain agrees with the others to go on. Refusals
name the flag."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from formats.errors import UserError
from formats.plan import Plan, SyncConfig, save_plan
from modules.config import DataConfig, HivemindConfig, RunConfig
from modules.control.agreement import agree, agreed_fields
from modules.control.auth import Auth, AuthStore
from modules.data.tokenizer import BYTES_ID
from modules.train.checkpoint import complete_steps, load_checkpoint, step_path
from modules.train.metrics import read_metrics, replica_metrics_path
from modules.train.stopping import StopAtLoss
from tests.conftest import run_entry

STEPS, EVERY = 8, 2
EVAL = ["--eval-every", str(EVERY), "--eval-sequences", "4"]


def _plan(sync: SyncConfig, stages: int = 2) -> Plan:
    """`stages` x 2 replicas of gpt-tiny (4 layers)."""
    split = [(0, 2), (2, 4)] if stages == 2 else [(0, 4)]
    return Plan("local", "", "gpt-tiny", split, [[r * stages + s for s in range(stages)]
                                                 for r in range(2)],
                micro_batch_size=2, num_micro_batches=2, sync=sync)


def _launch(tmp_path, plan: Plan, metrics, *extra: str):
    save_plan(plan, tmp_path / "plan.json")
    proc = run_entry("scripts/launch_local.py", "--plan", str(tmp_path / "plan.json"),
                     "--threads-per-rank", "1", "--grace-s", "2", "--", "--fake-data",
                     "--metrics", str(metrics), "--timeout-s", "60", *EVAL, *extra,
                     timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # no rank used the store after its host left (the checkpoint floor was read after the
    # done mark once: c10d printed "Connection was likely closed" and a C++ traceback)
    assert "likely closed" not in proc.stdout + proc.stderr, proc.stdout[-3000:]
    return proc


def _records(metrics) -> list[list[dict]]:
    return [read_metrics(replica_metrics_path(metrics, k)) for k in (0, 1)]


def _losses(metrics) -> list[list[tuple]]:
    return [[(r["step"], r["loss"], r.get("val_loss")) for r in rs] for rs in _records(metrics)]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("sync, min_steps", [
    (SyncConfig(), 0), (SyncConfig(mode="diloco", inner_steps=2, overlap=True), 3)],
    ids=["allreduce", "diloco"])
def test_every_rank_stops_at_the_first_evaluation_at_the_loss_and_resumes_bit_identically(
        tmp_path, sync, min_steps):
    plan, stages = _plan(sync), 2
    full = tmp_path / "full.jsonl"
    _launch(tmp_path, plan, full, "--steps", str(STEPS), "--ckpt-dir", str(tmp_path / "ckf"))
    want = _losses(full)
    vals = {s: v for s, _, v in want[0] if v is not None}  # replica 0's: the deciding one
    assert sorted(vals) == list(range(EVERY, STEPS + 1, EVERY))
    target = vals[STEPS - EVERY]  # reached at the latest one evaluation before the end
    stop = min(s for s, v in vals.items() if v <= target and s >= min_steps)
    assert stop < STEPS

    ck, cut = tmp_path / "ck", tmp_path / "cut.jsonl"
    proc = _launch(tmp_path, plan, cut, "--steps", str(STEPS), "--ckpt-dir", str(ck),
                   "--stop-at-loss", repr(target), "--min-steps", str(min_steps))
    for rank in range(2 * stages):  # every rank says so, at the same step
        lines = re.findall(rf"^\[rank {rank}\] step (\d+): validation loss (\S+) <= "
                           rf"--stop-at-loss {re.escape(repr(target))} \(replica 0\): stopping$",
                           proc.stdout, re.M)
        assert lines == [(str(stop), f"{vals[stop]:.6g}")], proc.stdout[-3000:]
        assert complete_steps(ck, rank) == [stop]  # the final checkpoint at that step
    got = _records(cut)
    for rs in got:  # both replicas' records end there, the last one marked
        assert [r["step"] for r in rs] == list(range(1, stop + 1))
        assert [r.get("stopped_at_loss", False) for r in rs] == [False] * (stop - 1) + [True]
        assert all("stop_check_s" in r for r in rs if r["step"] % EVERY == 0
                   and r["step"] >= min_steps)
    assert _losses(cut) == [rs[:stop] for rs in want]  # the same run up to there
    if sync.overlap:  # the round of step `stop` was in flight: the checkpoint holds it
        assert load_checkpoint(step_path(ck, 0, stop), {})["opt"]["pending"]

    # --resume without the flag: on to --steps, bit-identical to the run that never stopped
    proc = _launch(tmp_path, plan, cut, "--steps", str(STEPS), "--ckpt-dir", str(ck),
                   "--resume")
    assert f"resumed from step {stop}" in proc.stdout
    assert not re.search(r"\): stopping$", proc.stdout, re.M)
    assert _losses(cut) == want
    for rank in range(2 * stages):
        a = load_checkpoint(step_path(tmp_path / "ckf", rank, STEPS), {})["model"]
        b = load_checkpoint(step_path(ck, rank, STEPS), {})["model"]
        assert all(torch.equal(a[k], b[k]) for k in a), rank


def _store() -> AuthStore:
    return AuthStore(dist.HashStore(), Auth(b"test-secret-0123456789"))


def test_one_decision_per_step_and_a_lost_decider_agreed_away():
    store, said = _store(), []
    decider = StopAtLoss(store, 3.0, 4, 0.2, said.append)
    follower = StopAtLoss(store, 3.0, 4, 0.2, said.append)
    assert [decider.due(s) for s in (2, 4, 6)] == [False, True, True]
    d = decider.decide(4, 2.9, 0)
    assert (d.stop, d.val_loss, d.replica) == (True, 2.9, 0)
    assert follower.follow(4, 0) == d
    assert not decider.decide(6, 3.01, 0).stop and not follower.follow(6, 0).stop
    assert not decider.decide(10, None, 0).stop  # no loss (not evaluated): go on
    # nobody decides step 8 within 0.2 s: the follower claims "go on", and a late decider
    # (below the target) takes that, so every rank goes on alike
    late = follower.follow(8, 0)
    assert not late.stop and late.replica is None
    assert said == ["step 8: no --stop-at-loss decision from replica 0 within 0.2 s; going on "
                    "(every rank alike)"]
    assert decider.decide(8, 1.0, 0) == late


def test_refused_by_name_and_agreed_by_every_rank(tmp_path):
    with pytest.raises(UserError, match=r"^--stop-at-loss: needs --eval-every > 0 .* give "
                                        r"--eval-every N$"):
        DataConfig(stop_at_loss=3.0, eval_sequences=4)
    with pytest.raises(UserError, match=r"^--stop-at-loss: needs --eval-sequences > 0"):
        DataConfig(stop_at_loss=3.0, eval_every=5)
    with pytest.raises(UserError, match=r"^--min-steps 5: only applies with --stop-at-loss"):
        DataConfig(min_steps=5)
    with pytest.raises(UserError, match=r"^--stop-at-loss: must be"):
        DataConfig(stop_at_loss=-1.0, eval_every=5, eval_sequences=4)
    data = DataConfig(stop_at_loss=3.0, eval_every=5, eval_sequences=4, min_steps=30)
    with pytest.raises(UserError, match=r"^--min-steps 30: more than --steps 20"):
        RunConfig(steps=20, data=data)
    with pytest.raises(UserError, match=r"^--stop-at-loss: not with --outer-backend hivemind "
                                        r"\(each replica has its own store"):
        RunConfig(steps=40, data=data, hivemind=HivemindConfig(outer_backend="hivemind"))
    # every rank must give the same value (checked through the store, named)
    run = RunConfig(steps=40, data=data).resolve(_plan(SyncConfig()))
    mine = agreed_fields(run, BYTES_ID)
    assert (mine["--stop-at-loss"], mine["--min-steps"], mine["--eval-every"]) == (3.0, 30, 5)
    assert agreed_fields(RunConfig().resolve(_plan(SyncConfig())),
                         BYTES_ID)["--stop-at-loss"] is None
    store = _store()
    agree(store, mine, 0)
    with pytest.raises(UserError, match=r"^--stop-at-loss: rank 2 has 2.5 but the run's other "
                                        r"ranks have 3.0"):
        agree(store, {**mine, "--stop-at-loss": 2.5}, 2)
    # through the CLI: exit 2, one line, no traceback
    save_plan(_plan(SyncConfig()), tmp_path / "plan.json")
    proc = run_entry("dist_runner.py", "--plan", str(tmp_path / "plan.json"), "--rank", "0",
                     "--world-size", "4", "--fake-data", "--stop-at-loss", "3.2")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert ("error: --stop-at-loss: needs --eval-every > 0 (the run stops at an evaluation of "
            "the validation loss); give --eval-every N") in proc.stderr.splitlines()
