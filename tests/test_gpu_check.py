"""scripts/gpu_check.sh on a machine without a GPU (imports, nvcc, exit 0), and the plumbing its
GPU runs use (plan -> launch_local -> metrics -> comparison), run here on CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from formats.plan import SyncConfig
from scripts.gpu_check import Checker, Run, Trainer, compare, max_rel_diff
from tests.conftest import ROOT


def _has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    return "GPU " in r.stdout


pytestmark = pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU: gpu_check.sh "
                                "would run the whole GPU check, which is not a unit test")


def run_check(tmp_path, **env) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--out-dir", str(out)], cwd=ROOT,
                       env=dict(os.environ, **env), capture_output=True, text=True, timeout=280)
    rows = {row["check"]: row for row in json.loads((out / "results.json").read_text())["rows"]}
    return r, rows


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed here")
def test_without_a_gpu_it_says_so_compiles_the_kernel_and_exits_0(tmp_path):
    r, rows = run_check(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("gpu_check: no GPU on this machine (")
    assert rows["imports"]["status"] == "PASS"
    assert rows["kernel compiles (nvcc)"]["status"] == "PASS"
    for arch in ("sm_80", "sm_90"):  # the PTX really was written by nvcc
        ptx = (tmp_path / "out" / f"int8_{arch}.ptx").read_text()
        assert ".entry quantize_blocks" in ptx and ".entry dequantize_blocks" in ptx
    # WARN until dist_runner.py has the GPU flags, PASS after; never a failure without a GPU
    assert rows["runtime GPU flags"]["status"] in ("PASS", "WARN")
    assert "| kernel compiles (nvcc) | PASS |" in r.stdout
    assert "gpu_check passed on no GPU" in r.stdout


@pytest.mark.timeout(300)
def test_without_nvcc_it_says_so_and_still_exits_0(tmp_path):
    r, rows = run_check(tmp_path, NVCC=str(tmp_path / "no-nvcc"))
    assert r.returncode == 0, r.stdout + r.stderr
    row = rows["kernel compiles (nvcc)"]
    assert row["status"] == "SKIP" and "not found" in row["detail"]
    assert "cupy compiles it with NVRTC" in row["detail"]


def test_loss_comparison():
    want = Run({0: [5.0, 4.0], 1: [5.0, 4.1]}, 100.0)
    assert max_rel_diff(Run({0: [5.0, 4.0], 1: [5.0, 4.1]}, 1.0), want) == 0.0
    assert max_rel_diff(Run({0: [5.0, 4.004], 1: [5.0, 4.1]}, 1.0), want) == pytest.approx(1e-3)
    assert max_rel_diff(Run({0: [5.0, 4.0]}, 1.0), want) == float("inf")  # a replica missing
    assert max_rel_diff(Run({0: [5.0], 1: [5.0]}, 1.0), want) == float("inf")  # steps missing


@pytest.mark.timeout(300)
def test_a_training_run_of_the_check_on_cpu(tmp_path):
    """The GPU runs' plumbing with CPU flags: plan, launch_local, metrics, comparison rows."""
    c = Checker(tmp_path, str(ROOT / ".venv" / "bin" / "python") if
                (ROOT / ".venv" / "bin" / "python").exists() else "python3", 200)
    t = Trainer(c, steps=3, peak_tflops=None, model="gpt-tiny")
    plan = t.plan("pp", [(0, 2), (2, 4)], [[0, 1]], 2, 2, SyncConfig())
    run = t.train("pp_cpu", plan, ["--threads", "1"])
    assert isinstance(run, Run) and len(run.losses[0]) == 3 and run.tokens_per_s > 0
    compare(c, "same run twice", 0.0, t.train("pp_cpu2", plan, ["--threads", "1"]), run, 1e-5)
    assert c.rows[-1].status == "PASS" and "difference 0.00e+00 over 3 steps" in c.rows[-1].detail
    bad = t.train("bad", plan, ["--device", "gpu"])  # dist_runner refuses it (exit 2)
    assert isinstance(bad, str) and "exit 2" in bad and "--device" in bad
    compare(c, "failed run", 0.0, bad, run, 1e-5)
    assert c.failed() and (tmp_path / "bad.log").exists()
