"""scripts/gpu_check.sh on a machine without a GPU (imports, nvcc, exit 0), on a pretend GPU host
(a fake nvidia-smi, no pip index: it gets to its GPU rows and fails them by name), and the
plumbing its GPU runs use (plan -> launch_local -> metrics -> comparison), run here on CPU."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

from formats.plan import SyncConfig
from scripts.gpu_check import GPU_ROWS, Checker, Run, Trainer, compare, max_rel_diff
from tests.conftest import ROOT


def _has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    return "GPU " in r.stdout


pytestmark = pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU: gpu_check.sh "
                                "would run the whole GPU check, which is not a unit test")


def run_check(tmp_path, *flags, **env) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--out", str(out), *flags], cwd=ROOT,
                       env=dict(os.environ, **env), capture_output=True, text=True, timeout=280)
    rows = {row["name"]: row for row in json.loads((out / "results.json").read_text())["rows"]}
    return r, rows


def _python() -> str:
    """The interpreter running the tests (it has the project's dependencies)."""
    return sys.executable


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed here")
def test_without_a_gpu_it_says_so_compiles_the_kernel_and_exits_0(tmp_path):
    r, rows = run_check(tmp_path, "--python", _python())
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("gpu_check: no GPU on this machine (")
    assert rows["imports"]["status"] == "PASS"
    assert rows["kernel PTX under cupy's flags (nvcc)"]["status"] == "PASS"
    for arch in ("sm_80", "sm_90"):  # the PTX really was written by nvcc
        ptx = (tmp_path / "out" / f"int8_{arch}.ptx").read_text()
        assert ".entry quantize_blocks" in ptx and ".entry dequantize_blocks" in ptx
        assert ".ftz" not in ptx
    assert rows["runtime GPU flags"]["status"] == "PASS"
    assert "| kernel PTX under cupy's flags (nvcc) | PASS |" in r.stdout
    assert "gpu_check passed on no GPU" in r.stdout
    with tarfile.open(tmp_path / "out" / "logs.tar") as tar:
        assert "logs/nvcc_sm_90.log" in tar.getnames()


@pytest.mark.timeout(300)
def test_without_nvcc_it_says_so_and_still_exits_0(tmp_path):
    r, rows = run_check(tmp_path, "--python", _python(), NVCC=str(tmp_path / "no-nvcc"))
    assert r.returncode == 0, r.stdout + r.stderr
    row = rows["kernel PTX under cupy's flags (nvcc)"]
    assert row["status"] == "SKIP" and "not found" in row["detail"]
    assert "cupy compiles it with NVRTC" in row["detail"]


@pytest.mark.timeout(300)
def test_on_an_offline_gpu_host_it_reaches_the_gpu_rows_and_fails_them_by_name(tmp_path):
    """A fake nvidia-smi lists a GPU; no pip index, no network, a venv's python3 first on PATH
    without CUDA torch or cupy: no set-up step runs, every GPU row FAILs naming why."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-fake)'\n")
    smi.chmod(0o755)
    py = bin_dir / "python3"  # the host's python3: torch without CUDA, no cupy
    py.write_text(f"#!/bin/sh\nexec {_python()} \"$@\"\n")
    py.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PIP_NO_INDEX": "1",
           "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}
    r, rows = run_check(tmp_path, **env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.startswith(f"gpu_check: 1 GPU(s), {py}:")
    assert not re.search(r"\bpip\b|-m venv", r.stdout + r.stderr) and \
        not (ROOT / ".venv-gpu").exists()
    assert rows["imports"]["status"] == "PASS"
    assert rows["torch + cupy see the GPUs"]["status"] == "FAIL"
    for name in GPU_ROWS:
        assert rows[name]["status"] == "FAIL" and rows[name]["detail"].startswith("not run: ")
    assert "sees no CUDA device" in rows[GPU_ROWS[0]]["detail"]
    assert "gpu_check FAILED on 1 GPU(s)" in r.stdout


def test_an_unexpected_skip_fails_the_verdict_on_a_gpu_host(tmp_path):
    c = Checker(tmp_path, "python3", 10, gpus=1)
    c.add("optional: paramiko", "SKIP", 0.0, "paramiko is not installed", expected=True)
    c.add("NCCL all-reduce", "UNVERIFIED", 0.0, "needs 2 GPUs")
    assert c.verdict() == "passed"
    c.add("pytest -m gpu", "SKIP", 0.0, "needs cupy")
    assert c.verdict() == "FAILED"
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["verdict"] == "FAILED" and [r["status"] for r in saved["rows"]] == \
        ["SKIP", "UNVERIFIED", "SKIP"]
    assert Checker(tmp_path / "cpu", "python3", 10, gpus=0).verdict() == "passed"


def test_loss_comparison():
    want = Run({0: [5.0, 4.0], 1: [5.0, 4.1]}, 100.0)
    assert max_rel_diff(Run({0: [5.0, 4.0], 1: [5.0, 4.1]}, 1.0), want) == 0.0
    assert max_rel_diff(Run({0: [5.0, 4.004], 1: [5.0, 4.1]}, 1.0), want) == pytest.approx(1e-3)
    assert max_rel_diff(Run({0: [5.0, 4.0]}, 1.0), want) == float("inf")  # a replica missing
    assert max_rel_diff(Run({0: [5.0], 1: [5.0]}, 1.0), want) == float("inf")  # steps missing


@pytest.mark.timeout(300)
def test_a_training_run_of_the_check_on_cpu(tmp_path):
    """The GPU runs' plumbing with CPU flags: plan, launch_local, metrics, comparison rows."""
    c = Checker(tmp_path, _python(), 200)
    t = Trainer(c, steps=3, peak_tflops=None, model="gpt-tiny")
    plan = t.plan("pp", [(0, 2), (2, 4)], [[0, 1]], 2, 2, SyncConfig())
    run = t.train("pp_cpu", plan, ["--threads", "1"])
    assert isinstance(run, Run) and len(run.losses[0]) == 3 and run.tokens_per_s > 0
    compare(c, "same run twice", 0.0, t.train("pp_cpu2", plan, ["--threads", "1"]), run, 1e-5)
    assert c.rows[-1].status == "PASS" and "difference 0.00e+00 over 3 steps" in c.rows[-1].detail
    bad = t.train("bad", plan, ["--device", "gpu"])  # dist_runner refuses it (exit 2)
    assert isinstance(bad, str) and "exit 2" in bad and "--device" in bad
    compare(c, "failed run", 0.0, bad, run, 1e-5)
    assert c.failed() and (tmp_path / "logs" / "bad.log").exists()


@pytest.mark.parametrize("out, status", [
    ("SKIPPED [2] tests/test_comm_nccl.py:132: needs 2+ CUDA devices and cupy with NCCL\n"
     "40 passed, 2 skipped in 9.0s", "PASS"),
    ("SKIPPED [27] tests/test_quant_codec.py:150: needs a CUDA device and cupy\n"
     "3 passed, 27 skipped in 2.0s", "SKIP"),
    ("1 failed, 39 passed in 9.0s", "FAIL")])
def test_gpu_tests_row_tells_expected_from_unexpected_skips(tmp_path, monkeypatch, out, status):
    from scripts import gpu_check

    c = Checker(tmp_path, "python3", 10, gpus=1)
    monkeypatch.setattr(c, "run", lambda *a, **k: (1 if "failed" in out else 0, out))
    gpu_check.check_gpu_tests(c)
    assert c.rows[-1].status == status


def test_wrapper_help_describes_the_wrapper():
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.startswith("The one command to run first"), r.stderr
    assert "--python PY" in r.stdout and "bash scripts/gpu_check.sh" in r.stdout
    assert "usage: gpu_check.py" not in r.stdout


@pytest.mark.timeout(300)
def test_with_two_gpus_listed_the_multi_gpu_rows_say_why_and_nothing_is_installed(tmp_path):
    """A fake nvidia-smi lists 2 GPUs, the python3 on PATH imports (CPU) torch, no package
    index, a recording pip: every `multi-gpu: ...` row has a status and a reason, no install
    is tried."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(
        "#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-a)'\n"
        "echo 'GPU 1: NVIDIA H100 (UUID: GPU-b)'\n")
    (bin_dir / "python3").write_text(f"#!/bin/sh\nexec {_python()} \"$@\"\n")
    for pip in ("pip", "pip3"):
        (bin_dir / pip).write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/pip_calls\nexit 1\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PIP_NO_INDEX": "1",
           "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}
    r, rows = run_check(tmp_path, **env)
    assert r.stdout.startswith("gpu_check: 2 GPU(s), "), r.stdout + r.stderr
    multi = {n: row for n, row in rows.items() if n.startswith("multi-gpu:")}
    assert len(multi) >= 5, list(rows)
    for row in multi.values():
        assert row["status"] in ("PASS", "FAIL", "SKIP", "WARN", "UNVERIFIED")
        assert row["reason"] and row["reason"] == row["detail"]
        assert "sees no CUDA device though nvidia-smi lists 2" in row["reason"]
    assert not (tmp_path / "pip_calls").exists()
    assert not re.search(r"\bpip install\b|-m venv", r.stdout + r.stderr)


def test_with_one_gpu_the_multi_gpu_rows_skip_saying_why(tmp_path):
    from scripts import gpu_multi

    c = Checker(tmp_path, "python3", 10, gpus=1)
    gpu_multi.multi_gpu_checks(c, None, 1, None)
    assert [r.name for r in c.rows] == list(gpu_multi.ROWS)
    assert all(r.status == "SKIP" and r.expected and "needs 2 GPUs (1 visible)" in r.detail
               for r in c.rows)
    assert c.verdict() == "passed"
