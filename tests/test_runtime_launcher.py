"""scripts/launch_local.py: rank-prefixed logs and progress, a failing rank stops the others,
SIGTERM stops every child, bad arguments are clear errors."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from formats.plan import Plan, SyncConfig, save_plan
from tests.conftest import ROOT, run_entry

DILOCO_1X2 = Plan("local", "", "gpt-tiny", [(0, 4)], [[0], [1]], micro_batch_size=1,
                  sync=SyncConfig(mode="diloco", inner_steps=2))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(120)
def test_failing_rank_stops_the_others_and_sets_the_status(tmp_path):
    save_plan(DILOCO_1X2, tmp_path / "plan.json")
    # rank 1 dies with status 3 before step 3; rank 0 would wait for it forever (--wait-for-peers)
    # at the outer step after step 4; rank 0 printed step 1 before the outer step at 2
    proc = run_entry("scripts/launch_local.py", "--plan", str(tmp_path / "plan.json"),
                     "--threads-per-rank", "1", "--grace-s", "2", "--", "--steps", "50",
                     "--fake-data", "--timeout-s", "60", "--wait-for-peers",
                     "--debug-vanish", "1:3:3", timeout=100)
    assert proc.returncode == 3, proc.stdout[-3000:]
    assert "launch: rank 1 exited with status 3; stopping the other ranks" in proc.stdout
    assert re.search(r"^\[rank 0\] step 1/50 loss [\d.]+ tok/s \d+", proc.stdout, re.M)
    pids = [int(p) for p in re.findall(r"launch: rank \d pid (\d+)", proc.stdout)]
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


@pytest.mark.timeout(120)
def test_sigterm_stops_every_child(tmp_path):
    save_plan(DILOCO_1X2, tmp_path / "plan.json")
    launcher = subprocess.Popen(  # relative paths: ranks work in the caller's directory
        [sys.executable, str(ROOT / "scripts/launch_local.py"), "--plan", "plan.json",
         "--threads-per-rank", "1", "--grace-s", "3", "--", "--steps", "100000", "--fake-data",
         "--metrics", "m.jsonl"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids, lines = [], []
    try:
        for line in launcher.stdout:  # read until training is under way
            lines.append(line)
            m = re.match(r"launch: rank \d pid (\d+)", line)
            if m:
                pids.append(int(m.group(1)))
            if "step 2/100000" in line:
                break
        assert len(pids) == 2, "".join(lines)
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        rest, _ = launcher.communicate(timeout=30)
        assert launcher.returncode == 130, rest
        assert "SIGTERM; stopping every rank" in rest
        assert time.monotonic() - t0 < 15
        assert not any(_alive(p) for p in pids)
        assert (tmp_path / "m.jsonl").exists()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_bad_netns_map_is_a_clear_error(tmp_path):
    save_plan(DILOCO_1X2, tmp_path / "plan.json")
    (tmp_path / "map.json").write_text('{"0": "ns0"}')
    proc = run_entry("scripts/launch_local.py", "--plan", str(tmp_path / "plan.json"),
                     "--netns-map", str(tmp_path / "map.json"), "--", "--steps", "1")
    assert proc.returncode == 2
    assert "error: --netns-map: ranks [1] have no namespace" in proc.stderr


@pytest.mark.timeout(150)
def test_keep_going_lets_diloco_drop_a_lost_replica_and_finish(tmp_path):
    plan = Plan("local", "", "gpt-tiny", [(0, 4)], [[0], [1], [2]], micro_batch_size=1,
                sync=SyncConfig(mode="diloco", inner_steps=2))
    save_plan(plan, tmp_path / "plan.json")
    # rank 2 (replica 2) dies with status 1 before step 3; replicas 0 and 1 drop it and finish
    proc = run_entry("scripts/launch_local.py", "--plan", str(tmp_path / "plan.json"),
                     "--threads-per-rank", "1", "--keep-going", "--", "--steps", "8",
                     "--fake-data", "--timeout-s", "30", "--heartbeat-timeout-s", "2",
                     "--min-replicas", "2", "--debug-vanish", "2:3:1", timeout=140)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "launch: rank 2 exited with status 1; the others go on (--keep-going)" in proc.stdout
    assert "launch: ranks [2] failed; replicas [0, 1] finished" in proc.stdout
    assert re.search(r"^\[rank 0\] step 8/8 loss", proc.stdout, re.M), proc.stdout[-3000:]
