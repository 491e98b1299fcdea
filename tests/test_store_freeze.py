"""A frozen or cut-off store host is noticed within the heartbeat timeout, named (which host,
since when), and every rank stops cleanly with a checkpoint to resume from (the documented
rule, docs/security.md): SIGSTOP of the coordinator, SIGSTOP of rank 0 as the store's host,
and the store's port DROPped by iptables (in a network namespace of its own)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from modules.train.checkpoint import complete_steps
from testkit.fault_harness import ROOT, Ranks, free_port, write_trial_plan

HB = 2.0
SAID = "does not answer: no reply since"


def start(out: Path, coordinator: bool) -> Ranks:
    """A 1 x 3 DiLoCo run with checkpoints (only the emergency ones), past step 6."""
    out.mkdir(parents=True, exist_ok=True)
    plan = write_trial_plan(out / "plan.json", 3, 1, "diloco")
    ranks = Ranks(plan, f"tcp://127.0.0.1:{free_port()}", out)
    if coordinator:
        ranks.start_coordinator()
    for r in range(3):
        ranks.start(r, "--fake-data", "--steps", "5000", "--timeout-s", "60",
                    "--heartbeat-timeout-s", str(HB), "--min-replicas", "1",
                    "--ckpt-dir", str(out / "ck"), "--ckpt-every", "100000")
    assert ranks.wait_for_text(0, "step 6/", 90), ranks.output(0)[-3000:]
    return ranks


def watch_exits(ranks: Ranks, watched: list[int], t0: float, limit_s: float) -> dict:
    """{rank: (exit status, seconds after t0)} of the watched ranks (None when still running)."""
    done: dict[int, tuple[int, float]] = {}
    while time.monotonic() - t0 < limit_s and len(done) < len(watched):
        for r in watched:
            if r not in done and ranks.procs[r].poll() is not None:
                done[r] = (ranks.procs[r].returncode, time.monotonic() - t0)
        time.sleep(0.1)
    return done


def check_stopped(ranks: Ranks, watched: list[int], done: dict, who: str) -> None:
    logs = {r: ranks.output(r) for r in ranks.procs}
    shown = "\n".join(f"[rank {r}] {t[-2500:]}" for r, t in logs.items())
    assert sorted(done) == watched, (done, shown)
    for r in watched:
        code, after = done[r]
        assert code == 1 and SAID in logs[r] and who in logs[r], shown
        assert "checkpoint:" in logs[r] and "Traceback" not in logs[r], shown
        assert complete_steps(ranks.out_dir / "ck", r), shown  # something to resume from
        # detected within the heartbeat timeout (+ one beat, the checkpoint and a loaded box)
        assert after < HB + 15, (r, after, shown)


@pytest.mark.timeout(240)
def test_a_frozen_coordinator_stops_every_rank_with_a_checkpoint(tmp_path):
    ranks = start(tmp_path, coordinator=True)
    try:
        t0 = time.monotonic()
        os.kill(ranks.coordinator.pid, signal.SIGSTOP)
        done = watch_exits(ranks, [0, 1, 2], t0, 60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(ranks.coordinator.pid, signal.SIGCONT)
        ranks.stop()
    check_stopped(ranks, [0, 1, 2], done, "the coordinator tcp://127.0.0.1:")


@pytest.mark.timeout(240)
def test_a_frozen_rank_0_store_host_stops_the_others_with_a_checkpoint(tmp_path):
    ranks = start(tmp_path, coordinator=False)
    try:
        t0 = time.monotonic()
        os.kill(ranks.procs[0].pid, signal.SIGSTOP)
        done = watch_exits(ranks, [1, 2], t0, 60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(ranks.procs[0].pid, signal.SIGCONT)
        ranks.stop()
    check_stopped(ranks, [1, 2], done, "hosted by rank 0 (host")


def drop_trial(out: str, coordinator: bool) -> None:
    """Inside a fresh network namespace: the run (behind a coordinator, or rank 0 hosting the
    store), then the store's port DROPped; the outcome to out/result.json."""
    ranks = start(Path(out), coordinator=coordinator)
    port = ranks.url.rsplit(":", 1)[1]
    try:
        t0 = time.monotonic()
        subprocess.run(["iptables", "-I", "INPUT", "-p", "tcp", "--dport", port, "-j", "DROP"],
                       check=True)
        done = watch_exits(ranks, [0, 1, 2] if coordinator else [1, 2], t0, 60)
    finally:
        ranks.stop()
    Path(out, "result.json").write_text(json.dumps({str(r): v for r, v in done.items()}))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("coordinator", [True, False], ids=["coordinator", "rank0-host"])
def test_a_dropped_store_port_stops_every_rank_with_a_checkpoint(tmp_path, coordinator):
    if os.geteuid() != 0 or not shutil.which("iptables") or not shutil.which("unshare"):
        pytest.skip("needs root, iptables and unshare (a network namespace of its own)")
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
            "from tests.test_store_freeze import drop_trial; "
            f"drop_trial({str(tmp_path)!r}, {coordinator})")
    r = subprocess.run(["flock", "/tmp/netns.lock", "unshare", "-n", "sh", "-c",
                        f'ip link set lo up && exec "{sys.executable}" -c "$0"', code],
                       capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    done = {int(k): tuple(v) for k, v in json.loads((tmp_path / "result.json").read_text()
                                                    ).items()}
    ranks = Ranks(tmp_path / "plan.json", "", tmp_path)
    ranks.procs = {r: None for r in range(3)}  # outputs only
    if coordinator:
        check_stopped(ranks, [0, 1, 2], done, "the coordinator tcp://127.0.0.1:")
    else:
        check_stopped(ranks, [1, 2], done, "hosted by rank 0 (host")
