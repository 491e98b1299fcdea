"""Asynchronous checkpoints: a rank killed (SIGKILL) while its background write is half done
leaves only a temp file; --resume picks the newest step every rank completed and reproduces the
losses of an uninterrupted run from there."""

from __future__ import annotations

import pytest
import torch

from formats.plan import Plan, SyncConfig, save_plan
from modules.train.checkpoint import AsyncCheckpointer, complete_steps, load_checkpoint, rank_dir
from modules.train.metrics import read_metrics
from testkit.fault_harness import Ranks, free_port

PLAN = Plan("local", "", "gpt-tiny", [(0, 4)], [[0], [1]], micro_batch_size=1,
            sync=SyncConfig(mode="allreduce"))


def _run(tmp_path, name: str, *args: str, timeout: float = 90) -> tuple[Ranks, dict]:
    out = tmp_path / name
    out.mkdir()
    save_plan(PLAN, tmp_path / "plan.json")
    ranks = Ranks(tmp_path / "plan.json", f"tcp://127.0.0.1:{free_port()}", out)
    try:
        for r in (0, 1):
            ranks.start(r, "--fake-data", "--timeout-s", "20", "--metrics",
                        str(out / "m.jsonl"), *args)
        codes = ranks.wait(timeout)
    finally:
        left = ranks.stop()
    assert not left, f"ranks {left} still running after {timeout} s: " + ranks.output(0)[-2000:]
    return ranks, codes


@pytest.mark.timeout(280)
def test_kill_during_background_write_then_resume_from_previous_complete_step(tmp_path):
    ck = tmp_path / "ck"
    common = ("--ckpt-dir", str(ck), "--ckpt-every", "2", "--steps", "8")
    ranks, codes = _run(tmp_path, "crash", *common, "--debug-ckpt-die", "1:4")
    assert codes[1] == -9, ranks.output(1)
    assert codes[0] != 0, ranks.output(0)
    assert "error:" in ranks.output(0) and "Traceback" not in ranks.output(0)
    assert complete_steps(ck, 1) == [2]  # step 4 was half written when it died
    assert [p.name for p in rank_dir(ck, 1).glob(".step00000004.pt.*.tmp")], \
        list(rank_dir(ck, 1).iterdir())
    assert 4 in complete_steps(ck, 0)

    full, codes = _run(tmp_path, "full", "--steps", "8", "--ckpt-dir", str(tmp_path / "ck_sync"),
                       "--ckpt-every", "4", "--sync-checkpoints", "--keep-checkpoints", "1")
    assert codes == {0: 0, 1: 0}, full.output(0)[-2000:]
    assert complete_steps(tmp_path / "ck_sync", 0) == [8]  # written on the training thread
    resumed, codes = _run(tmp_path, "resume", *common, "--resume")
    assert codes == {0: 0, 1: 0}, resumed.output(0)[-2000:] + resumed.output(1)[-2000:]
    assert "resumed from step 2" in resumed.output(0)
    want = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "full" / "m.jsonl")}
    got = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "resume" / "m.jsonl")}
    assert sorted(got) == list(range(3, 9))
    assert got == {s: want[s] for s in range(3, 9)}  # bit-identical from the resumed step
    # the last two complete checkpoints are kept, temp files of the crash are not complete
    assert complete_steps(ck, 0) == complete_steps(ck, 1) == [6, 8]


def test_async_checkpointer_keeps_the_newest_and_snapshots_at_call_time(tmp_path):
    ck = AsyncCheckpointer(tmp_path, 3, keep=2)
    t = torch.zeros(1000)
    for step in (1, 2, 3):
        t.fill_(step)
        ck.save(step, {"rank": 3}, {"step": step, "t": t})
        t.fill_(-1)  # changing the live tensor after save() must not reach the file
    assert ck.flush(timeout=30)
    assert complete_steps(tmp_path, 3) == [2, 3]
    state = load_checkpoint(rank_dir(tmp_path, 3) / "step00000003.pt", {"rank": 3})
    assert state["step"] == 3 and bool((state["t"] == 3).all())
    assert len(ck.block_s) == 3
