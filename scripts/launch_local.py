"""Start every rank of a plan on this machine, stream their logs, stop them all together.

    python scripts/launch_local.py --plan plan.json [--netns-map map.json] -- [dist_runner args]

Picks a free port on --host for the rendezvous, starts `python dist_runner.py --rank R ...` for
every device of the plan (each in its own process group), prefixes each output line with the
rank, and prints a progress summary. If a rank fails the others are stopped and the launcher
exits with that rank's status; with --keep-going (DiLoCo runs that drop a lost replica) the
others go on and the launcher exits 0 when every rank of at least one replica finished.
Ctrl+C (SIGINT, also when started in the background from a script), SIGTERM or SIGHUP stops
every child (SIGTERM to its process group, SIGKILL after --grace-s) and exits 128 + the signal
number (130, 143, 129). On Linux every rank also gets SIGKILL from the kernel when the launcher
dies (parent-death signal), so no rank outlives a launcher that was killed with SIGKILL.
With --netns-map, rank R runs under `ip netns exec NS`. With --coordinator, the rendezvous store
and membership leader run as their own process (scripts/coordinator.py, output prefixed
`[coordinator]`) and the ranks get --coordinator instead of --dist-url: rank 0 is then an
ordinary rank, and with --keep-going a DiLoCo run survives losing it. The coordinator's exit is
reported, not acted on (if it dies, the ranks save and exit 1 on their own).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from formats import argtypes, checks  # noqa: E402
from formats.addresses import resolve  # noqa: E402
from formats.errors import UserError, run_main  # noqa: E402
from formats.jsonfile import load_json  # noqa: E402
from formats.plan import Entry, Plan, as_group, load_plan  # noqa: E402
from formats.run_metrics import STATUS_ENV, format_status, parse_status  # noqa: E402
from modules.cli_config import from_args, runner_parser  # noqa: E402
from modules.config import MAX_CUDA_DEVICE, MAX_THREADS, RunConfig  # noqa: E402
from modules.control.auth import SECRET_ENV, SECRET_FILE_ENV, new_secret  # noqa: E402

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1
"""prctl option (linux/prctl.h): the signal this process gets when its parent thread dies."""
DIST_RUNNER = ROOT / "dist_runner.py"
SET_BY_LAUNCHER = ("--plan", "--rank", "--world-size", "--dist-url", "--coordinator")
"""dist_runner flags the launcher gives each rank its own value of (not allowed after --;
--threads and --cuda-device after -- override the launcher's on purpose)."""
MAX_GRACE_S = 3600.0


class Stop(Exception):
    """SIGINT, SIGTERM or SIGHUP arrived: stop every child, exit 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def install_stop_handlers() -> dict[int, object]:
    """Raise Stop on SIGINT, SIGTERM and SIGHUP; returns the handlers they replace.

    SIGINT too: a shell ignores it in the background jobs a script starts, and Python then
    installs no KeyboardInterrupt handler, so the launcher would not react to it at all.
    """
    def on_signal(signum: int, frame: object) -> None:
        raise Stop(signum)

    return {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}


def ignore_stop_signals() -> None:
    """While the children are being stopped, a second signal must not cut that short."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def parent_death_signal(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` giving the child `sig` when the launcher dies (Linux), else None.

    The kernel sends it when the thread that started the child exits, so start ranks from the
    main thread. prctl is looked up here, before the fork, so the child only calls it.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                      ctypes.c_ulong]
    launcher = os.getpid()

    def preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != launcher:  # it died before prctl took effect: nobody will signal us
            os.kill(os.getpid(), sig)

    return preexec


def free_port(host: str) -> int:
    """A TCP port that is free on `host` right now (UserError when `host` is not an address
    of this machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError as e:
            raise UserError(f"--host {host}: cannot listen there ({e.strerror or e})") from None
        return s.getsockname()[1]


def load_netns_map(path: str | None, ranks: list[int]) -> dict[int, str]:
    """{rank: namespace} from a JSON object {"0": "ns0", ...}; every rank must be mapped."""
    if not path:
        return {}
    raw = load_json(path, "--netns-map")
    if not isinstance(raw, dict):
        raise UserError(f'--netns-map: expected a JSON object {{"RANK": "NAMESPACE", ...}} in '
                        f'{path}, got {type(raw).__name__}')
    mapping = {}
    for key, value in raw.items():
        if not (key.isascii() and key.isdigit()):
            raise UserError(f"--netns-map: key {checks.shown(key)} is not a rank number")
        mapping[int(key)] = netns_name(value, f"--netns-map: rank {key}")
    missing = [r for r in ranks if r not in mapping]
    if missing:
        raise UserError(f"--netns-map: ranks {missing} have no namespace")
    return mapping


def netns_name(value: object, where: str) -> str:
    """A network namespace name: a file name under /run/netns (no '/', not '.' or '..')."""
    name = checks.text(value, where, max_chars=255)
    if "/" in name or name in (".", ".."):
        raise UserError(f"{where}: {checks.shown(name)} is not a namespace name")
    return name


def check_runner_args(rest: list[str], plan_path: str, plan: Plan) -> None:
    """The dist_runner flags after `--`, checked as every rank would check them (UserError or
    argparse's exit 2 naming the flag), before any rank starts."""
    given = [a.split("=", 1)[0] for a in rest if a.startswith("--")]
    for flag in SET_BY_LAUNCHER:
        if flag in given:
            raise UserError(f"{flag} after --: the launcher sets it for every rank")
    args = runner_parser(prog="dist_runner.py (after --)").parse_args(
        ["--plan", plan_path, *rest])
    cfg = from_args(RunConfig, args)
    cfg.check_paths()
    cfg.check_plan(plan)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """Launcher flags, and the arguments after `--` for dist_runner.py."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description="Run every rank of a plan on this machine; "
                                "arguments after -- go to dist_runner.py.")
    p.add_argument("--plan", required=True,
                   help="plan JSON file (plan/1, or plan/2 with shard groups)")
    p.add_argument("--host", default="127.0.0.1",
                   help="rendezvous address (rank 0, or the coordinator, listens)")
    p.add_argument("--port", type=argtypes.port(zero_ok=True), default=0,
                   help="rendezvous port (0: pick a free one)")
    p.add_argument("--threads-per-rank", type=argtypes.integer(0, MAX_THREADS), default=0,
                   help="OMP/torch threads per rank (0: cores / ranks, at least 1)")
    p.add_argument("--netns-map", help='JSON {"RANK": "NETNS"}: run rank under ip netns exec')
    p.add_argument("--gloo-ifname", type=argtypes.interface_name,
                   help="GLOO_SOCKET_IFNAME for the ranks (e.g. inside netns)")
    p.add_argument("--grace-s", type=argtypes.number(0, MAX_GRACE_S), default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping ranks")
    p.add_argument("--gpus", type=argtypes.integer(0, MAX_CUDA_DEVICE + 1), default=None,
                   help="CUDA devices on this host: the ranks take them round robin "
                   "(--cuda-device i %% N for the i-th rank started; default: the GPUs "
                   "visible here, one per rank; 0: pass none, every rank on its default GPU "
                   "0). The mapping is printed at start")
    p.add_argument("--keep-going", action="store_true",
                   help="a rank that fails does not stop the others (DiLoCo drops its replica "
                   "and trains on); exit 0 if every rank of some replica finished")
    p.add_argument("--coordinator", action="store_true",
                   help="start scripts/coordinator.py as its own process to host the store and "
                   "lead membership, so that no rank is special (DiLoCo then survives losing "
                   "rank 0 too, with --keep-going)")
    p.add_argument("--coordinator-timeout-s", type=argtypes.number(0, MAX_GRACE_S, lo_open=True),
                   default=60.0,
                   help="with --coordinator: how long to wait for it to listen, and for it to "
                   "exit after the ranks (default 60)")
    p.add_argument("--runner", default=str(DIST_RUNNER), help=argparse.SUPPRESS)
    return p.parse_args(argv), rest


def visible_gpus() -> int:
    """CUDA devices this process sees (CUDA_VISIBLE_DEVICES applied; 0 without CUDA torch)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _flag_value(rest: list[str], flag: str) -> str | None:
    """The value of `flag` among dist_runner's arguments (the last one given), else None."""
    value = None
    for i, a in enumerate(rest):
        if a == flag and i + 1 < len(rest):
            value = rest[i + 1]
        elif a.startswith(f"{flag}="):
            value = a.split("=", 1)[1]
    return value


def gpu_flags(gpus: int | None, ranks: list[int], rest: list[str],
              log: Callable[[str], None] = print) -> dict[int, list[str]]:
    """Each rank's `--cuda-device` flags: the i-th rank started gets GPU i % N, N = `gpus`
    (None: the GPUs visible here). Prints the mapping, and says when ranks share a GPU under
    --comm auto (their groups then use gloo: NCCL needs one GPU per rank)."""
    none: dict[int, list[str]] = {r: [] for r in ranks}
    if _flag_value(rest, "--device") == "cpu":
        return none
    if _flag_value(rest, "--cuda-device") is not None:
        log("launch: GPU mapping: every rank takes --cuda-device from the arguments after --")
        return none
    n = visible_gpus() if gpus is None else gpus
    if n == 0:
        if gpus == 0 and len(ranks) > 1 and visible_gpus() > 1:
            log(f"launch: --gpus 0: no --cuda-device passed, so every rank that runs on CUDA "
                f"uses GPU 0 of the {visible_gpus()} here (drop --gpus 0 for one GPU per rank)")
        return none
    where = {r: i % n for i, r in enumerate(ranks)}
    log("launch: GPU mapping: " + ", ".join(f"rank {r} -> cuda:{g}" for r, g in where.items()))
    shared = {g: [r for r in ranks if where[r] == g] for g in set(where.values())}
    crowded = {g: rs for g, rs in sorted(shared.items()) if len(rs) > 1}
    comm = _flag_value(rest, "--comm") or "auto"
    if crowded and comm != "gloo":
        log(f"launch: {len(ranks)} ranks on {n} GPU(s): "
            + "; ".join(f"ranks {rs} share cuda:{g}" for g, rs in crowded.items())
            + f": --comm {comm} cannot use NCCL between ranks of one GPU ("
            + ("their groups fall back to gloo" if comm == "auto" else "such a group is refused")
            + "); give each rank its own GPU (--gpus, more GPUs or fewer ranks)")
    return {r: ["--cuda-device", str(g)] for r, g in where.items()}


def start_rank(rank: int, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start one rank in its own process group, stdout+stderr merged into a pipe; it dies
    with the launcher (parent-death signal, Linux)."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, env=env, start_new_session=True,
                            preexec_fn=parent_death_signal())


def stream(rank: int, proc: subprocess.Popen, progress: dict[int, str],
           lock: threading.Lock) -> None:
    """Copy a rank's output with a `[rank R]` prefix; remember its latest status record
    (formats.run_metrics: `STATUS {json}` lines, passed on only when $SCATTERED_STATUS asks)."""
    assert proc.stdout is not None
    pass_status = os.environ.get(STATUS_ENV) == "1"
    for line in proc.stdout:
        line = line.rstrip("\n").removeprefix(f"rank {rank}: ")
        rec = parse_status(line)
        with lock:
            if rec is not None:
                progress[rank] = format_status(rec)
            if rec is None or pass_status:
                print(f"[rank {rank}] {line}", flush=True)


def start_coordinator(plan: str, host: str, port: int, env: dict[str, str], timeout_s: float,
                      lock: threading.Lock) -> tuple[subprocess.Popen, threading.Thread]:
    """Start scripts/coordinator.py (own process group, dies with the launcher), stream its
    output as `[coordinator] ...` and its exit status as a `launch:` line; returns the process
    and that streaming thread once it listens (UserError if not within `timeout_s`)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "coordinator.py"), "--listen",
           f"{host}:{port}", "--plan", plan]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, env=env, start_new_session=True,
                            preexec_fn=parent_death_signal())
    listening = threading.Event()

    def copy() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n").removeprefix("coordinator: ")
            if line.startswith("listening on port"):
                listening.set()
            with lock:
                print(f"[coordinator] {line}", flush=True)
        print(f"launch: the coordinator exited with status {proc.wait()}", flush=True)

    reporter = threading.Thread(target=copy, daemon=True)
    reporter.start()
    print(f"launch: coordinator pid {proc.pid}", flush=True)
    deadline = time.monotonic() + timeout_s
    while not listening.wait(0.1):
        if proc.poll() is not None or time.monotonic() > deadline:
            _signal_group(proc, signal.SIGKILL)
            raise UserError(f"--coordinator: scripts/coordinator.py did not listen on "
                            f"{host}:{port} within {timeout_s:g} s (status {proc.poll()})")
    return proc, reporter


def finish_coordinator(proc: subprocess.Popen, reporter: threading.Thread,
                       timeout_s: float) -> None:
    """After the ranks: give the coordinator `timeout_s` to see them done and exit (its status
    is reported); if it is still running it is stopped with the others."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"launch: the coordinator is still running {timeout_s:g} s after the ranks; "
              "stopping it", flush=True)
        return
    reporter.join(timeout=5)


def stop_all(procs: dict[int, subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every live child's process group, then SIGKILL what is left after grace_s."""
    for proc in procs.values():
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # the child's own group (start_new_session), by its pid


def keep_going_status(pipelines: list[list[Entry]], failed: dict[int, int]) -> int:
    """0 if every rank of some replica finished, else the first failed rank's status."""
    finished = [r for r, chain in enumerate(pipelines)
                if not {d for entry in chain for d in as_group(entry)} & set(failed)]
    print(f"launch: ranks {sorted(failed)} failed; replicas {finished} finished", flush=True)
    if finished:
        return 0
    rc = failed[min(failed)]
    return rc if rc > 0 else 1


def main(argv: list[str] | None = None) -> int:
    """Launch, supervise and stop the ranks; returns the exit status."""
    args, rest = parse_args(argv)
    plan = load_plan(args.plan)
    ranks = sorted(plan.devices())
    netns = load_netns_map(args.netns_map, ranks)
    resolve(args.host, "--host")
    if Path(args.runner) == DIST_RUNNER:  # (tests start a stand-in with flags of its own)
        check_runner_args(rest, args.plan, plan)
    port = args.port or free_port(args.host if not netns else "127.0.0.1")
    url = f"tcp://{args.host}:{port}"
    threads = args.threads_per_rank or max(1, (os.cpu_count() or 1) // len(ranks))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    env[STATUS_ENV] = "1"  # ranks print status records; stream() reads them
    if not env.get(SECRET_ENV) and not env.get(SECRET_FILE_ENV):  # one secret per launch,
        env[SECRET_ENV] = new_secret()  # through the environment only (docs/security.md)
    if args.gloo_ifname:  # NCCL's bootstrap and socket transport take the same interface
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = args.gloo_ifname
    gpu = gpu_flags(args.gpus, ranks, rest)
    print(f"launch: {len(ranks)} ranks of {args.plan} ({plan.num_replicas} replicas x "
          f"{plan.num_stages} stages), rendezvous {url}"
          f"{' (coordinator process)' if args.coordinator else ''}, {threads} thread(s) per "
          "rank", flush=True)
    run = Ranks(threading.Lock())
    t0 = time.monotonic()
    status = 0
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        install_stop_handlers()
        if args.coordinator:
            run.coord = start_coordinator(args.plan, args.host, port, env,
                                          args.coordinator_timeout_s, run.lock)
        for r in ranks:
            cmd = [sys.executable, args.runner, "--plan", args.plan, "--rank", str(r),
                   "--world-size", str(len(ranks)),
                   "--coordinator" if args.coordinator else "--dist-url", url,
                   "--threads", str(threads), *gpu[r], *rest]
            run.start(r, ["ip", "netns", "exec", netns[r], *cmd] if r in netns else cmd, env,
                      netns.get(r))
        status = run.wait_all(len(ranks), args.keep_going, plan.pipelines)
        if run.coord is not None and status == 0:
            finish_coordinator(*run.coord, args.coordinator_timeout_s)
    except Stop as e:
        print(f"launch: {e}; stopping every rank", flush=True)
        status = 128 + e.signum
    finally:
        ignore_stop_signals()
        stop_all({**run.procs, -1: run.coord[0]} if run.coord is not None else run.procs,
                 args.grace_s)
        # called in-process (a test, a wrapper): what this process starts next must not
        # inherit SIG_IGN for SIGTERM, or terminate() would no longer stop it
        for sig, handler in before.items():
            signal.signal(sig, handler)
    run.report(status, len(ranks), time.monotonic() - t0)
    return status


@dataclass
class Ranks:
    """The launched rank processes, their latest progress and how they ended."""

    lock: threading.Lock
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    coord: tuple[subprocess.Popen, threading.Thread] | None = None
    done: queue.Queue = field(default_factory=queue.Queue)
    progress: dict[int, str] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)

    def start(self, r: int, cmd: list[str], env: dict[str, str], netns: str | None) -> None:
        """Start rank `r`, stream its output, and put `r` on `done` when it has exited."""
        self.procs[r] = start_rank(r, cmd, env)
        print(f"launch: rank {r} pid {self.procs[r].pid}" + (f" in netns {netns}"
                                                             if netns else ""), flush=True)
        out = threading.Thread(target=stream, args=(r, self.procs[r], self.progress, self.lock),
                               daemon=True)
        out.start()
        threading.Thread(target=lambda r=r, out=out: (self.procs[r].wait(), out.join(),
                                                      self.done.put(r)), daemon=True).start()

    def wait_all(self, count: int, keep_going: bool, pipelines: list[list[int]]) -> int:
        """Wait for the ranks in the order they exit: the exit status of the launch."""
        status = 0
        for _ in range(count):
            r = self.done.get()
            rc = self.procs[r].returncode
            if rc != 0 and keep_going:
                print(f"launch: rank {r} exited with status {rc}; the others go on "
                      "(--keep-going)", flush=True)
                self.failed[r] = rc
            elif rc != 0:
                print(f"launch: rank {r} exited with status {rc}; stopping the other ranks",
                      flush=True)
                status = rc if rc > 0 else 1
                break
        if self.failed:
            status = keep_going_status(pipelines, self.failed)
        return status

    def report(self, status: int, count: int, wall: float) -> None:
        """Each rank's last progress, and how many ranks finished."""
        for r in sorted(self.progress):
            print(f"launch: rank {r} last: {self.progress[r]}")
        if status == 0:
            print(f"launch: {'all ' if not self.failed else ''}{count - len(self.failed)} ranks "
                  f"finished in {wall:.1f} s")


def entry() -> None:
    """Console entry point (setup.py): run main() under run_main."""
    run_main(main)


if __name__ == "__main__":
    entry()
