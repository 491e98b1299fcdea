"""scripts/slurm_job.py without Slurm: layout, srun argv, a task's rank and GPU, the batch
script, requeue resume, scontrol's job states; and slurm.py's one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, run_entry

from formats.cluster import Cluster, Device
from formats.errors import UserError
from formats.plan import Plan
from scripts import slurm_job as sj


def plan(n: int) -> Plan:
    """gpt-tiny, n replicas of 1 stage on devices 0..n-1."""
    return Plan("c", "", "gpt-tiny", [(0, 4)], [[d] for d in range(n)])


def cluster(hosts: list[str]) -> Cluster:
    """One device per entry, on that host."""
    n = len(hosts)
    devs = [Device(i, f"d{i}", h, h, "cpu", 1.0, 1.0) for i, h in enumerate(hosts)]
    return Cluster("c", devs, np.zeros((n, n)), np.ones((n, n)))


def test_layout_block_and_arbitrary() -> None:
    lay = sj.plan_layout(plan(4), ["a", "b"], None, 2)
    assert lay.node_of == [0, 0, 1, 1] and lay.block() == 2
    argv = sj.srun_argv(lay, ["python", "t"], 3)
    assert "--ntasks=4" in argv and "--ntasks-per-node=2" in argv and "--nodelist=a,b" in argv
    assert argv[-2:] == ["python", "t"] and "--cpus-per-task=3" in argv
    # a cluster whose hosts interleave: task i goes to its device's host, by name
    lay = sj.plan_layout(plan(4), ["a", "b"], cluster(["b", "a", "b", "a"]), 1)
    assert lay.node_of == [1, 0, 1, 0] and lay.block() is None
    assert lay.hostfile() == "b\na\nb\na\n"
    assert "--distribution=arbitrary" in sj.srun_argv(lay, ["t"], 1, "hosts")
    # host names that are not node names: the cluster's hosts in order onto the nodes
    assert sj.plan_layout(plan(2), ["n1", "n2"], cluster(["x", "y"]), 1).node_of == [0, 1]


def test_layout_needs_more_nodes_than_allocated() -> None:
    with pytest.raises(UserError, match="needs 2 nodes .* allocation has 1 .*--nodes 2"):
        sj.plan_layout(plan(4), ["a"], None, 2)
    with pytest.raises(UserError, match="needs 3 nodes"):
        sj.plan_layout(plan(3), ["a", "b"], cluster(["x", "y", "z"]), 1)
    with pytest.raises(UserError, match="4 ranks but the allocation has 2 tasks"):
        sj.check_tasks(sj.plan_layout(plan(4), ["a", "b"], None, 2), 2)


def test_task_rank_and_gpu_from_slurm_env() -> None:
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1"}
    assert sj.task_target(env, [0, 1, 2, 3], 0) == sj.TaskTarget(3, 4, None)  # CPU
    assert sj.task_target(env, [0, 1, 2, 3], 2) == sj.TaskTarget(3, 4, 1)  # local rank = GPU
    one = dict(env, CUDA_VISIBLE_DEVICES="5")  # srun --gpus-per-task=1: its one device
    assert sj.task_target(one, [0, 1, 2, 3], 2).cuda_device == 0
    many = dict(env, CUDA_VISIBLE_DEVICES="4,6")
    assert sj.task_target(many, [0, 1, 2, 3], 2).cuda_device == 1
    with pytest.raises(UserError, match="local rank 1 .* has no GPU"):
        sj.task_target(env, [0, 1, 2, 3], 1)  # 1 GPU per node, 2 ranks on it
    with pytest.raises(UserError, match=r"\$SLURM_NTASKS is 4 but the plan has 2"):
        sj.task_target(env, [0, 1], 0)
    with pytest.raises(UserError, match=r"\$SLURM_PROCID is not set"):
        sj.task_target({"SLURM_NTASKS": "4"}, [0, 1, 2, 3], 0)


def test_requeue_resumes_only_with_a_checkpoint(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    assert not sj.want_resume({"SLURM_RESTART_COUNT": "1"}, False, ckpt)
    (ckpt / "rank0").mkdir(parents=True)
    (ckpt / "rank0" / "step00000004.pt").write_bytes(b"x")
    assert sj.want_resume({"SLURM_RESTART_COUNT": "1"}, False, ckpt)
    assert not sj.want_resume({"SLURM_RESTART_COUNT": ""}, False, ckpt)
    assert not sj.want_resume({}, False, ckpt) and sj.want_resume({}, True, ckpt)


def test_batch_script_runs_itself(tmp_path) -> None:
    sub = sj.Submission(nodes=2, ntasks=8, ntasks_per_node=4, gpus_per_node=4, cpus_per_task=8,
                        run_dir=str(tmp_path), partition="gpu", time="1:00:00",
                        extra=("--qos=normal",))
    text = sj.sbatch_script(sub, ["python", "slurm.py", "run", "--run-dir", "a b"])
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks=8", "#SBATCH --ntasks-per-node=4",
                 "#SBATCH --gpus-per-node=4", "#SBATCH --partition=gpu", "#SBATCH --requeue",
                 "#SBATCH --time=1:00:00", "#SBATCH --qos=normal", "#SBATCH --open-mode=append",
                 f"#SBATCH --output={tmp_path}/slurm-%j.out"):
        assert line in text.splitlines(), line
    assert text.splitlines()[-1] == "exec python slurm.py run --run-dir 'a b'"
    script = tmp_path / "s.sh"
    script.write_text(text.replace("exec python slurm.py", "exec printf '%s\\n'"))
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                         env=dict(os.environ, SLURM_JOB_ID="7", SLURM_JOB_NODELIST="a"))
    assert out.stdout.splitlines()[-3:] == ["run", "--run-dir", "a b"]  # one argument each
    assert sj.submission_shape(8, 2, 4, 0) == (8, 4)
    assert sj.submission_shape(3, 2, 0, 0) == (3, None)
    with pytest.raises(UserError, match="ask for --nodes 3"):
        sj.submission_shape(9, 2, 4, 0)


def test_job_states() -> None:
    line = ("JobId=5 JobName=x JobState=RUNNING Reason=None Restarts=1 ExitCode=0:0 "
            "NumNodes=1")
    assert sj.job_outcome(sj.job_fields(line)) == ("RUNNING", None)
    assert sj.job_outcome({"JobState": "COMPLETED", "ExitCode": "0:0"}) == ("COMPLETED", 0)
    assert sj.job_outcome({"JobState": "FAILED", "ExitCode": "2:0"}) == ("FAILED", 2)
    assert sj.job_outcome({"JobState": "CANCELLED", "ExitCode": "0:15"}) == ("CANCELLED", 143)
    assert sj.job_outcome({"JobState": "TIMEOUT", "ExitCode": "0:0"})[1] == 1
    assert sj.job_outcome({"JobState": "PENDING"}) == ("PENDING", None)  # requeued: goes on
    assert sj.hopeless({"JobState": "PENDING", "Reason": "PartitionNodeLimit"})
    assert sj.hopeless({"JobState": "PENDING", "Reason": "Resources"}) is None


def test_flags_set_per_rank_are_refused() -> None:
    with pytest.raises(UserError, match="--rank after --: scripts/slurm.py sets it"):
        sj.check_runner_flags(["--steps", "3", "--rank=1"])
    assert sj.flag_value(["--ckpt-dir", "a", "--ckpt-dir=b"], "--ckpt-dir") == "b"


def test_cli_errors_are_one_line(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = run_entry("scripts/slurm.py", "run", "--run-dir", str(tmp_path / "r"), "--plan", "p",
                  env=env)
    assert r.returncode == 2 and r.stderr.startswith("error: run: not inside a Slurm allocation")
    env["PATH"] = str(tmp_path)  # no sbatch on PATH
    pl = tmp_path / "plan.json"
    from formats.plan import save_plan
    save_plan(plan(2), pl)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "slurm.py"), "submit", "--plan",
                        str(pl), "--run-dir", str(tmp_path / "r"), "--", "--steps", "2",
                        "--fake-data"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "sbatch not found on PATH" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1
    r = run_entry("scripts/slurm.py", "submit", "--plan", str(pl), "--run-dir", "r", "--",
                  "--rank", "0")
    assert r.returncode == 2 and "--rank after --" in r.stderr
    r = run_entry("scripts/slurm.py", "submit", "--plan", str(pl), "--run-dir", "r", "--resume",
                  "--dry-run", "--", "--steps", "2", "--fake-data")
    assert r.returncode == 0 and " --resume -- --steps 2 --fake-data" in r.stdout, r.stderr
    r = run_entry("scripts/slurm.py", "submit", "--plan", str(pl), "--run-dir", "r", "--dry-run",
                  "--", "--steps", "2", "--fake-data", "--resume")  # the ckpt folder is ours
    assert r.returncode == 0, r.stderr
    r = run_entry("scripts/slurm.py", "--help")
    assert r.returncode == 0 and "submit" in r.stdout and "--resume" in r.stdout
    assert "--wait" in run_entry("scripts/slurm.py", "submit", "--help").stdout


def test_overcommit_drops_ntasks_per_node(tmp_path) -> None:
    sub = sj.Submission(nodes=1, ntasks=4, ntasks_per_node=4, gpus_per_node=0, cpus_per_task=1,
                        run_dir=str(tmp_path), extra=("--overcommit",))
    lines = sj.sbatch_script(sub, ["true"]).splitlines()
    assert "#SBATCH --overcommit" in lines and "#SBATCH --ntasks=4" in lines
    assert not any(x.startswith("#SBATCH --ntasks-per-node") for x in lines)


def test_submission_from_cluster_without_plan(tmp_path) -> None:
    from formats.cluster import save_cluster
    from scripts import slurm

    save_cluster(cluster(["a", "a", "b", "b"]), tmp_path / "c.json")
    args = slurm.build_parser().parse_args(["submit", "--cluster", str(tmp_path / "c.json"),
                                            "--model", "gpt-tiny", "--run-dir", "r"])
    sub = slurm.submission(args, tmp_path)
    assert (sub.nodes, sub.ntasks, sub.ntasks_per_node) == (2, 4, 2)  # its hosts, its devices
