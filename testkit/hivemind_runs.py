"""Replicas of a DiLoCo run with --outer-backend hivemind on this host, for tests and
benchmarks: each replica (one rank per stage) gets its own --dist-url store, the first
replica's DHT address is passed to the others as --initial-peers, and every process (its DHT
process and p2pd included) runs in a session of its own, so that a kill -9 of the session
leaves nothing behind and `p2pd_left` can find what would. The same run with the store
backend (backend="store": one store, rank 0's) and in namespace hosts (`netns`: replica ->
namespace, `addrs`: replica -> its address there) for benchmarks/outer_backends.py."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from testkit.fault_harness import free_port, wait_all

ROOT = Path(__file__).resolve().parent.parent
PEERS = re.compile(r"--initial-peers (\S+)")


@dataclass
class HivemindRun:
    """The processes of one run: rank -> Popen, logs in out_dir/rank{R}.log."""

    plan: Path
    out_dir: Path
    ranks_per_replica: int = 1
    """A replica's ranks: its stages (times D with shard groups: its devices)."""
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    ports: dict[int, int] = field(default_factory=dict)
    """Replica -> its own store's port (backend "store": 0 -> the run's store)."""
    backend: str = "hivemind"
    netns: dict[int, str] = field(default_factory=dict)
    """Replica -> the namespace host it runs in (none: this host's loopback)."""
    addrs: dict[int, str] = field(default_factory=dict)
    """Replica -> its address in its namespace host."""
    ifname: str = "eth0"
    """gloo's interface in a namespace host (the replica's own store is on its loopback)."""

    def start(self, rank: int, *args: str, peers: str | None = None,
              secret: str | None = None) -> None:
        """Start dist_runner.py --rank rank with --outer-backend hivemind (and --initial-peers
        `peers` when given); the replica's store port is chosen once per replica. Backend
        "store": every rank on rank 0's store, the outer average through it. `secret`: the
        rank's ST_RUN_SECRET (default: this process's environment's)."""
        replica = rank // self.ranks_per_replica
        host = self.addrs.get(replica, "127.0.0.1")
        if self.backend == "store":
            url = f"tcp://{self.addrs.get(0, '127.0.0.1')}:{self.ports.setdefault(0, free_port())}"
            backend_args: list[str] = []
        else:
            url = f"tcp://127.0.0.1:{self.ports.setdefault(replica, free_port())}"
            backend_args = ["--outer-backend", "hivemind", "--host-maddrs", f"/ip4/{host}/tcp/0"]
        where = ["ip", "netns", "exec", self.netns[replica]] if replica in self.netns else []
        cmd = [*where, sys.executable, str(ROOT / "dist_runner.py"), "--plan", str(self.plan),
               "--rank", str(rank), "--dist-url", url, "--threads", "1", *backend_args, *args]
        if peers:
            cmd += ["--initial-peers", peers]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if secret is not None:
            env["ST_RUN_SECRET"] = secret
        if self.netns:
            env["GLOO_SOCKET_IFNAME"] = self.ifname  # the namespace host's link by default
        with open(self.out_dir / f"rank{rank}.log", "w") as log:
            self.procs[rank] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                env=env, cwd=ROOT, start_new_session=True)

    def output(self, rank: int) -> str:
        """Everything rank `rank` printed so far."""
        return (self.out_dir / f"rank{rank}.log").read_text(errors="replace")

    def wait_for(self, rank: int, pattern: str, timeout: float) -> re.Match | None:
        """The first match of `pattern` in rank's output within `timeout` (None: not seen, or
        the rank exited without printing it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.output(rank))
            if found or self.procs[rank].poll() is not None:
                return found or re.search(pattern, self.output(rank))
            time.sleep(0.1)
        return None

    def peers_of(self, rank: int, timeout: float = 60) -> str:
        """The --initial-peers addresses rank `rank` printed."""
        found = self.wait_for(rank, PEERS.pattern, timeout)
        if found is None:
            raise RuntimeError(f"rank {rank} printed no DHT address:\n{self.output(rank)[-3000:]}")
        return found.group(1)

    def kill(self, rank: int) -> None:
        """kill -9 of the rank's whole session (its DHT process and p2pd too)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[rank].pid, signal.SIGKILL)

    def wait(self, timeout: float) -> dict[int, int | None]:
        """Exit status of every rank within `timeout` in all (None: still running)."""
        return wait_all(self.procs, timeout)

    def wait_progressing(self, stall_s: float, limit_s: float) -> dict[int, int | None]:
        """Exit status of every rank (None: still running), waiting while any rank's output
        grows: at most `stall_s` without a new line from any rank and `limit_s` in all. A
        loaded machine makes a run slower, not silent; a hang still ends the wait."""
        deadline = time.monotonic() + limit_s
        last, quiet_since = -1, time.monotonic()
        while time.monotonic() < deadline:
            if all(p.poll() is not None for p in self.procs.values()):
                break
            size = sum((self.out_dir / f"rank{r}.log").stat().st_size for r in self.procs)
            if size != last:
                last, quiet_since = size, time.monotonic()
            elif time.monotonic() - quiet_since > stall_s:
                break
            time.sleep(0.5)
        return {r: p.poll() for r, p in self.procs.items()}

    def stop(self) -> None:
        """kill -9 every session still there (ranks that exited included: their children)."""
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)

    def p2pd_left(self, grace_s: float = 5.0) -> list[int]:
        """p2pd processes still running in any of this run's sessions after `grace_s` (a
        daemon that was just killed or told to stop gets that long to go)."""
        sessions = {p.pid for p in self.procs.values()}
        deadline = time.monotonic() + grace_s
        while (left := p2pd_in_sessions(sessions)) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left


def p2pd_in_sessions(sessions: set[int]) -> list[int]:
    """Pids of live (not zombie) p2pd processes whose session is one of `sessions`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            if comm != "p2pd":
                continue
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[3]) in sessions:  # fields 3 and 6: state, sid
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def load_models(ck_dir: Path, ranks: list[int], step: int) -> list[dict]:
    """The model state of each rank's checkpoint of `step`."""
    from modules.train.checkpoint import load_checkpoint, step_path

    return [load_checkpoint(step_path(ck_dir, r, step), {})["model"] for r in ranks]


def max_param_diff(models: list[dict]) -> float:
    """Largest absolute difference of any parameter between the first model and the others."""
    first = models[0]
    return max((float((m[k] - first[k]).abs().max()) for m in models[1:] for k in first),
               default=0.0)


FAKE_PEER_ID = "12D3KooWBpJ5MYtL1QxfmJV1CyweZGo8w2zuDEW3J5E9z6P7oJra"
"""A well-formed libp2p peer id for fakes."""


class FakeDHT:
    """What the roster, HivemindOuter and dht_call use of hivemind's DHT, in one process:
    `answers[key]` is what get returns; `alive` False is a DHT process that died, `answering`
    False one that never answers (its futures never resolve)."""

    def __init__(self, peer_id: str = FAKE_PEER_ID, alive: bool = True,
                 answering: bool = True) -> None:
        from hivemind.p2p import PeerID

        self.peer_id = PeerID.from_base58(peer_id)
        self.answers: dict = {}
        self.alive, self.answering = alive, answering
        self.pid, self.exitcode = 4242, None if alive else -9
        self.calls: list[tuple] = []

    def get(self, key, latest=False, return_future=False):
        """The answer for `key`, or (return_future) a future of it, as hivemind's MPFuture."""
        import concurrent.futures

        self.calls.append(("get", key, latest))
        if not return_future:
            return self.answers.get(key)
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.answering and self.alive:
            future.set_result(self.answers.get(key))
        return future

    def is_alive(self) -> bool:
        """Whether the (fake) DHT process runs."""
        return self.alive

    def get_visible_maddrs(self):
        """No addresses: a --client-mode peer's."""
        return []
