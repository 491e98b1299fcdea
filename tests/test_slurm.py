"""scripts/slurm.py on a real one-host Slurm cluster (slurmctld + slurmd + munge, started here).

The fixture installs slurm-wlm and munge when missing (root with apt), writes a private
slurm.conf and starts the daemons on ports of their own; the tests submit plans with
`slurm.py submit ... --wait` and read the run folder the ranks wrote.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, run_entry

from testkit.fault_harness import write_trial_plan
from testkit.slurm_lab import slurm_missing, start_slurm

pytestmark = pytest.mark.slurm

RUNNER = ["--fake-data", "--log-every", "1"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-host Slurm cluster, stopped after the module."""
    why = slurm_missing()
    if why:
        pytest.skip(why)
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPUs for 2 ranks (one task per CPU)")
    lab = start_slurm(tmp_path_factory.mktemp("slurm"))
    yield lab
    lab.stop()


@pytest.fixture(scope="module")
def plan2(tmp_path_factory) -> Path:
    """gpt-tiny, 2 replicas x 1 stage (2 CPU ranks, allreduce)."""
    return write_trial_plan(tmp_path_factory.mktemp("plan") / "plan.json", 2, 1, "allreduce")


def submit(slurm, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """`scripts/slurm.py submit ARGS` against the lab's slurm.conf."""
    return run_entry("scripts/slurm.py", "submit", *args, env=slurm.env, timeout=timeout)


def metrics_steps(run: Path) -> dict[int, int]:
    """{rank: last step} of every rank's timing file in a run folder."""
    out = {}
    for f in sorted((run / "ranks").glob("rank*.jsonl")):
        rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        out[rows[-1]["rank"]] = rows[-1]["step"]
    return out


def test_submit_wait_trains_every_rank(slurm, tmp_path) -> None:
    """4 ranks (2 replicas x 2 stages) for 10 steps; on a 2-CPU node they share CPUs
    (--overcommit), as launch_local.py's ranks share the cores."""
    plan = write_trial_plan(tmp_path / "plan4.json", 2, 2, "allreduce")
    run = tmp_path / "run"
    over = ["--sbatch-arg=--overcommit"] if (os.cpu_count() or 1) < 4 else []
    r = submit(slurm, "--plan", str(plan), "--run-dir", str(run), *over, "--wait", "--",
               "--steps", "10", "--log-every", "5", "--fake-data")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "COMPLETED, exit status 0" in out
    assert "step 10/10" in out  # the trainer's progress, followed from the job's output
    assert metrics_steps(run) == {0: 10, 1: 10, 2: 10, 3: 10}
    for rank in range(4):
        assert (run / "ckpt" / f"rank{rank}" / "step00000010.pt").is_file()
    assert (run / "metrics.jsonl").is_file() and (run / "slurm-submit.sh").is_file()


def test_more_cpu_ranks_than_cpus_named(slurm, tmp_path) -> None:
    n = (os.cpu_count() or 1) + 1
    plan = write_trial_plan(tmp_path / "plan.json", n, 1, "allreduce")
    r = submit(slurm, "--plan", str(plan), "--run-dir", str(tmp_path / "run"), "--wait", "--",
               "--steps", "2", *RUNNER, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    # refused by sbatch, or accepted and left pending (Reason=PartitionConfig): named either way
    assert "--sbatch-arg=--overcommit" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_bad_partition_and_too_many_nodes_one_line(slurm, plan2, tmp_path) -> None:
    for extra, words in ((["--partition", "nosuch"], "invalid partition"),
                         (["--nodes", "2", "--ranks-per-node", "1", "--wait"],
                          "cannot start as asked")):
        r = submit(slurm, "--plan", str(plan2), "--run-dir", str(tmp_path / "bad"), *extra,
                   "--", "--steps", "2", *RUNNER, timeout=60)
        assert r.returncode == 2, r.stdout + r.stderr
        assert words in r.stderr.lower() or words in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_requeued_job_resumes_then_ctrl_c_cancels(slurm, plan2, tmp_path) -> None:
    """`scontrol requeue` mid-run (as preemption does): the same batch script runs again with
    SLURM_RESTART_COUNT=1 and continues from the checkpoints, --wait following both runs; then
    Ctrl+C cancels the job (scancel), every rank saves, and the follower exits 130."""
    run = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "scripts" / "slurm.py"), "submit", "--plan", str(plan2),
           "--run-dir", str(run), "--wait", "--", "--steps", "400", "--ckpt-every", "2", *RUNNER]
    p = subprocess.Popen(cmd, env=slurm.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, cwd=ROOT)
    ctl = {"env": slurm.env, "capture_output": True, "text": True, "timeout": 30}
    lines, job, resumed = [], None, None
    assert p.stdout is not None
    for line in p.stdout:
        lines.append(line)
        if line.startswith("slurm: submitted job "):
            job = line.split()[3]
        elif "rank 0: step 3/400" in line and resumed is None:
            assert subprocess.run(["scontrol", "requeue", job], **ctl).returncode == 0
            _start_now(job, ctl)
            resumed = 0
        elif found := re.search(r"rank 0: resumed from step (\d+)", line):
            resumed = int(found.group(1))  # (also where another rank's output shares the line)
        elif resumed and f"rank 0: step {resumed + 2}/400" in line:
            p.send_signal(signal.SIGINT)  # Ctrl+C
            break
    rest, _ = p.communicate(timeout=120)
    out = "".join(lines) + rest
    assert p.returncode == 130, out
    assert "DUE TO JOB REQUEUE" in out and "restart 1" in out and resumed, out
    assert "continuing from the checkpoints" in out  # --resume added by the requeued job
    assert "cancelling job" in out and "CANCELLED" in out
    assert subprocess.run(["squeue", "-h"], **ctl).stdout.strip() == ""  # nothing left
    assert min(metrics_steps(run).values()) >= resumed + 1
    for k in (0, 1):  # every rank saved past the resumed step (periodic or on SIGTERM)
        steps = [int(f.stem[4:]) for f in (run / "ckpt" / f"rank{k}").glob("step*.pt")]
        assert max(steps) > resumed, steps


def _losses_by_step(run: Path) -> dict[tuple[int, int], float]:
    """{(replica, step): loss} of every record in a run folder's metrics (a resumed run's
    records included: each must be the uninterrupted run's loss at that step)."""
    from modules.train.metrics import read_metrics, replica_metrics_path

    return {(k, r["step"]): r["loss"] for k in (0, 1)
            for r in read_metrics(replica_metrics_path(run / "metrics.jsonl", k))}


def test_a_cancelled_job_resubmitted_with_resume_continues_bit_identically(
        slurm, plan2, tmp_path) -> None:
    """Ctrl+C cancels the job mid-run (every rank saves on SIGTERM); `submit --resume` of the
    same run folder continues from the last step every rank saved; every loss either launch
    recorded equals an uninterrupted run's at that step, to the bit."""
    from modules.train.checkpoint import complete_steps

    cut = tmp_path / "cut"
    cmd = [sys.executable, str(ROOT / "scripts" / "slurm.py"), "submit", "--plan", str(plan2),
           "--run-dir", str(cut), "--wait", "--", "--steps", "400", "--ckpt-every", "2",
           *RUNNER]
    p = subprocess.Popen(cmd, env=slurm.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, cwd=ROOT)
    assert p.stdout is not None
    for line in p.stdout:
        if "rank 0: step 5/400" in line:
            p.send_signal(signal.SIGINT)  # Ctrl+C: scancel, every rank saves
            break
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 130, out
    common = max(set(complete_steps(cut / "ckpt", 0)) & set(complete_steps(cut / "ckpt", 1)))
    assert common >= 4, out
    end = str(common + 3)
    again = submit(slurm, "--plan", str(plan2), "--run-dir", str(cut), "--resume", "--wait",
                   "--", "--steps", end, "--ckpt-every", "2", *RUNNER)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from step {common}" in again.stdout, again.stdout
    full = tmp_path / "full"
    straight = submit(slurm, "--plan", str(plan2), "--run-dir", str(full), "--wait", "--",
                      "--steps", end, "--ckpt-every", "2", *RUNNER)
    assert straight.returncode == 0, straight.stdout + straight.stderr
    want, got = _losses_by_step(full), _losses_by_step(cut)
    assert {s for _, s in want} == set(range(1, common + 4))
    assert {(k, s) for k, s in got if s > common} == {(k, s) for k, s in want if s > common}
    for key, loss in got.items():
        if key[1] <= common + 3:
            assert loss == want[key], (key, loss, want[key])  # bit-identical


def _start_now(job: str, ctl: dict) -> None:
    """Slurm holds a requeued job about two minutes (Reason=BeginTime): release it now, but not
    within the second its first run was killed in. slurmd refuses a launch whose credential is
    no newer (in whole seconds) than the killed run's revocation ("Job credential revoked"),
    and the job then ends FAILED instead of running again: under load the release came that
    fast."""
    for _ in range(150):
        show = subprocess.run(["scontrol", "show", "job", "-o", job], **ctl).stdout
        if "Reason=BeginTime" in show and "JobState=PENDING" in show:
            time.sleep(2.0)
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], **ctl)
            return
        time.sleep(0.2)
