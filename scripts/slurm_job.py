"""The pure half of scripts/slurm.py: the sbatch script, the srun argv, a task's rank and device
from Slurm's environment, where each rank runs, and what `scontrol show job` says.

Nothing here runs a Slurm command, so every rule is unit-tested without Slurm
(tests/test_slurm_job.py); scripts/slurm.py calls these and runs sbatch, srun and scancel.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from formats.cluster import Cluster
from formats.errors import UserError
from formats.plan import Plan

OUTPUT_NAME = "slurm-%j.out"
"""The job's output file in the run folder (sbatch's %j = the job id)."""
SCRIPT_NAME = "slurm-submit.sh"
"""The generated batch script, kept in the run folder."""
TERMINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
    "DEADLINE", "SPECIAL_EXIT"})
"""Job states after which the job will not run again (PREEMPTED and REQUEUED ones do)."""
NEVER_REASONS = frozenset({
    "PartitionNodeLimit", "PartitionConfig", "BadConstraints", "InvalidAccount", "InvalidQOS",
    "AccountNotAllowed", "QOSMaxNodePerJobLimit", "QOSMaxGRESPerJob", "PartitionTimeLimit"})
"""Reasons a pending job gives when it cannot start as asked (too many nodes, GPUs or time for
the partition): --wait names them and cancels the job rather than wait forever."""
SET_BY_SLURM = ("--plan", "--rank", "--world-size", "--dist-url", "--coordinator", "--run-dir",
                "--cuda-device")
"""dist_runner flags scripts/slurm.py gives every rank itself (refused after --)."""


@dataclass(frozen=True)
class Layout:
    """Where the plan's ranks run: ranks[i] is Slurm task i's rank, on node nodes[node_of[i]]."""

    ranks: list[int]
    node_of: list[int]
    nodes: list[str]

    @property
    def per_node(self) -> list[int]:
        """Tasks on each node of the allocation."""
        return [self.node_of.count(k) for k in range(len(self.nodes))]

    def block(self) -> int | None:
        """K when tasks fill the nodes in order, K per node (srun's block distribution with
        --ntasks-per-node K); None when they need an arbitrary distribution (a host file)."""
        counts = [c for c in self.per_node if c]
        k = counts[0] if counts else 0
        expected = [i // k for i in range(len(self.ranks))] if k else []
        return k if self.node_of == expected and all(c == k for c in counts[:-1]) else None

    def hostfile(self) -> str:
        """SLURM_HOSTFILE's text for srun --distribution=arbitrary: task i's node on line i."""
        return "".join(f"{self.nodes[k]}\n" for k in self.node_of)


def plan_layout(plan: Plan, nodes: Sequence[str], cluster: Cluster | None,
                per_node: int) -> Layout:
    """Each rank's node: with a cluster, its device's host (matched by name to the nodelist, or
    else the cluster's hosts in order onto the nodes in order); without, device d on node
    d // per_node. UserError when the plan needs more nodes than the allocation has."""
    ranks = sorted(plan.devices())
    if not nodes:
        raise UserError("the allocation has no nodes ($SLURM_JOB_NODELIST is empty)")
    if cluster is None:
        if per_node < 1:
            raise UserError(f"--ranks-per-node: expected at least 1, got {per_node}")
        node_of = [d // per_node for d in ranks]
        need = max(node_of) + 1
        what = f"{len(ranks)} ranks at {per_node} per node (--ranks-per-node/--gpus-per-node)"
    else:
        hosts = list(dict.fromkeys(cluster.devices[d].host for d in range(cluster.num_devices)))
        by_name = all(h in nodes for h in hosts)
        index = {h: (list(nodes).index(h) if by_name else k) for k, h in enumerate(hosts)}
        node_of = [index[cluster.devices[d].host] for d in ranks]
        need = max(node_of) + 1
        what = f"{len(ranks)} ranks on {len(hosts)} hosts of cluster {cluster.name!r}"
    if need > len(nodes):
        raise UserError(f"the plan needs {need} nodes ({what}) but the allocation has "
                        f"{len(nodes)} ({','.join(nodes)}): submit with --nodes {need}, or plan "
                        "for fewer nodes")
    return Layout(ranks, node_of, list(nodes))


def check_tasks(layout: Layout, ntasks: int | None) -> None:
    """UserError when the allocation has fewer tasks ($SLURM_NTASKS) than the plan has ranks."""
    if ntasks is not None and ntasks < len(layout.ranks):
        raise UserError(f"the plan has {len(layout.ranks)} ranks but the allocation has "
                        f"{ntasks} tasks ($SLURM_NTASKS): submit with --ntasks "
                        f"{len(layout.ranks)} (scripts/slurm.py submit sets it from the plan)")


def srun_argv(layout: Layout, task_cmd: Sequence[str], cpus_per_task: int,
              hostfile: str | None = None) -> list[str]:
    """One srun step that starts every rank: block distribution when the layout allows it,
    else arbitrary over `hostfile` (SLURM_HOSTFILE, written by the caller)."""
    n = len(layout.ranks)
    used = sorted(set(layout.node_of))
    argv = ["srun", f"--ntasks={n}", f"--nodes={len(used)}", f"--cpus-per-task={cpus_per_task}",
            "--kill-on-bad-exit=1", "--unbuffered", f"--job-name=ranks-{n}"]
    k = layout.block()
    if k is not None:
        argv += [f"--ntasks-per-node={k}", "--distribution=block",
                 f"--nodelist={','.join(layout.nodes[i] for i in used)}"]
    else:
        if hostfile is None:
            raise ValueError("an arbitrary layout needs a host file")
        argv += ["--distribution=arbitrary"]
    return [*argv, *task_cmd]


@dataclass(frozen=True)
class TaskTarget:
    """What one srun task runs as: its rank, the world size and its CUDA device (None: CPU)."""

    rank: int
    world_size: int
    cuda_device: int | None


def task_target(env: Mapping[str, str], ranks: Sequence[int], gpus_per_node: int) -> TaskTarget:
    """Task -> rank from $SLURM_PROCID (task i runs the plan's i-th rank), device from
    $SLURM_LOCALID: with --gpus-per-node G > 0 one GPU per local rank. A per-task
    CUDA_VISIBLE_DEVICES naming one device (srun --gpus-per-task=1, --gpu-bind) is device 0;
    naming several, the local rank indexes them."""
    procid = _env_count(env, "SLURM_PROCID")
    ntasks = _env_count(env, "SLURM_NTASKS")
    if ntasks != len(ranks):
        raise UserError(f"$SLURM_NTASKS is {ntasks} but the plan has {len(ranks)} ranks: the "
                        "srun step must start one task per rank")
    if procid >= ntasks:
        raise UserError(f"$SLURM_PROCID {procid} is not below $SLURM_NTASKS {ntasks}")
    if gpus_per_node <= 0:
        return TaskTarget(ranks[procid], ntasks, None)
    local = _env_count(env, "SLURM_LOCALID")
    visible = [v for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if len(visible) == 1:
        return TaskTarget(ranks[procid], ntasks, 0)
    limit = len(visible) or gpus_per_node
    if local >= limit:
        given = f"CUDA_VISIBLE_DEVICES={','.join(visible)}" if visible else "--gpus-per-node"
        raise UserError(f"local rank {local} ($SLURM_LOCALID) has no GPU: this node has "
                        f"{limit} ({given}); start at most one rank per GPU")
    return TaskTarget(ranks[procid], ntasks, local)


def _env_count(env: Mapping[str, str], name: str) -> int:
    value = env.get(name)
    if value is None:
        raise UserError(f"${name} is not set: `scripts/slurm.py task` runs inside an srun step")
    if not (value.isascii() and value.isdigit()):
        raise UserError(f"${name}: expected a non-negative integer, got {value!r}")
    return int(value)


def restart_count(env: Mapping[str, str]) -> int:
    """$SLURM_RESTART_COUNT (how often the job was requeued); 0 when unset."""
    value = env.get("SLURM_RESTART_COUNT", "") or "0"
    return int(value) if value.isascii() and value.isdigit() else 0


def has_checkpoint(ckpt_dir: str | Path) -> bool:
    """Some rank has written a checkpoint file (rank{R}/step{S}.pt) under ckpt_dir."""
    return any(Path(ckpt_dir).glob("rank*/step*.pt"))


def want_resume(env: Mapping[str, str], asked: bool, ckpt_dir: str | Path) -> bool:
    """--resume when asked, or when a requeued job (SLURM_RESTART_COUNT > 0) finds a
    checkpoint to continue from (a requeue without one starts again from step 0)."""
    return asked or (restart_count(env) > 0 and has_checkpoint(ckpt_dir))


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in an argv (`--flag V` or `--flag=V`; the last one wins)."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def check_runner_flags(rest: Sequence[str]) -> None:
    """UserError for a dist_runner flag after -- that scripts/slurm.py sets per rank."""
    given = {a.split("=", 1)[0] for a in rest if a.startswith("--")}
    for flag in SET_BY_SLURM:
        if flag in given:
            raise UserError(f"{flag} after --: scripts/slurm.py sets it for every rank")


@dataclass(frozen=True)
class Submission:
    """What sbatch is asked for."""

    nodes: int
    ntasks: int
    ntasks_per_node: int | None
    gpus_per_node: int
    cpus_per_task: int
    run_dir: str
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    job_name: str = "scattered-train"
    extra: tuple[str, ...] = ()


def sbatch_script(sub: Submission, run_cmd: Sequence[str]) -> str:
    """The batch script: #SBATCH lines for `sub` (output appended in the run folder, so a
    requeued job's lines follow the first run's), then `exec run_cmd` (slurm.py run)."""
    lines = ["#!/bin/bash", f"#SBATCH --job-name={sub.job_name}", f"#SBATCH --nodes={sub.nodes}",
             f"#SBATCH --ntasks={sub.ntasks}", f"#SBATCH --cpus-per-task={sub.cpus_per_task}"]
    overcommit = any(a in ("--overcommit", "-O") for a in sub.extra)
    if sub.ntasks_per_node is not None and not overcommit:  # sbatch refuses more per node than
        # CPUs even with --overcommit; srun's --ntasks-per-node places the ranks then
        lines.append(f"#SBATCH --ntasks-per-node={sub.ntasks_per_node}")
    if sub.gpus_per_node > 0:
        lines.append(f"#SBATCH --gpus-per-node={sub.gpus_per_node}")
    for flag, value in (("partition", sub.partition), ("time", sub.time),
                        ("account", sub.account)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    out = str(Path(sub.run_dir) / OUTPUT_NAME)
    lines += [f"#SBATCH --output={out}", "#SBATCH --open-mode=append", "#SBATCH --requeue",
              *(f"#SBATCH {a}" for a in sub.extra), "",
              "# written by scripts/slurm.py submit: measure (unless given a cluster or plan),",
              "# plan (unless given one), then one srun step of every rank (docs/slurm.md)",
              "set -u", 'echo "slurm: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, '
              'restart ${SLURM_RESTART_COUNT:-0}"', f"exec {shlex.join(run_cmd)}", ""]
    return "\n".join(lines)


def submission_shape(num_ranks: int, nodes: int, gpus_per_node: int,
                     ranks_per_node: int) -> tuple[int, int | None]:
    """(ntasks, ntasks-per-node) to ask sbatch for: one task per rank, per node G (GPUs) or
    --ranks-per-node, else the ranks spread evenly over the nodes."""
    per = gpus_per_node or ranks_per_node or math.ceil(num_ranks / nodes)
    if per * nodes < num_ranks:
        raise UserError(f"{num_ranks} ranks do not fit on {nodes} nodes at {per} per node: "
                        f"ask for --nodes {math.ceil(num_ranks / per)}")
    return num_ranks, (per if per * nodes == num_ranks else None)


_FIELD = re.compile(r"(\w+)=(\S*)")


def job_fields(scontrol_line: str) -> dict[str, str]:
    """`scontrol show job -o ID`'s one line -> {field: value}."""
    return dict(_FIELD.findall(scontrol_line))


def job_outcome(fields: Mapping[str, str]) -> tuple[str, int | None]:
    """(state, exit status) of a job: status None while it can still run; else the batch
    script's exit code, or 128 + the signal that ended it (ExitCode=CODE:SIGNAL)."""
    state = fields.get("JobState", "UNKNOWN")
    if state not in TERMINAL_STATES:
        return state, None
    code, _, sig = fields.get("ExitCode", "1:0").partition(":")
    status = int(code) if code.isdigit() else 1
    if status == 0 and sig.isdigit() and int(sig):
        status = 128 + int(sig)
    if status == 0 and state != "COMPLETED":
        status = 1
    return state, status


def hopeless(fields: Mapping[str, str]) -> str | None:
    """A pending job's Reason when it names a limit the job cannot fit (NEVER_REASONS)."""
    reason = fields.get("Reason", "")
    if fields.get("JobState") == "PENDING" and reason in NEVER_REASONS:
        return reason
    return None


def split_at_dashes(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the command's own flags, the flags after `--`: every rank's dist_runner flags)."""
    if "--" not in argv:
        return list(argv), []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]
