"""A checkpoint that cannot be written is retried once, then stops every rank (exit 1) naming
the path, the reason and the step --resume restarts from, unless --on-checkpoint-error
continue (modules/train/ckpt_stop.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_checkpoint_faults import run_ranks, tmpfs

from modules.control.protocol import checkpoint_key
from modules.train import checkpoint
from modules.train.checkpoint import AsyncCheckpointer, complete_steps
from modules.train.ckpt_stop import STOP_KEY, CheckpointStop, newest_steps, start_note

STATE = {"w": torch.zeros(1000)}


class DictStore:
    """The signed store's calls, in a dict (one process, no signatures)."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}

    def put(self, key: str, value: str) -> None:
        self.data[key] = value

    def read(self, key: str) -> str | None:
        return self.data.get(key)

    def read_int(self, key: str, default: int = 0) -> int:
        return int(self.data.get(key, default))

    def claim(self, key: str, value: str) -> str:
        return self.data.setdefault(key, value)


@pytest.fixture(autouse=True)
def quick_retry(monkeypatch) -> None:
    monkeypatch.setattr(checkpoint, "RETRY_PAUSE_S", 0.01)


def test_a_transient_failure_is_retried_once(tmp_path: Path, monkeypatch) -> None:
    real, calls = checkpoint.write_step, []

    def flaky(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return "cannot write x (Input/output error)" if len(calls) == 1 else real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "write_step", flaky)
    failed: list[tuple[int, str]] = []
    logged: list[str] = []
    w = AsyncCheckpointer(tmp_path, 0, log=logged.append,
                          on_failure=lambda s, why: failed.append((s, why)))
    w.save(3, {}, STATE)
    w.flush()
    assert len(calls) == 2 and failed == [] and w.last_step == 3 and complete_steps(tmp_path, 0)
    assert "retrying once" in logged[0]


def test_a_second_failure_goes_to_the_handler(tmp_path: Path) -> None:
    failed: list[tuple[int, str]] = []
    w = AsyncCheckpointer(tmp_path, 1, log=lambda m: None,
                          on_failure=lambda s, why: failed.append((s, why)))
    w.save(2, {}, STATE)
    w.flush()
    w.fail_from = 4
    w.save(4, {}, STATE)
    w.flush()
    assert [s for s, _ in failed] == [4] and "rank1/step00000004.pt" in failed[0][1]
    assert w.last_step == 2 and complete_steps(tmp_path, 1) == [2]


def test_a_read_only_folder_stops_the_run(tmp_path: Path) -> None:
    stop = CheckpointStop(0)
    with tmpfs(tmp_path / "ro", "1m", readonly=True) as ro:
        w = AsyncCheckpointer(ro, 0, log=lambda m: None,
                              on_failure=lambda s, why: stop.failed(s, why, w.last_step))
        w.save(5, {}, STATE)
        w.flush()
    store = DictStore()
    reason = stop.poll(store, [0, 1])
    assert reason is not None and "Read-only file system" in reason and "step 5" in reason
    assert "no step is completely written on every rank: this run cannot be resumed" in reason


def test_every_rank_reads_the_first_failure_and_the_common_step() -> None:
    store = DictStore()
    for r, last in ((0, 8), (1, 8), (2, 4)):
        store.put(checkpoint_key(r), str(last))
    failing, other = CheckpointStop(2), CheckpointStop(0)
    assert other.poll(store, [0, 1, 2]) is None  # nobody failed yet
    failing.failed(8, "cannot write ck/rank2/step00000008.pt (No space left on device)", 4)
    failing.failed(12, "a later failure is not the one told", 4)
    mine = failing.poll(store, [0, 1, 2])
    theirs = other.poll(store, [0, 1, 2])
    assert mine == theirs and json.loads(store.data[STOP_KEY])["step"] == 8
    assert "rank 2 could not write its checkpoint of step 8, also on a retry" in theirs
    assert "No space left on device" in theirs and "step 4 is complete on every rank" in theirs
    assert "(newest complete step by rank: 0: 8, 1: 8, 2: 4)" in theirs
    assert newest_steps(store, [0, 1]) == ("step 8 is complete on every rank: --resume restarts "
                                           "there")


def test_the_start_line_states_the_policy() -> None:
    from modules.config import CheckpointConfig

    note = start_note(CheckpointConfig(dir="ck", every=10), 100)
    assert note == ("; checkpoints to ck every 10 steps and at the end (a write that fails twice "
                    "stops every rank: --on-checkpoint-error stop)")
    assert "training goes on" in start_note(CheckpointConfig(dir="ck", on_error="continue"), 9)
    assert start_note(CheckpointConfig(), 9) == ""


@pytest.mark.timeout(200)
def test_one_ranks_failed_checkpoint_stops_every_rank(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    ranks = run_ranks(tmp_path, "run", ck, "--steps", "400", "--ckpt-every", "4",
                      "--debug-ckpt-fail", "2:8")
    try:
        codes = ranks.wait(150)
    finally:
        ranks.stop()
    logs = [ranks.output(r) for r in range(3)]
    assert codes == {0: 1, 1: 1, 2: 1}, "\n".join(logs)[-6000:]
    assert "(a write that fails twice stops every rank: --on-checkpoint-error stop)" in logs[0]
    for out in logs:
        assert "rank 2 could not write its checkpoint of step 8, also on a retry" in out, \
            out[-3000:]
        assert "step 4 is complete on every rank: --resume restarts there" in out, out[-3000:]
        assert "Traceback" not in out
    assert 4 in set.intersection(*(set(complete_steps(ck, r)) for r in range(3)))


def checkpointing(tmp_path: Path, policy: str, logged: list[str]):  # noqa: ANN201
    import threading

    from modules.config import CheckpointConfig
    from modules.train.checkpointing import Checkpointing

    cfg = CheckpointConfig(dir=str(tmp_path), every=4, on_error=policy)
    return Checkpointing(cfg, 0, {}, lambda: STATE, lambda: 4, threading.Lock(), False,
                         log=logged.append, fail_from=4)


def test_a_failed_last_write_ends_the_run_with_the_message(tmp_path: Path) -> None:
    from modules.train.ckpt_stop import CheckpointFailed

    logged: list[str] = []
    ck = checkpointing(tmp_path, "stop", logged)
    ck.save()
    ck.flush()
    assert ck.stop.pending and "stopping every rank" in logged[-1]
    store = DictStore()
    store.put(checkpoint_key(1), "4")
    ck.share_floor(store, [0, 1])  # the last publish, before the end's barrier
    other = CheckpointStop(1)
    assert "rank 0 could not write its checkpoint of step 4" in other.poll(store, [0, 1])
    ck.at_end(store, [0, 1])
    with pytest.raises(CheckpointFailed, match="no step is completely written on every rank"):
        ck.raise_at_end()


def test_continue_trains_on_and_says_at_the_end_that_no_step_is_common(tmp_path: Path) -> None:
    logged: list[str] = []
    ck = checkpointing(tmp_path, "continue", logged)
    ck.save()
    ck.flush()
    assert not ck.stop.pending and "training goes on" in logged[-1]
    store = DictStore()
    store.put(checkpoint_key(1), "4")
    ck.share_floor(store, [0, 1])
    ck.at_end(store, [0, 1])
    ck.raise_at_end()  # continue: no error
    assert "warning: checkpoints at the end of the run: no step is completely written" \
        in logged[-1]
