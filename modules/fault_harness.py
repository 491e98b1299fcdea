"""Start every rank of a plan as its own process, without a supervisor that stops the others
when one fails (unlike scripts/launch_local.py), so tests and benchmarks can kill a rank and
watch the rest. Every process gets a hard deadline; `stop` leaves no process behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Ranks:
    """Processes of one run: rank -> Popen, output files and the rendezvous URL."""

    plan: Path
    url: str
    out_dir: Path
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    started: dict[int, float] = field(default_factory=dict)

    def start(self, rank: int, *args: str, world_size: int | None = None) -> None:
        """Start `dist_runner.py --rank rank` with `args`; output to out_dir/rank{R}.log."""
        cmd = [sys.executable, str(ROOT / "dist_runner.py"), "--plan", str(self.plan),
               "--rank", str(rank), "--dist-url", self.url, "--threads", "1", *args]
        if world_size is not None:
            cmd += ["--world-size", str(world_size)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        log = open(self.out_dir / f"rank{rank}.log", "w")  # noqa: SIM115
        self.procs[rank] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            cwd=ROOT, start_new_session=True)
        log.close()
        self.started[rank] = time.monotonic()

    def output(self, rank: int) -> str:
        """Everything rank `rank` printed so far."""
        return (self.out_dir / f"rank{rank}.log").read_text(errors="replace")

    def kill(self, rank: int) -> float:
        """SIGKILL rank `rank` (kill -9); returns time.monotonic() of the kill."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.procs[rank].pid, signal.SIGKILL)
        return time.monotonic()

    def wait_for_text(self, rank: int, text: str, timeout: float) -> bool:
        """Poll rank `rank`'s output until `text` appears (False after `timeout` or exit)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.output(rank):
                return True
            if self.procs[rank].poll() is not None:
                return text in self.output(rank)
            time.sleep(0.05)
        return False

    def wait(self, timeout: float) -> dict[int, int | None]:
        """Wait for every process at most `timeout` s in all; rank -> exit status (None: still
        running after the deadline)."""
        deadline = time.monotonic() + timeout
        codes: dict[int, int | None] = {}
        for r, p in self.procs.items():
            try:
                codes[r] = p.wait(timeout=max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[r] = None
        return codes


    def stop(self) -> list[int]:
        """SIGKILL every process (group) still running; returns the ranks that were running."""
        alive = [r for r, p in self.procs.items() if p.poll() is None]
        for r in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.procs[r].pid, signal.SIGKILL)
        for r in alive:
            self.procs[r].wait()
        return alive


def poll_exits(ranks: Ranks, timeout: float, poll_s: float = 0.05) -> dict[int, tuple[int, float]]:
    """Wait at most `timeout` for all processes; rank -> (status, time.monotonic() of exit)
    for those that exited (seen within `poll_s`)."""
    deadline = time.monotonic() + timeout
    done: dict[int, tuple[int, float]] = {}
    while len(done) < len(ranks.procs) and time.monotonic() < deadline:
        for r, p in ranks.procs.items():
            if r not in done and p.poll() is not None:
                done[r] = (p.returncode, time.monotonic())
        time.sleep(poll_s)
    return done
