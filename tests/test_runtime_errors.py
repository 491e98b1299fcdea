"""Bad input to dist_runner.py: clear `error:` lines, exit 2 (user) or 1 (peers), no hang."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from formats.cluster import save_cluster
from formats.plan import Plan, save_plan
from scheduler.scenarios import random_cluster
from tests.conftest import ROOT, run_entry

PLAN = Plan("local", "", "gpt-tiny", [(0, 2), (2, 4)], [[0, 1], [2, 3]], micro_batch_size=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _runner(tmp_path, *args, plan=PLAN, timeout=60):
    save_plan(plan, tmp_path / "plan.json")
    return run_entry("dist_runner.py", "--plan", str(tmp_path / "plan.json"), "--steps", "2",
                     *args, timeout=timeout)


def _assert_clear(proc, code: int, text: str) -> None:
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert f"error: {text}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_rank_not_in_plan(tmp_path):
    proc = _runner(tmp_path, "--rank", "7", "--world-size", "4", "--dist-url",
                   "tcp://127.0.0.1:1", "--fake-data")
    _assert_clear(proc, 2, "rank 7 is not in the plan")


def test_world_size_disagrees_with_plan(tmp_path):
    proc = _runner(tmp_path, "--rank", "0", "--world-size", "3", "--dist-url",
                   "tcp://127.0.0.1:1", "--fake-data")
    _assert_clear(proc, 2, "world size 3 disagrees with the plan, which has 4 devices")


def test_missing_data_path(tmp_path):
    proc = _runner(tmp_path, "--rank", "0", "--dist-url", "tcp://127.0.0.1:1", "--data",
                   str(tmp_path / "missing.txt"))
    _assert_clear(proc, 2, f"data: {tmp_path / 'missing.txt'} does not exist")


def test_bad_dist_url(tmp_path):
    proc = _runner(tmp_path, "--rank", "0", "--dist-url", "http://x", "--fake-data")
    _assert_clear(proc, 2, "--dist-url: expected tcp://HOST:PORT")


def test_plan_cluster_mismatch(tmp_path):
    save_cluster(random_cluster(seed=0, num_devices=4, num_regions=2), tmp_path / "a.json")
    other = random_cluster(seed=1, num_devices=4, num_regions=2)
    plan = Plan(other.name, other.sha256(), "gpt-tiny", PLAN.stages, PLAN.pipelines)
    proc = _runner(tmp_path, "--rank", "0", "--dist-url", "tcp://127.0.0.1:1", "--fake-data",
                   "--cluster", str(tmp_path / "a.json"), plan=plan)
    _assert_clear(proc, 2, "")
    assert "cluster_sha256 differs" in proc.stderr
    save_cluster(random_cluster(seed=0, num_devices=2, num_regions=1), tmp_path / "b.json")
    proc = _runner(tmp_path, "--rank", "0", "--dist-url", "tcp://127.0.0.1:1", "--fake-data",
                   "--cluster", str(tmp_path / "b.json"))
    _assert_clear(proc, 2, "")
    assert "not in cluster" in proc.stderr


@pytest.mark.timeout(60)
def test_unreachable_dist_url_fails_within_timeout(tmp_path):
    t0 = time.monotonic()
    proc = _runner(tmp_path, "--rank", "1", "--dist-url", f"tcp://127.0.0.1:{_free_port()}",
                   "--fake-data", "--timeout-s", "3")
    elapsed = time.monotonic() - t0
    _assert_clear(proc, 1, "rendezvous: cannot reach tcp://127.0.0.1:")
    assert elapsed < 25  # 3 s budget + interpreter and torch start-up on a busy machine


@pytest.mark.timeout(60)
def test_ranks_that_never_join_fail_within_timeout(tmp_path):
    proc = _runner(tmp_path, "--rank", "0", "--dist-url", f"tcp://127.0.0.1:{_free_port()}",
                   "--fake-data", "--timeout-s", "3")
    _assert_clear(proc, 1, "rendezvous: not all 4 ranks joined")


@pytest.mark.timeout(120)  # not slow: the one torchrun run that `-m "not slow"` keeps
def test_runs_under_torchrun(tmp_path):
    plan = Plan("local", "", "gpt-tiny", [(0, 2), (2, 4)], [[1, 0]], micro_batch_size=1)
    save_plan(plan, tmp_path / "plan.json")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
         str(ROOT / "dist_runner.py"), "--plan", str(tmp_path / "plan.json"), "--steps", "2",
         "--fake-data", "--threads", "1", "--metrics", str(tmp_path / "m.jsonl")],
        cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "rank 0: step 2/2 loss" in proc.stdout
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2

