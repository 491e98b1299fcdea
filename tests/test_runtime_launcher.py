"""scripts/launch_local.py: rank-prefixed logs and progress, a failing rank stops the others,
SIGTERM stops every child (exit 143), ranks die with a SIGKILLed launcher, SIGINT works when a
script started the launcher in the background, bad arguments are clear errors."""

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
    """Running (a zombie waiting for a reaper counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


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
        assert launcher.returncode == 143, rest  # 128 + SIGTERM
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
    # the summary comes from the ranks' status records, which are not echoed
    assert re.search(r"^launch: rank 0 last: step 8/8 loss [\d.]+ tok/s \d+$", proc.stdout,
                     re.M), proc.stdout[-3000:]
    assert "STATUS {" not in proc.stdout


STUB_RANK = """import os, sys, time
print(f"stub {os.getpid()} ready", flush=True)
time.sleep(300)
"""


def _stub_launcher(tmp_path, *extra: str) -> list[str]:
    """launch_local.py over a stand-in rank that only says it is ready and sleeps."""
    save_plan(DILOCO_1X2, tmp_path / "plan.json")
    (tmp_path / "stub.py").write_text(STUB_RANK)
    return [sys.executable, str(ROOT / "scripts/launch_local.py"), "--plan",
            str(tmp_path / "plan.json"), "--runner", str(tmp_path / "stub.py"), "--grace-s", "2",
            *extra]


def _wait_for(pred, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


@pytest.mark.timeout(60)
def test_ranks_die_with_a_sigkilled_launcher(tmp_path):
    launcher = subprocess.Popen(_stub_launcher(tmp_path), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    pids, lines = [], []
    try:
        for line in launcher.stdout:
            lines.append(line)
            pids += [int(p) for p in re.findall(r"stub (\d+) ready", line)]
            if len(pids) == 2:
                break
        assert len(pids) == 2, "".join(lines)
        launcher.kill()  # SIGKILL: no handler, no stop_all; only the kernel can stop the ranks
        t0 = time.monotonic()
        launcher.wait()
        assert _wait_for(lambda: not any(_alive(p) for p in pids), 5), "ranks outlived it"
        print(f"ranks gone {time.monotonic() - t0:.3f} s after the launcher was killed")
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_sigint_stops_a_launcher_that_a_script_started_in_the_background(tmp_path):
    log = tmp_path / "launch.log"
    cmd = " ".join(f"'{a}'" for a in _stub_launcher(tmp_path))
    # a non-interactive shell starts background jobs with SIGINT ignored; the first line
    # shows that for a plain Python started the same way
    probe = "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"
    script = (f"'{sys.executable}' -c '{probe}' &\nwait $!\n"
              f"{cmd} > '{log}' 2>&1 &\necho $!\nwait $!\necho rc=$?\n")
    shell = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    launcher = 0
    try:
        assert shell.stdout.readline().strip() == "True"  # SIGINT ignored
        launcher = int(shell.stdout.readline())

        def ready() -> bool:
            text = log.read_text() if log.exists() else ""
            pids[:] = [int(p) for p in re.findall(r"stub (\d+) ready", text)]
            return len(pids) == 2

        assert _wait_for(ready, 30), log.read_text()
        os.kill(launcher, signal.SIGINT)
        rest, _ = shell.communicate(timeout=20)
        assert rest.strip() == "rc=130", rest + log.read_text()
        assert "launch: SIGINT; stopping every rank" in log.read_text()
        assert not any(_alive(p) for p in pids)
    finally:
        if shell.poll() is None:
            shell.kill()
        for p in [launcher, *pids] if launcher else pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
