"""Messages of the entry paths: the run secret file checked (a folder, another user's file),
c10d's C++ stack traces kept out of a rendezvous failure (TORCH_CPP_LOG_LEVEL set before torch
is first imported)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from formats.errors import UserError
from modules.control.auth import SECRET_ENV, SECRET_FILE_ENV, load_secret

CPP_FRAMES = ("frame #", "Exception raised from", "c10::", "[W", "[E")


def test_a_secret_folder_is_named_not_raised(tmp_path: Path) -> None:
    folder = tmp_path / "secret"
    folder.mkdir(mode=0o700)
    with pytest.raises(UserError, match="the run secret .*secret is a folder"):
        load_secret({SECRET_FILE_ENV: str(folder)})


def test_a_secret_of_another_user_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("s" * 40 + "\n")
    path.chmod(0o600)
    assert load_secret({SECRET_FILE_ENV: str(path)}) == b"s" * 40
    if os.getuid() != 0:
        pytest.skip("changing a file's owner needs root")
    os.chown(path, 12345, 12345)
    with pytest.raises(UserError, match="belongs to user id 12345, not to this user"):
        load_secret({SECRET_FILE_ENV: str(path)})


@pytest.mark.timeout(120)
def test_a_rendezvous_failure_prints_no_cpp_frames(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    procs = []
    for rank, secret in ((0, "a" * 40), (1, "b" * 40)):  # the secrets differ
        env = {**os.environ, SECRET_ENV: secret}
        env.pop("TORCH_CPP_LOG_LEVEL", None)
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "dist_runner.py"), "--model", "gpt-tiny", "--dist-url",
             url, "--world-size", "2", "--rank", str(rank), "--threads", "1", "--fake-data",
             "--steps", "2", "--timeout-s", "8"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True))
    outs = [(p.wait(timeout=100), p.stdout.read()) for p in procs]
    for code, out in outs:
        assert code != 0 and "error:" in out, out[-3000:]
        assert not [f for f in CPP_FRAMES if f in out], out[-3000:]
        assert "Traceback" not in out


def test_a_world_size_no_run_can_have_is_refused(monkeypatch) -> None:
    import dist_runner
    from modules.plan_flags import plan_without_file

    with pytest.raises(UserError, match=r"--world-size: must be in \[1, 65536\], got 2147483648"):
        dist_runner.parse_args(["--model", "gpt-tiny", "--world-size", "2147483648"])
    launch, cfg = dist_runner.parse_args(["--model", "gpt-tiny", "--fake-data"])
    monkeypatch.setenv("WORLD_SIZE", "99999999999")
    with pytest.raises(UserError, match="WORLD_SIZE 99999999999: more ranks than a run may"):
        plan_without_file(launch, cfg)


@pytest.mark.timeout(120)
def test_sigterm_stops_the_coordinator_without_a_traceback(tmp_path: Path) -> None:
    """SIGTERM at once after it listens, and twice in a row: one line, exit 143, never a
    SystemExit traceback (the second signal lands while the first is being reported)."""
    import signal
    import time

    from testkit.fault_harness import Ranks, free_port, write_trial_plan

    plan = write_trial_plan(tmp_path / "plan.json", 2, 1, "diloco")
    for trial, signals in enumerate((2,)):
        ranks = Ranks(plan, f"tcp://127.0.0.1:{free_port()}", tmp_path / f"t{trial}")
        ranks.out_dir.mkdir()
        ranks.start_coordinator()
        for _ in range(signals):
            ranks.coordinator.send_signal(signal.SIGTERM)
            time.sleep(0.01)
        code = ranks.wait_coordinator(30)
        out = ranks.coordinator_output()
        assert code == 143 and "Traceback" not in out and "SystemExit" not in out, out


@pytest.mark.timeout(200)
def test_a_join_of_a_live_replica_is_refused_at_once(tmp_path: Path) -> None:
    from testkit.fault_harness import Ranks, free_port, write_trial_plan

    plan = write_trial_plan(tmp_path / "plan.json", 2, 1, "diloco")
    ranks = Ranks(plan, f"tcp://127.0.0.1:{free_port()}", tmp_path / "run")
    ranks.out_dir.mkdir()
    common = ("--fake-data", "--steps", "100000", "--timeout-s", "60")
    try:
        for r in (0, 1):
            ranks.start(r, *common)
        assert ranks.wait_for_text(0, "step 2", 120), ranks.output(0)[-3000:]
        env = {**os.environ, SECRET_ENV: ranks.secret}
        joiner = subprocess.run(
            [sys.executable, str(ROOT / "dist_runner.py"), "--plan", str(plan), "--rank", "1",
             "--dist-url", ranks.url, "--threads", "1", "--join", *common], cwd=ROOT, env=env,
            capture_output=True, text=True, timeout=50)  # well below --timeout-s 60
    finally:
        ranks.stop()
    assert joiner.returncode == 2, joiner.stdout[-3000:] + joiner.stderr[-3000:]
    assert "--join: replica 1 is still running" in joiner.stderr
    assert "Traceback" not in joiner.stderr + joiner.stdout
