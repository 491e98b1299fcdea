"""Start every rank of a plan as its own process, without a supervisor that stops the others
when one fails (unlike scripts/launch_local.py), so tests and benchmarks can kill a rank and
watch the rest; optionally with a coordinator process (scripts/coordinator.py) hosting the
store, so that rank 0 can be killed too. Every process gets a hard deadline; `stop` leaves no
process behind.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from modules.control.auth import new_secret

ROOT = Path(__file__).resolve().parent.parent


def soak_seeds(first: int, full: int) -> range:
    """Seeds for a randomized soak test: 3 in the default suite (it has to fit CI's time);
    SOAK_TRIALS=full runs `full` of them, SOAK_TRIALS=N runs N (a night's soak: 50).
    ValueError naming the variable for anything else (a typo must not quietly run 3)."""
    wanted = os.environ.get("SOAK_TRIALS", "").strip()
    if wanted == "":
        return range(first, first + 3)
    if wanted == "full":
        return range(first, first + full)
    if not wanted.isdigit() or int(wanted) < 1:
        raise ValueError(f"SOAK_TRIALS={wanted!r}: give a number of trials (1 or more) or "
                         "'full', or unset it for the default 3")
    return range(first, first + int(wanted))


def free_port() -> int:
    """A free TCP port on 127.0.0.1, below the kernel's ephemeral port range when it can: a
    port from that range (what binding port 0 gives) can be taken as the source port of any
    outgoing connection on the machine in the seconds before the rank that is given it binds
    it (its peers would then reach whatever holds it)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rng = random.Random()
    for _ in range(50 if low > 12000 else 0):
        port = rng.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_all(procs: dict[int, subprocess.Popen], timeout: float) -> dict[int, int | None]:
    """Exit status of every process within `timeout` s in all (None: still running)."""
    deadline = time.monotonic() + timeout
    codes: dict[int, int | None] = {}
    for r, p in procs.items():
        try:
            codes[r] = p.wait(timeout=max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[r] = None
    return codes


@dataclass
class Ranks:
    """Processes of one run: rank -> Popen, output files and the rendezvous URL."""

    plan: Path
    url: str
    out_dir: Path
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    started: dict[int, float] = field(default_factory=dict)
    coordinator: subprocess.Popen | None = None
    """scripts/coordinator.py hosting the store at `url` (None: rank 0 hosts it)."""
    secret: str = field(default_factory=new_secret)
    """The run secret every process of the run gets (ST_RUN_SECRET)."""

    def start_coordinator(self, timeout: float = 60) -> None:
        """Start scripts/coordinator.py at `url` (output to out_dir/coordinator.log) and wait
        until it listens; ranks started afterwards get --coordinator instead of --dist-url."""
        host_port = self.url.removeprefix("tcp://")
        cmd = [sys.executable, str(ROOT / "scripts" / "coordinator.py"), "--listen", host_port,
               "--plan", str(self.plan)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", ST_RUN_SECRET=self.secret)
        log = open(self.out_dir / "coordinator.log", "w")  # noqa: SIM115
        self.coordinator = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            cwd=ROOT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while "listening on port" not in self.coordinator_output():
            if self.coordinator.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the coordinator did not start: "
                                   + self.coordinator_output()[-2000:])
            time.sleep(0.05)

    def coordinator_output(self) -> str:
        """Everything the coordinator printed so far."""
        return (self.out_dir / "coordinator.log").read_text(errors="replace")

    def wait_coordinator(self, timeout: float) -> int | None:
        """The coordinator's exit status once it exits within `timeout` (None: still running,
        or there is none)."""
        if self.coordinator is None:
            return None
        try:
            return self.coordinator.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill_coordinator(self) -> float:
        """SIGKILL the coordinator; returns time.monotonic() of the kill."""
        assert self.coordinator is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.coordinator.pid, signal.SIGKILL)
        return time.monotonic()

    def start(self, rank: int, *args: str, world_size: int | None = None) -> None:
        """Start `dist_runner.py --rank rank` with `args`; output to out_dir/rank{R}.log."""
        store_flag = "--dist-url" if self.coordinator is None else "--coordinator"
        cmd = [sys.executable, str(ROOT / "dist_runner.py"), "--plan", str(self.plan),
               "--rank", str(rank), store_flag, self.url, "--threads", "1", *args]
        if world_size is not None:
            cmd += ["--world-size", str(world_size)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   ST_RUN_SECRET=self.secret)
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
        return wait_all(self.procs, timeout)


    def stop(self) -> list[int]:
        """SIGKILL every process (group) still running, the coordinator's too; returns the
        ranks that were running."""
        alive = [r for r, p in self.procs.items() if p.poll() is None]
        for r in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.procs[r].pid, signal.SIGKILL)
        for r in alive:
            self.procs[r].wait()
        if self.coordinator is not None and self.coordinator.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.coordinator.pid, signal.SIGKILL)
            self.coordinator.wait()
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


def write_trial_plan(path: Path, replicas: int, stages: int, mode: str, inner_steps: int = 2,
                     micro_batch_size: int = 1) -> Path:
    """A gpt-tiny plan of `replicas` x `stages` devices for kill trials, written to `path`."""
    from formats.plan import Plan, SyncConfig, save_plan

    layers = 4
    cuts = [round(i * layers / stages) for i in range(stages + 1)]
    sync = (SyncConfig(mode="diloco", inner_steps=inner_steps) if mode == "diloco"
            else SyncConfig(mode="allreduce"))
    plan = Plan("local", "", "gpt-tiny", [(cuts[i], cuts[i + 1]) for i in range(stages)],
                [[r * stages + s for s in range(stages)] for r in range(replicas)],
                micro_batch_size=micro_batch_size, sync=sync)
    save_plan(plan, path)
    return path


@dataclass
class TrialResult:
    """What one kill trial saw."""

    mode: str
    killed: int
    kill_step: int
    codes: dict[int, int | None]
    outputs: dict[int, str]
    detect_s: float | None
    """Kill -> first survivor's log line naming the lost rank (or the store)."""
    exit_s: dict[int, float]
    """Kill -> each other rank's exit."""
    orphans: list[int]
    """Ranks still running at the deadline (killed by the harness)."""
    coordinator_code: int | None = None
    """The coordinator's exit status (None: none, or still running 10 s after the ranks)."""
    coordinator_output: str = ""


class TrialNotStarted(AssertionError):
    """A kill trial's run never reached the step of its fault: nothing was tested."""


def kill_trial(out_dir: Path, mode: str, replicas: int, stages: int, kill_rank: int,
               kill_step: int, steps: int = 400, heartbeat_s: float = 2.0,
               deadline_s: float = 90, extra: tuple[str, ...] = (),
               coordinator: bool = False, start_s: float = 120) -> TrialResult:
    """Start a run (with `coordinator`: behind a coordinator process), SIGKILL `kill_rank`
    once replica 0 logged step `kill_step` (TrialNotStarted if it did not within `start_s`),
    wait for the rest (at most `deadline_s`), and report exits, detection time and
    leftovers."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = write_trial_plan(out_dir / "plan.json", replicas, stages, mode)
    ranks = Ranks(plan, f"tcp://127.0.0.1:{free_port()}", out_dir)
    n = replicas * stages
    last0 = stages - 1  # replica 0's last stage logs progress
    try:
        if coordinator:
            ranks.start_coordinator()
        for r in range(n):
            ranks.start(r, "--fake-data", "--steps", str(steps), "--timeout-s", "30",
                        "--heartbeat-timeout-s", str(heartbeat_s), "--min-replicas", "1",
                        *extra)
        # the fault is a kill at that step: killing earlier (a slow start on a loaded
        # machine, a rank that failed to start) would test another fault and blame the product
        if not ranks.wait_for_text(last0, f"step {kill_step}/", start_s):
            raise TrialNotStarted(f"rank {last0} did not log step {kill_step} within "
                                  f"{start_s:g} s, so no rank was killed; its log ends: "
                                  f"{ranks.output(last0)[-1500:]}")
        t_kill = ranks.kill(kill_rank)
        detect = None
        others = [r for r in range(n) if r != kill_rank]
        exits: dict[int, float] = {}
        deadline = t_kill + deadline_s
        while time.monotonic() < deadline and len(exits) < len(others):
            now = time.monotonic()
            if detect is None and any(_detected(ranks.output(r), kill_rank) for r in others):
                detect = now - t_kill
            for r in others:
                if r not in exits and ranks.procs[r].poll() is not None:
                    exits[r] = now - t_kill
            time.sleep(0.05)
        ranks.procs[kill_rank].wait(timeout=10)
        coord_code = ranks.wait_coordinator(10)
    finally:
        orphans = ranks.stop()
    codes = {r: p.returncode for r, p in ranks.procs.items()}
    return TrialResult(mode, kill_rank, kill_step, codes,
                       {r: ranks.output(r) for r in ranks.procs}, detect, exits, orphans,
                       coord_code, ranks.coordinator_output() if coordinator else "")


def _detected(text: str, rank: int) -> bool:
    return (f"rank {rank} (host" in text and "gone" in text) or "rendezvous store" in text
