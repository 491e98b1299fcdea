"""scripts/aws_*.sh stop with a clear message (exit 2) when the project's Python is missing or
lacks the project's packages, instead of falling back to another Python."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

WRAPPERS = ["aws_kill.sh", "aws_copy_logs.sh", "aws_run_batch.sh", "aws_start_tc.sh",
            "aws_clear_tc.sh"]


def _run(script, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), "x.json", "tcp://127.0.0.1:1"],
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_missing_python_is_a_clear_error(wrapper):
    r = _run(ROOT / "scripts" / wrapper, PY="/nonexistent/python")
    assert r.returncode == 2
    assert r.stderr.startswith("error: PY=/nonexistent/python: no such Python;"), r.stderr
    assert "scripts/setup_env.sh" in r.stderr and not r.stdout


def test_python_without_the_packages_is_a_clear_error(tmp_path):
    bare = tmp_path / "python"  # this Python without site-packages: no numpy, no paramiko
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    bare.chmod(0o755)
    r = _run(ROOT / "scripts" / "aws_kill.sh", PY=str(bare))
    assert r.returncode == 2
    assert r.stderr.startswith(f"error: PY={bare} lacks the project's packages "
                               "(ModuleNotFoundError: No module named"), r.stderr


def test_checkout_without_a_venv_does_not_fall_back_to_python3(tmp_path):
    # a checkout where setup_env.sh never ran: the wrappers used to take `python3` silently
    (tmp_path / "scripts").mkdir()
    for name in ("aws_env.sh", "aws_kill.sh"):
        shutil.copy(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    env = {k: v for k, v in os.environ.items() if k != "PY"}
    r = subprocess.run(["bash", str(tmp_path / "scripts" / "aws_kill.sh")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith(f"error: PY={tmp_path}/.venv/bin/python: no such Python;")
