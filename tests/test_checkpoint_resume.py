"""Checkpoints: 3 steps + resume 3 gives the same losses as 6 uninterrupted steps (2 stages x 2
replicas, DiLoCo with H=2 so the cut falls inside an outer period); a corrupt or mismatched
checkpoint is a clear error; after a crash between checkpoints, --resume leaves each step once in
metrics.jsonl."""

from __future__ import annotations

import shutil

import pytest

from formats.errors import UserError
from formats.plan import Plan, SyncConfig, save_plan
from modules.train.checkpoint import (
    checkpoint_path,
    complete_steps,
    load_checkpoint,
    save_checkpoint,
    step_path,
)
from modules.train.metrics import read_metrics, replica_metrics_path
from tests.conftest import run_entry

PLAN = Plan("local", "", "gpt-tiny", [(0, 2), (2, 4)], [[0, 1], [2, 3]], micro_batch_size=2,
            num_micro_batches=2, sync=SyncConfig(mode="diloco", inner_steps=2))


def _launch(plan_path, metrics, *extra):
    return run_entry("scripts/launch_local.py", "--plan", str(plan_path), "--threads-per-rank",
                     "1", "--grace-s", "2", "--", "--fake-data", "--metrics", str(metrics),
                     "--timeout-s", "60", *extra, timeout=150)


def _losses(metrics):
    return [[r["loss"] for r in read_metrics(replica_metrics_path(metrics, k))] for k in (0, 1)]


@pytest.mark.timeout(280)
def test_resume_gives_identical_losses_and_bad_checkpoints_are_clear_errors(tmp_path):
    plan_path = tmp_path / "plan.json"
    save_plan(PLAN, plan_path)
    full = _launch(plan_path, tmp_path / "full.jsonl", "--steps", "6")
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
    ck = tmp_path / "ck"
    first = _launch(plan_path, tmp_path / "cut.jsonl", "--steps", "3", "--ckpt-dir", str(ck),
                    "--ckpt-every", "3")
    assert first.returncode == 0, first.stdout[-3000:]
    assert sorted(p.name for p in ck.iterdir()) == [f"rank{r}" for r in range(4)]
    assert all(complete_steps(ck, r) == [3] for r in range(4))
    shutil.copytree(ck, tmp_path / "ck_copy")
    second = _launch(plan_path, tmp_path / "cut.jsonl", "--steps", "6", "--ckpt-dir", str(ck),
                     "--resume")
    assert second.returncode == 0, second.stdout[-3000:]
    assert "resumed from step 3" in second.stdout
    assert _losses(tmp_path / "cut.jsonl") == _losses(tmp_path / "full.jsonl")  # bit-identical

    # a corrupt checkpoint (truncated file) on one rank
    bad = step_path(tmp_path / "ck_copy", 3, 3)
    bad.write_bytes(bad.read_bytes()[:1000])
    proc = _launch(plan_path, tmp_path / "x.jsonl", "--steps", "6", "--ckpt-dir",
                   str(tmp_path / "ck_copy"), "--resume")
    assert proc.returncode == 2
    assert f"error: checkpoint {bad} is corrupt or unreadable" in proc.stdout
    assert "Traceback" not in proc.stdout


@pytest.mark.timeout(150)
def test_resume_after_a_crash_between_checkpoints_writes_each_step_once(tmp_path):
    plan_path = tmp_path / "plan.json"
    save_plan(Plan("local", "", "gpt-tiny", [(0, 4)], [[0]], micro_batch_size=2), plan_path)
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    # checkpoint at step 2 (on the training thread, so it is on disk), gone before step 4
    crash = _launch(plan_path, metrics, "--steps", "5", "--ckpt-dir", str(ck), "--ckpt-every",
                    "2", "--sync-checkpoints", "--debug-vanish", "0:4")
    assert crash.returncode == 0, crash.stdout[-3000:]
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3]
    resumed = _launch(plan_path, metrics, "--steps", "5", "--ckpt-dir", str(ck), "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resumed from step 2" in resumed.stdout
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3, 4, 5]
    assert not list(tmp_path.glob(".*.tmp"))


def test_mismatched_or_missing_checkpoint_names_the_field(tmp_path):
    path = checkpoint_path(tmp_path, 5)
    save_checkpoint(path, {"model": "gpt-tiny", "micro_batch_size": 2}, {"step": 1})
    assert load_checkpoint(path, {"model": "gpt-tiny"})["step"] == 1
    with pytest.raises(UserError, match=r"micro_batch_size is 2 but this run has 4"):
        load_checkpoint(path, {"model": "gpt-tiny", "micro_batch_size": 4})
    with pytest.raises(UserError, match="no checkpoint at"):
        load_checkpoint(checkpoint_path(tmp_path, 6), {})
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="corrupt or unreadable"):
        load_checkpoint(path, {})
    assert not list(tmp_path.glob(".*.tmp"))  # atomic write leaves no temp files
