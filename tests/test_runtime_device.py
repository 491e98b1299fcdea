"""The device-generic runtime through dist_runner.py on CPU: --device cpu, bf16 pipelines, MFU
and the backend choice in the metrics, a diverged run, and device flags that cannot run here
refused before any rendezvous (exit 2)."""

from __future__ import annotations

import os
import re
import socket

import pytest
import torch

from formats.models import get_model
from formats.plan import Plan, SyncConfig, save_plan
from modules.data.dataset import DEFAULT_CORPUS
from modules.device.mfu import flops_per_token
from modules.train.checkpoint import load_checkpoint
from modules.train.metrics import read_metrics, replica_metrics_path
from tests.conftest import run_entry

PLAN = Plan("local", "", "gpt-tiny", [(0, 2), (2, 4)], [[0, 1], [2, 3]], micro_batch_size=2,
            num_micro_batches=2, sync=SyncConfig(mode="allreduce"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, metrics, *extra, plan=PLAN, timeout=240, launcher=()):
    save_plan(plan, tmp_path / "plan.json")
    return run_entry("scripts/launch_local.py", "--plan", str(tmp_path / "plan.json"),
                     "--threads-per-rank", "1", "--grace-s", "2", *launcher, "--", "--metrics",
                     str(metrics), "--timeout-s", "60", *extra, timeout=timeout)


def _final_losses(metrics, replicas=2) -> list[float]:
    return [read_metrics(replica_metrics_path(metrics, k))[-1]["loss"] for k in range(replicas)]


@pytest.mark.timeout(600)
def test_bf16_pipeline_on_cpu_ends_within_3_percent_of_fp32(tmp_path):
    """A 2x2 (pipeline and data parallel) run on real text: bf16 activations cross the links,
    and the loss after 30 steps stays within 3% of fp32's (the same plan, data and seed)."""
    if not DEFAULT_CORPUS.exists():
        pytest.skip("Debian fortunes not installed (apt-get install fortunes fortunes-min)")
    common = ("--steps", "30", "--device", "cpu", "--lr", "3e-3")
    fp32 = _launch(tmp_path, tmp_path / "fp32.jsonl", *common)
    assert fp32.returncode == 0, fp32.stdout[-3000:] + fp32.stderr[-3000:]
    bf16 = _launch(tmp_path, tmp_path / "bf16.jsonl", *common, "--precision", "bf16")
    assert bf16.returncode == 0, bf16.stdout[-3000:] + bf16.stderr[-3000:]
    a, b = _final_losses(tmp_path / "fp32.jsonl"), _final_losses(tmp_path / "bf16.jsonl")
    assert all(abs(y - x) / x < 0.03 for x, y in zip(a, b)), (a, b)
    assert "precision bf16" in bf16.stdout
    # the last stage's activation gradients crossed in bf16: 2 bytes per value, not 4 (the
    # tied-embedding sum and the data-parallel average stay fp32)
    spec = get_model(PLAN.model)
    values = PLAN.num_micro_batches * PLAN.micro_batch_size * spec.seq_len * spec.d_model
    rec32 = read_metrics(tmp_path / "fp32.jsonl")[-1]
    rec16 = read_metrics(tmp_path / "bf16.jsonl")[-1]
    assert rec32["bytes_sent"] - rec16["bytes_sent"] == 2 * values


@pytest.mark.timeout(300)
def test_mfu_and_backend_choice_are_in_the_metrics(tmp_path):
    r = _launch(tmp_path, tmp_path / "m.jsonl", "--steps", "3", "--fake-data", "--comm", "auto",
                "--peak-tflops", "0.5")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = read_metrics(tmp_path / "m.jsonl")
    spec = get_model("gpt-tiny")
    tokens_per_step = PLAN.num_micro_batches * PLAN.micro_batch_size * spec.seq_len
    for rec in recs:
        expected = tokens_per_step / rec["step_s"] * flops_per_token(spec) / (2 * 0.5e12)
        assert rec["mfu"] == pytest.approx(expected, rel=1e-3)
        # CPU ranks: auto picks gloo for every group, and says so per group
        assert rec["comm"] and set(rec["comm"].values()) == {"gloo"}
    assert "mean MFU" in r.stdout and " mfu " in r.stdout


@pytest.mark.timeout(300)
def test_a_diverged_run_stops_with_the_last_finite_state_saved(tmp_path):
    """lr 1e30 blows the weights up after the first update: the next step's loss is not
    finite, every rank stops (exit 1) naming it, and the checkpoint on disk is finite."""
    ckpt = tmp_path / "ckpt"
    r = _launch(tmp_path, tmp_path / "m.jsonl", "--steps", "5", "--fake-data", "--lr", "1e30",
                "--ckpt-dir", str(ckpt))
    assert r.returncode != 0
    assert "the last finite state (step" in r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    files = sorted(ckpt.rglob("step*.pt"))
    assert files, "no checkpoint of the last finite state"
    for f in files:  # intact, and load_checkpoint refuses non-finite tensors
        assert load_checkpoint(f, {})["step"] >= 1


def _runner(tmp_path, *args):
    save_plan(PLAN, tmp_path / "plan.json")
    return run_entry("dist_runner.py", "--plan", str(tmp_path / "plan.json"), "--steps", "2",
                     "--rank", "0", "--dist-url", f"tcp://127.0.0.1:{_free_port()}",
                     "--fake-data", "--timeout-s", "5", *args, timeout=120)


@pytest.mark.parametrize("args, message", [
    (("--device", "cuda"), "--device cuda: no CUDA device is visible"),
    (("--comm", "nccl"), "--comm nccl: NCCL needs CUDA ranks"),
    (("--precision", "fp16"), "--precision fp16: needs a CUDA device"),
    (("--cuda-device", "0"), "--cuda-device 0: no CUDA device is visible"),
])
def test_device_flags_that_cannot_run_here_exit_2_before_the_rendezvous(tmp_path, args,
                                                                         message):
    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device: these flags are valid here")
    r = _runner(tmp_path, *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"error: {message}" in r.stderr and "Traceback" not in r.stderr
    assert "joining" not in r.stdout  # nothing was attempted: the rendezvous would have timed out


@pytest.mark.timeout(600)
def test_compile_without_a_compiler_exits_2_before_the_rendezvous(tmp_path):
    env = dict(os.environ, CXX=str(tmp_path / "no-such-g++"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    save_plan(PLAN, tmp_path / "plan.json")
    r = run_entry("dist_runner.py", "--plan", str(tmp_path / "plan.json"), "--steps", "2",
                  "--rank", "0", "--dist-url", f"tcp://127.0.0.1:{_free_port()}", "--fake-data",
                  "--timeout-s", "5", "--compile", timeout=500, env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "error: --compile:" in r.stderr and "Traceback" not in r.stderr
    assert "joining" not in r.stdout


@pytest.mark.timeout(300)
def test_launcher_hands_each_rank_a_cuda_device_round_robin(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device: the ranks would start for real")
    r = _launch(tmp_path, tmp_path / "m.jsonl", "--steps", "1", "--fake-data", timeout=200,
                launcher=("--gpus", "2"))
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    # every rank that got to say it names its own device: rank r has --cuda-device r % 2 (the
    # launcher stops the others after the first refusal)
    said = re.findall(r"\[rank (\d)\] error: --cuda-device (\d): no CUDA device is visible", out)
    assert said and all(int(dev) == int(rank) % 2 for rank, dev in said), out[-3000:]
