"""scripts/launch_specs.py: the SkyPilot task and the Kubernetes JobSet a plan becomes.

Neither tool runs here: the SkyPilot task is checked against its documented YAML fields and its
`run` script is run for real on two stand-in nodes (SKYPILOT_NODE_RANK / SKYPILOT_NODE_IPS set
as SkyPilot sets them, both on loopback); the JobSet is checked against a schema written from
the JobSet CRD's documented fields (testkit/spec_schemas.py) and each pod's command is run with
a stand-in python that prints the flags it was given.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_entry

from formats.plan import Plan, save_plan
from testkit.fault_harness import write_trial_plan
from testkit.spec_schemas import JOBSET, SKY_TASK, errors

yaml = pytest.importorskip("yaml", reason="PyYAML not installed (the specs are read with it)")


def spec(kind: str, plan: Path, out: Path, *args: str, rest: tuple[str, ...] = ()) -> dict:
    """Write a spec with launch_specs.py and read it back."""
    r = run_entry("scripts/launch_specs.py", kind, "--plan", str(plan), "--out", str(out),
                  *args, "--", *rest)
    assert r.returncode == 0, r.stdout + r.stderr
    return yaml.safe_load(out.read_text())


def test_sky_task_runs_on_two_stand_in_nodes(tmp_path) -> None:
    plan = write_trial_plan(tmp_path / "plan.json", 2, 1, "allreduce")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "run"
    task = spec("sky", plan, tmp_path / "task.yaml", "--ranks-per-node", "1", "--run-dir",
                str(run), "--port", str(port), "--python", sys.executable,
                rest=("--steps", "3", "--fake-data", "--threads", "1"))
    assert errors(task, SKY_TASK) == []
    assert task["num_nodes"] == 2 and "accelerators" not in task["resources"]
    env = dict(os.environ, SKYPILOT_NODE_IPS="127.0.0.1\n127.0.0.1",
               ST_RUN_SECRET="s" * 32, OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen(["bash", "-c", task["run"]], cwd=ROOT, text=True,
                              env=dict(env, SKYPILOT_NODE_RANK=str(k)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for k in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    assert "rank 0: step 3/3" in outs[0] and "rank 1: done" in outs[1]
    assert sorted(p.name for p in (run / "ranks").glob("*.jsonl")) == ["rank0.jsonl",
                                                                       "rank1.jsonl"]
    assert (run / "ckpt" / "rank1" / "step00000003.pt").is_file()
    # recovered on new nodes (spot): the same script continues from the checkpoint
    again = subprocess.run(["bash", "-c", _echo(task["run"], sys.executable)], cwd=ROOT,
                           env=dict(env, SKYPILOT_NODE_RANK="1"), capture_output=True,
                           text=True)
    assert again.stdout.split()[-1] == "--resume", again.stdout


def _echo(script: str, python: str) -> str:
    """The node script with its python replaced by `echo` (prints the rank's command)."""
    return script.replace(python + " ", "echo ", 1)


def test_sky_task_gpus_spot_bucket(tmp_path) -> None:
    plan = write_trial_plan(tmp_path / "plan.json", 4, 2, "diloco")  # 8 ranks
    task = spec("sky", plan, tmp_path / "t.yaml", "--accelerator", "H100:4", "--use-spot",
                "--bucket", "my-ckpts", rest=("--steps", "100"))
    assert errors(task, SKY_TASK) == []
    assert task["num_nodes"] == 2 and task["resources"] == {"accelerators": "H100:4",
                                                            "use_spot": True}
    assert task["file_mounts"] == {"/mnt/run": {"name": "my-ckpts", "mode": "MOUNT"}}
    out = subprocess.run(["bash", "-c", _echo(task["run"], "python")], capture_output=True,
                         text=True, env=dict(os.environ, SKYPILOT_NODE_RANK="1",
                                             SKYPILOT_NODE_IPS="10.0.0.5\n10.0.0.6"))
    lines = sorted(out.stdout.splitlines(), key=lambda x: x.split("--rank ")[1])  # any order:
    assert len(lines) == 4, out.stdout + out.stderr  # node 1 runs ranks 4..7, GPUs 0..3
    for i, line in enumerate(lines):
        assert f"--rank {4 + i} --dist-url tcp://10.0.0.5:29500 --cuda-device {i}" in line
        assert "--world-size 8" in line and "--resume" not in line


def test_jobset_one_replicated_job_per_replica(tmp_path) -> None:
    plan = write_trial_plan(tmp_path / "plan.json", 3, 2, "diloco")  # 3 replicas x 2 stages
    js = spec("k8s", plan, tmp_path / "js.yaml", "--image", "reg/st:1", "--gpus-per-node", "1",
              "--pvc", "runs", "--name", "demo", rest=("--steps", "50"))
    assert errors(js, JOBSET) == []
    jobs = js["spec"]["replicatedJobs"]
    assert [j["name"] for j in jobs] == ["replica-0", "replica-1", "replica-2"]
    stub = tmp_path / "py"
    stub.write_text("#!/bin/sh\necho \"$@\"\n")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    seen = {}
    for j in jobs:
        spec_ = j["template"]["spec"]
        assert spec_["completionMode"] == "Indexed" and spec_["parallelism"] == 2
        pod = spec_["template"]["spec"]
        c = pod["containers"][0]
        assert c["resources"] == {"limits": {"nvidia.com/gpu": 1}}
        assert pod["volumes"] == [{"name": "run", "persistentVolumeClaim": {"claimName": "runs"}}]
        host = {e["name"]: e.get("value") for e in c["env"]}["ST_RENDEZVOUS_HOST"]
        assert host == "demo-replica-0-0-0.demo"
        for index in range(spec_["parallelism"]):
            out = subprocess.run([*c["command"][:2], c["command"][2].replace("python ",
                                  f"{stub} ", 1)], capture_output=True, text=True,
                                 env=dict(os.environ, JOB_COMPLETION_INDEX=str(index),
                                          ST_RENDEZVOUS_HOST=host))
            args = out.stdout.split()
            assert out.returncode == 0 and args[:2] == ["dist_runner.py", "--plan"], out
            rank = int(args[args.index("--rank") + 1])
            seen[rank] = args[args.index("--dist-url") + 1]
            assert args[args.index("--world-size") + 1] == "6"
    assert sorted(seen) == list(range(6)) and set(seen.values()) == {"tcp://demo-replica-0-0-0"
                                                                    ".demo:29500"}


def test_bad_input_one_line(tmp_path) -> None:
    plan = tmp_path / "plan.json"
    save_plan(Plan("c", "", "gpt-tiny", [(0, 4)], [[0], [1]]), plan)
    for args, words in ((["sky", "--accelerator", "A100:x"], "expected NAME[:COUNT]"),
                        (["k8s", "--image", "i", "--name", "Bad_Name"], "--name"),
                        (["sky", "--", "--rank", "1"], "--rank after --")):
        cut = args.index("--") if "--" in args else len(args)
        r = run_entry("scripts/launch_specs.py", *args[:cut], "--plan", str(plan), "--out",
                      str(tmp_path / "o.yaml"), *args[cut:])
        assert r.returncode == 2 and words in r.stderr, r.stderr
    assert not (tmp_path / "o.yaml").exists()
    assert json.loads(plan.read_text())["model"] == "gpt-tiny"


def test_sky_task_parses_with_skypilot(tmp_path) -> None:
    """Where SkyPilot is installed (98 packages: not in the dev extras), its own parser."""
    sky = pytest.importorskip("sky", reason="skypilot is not installed (pip install skypilot)")
    plan = write_trial_plan(tmp_path / "plan.json", 4, 1, "allreduce")
    spec("sky", plan, tmp_path / "t.yaml", "--accelerator", "A100:2", "--use-spot", "--bucket",
         "b", rest=("--steps", "10"))
    task = sky.Task.from_yaml(str(tmp_path / "t.yaml"))
    assert task.num_nodes == 2 and "/mnt/run" in task.storage_mounts
