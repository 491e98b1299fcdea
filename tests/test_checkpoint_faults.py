"""A checkpoint that cannot be written never leaves the run unresumable
(modules/train/checkpoint.py): the failure names the path, the bytes needed and the free
space, the partial temp file is gone, the previous complete step stays on every rank (nothing
is pruned below the newest step every rank has), with --on-checkpoint-error continue training
goes on, and --resume finds a common step (the default, stop: tests/test_checkpoint_stop.py).
A killed write's temp file is removed at the next start; SIGTERM to one rank saves an
emergency checkpoint. Full and read-only folders are real tmpfs mounts (root)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from modules.train.checkpoint import (
    AsyncCheckpointer,
    complete_steps,
    prune,
    step_files,
    step_path,
    write_step,
)
from testkit.fault_harness import Ranks, free_port, write_trial_plan

STATE = {"w": torch.arange(300_000, dtype=torch.float32)}  # 1.2 MB


@contextlib.contextmanager
def tmpfs(path: Path, size: str, readonly: bool = False) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` (skipped, saying why, where mounting is not
    allowed)."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if readonly else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def temps(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*.tmp")]


def test_a_full_disk_write_reports_path_and_space_and_leaves_nothing(tmp_path):
    with tmpfs(tmp_path / "ck", "1m") as ck:
        why = write_step(ck, 0, 4, {"rank": 0}, STATE)
        assert why is not None and str(step_path(ck, 0, 4)) in why, why
        assert "No space left on device" in why and "it needs 1" in why and "free there" in why
        assert temps(ck) == [] and step_files(ck, 0) == []


def test_a_read_only_folder_is_reported_not_raised(tmp_path):
    with tmpfs(tmp_path / "ro", "1m", readonly=True) as ro:
        why = write_step(ro, 1, 2, {"rank": 1}, STATE)
    assert why is not None and "Read-only file system" in why and "rank1" in why, why


def test_the_writer_goes_on_after_a_failed_save_and_keeps_the_older_steps(tmp_path):
    logged: list[str] = []
    with tmpfs(tmp_path / "ck", "4m") as ck:
        w = AsyncCheckpointer(ck, 0, keep=1, log=logged.append)
        w.save(2, {}, STATE)
        w.flush()
        w.save(4, {}, {"w": torch.zeros(2_000_000)})  # 8 MB: does not fit
        w.flush()  # no exception: the run goes on
        assert w.last_step == 2 and complete_steps(ck, 0) == [2] and temps(ck) == []
        assert len(w.failures) == 1 and "step 2 stays the newest complete one" in logged[-1]
        w.save(6, {}, STATE)
        w.flush()
        assert complete_steps(ck, 0) == [6]


def test_prune_never_deletes_the_newest_step_every_rank_has(tmp_path):
    for s in (2, 4, 6, 8):
        write_step(tmp_path, 0, s, {}, {"x": torch.zeros(1)})
    prune(tmp_path, 0, keep=1, floor=4)  # another rank's newest complete step is 4
    assert step_files(tmp_path, 0) == [4, 6, 8]
    prune(tmp_path, 0, keep=1, floor=None)
    assert step_files(tmp_path, 0) == [8]


def test_a_killed_writes_temp_file_is_removed_at_the_next_start(tmp_path):
    write_step(tmp_path, 3, 2, {}, {"x": torch.zeros(1)})
    stale = step_path(tmp_path, 3, 4).parent / ".step00000004.pt.k1ll3d.tmp"
    stale.write_bytes(b"x" * 1000)
    logged: list[str] = []
    AsyncCheckpointer(tmp_path, 3, log=logged.append)
    assert not stale.exists() and step_files(tmp_path, 3) == [2]
    assert any(str(stale) in m and "killed" in m for m in logged), logged


def run_ranks(tmp_path: Path, name: str, ck: Path, *args: str) -> Ranks:
    plan = write_trial_plan(tmp_path / "plan.json", 3, 1, "diloco")
    ranks = Ranks(plan, f"tcp://127.0.0.1:{free_port()}", tmp_path / name)
    ranks.out_dir.mkdir()
    for r in range(3):
        ranks.start(r, "--fake-data", "--timeout-s", "30", "--heartbeat-timeout-s", "2",
                    "--min-replicas", "1", "--ckpt-dir", str(ck), *args)
    return ranks


@pytest.mark.timeout(300)
def test_diloco_on_a_full_tmpfs_trains_on_and_resumes_from_a_common_step(tmp_path):
    # a checkpoint of gpt-tiny is 17.4 MB: every rank's step 4 fits, step 8 fits on one rank
    # at most, and that rank (--keep-checkpoints 1) must still keep step 4, the common one
    with tmpfs(tmp_path / "ck", "72m") as ck:
        ranks = run_ranks(tmp_path, "first", ck, "--steps", "16", "--ckpt-every", "4",
                          "--keep-checkpoints", "1", "--on-checkpoint-error", "continue")
        try:
            codes = ranks.wait(150)
        finally:
            ranks.stop()
        logs = "\n".join(ranks.output(r) for r in range(3))
        assert codes == {0: 0, 1: 0, 2: 0}, logs[-6000:]
        assert "checkpoint of step" in logs and "No space left on device" in logs, logs[-6000:]
        assert "Traceback" not in logs and temps(ck) == []
        common = set.intersection(*(set(complete_steps(ck, r)) for r in range(3)))
        assert 4 in common, [complete_steps(ck, r) for r in range(3)]
        again = run_ranks(tmp_path, "again", ck, "--steps", "20", "--ckpt-every", "100",
                          "--resume", "--on-checkpoint-error", "continue")
        try:
            codes = again.wait(150)
        finally:
            again.stop()
        logs = "\n".join(again.output(r) for r in range(3))
    assert codes == {0: 0, 1: 0, 2: 0}, logs[-6000:]
    assert f"resumed from step {max(common)}" in logs, logs[-6000:]


@pytest.mark.timeout(200)
def test_sigterm_to_one_rank_saves_an_emergency_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    ranks = run_ranks(tmp_path, "run", ck, "--steps", "400")
    try:
        assert ranks.wait_for_text(0, "step 10/", 90), ranks.output(0)[-3000:]
        ranks.procs[2].terminate()
        code = ranks.procs[2].wait(30)
        codes = ranks.wait(120)
    finally:
        ranks.stop()
    out = ranks.output(2)
    assert code == 143 and "stopped by SIGTERM" in out, out[-3000:]
    assert "checkpoint:" in out and complete_steps(ck, 2), out[-3000:]
    assert codes[0] == 0 and codes[1] == 0, ranks.output(0)[-3000:]
