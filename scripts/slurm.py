#!/usr/bin/env python3
"""Run the project's workflow on a Slurm allocation: measure, plan, one srun step of every rank.

    python scripts/slurm.py submit --run-dir DIR (--plan PLAN | --cluster C | --model M)
        [--nodes N] [--gpus-per-node G | --ranks-per-node K] [--partition P] [--time T]
        [--resume] [--wait] -- [dist_runner args]
    python scripts/slurm.py run --run-dir DIR (--plan PLAN | --cluster C | --model M) ... -- ...

`submit` writes a batch script (DIR/slurm-submit.sh) that calls `slurm.py run` and hands it to
sbatch; `run` is what that script runs, or what you run yourself inside `salloc`. Inside the
allocation: the nodes of $SLURM_JOB_NODELIST (`scontrol show hostnames`) are measured into
DIR/cluster.json with scripts/measure.py over SSH (unless --cluster or --plan is given), planned
with `scheduler.py plan` into DIR/plan.json (unless --plan is given), and one srun step starts
every rank: task i (SLURM_PROCID) runs the plan's i-th rank on its device's node, one GPU per
local rank (SLURM_LOCALID; a per-task CUDA_VISIBLE_DEVICES of one device is taken as given),
the rendezvous on the node of the first rank (its NodeAddr). DIR must be on storage every node
shares: the ranks write their metrics and checkpoints (DIR/ckpt unless --ckpt-dir is given)
there. A requeued job (SLURM_RESTART_COUNT > 0) continues with --resume when a checkpoint
exists. `--wait` follows the job, printing its output (the trainer's progress lines) as it
grows, and exits with the job's status; Ctrl+C there cancels the job (scancel) and exits 130.
Exit status: the job's (or srun's) status; 2 on bad input or no Slurm, with one line saying why.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from formats import argtypes  # noqa: E402
from formats.atomic_io import atomic_write_bytes, check_output_dir  # noqa: E402
from formats.cluster import Cluster, load_cluster  # noqa: E402
from formats.errors import UserError, run_main  # noqa: E402
from formats.plan import load_plan  # noqa: E402
from modules.control.auth import SECRET_ENV, SECRET_FILE_ENV, new_secret  # noqa: E402
from scripts import slurm_job as sj  # noqa: E402
from scripts.launch_local import check_runner_args, free_port  # noqa: E402

MEASURE = ROOT / "scripts" / "measure.py"
SCHEDULER = ROOT / "scheduler" / "scheduler.py"
DIST_RUNNER = ROOT / "dist_runner.py"
DEFAULT_PORT = 29500
POLL_S = 1.0
CANCEL_WAIT_S = 120.0


def slurm_command(argv: list[str], what: str, check: bool = True) -> str:
    """Run a Slurm client command; its stdout. UserError naming it when it is missing or fails."""
    if shutil.which(argv[0]) is None:
        raise UserError(f"{argv[0]} not found on PATH: run on a Slurm login or compute node "
                        "(or install slurm-client), with SLURM_CONF naming the cluster's "
                        "slurm.conf if it is not in /etc/slurm")
    p = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and p.returncode != 0:
        why = (p.stderr or p.stdout).strip().splitlines()
        last = why[-1] if why else f"status {p.returncode}"
        raise UserError(f"{what}: {argv[0]} failed ({last})")
    return p.stdout


def allocation_nodes() -> list[str]:
    """The allocation's node names, expanded by `scontrol show hostnames`."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not os.environ.get("SLURM_JOB_ID") or not nodelist:
        raise UserError("run: not inside a Slurm allocation ($SLURM_JOB_ID or "
                        "$SLURM_JOB_NODELIST unset): use `slurm.py submit`, or salloc first")
    out = slurm_command(["scontrol", "show", "hostnames", nodelist], "$SLURM_JOB_NODELIST")
    return [n for n in out.split() if n]


def node_addr(name: str) -> str:
    """The address other nodes reach `name` at: its NodeAddr in slurm.conf, else the name."""
    out = slurm_command(["scontrol", "show", "node", "-o", name], f"node {name}", check=False)
    return sj.job_fields(out).get("NodeAddr") or name


def measure_nodes(nodes: list[str], args: argparse.Namespace, run_dir: Path) -> Path:
    """scripts/measure.py over the allocation's nodes (SSH, as the current user): the cluster."""
    if not args.model:
        raise UserError("--model is required to measure the nodes (or give --cluster or --plan)")
    hosts = run_dir / "hosts"
    user = args.ssh_user or os.environ.get("USER") or "root"
    atomic_write_bytes(hosts, "".join(f"{user}@{n}\n" for n in nodes).encode())
    out = run_dir / "cluster.json"
    cmd = [args.python, str(MEASURE), "--hosts", str(hosts), "--model", args.model,
           "--out", str(out), *args.measure_arg]
    print(f"slurm: measuring {len(nodes)} node(s): {' '.join(cmd)}", flush=True)
    status = subprocess.run(cmd, check=False).returncode
    if status == 1:  # written, but some pairs could not connect: the planner avoids them
        print("slurm: some pairs could not connect (above); planning with them as blocked",
              flush=True)
    elif status != 0:
        raise UserError(f"scripts/measure.py exited with status {status} (above); fix that, "
                        "or give --cluster or --plan")
    return out


def plan_cluster(cluster: Path, args: argparse.Namespace, run_dir: Path) -> Path:
    """`scheduler.py plan` on the cluster file: DIR/plan.json."""
    if not args.model:
        raise UserError("--model is required to plan (or give --plan)")
    out = run_dir / "plan.json"
    cmd = [args.python, str(SCHEDULER), "plan", "--cluster", str(cluster), "--model", args.model,
           "--out", str(out), "--quiet", *args.plan_arg]
    print(f"slurm: planning: {' '.join(cmd)}", flush=True)
    status = subprocess.run(cmd, check=False).returncode
    if status != 0:
        raise UserError(f"scheduler.py plan exited with status {status} (above); fix its flags "
                        "(--plan-arg) or give --plan")
    return out


def with_ckpt_dir(rest: list[str], run_dir: Path) -> list[str]:
    """The runner flags with the checkpoint folder every rank gets (RUN_DIR/ckpt unless given),
    so that a --resume after -- is checked as the ranks will see it."""
    given = sj.flag_value(rest, "--ckpt-dir") is not None
    return rest if given else [*rest, "--ckpt-dir", str(run_dir / "ckpt")]


def runner_args(rest: list[str], run_dir: Path, resume: bool) -> list[str]:
    """The dist_runner flags every rank gets: the user's, the run folder, a checkpoint folder
    (DIR/ckpt unless given) and --resume when asked or requeued with a checkpoint."""
    ckpt = sj.flag_value(rest, "--ckpt-dir")
    extra = ["--run-dir", str(run_dir)]
    if ckpt is None:
        ckpt = str(run_dir / "ckpt")
        extra += ["--ckpt-dir", ckpt]
    resume = sj.want_resume(os.environ, resume, ckpt) and "--resume" not in rest
    if resume:
        print(f"slurm: continuing from the checkpoints in {ckpt} (--resume; restart "
              f"{sj.restart_count(os.environ)})", flush=True)
    return [*rest, *extra, *(["--resume"] if resume else [])]


def cmd_run(args: argparse.Namespace, rest: list[str]) -> int:
    """Inside an allocation: measure, plan, one srun step of every rank; srun's status."""
    sj.check_runner_flags(rest)
    run_dir = Path(args.run_dir).absolute()
    check_output_dir(run_dir, "--run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    nodes = allocation_nodes()
    cluster_path = Path(args.cluster) if args.cluster else None
    if args.plan is None and cluster_path is None:
        cluster_path = measure_nodes(nodes, args, run_dir)
    plan_path = Path(args.plan) if args.plan else plan_cluster(cluster_path, args, run_dir)
    plan = load_plan(plan_path)
    cluster: Cluster | None = load_cluster(cluster_path) if cluster_path else None
    per_node = args.gpus_per_node or args.ranks_per_node or _env_ntasks_per_node(len(nodes))
    layout = sj.plan_layout(plan, nodes, cluster, per_node)
    ntasks = os.environ.get("SLURM_NTASKS")
    sj.check_tasks(layout, int(ntasks) if ntasks and ntasks.isdigit() else None)
    check_runner_args(with_ckpt_dir(rest, run_dir), str(plan_path), plan)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not env.get(SECRET_ENV) and not env.get(SECRET_FILE_ENV):
        env[SECRET_ENV] = new_secret()  # one per run, through the environment only
    hostfile = None
    if layout.block() is None:
        hostfile = run_dir / f"slurm-{os.environ['SLURM_JOB_ID']}.hosts"
        atomic_write_bytes(hostfile, layout.hostfile().encode())
        env["SLURM_HOSTFILE"] = str(hostfile)
    url = rendezvous_url(layout, args.port)
    cpus = args.cpus_per_task or int(os.environ.get("SLURM_CPUS_PER_TASK", "1") or 1)
    task = [args.python, str(Path(__file__).resolve()), "task", "--plan", str(plan_path),
            "--dist-url", url, "--gpus-per-node", str(args.gpus_per_node), "--threads",
            str(cpus), "--", *runner_args(rest, run_dir, args.resume)]
    argv = sj.srun_argv(layout, task, cpus, str(hostfile) if hostfile else None)
    print(f"slurm: {len(layout.ranks)} ranks of {plan_path} on {','.join(nodes)} "
          f"({plan.num_replicas} replicas x {plan.num_stages} stages), rendezvous {url}",
          flush=True)
    print(f"slurm: {' '.join(argv[:argv.index(args.python)])} ...", flush=True)
    return subprocess.run(argv, env=env, check=False).returncode


def _env_ntasks_per_node(num_nodes: int) -> int:
    value = os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    if value.isdigit():
        return int(value)
    total = os.environ.get("SLURM_NTASKS", "")
    return max(1, -(-int(total) // num_nodes)) if total.isdigit() else 1


def rendezvous_url(layout: sj.Layout, port: int) -> str:
    """tcp://ADDR:PORT of the store, on the node of the first rank: a free port picked here
    when that is this node (the batch script runs on the first node), else --port."""
    node = layout.nodes[layout.node_of[0]]
    addr = node_addr(node)
    if port == 0:
        here = os.environ.get("SLURMD_NODENAME")
        port = free_port(addr) if here in (None, node) else DEFAULT_PORT
    return f"tcp://{addr}:{port}"


def cmd_task(args: argparse.Namespace, rest: list[str]) -> int:
    """One srun task: its rank and device from Slurm's environment, then dist_runner.py."""
    plan = load_plan(args.plan)
    target = sj.task_target(os.environ, sorted(plan.devices()), args.gpus_per_node)
    cuda = [] if target.cuda_device is None else ["--cuda-device", str(target.cuda_device)]
    argv = [args.python, str(DIST_RUNNER), "--plan", args.plan, "--rank", str(target.rank),
            "--world-size", str(target.world_size), "--dist-url", args.dist_url,
            "--threads", str(args.threads), *cuda, *rest]
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    sys.stdout.flush()
    os.execv(argv[0], argv)
    return 0  # not reached


def submission(args: argparse.Namespace, run_dir: Path) -> sj.Submission:
    """What to ask sbatch for: one task per rank of the plan, or nodes x per-node to measure."""
    devices = load_plan(args.plan).devices() if args.plan else None
    nodes = args.nodes
    if args.cluster:  # the hosts the plan uses (or all the cluster's: it will plan them all)
        cl = load_cluster(args.cluster)
        devices = devices if devices is not None else list(range(cl.num_devices))
        nodes = nodes or len({cl.devices[d].host for d in devices})
    nodes = nodes or 1
    if devices is not None:
        ranks = len(devices)
    else:
        ranks = nodes * (args.gpus_per_node or args.ranks_per_node or 1)
    ntasks, per_node = sj.submission_shape(ranks, nodes, args.gpus_per_node, args.ranks_per_node)
    return sj.Submission(nodes=nodes, ntasks=ntasks, ntasks_per_node=per_node,
                         gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task or 1,
                         run_dir=str(run_dir), partition=args.partition, time=args.time,
                         account=args.account, extra=tuple(args.sbatch_arg))


def run_command(args: argparse.Namespace, run_dir: Path, rest: list[str]) -> list[str]:
    """The `slurm.py run ...` line the batch script executes (absolute paths: the job starts in
    sbatch's working folder on another node)."""
    cmd = [args.python, str(Path(__file__).resolve()), "run", "--run-dir", str(run_dir),
           "--gpus-per-node", str(args.gpus_per_node), "--port", str(args.port)]
    for flag, value in (("--plan", args.plan), ("--cluster", args.cluster),
                        ("--model", args.model), ("--ssh-user", args.ssh_user)):
        if value:
            cmd += [flag, str(Path(value).absolute()) if flag in ("--plan", "--cluster")
                    else value]
    if args.ranks_per_node:
        cmd += ["--ranks-per-node", str(args.ranks_per_node)]
    if args.cpus_per_task:
        cmd += ["--cpus-per-task", str(args.cpus_per_task)]
    cmd += [f"--plan-arg={a}" for a in args.plan_arg]
    cmd += [f"--measure-arg={a}" for a in args.measure_arg]
    if args.resume:
        cmd.append("--resume")
    return [*cmd, "--", *rest]


def cmd_submit(args: argparse.Namespace, rest: list[str]) -> int:
    """Write the batch script, sbatch it; with --wait follow it to its end."""
    sj.check_runner_flags(rest)
    run_dir = Path(args.run_dir).absolute()
    check_output_dir(run_dir, "--run-dir")
    if args.plan:
        check_runner_args(with_ckpt_dir(rest, run_dir), args.plan, load_plan(args.plan))
    elif not args.model and not args.cluster:
        raise UserError("submit: give --plan, or --cluster or --model to plan inside the job")
    sub = submission(args, run_dir)
    script = sj.sbatch_script(sub, run_command(args, run_dir, rest))
    if args.dry_run:
        print(script, end="")
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / sj.SCRIPT_NAME
    atomic_write_bytes(path, script.encode())
    try:
        out = slurm_command(["sbatch", "--parsable", str(path)], "sbatch")
    except UserError as e:
        if "node configuration is not available" in str(e) and not args.gpus_per_node:
            raise UserError(f"{e}: {sub.ntasks} CPU ranks x {sub.cpus_per_task} CPU(s) do not "
                            f"fit on {sub.nodes} node(s); ask for more --nodes, or let ranks "
                            "share CPUs with --sbatch-arg=--overcommit") from None
        raise
    job = out.strip().split(";")[0]
    log = run_dir / sj.OUTPUT_NAME.replace("%j", job)
    print(f"slurm: submitted job {job} ({sub.ntasks} ranks on {sub.nodes} node(s)); "
          f"output {log}", flush=True)
    return follow(job, log) if args.wait else 0


def job_state(job: str) -> tuple[str, int | None]:
    """(state, exit status or None while it can still run) from `scontrol show job`;
    UserError (after scancel) when it waits for what the partition can never give it."""
    out = slurm_command(["scontrol", "show", "job", "-o", job], f"job {job}", check=False)
    if "JobState=" not in out:  # gone from slurmctld's memory (MinJobAge): it has ended
        return "UNKNOWN", 1
    fields = sj.job_fields(out)
    reason = sj.hopeless(fields)
    if reason is not None:
        slurm_command(["scancel", job], f"scancel {job}", check=False)
        raise UserError(f"job {job} cannot start as asked (Reason={reason}: "
                        f"{fields.get('NumNodes', '?')} node(s), partition "
                        f"{fields.get('Partition', '?')}); cancelled it: ask for fewer nodes "
                        "or GPUs (--nodes, --gpus-per-node), another --partition or --time, or "
                        "let CPU ranks share CPUs (--sbatch-arg=--overcommit)")
    return sj.job_outcome(fields)


def follow(job: str, log: Path) -> int:
    """Print the job's output as it grows until the job ends; its exit status. Ctrl+C cancels
    the job (scancel), waits for it to end and returns 130; so does SIGTERM."""
    def cancel(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # also when started in the background (SIGINT ignored there)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, cancel)
    pos = 0
    cancelled_at: float | None = None
    while True:
        try:
            state, status = job_state(job)
            pos = _print_new(log, pos)
            if status is not None:
                break
            if cancelled_at is not None and time.monotonic() - cancelled_at > CANCEL_WAIT_S:
                print(f"slurm: job {job} still {state} {CANCEL_WAIT_S:g} s after scancel",
                      flush=True)
                return 130
            time.sleep(POLL_S)
        except KeyboardInterrupt:
            if cancelled_at is None:
                print(f"slurm: Ctrl+C: cancelling job {job} (scancel)", flush=True)
                slurm_command(["scancel", job], f"scancel {job}", check=False)
                cancelled_at = time.monotonic()
    time.sleep(POLL_S)  # the last lines reach the shared file after the state changes
    _print_new(log, pos)
    print(f"slurm: job {job} {state}, exit status {status}", flush=True)
    return 130 if cancelled_at is not None else status


def _print_new(log: Path, pos: int) -> int:
    try:
        with open(log, "rb") as f:
            f.seek(pos)
            data = f.read()
    except FileNotFoundError:  # the job has not started yet
        return pos
    end = data.rfind(b"\n") + 1  # whole lines only; the rest next time
    if end:
        sys.stdout.write(data[:end].decode(errors="replace"))
        sys.stdout.flush()
    return pos + end


def add_workflow_args(p: argparse.ArgumentParser) -> None:
    """The flags `submit` and `run` share: what to run and where."""
    p.add_argument("--run-dir", required=True,
                   help="run folder on storage every node shares: plan, cluster, the job's "
                   "output, every rank's metrics and checkpoints")
    p.add_argument("--plan", help="plan file to run (skips measuring and planning)")
    p.add_argument("--cluster", help="cluster file to plan on (skips measuring)")
    p.add_argument("--model", help="model preset to measure and plan for (without --plan)")
    p.add_argument("--plan-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `scheduler.py plan` (repeat; e.g. "
                   "--plan-arg=--runtime=gpu)")
    p.add_argument("--measure-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for scripts/measure.py (repeat; e.g. "
                   "--measure-arg=--known-hosts=kh)")
    p.add_argument("--ssh-user", help="user measure.py logs in to the nodes as ($USER)")
    p.add_argument("--gpus-per-node", type=argtypes.integer(0, 1024), default=0,
                   help="GPUs per node, one rank each (0: CPU ranks, no --cuda-device)")
    p.add_argument("--ranks-per-node", type=argtypes.integer(0, 1024), default=0,
                   help="CPU ranks per node (0: --gpus-per-node, else the ranks spread evenly)")
    p.add_argument("--cpus-per-task", type=argtypes.integer(0, 1024), default=0,
                   help="CPUs (and torch threads) per rank (0: $SLURM_CPUS_PER_TASK, else 1)")
    p.add_argument("--port", type=argtypes.port(zero_ok=True), default=0,
                   help=f"rendezvous port (0: a free one on the first node, else {DEFAULT_PORT})")
    p.add_argument("--resume", action="store_true",
                   help="continue from the run's checkpoints (a requeued job does this itself "
                   "when a checkpoint exists)")
    p.add_argument("--python", default=sys.executable,
                   help="python on the nodes (this one; the project and it on shared storage)")


def build_parser() -> argparse.ArgumentParser:
    """`submit`, `run` and the internal `task`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("submit", help="sbatch a job that runs `slurm.py run` (--wait: follow it)")
    add_workflow_args(s)
    s.add_argument("--nodes", type=argtypes.integer(1, 100000),
                   help="nodes to ask for (default: the plan's cluster's hosts, else 1)")
    s.add_argument("--partition", help="sbatch --partition")
    s.add_argument("--time", help="sbatch --time (e.g. 2:00:00)")
    s.add_argument("--account", help="sbatch --account")
    s.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="extra #SBATCH line (repeat; e.g. --sbatch-arg=--qos=normal)")
    s.add_argument("--wait", action="store_true",
                   help="follow the job: print its output, exit with its status; Ctrl+C "
                   "cancels it (scancel)")
    s.add_argument("--dry-run", action="store_true", help="print the batch script, submit nothing")
    s.set_defaults(func=cmd_submit)
    r = sub.add_parser("run", help="inside an allocation: measure, plan, srun every rank")
    add_workflow_args(r)
    r.set_defaults(func=cmd_run)
    t = sub.add_parser("task", help="(one srun task: its rank and GPU, then dist_runner.py)")
    t.add_argument("--plan", required=True)
    t.add_argument("--dist-url", required=True)
    t.add_argument("--gpus-per-node", type=argtypes.integer(0, 1024), default=0)
    t.add_argument("--threads", type=argtypes.integer(1, 1024), default=1)
    t.add_argument("--python", default=sys.executable)
    t.set_defaults(func=cmd_task)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point: flags before `--` are ours, after it dist_runner's."""
    argv, rest = sj.split_at_dashes(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return args.func(args, rest)


def entry() -> None:
    """Console entry point: run main() under run_main."""
    run_main(main)


if __name__ == "__main__":
    entry()
