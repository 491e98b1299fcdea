"""The seeds' command lines without a plan file: DT-FM's `--dist-url --world-size --rank` and
torchrun's environment build the obvious plan; the sync and batch overrides, agreed by all
ranks; refusals named."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys

import pytest
from conftest import ROOT, run_entry
from test_hf_config import LLAMA, write_config

from formats.errors import UserError
from formats.models import get_model
from modules.train.metrics import read_metrics
from scheduler.quick_plan import obvious_plan, with_overrides


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(tmp_path, per_rank, common, timeout=150):
    """Start one dist_runner.py per entry of per_rank (its own flags), DT-FM style."""
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(
        [sys.executable, str(ROOT / "dist_runner.py"), "--dist-url", url, "--world-size",
         str(len(per_rank)), "--rank", str(r), "--threads", "1", "--timeout-s", "30", *common,
         *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r, extra in enumerate(per_rank)]
    return [(p.wait(timeout=timeout), p.stdout.read()) for p in procs]


def test_obvious_plan_and_overrides():
    plan = obvious_plan(get_model("gpt-tiny"), 4, 2)
    assert plan.stages == [(0, 2), (2, 4)] and plan.pipelines == [[0, 1], [2, 3]]
    # a real batch by default (4 x 4 sequences per replica), not 1 sequence
    assert (plan.micro_batch_size, plan.num_micro_batches) == (4, 4)
    out = with_overrides(plan, {"mode": "diloco", "inner_steps": 5, "outer_lr": 0.5,
                                "outer_momentum": None, "compression": "int8"}, 2, 16)
    assert (out.sync.mode, out.sync.inner_steps, out.sync.outer_lr, out.sync.compression,
            out.micro_batch_size, out.num_micro_batches) == ("diloco", 5, 0.5, "int8", 2, 4)
    with pytest.raises(UserError, match=r"--total-batch-size 6: must be a multiple of 4 \(2 "):
        with_overrides(plan, {}, 2, 6)
    with pytest.raises(UserError, match="--inner-steps 5: only with --sync diloco"):
        with_overrides(plan, {"inner_steps": 5}, None, None)
    with pytest.raises(UserError, match="--stages 3: must divide the world size 4"):
        obvious_plan(get_model("gpt-tiny"), 4, 3)


@pytest.mark.timeout(200)
def test_dtfm_style_launch_builds_the_plan_and_trains(tmp_path):
    model = write_config(tmp_path / "tiny-llama", LLAMA)
    common = ["--model", model, "--stages", "2", "--fake-data", "--steps", "3",
              "--total-batch-size", "4", "--metrics", str(tmp_path / "m.jsonl")]
    results = launch_ranks(tmp_path, [[], []], common)
    for code, out in results:
        assert code == 0, out[-3000:]
    out = results[0][1]
    assert "no --plan: built tiny-llama: 2 stage(s) [[0, 2], [2, 4]] x 1 replica(s)" in out
    assert "1 micro-batch(es) of 4 (total batch 4 sequences)" in out
    assert [r["step"] for r in read_metrics(tmp_path / "m.jsonl")] == [1, 2, 3]


@pytest.mark.timeout(200)
def test_torchrun_launch_with_diloco_overrides(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         str(ROOT / "dist_runner.py"), "--model", "gpt-tiny", "--sync", "diloco",
         "--inner-steps", "2", "--outer-lr", "0.5", "--steps", "4", "--fake-data", "--threads",
         "1", "--run-dir", str(tmp_path / "run")],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "x 2 replica(s), pipelines [[0], [1]], diloco H=2 outer lr 0.5" in proc.stdout
    saved = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert saved["sync"]["mode"] == "diloco" and saved["sync"]["inner_steps"] == 2


@pytest.mark.timeout(120)
def test_ranks_that_disagree_on_an_override_stop_naming_it(tmp_path):
    results = launch_ranks(tmp_path, [["--inner-steps", "2"], ["--inner-steps", "3"]],
                           ["--model", "gpt-tiny", "--sync", "diloco", "--fake-data",
                            "--steps", "2"])
    assert any(code == 2 and re.search(r"--inner-steps: rank [01] has [23] but the run's other "
                                       r"ranks have [23]", out) for code, out in results), results


@pytest.mark.parametrize("args,message", [
    (["--model", "gpt-tiny", "--rank", "0", "--dist-url", "tcp://127.0.0.1:1"],
     "--world-size (or $WORLD_SIZE"),
    (["--rank", "0", "--world-size", "2", "--dist-url", "tcp://127.0.0.1:1"],
     "--plan or --model is required"),
    (["--model", "gpt-tiny", "--world-size", "2", "--rank", "0", "--dist-url",
      "tcp://127.0.0.1:1", "--total-batch-size", "3"], "--total-batch-size 3: must be a multiple"),
    (["--model", "gpt-tiny", "--world-size", "3", "--stages", "2", "--rank", "0",
      "--dist-url", "tcp://127.0.0.1:1"], "--stages 2: must divide the world size 3"),
    (["--model", "gpt-tiny", "--world-size", "1", "--rank", "0", "--dist-url",
      "tcp://127.0.0.1:1", "--sync", "allreduce", "--inner-steps", "4"],
     "--inner-steps 4: only with --sync diloco"),
])
def test_planless_mistakes_exit_2_naming_the_flag(args, message):
    env = {k: v for k, v in __import__("os").environ.items() if k != "WORLD_SIZE"}
    r = run_entry("dist_runner.py", *args, "--fake-data", env=env)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_model_flag_must_match_the_plans(tmp_path):
    from formats.plan import save_plan
    save_plan(obvious_plan(get_model("gpt-tiny"), 1, 1), tmp_path / "p.json")
    r = run_entry("dist_runner.py", "--plan", str(tmp_path / "p.json"), "--model", "gpt-small",
                  "--rank", "0", "--dist-url", "tcp://127.0.0.1:1", "--fake-data")
    assert r.returncode == 2 and "--model gpt-small: is not the model" in r.stderr, r.stderr
    assert "num_layers 6 (plan: 4)" in r.stderr
