#!/usr/bin/env python3
"""Write a SkyPilot task or a Kubernetes JobSet that runs a plan's ranks.

    python scripts/launch_specs.py sky --plan PLAN --out task.yaml [--accelerator A100:8]
        [--use-spot] [--bucket NAME] [--run-dir /mnt/run] -- [dist_runner args]
    python scripts/launch_specs.py k8s --plan PLAN --out jobset.yaml --image IMAGE
        [--gpus-per-node G] [--pvc CLAIM] [--run-dir /mnt/run] -- [dist_runner args]

SkyPilot: `num_nodes` nodes with the accelerators each needs; on node SKYPILOT_NODE_RANK the
`run` script starts that node's ranks (the plan's ranks in order, G per node), one GPU each,
with the rendezvous on the first address of SKYPILOT_NODE_IPS. With --use-spot the task is
meant for `sky jobs launch` (managed, recovered on preemption): a recovered run finds the
checkpoints in the run folder (--bucket mounts one there) and continues with --resume.
Kubernetes: a JobSet (jobset.x-k8s.io/v1alpha2) with one replicated job per replica of the
plan (its pods = the replica's ranks / G, an Indexed Job: pod JOB_COMPLETION_INDEX starts its
ranks), the rendezvous on the first pod of the replica holding rank 0 (JobSet's DNS names), the
run folder on a PersistentVolumeClaim; a JobSet restart (failurePolicy) continues with --resume.
The run secret (docs/security.md) comes from the environment: `sky launch --env
ST_RUN_SECRET=...`, a Kubernetes Secret NAME-secret (key run-secret) for the JobSet.
Written as YAML with PyYAML when it is installed, else as JSON (which YAML parsers read).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

from formats import argtypes, checks  # noqa: E402
from formats.atomic_io import atomic_write_bytes, check_output_path  # noqa: E402
from formats.errors import UserError, run_main  # noqa: E402
from formats.plan import Plan, as_group, load_plan  # noqa: E402
from scripts.launch_local import check_runner_args  # noqa: E402
from scripts.slurm_job import check_runner_flags, split_at_dashes  # noqa: E402

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
DEFAULT_PORT = 29500
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-")


def node_script(ranks: list[int], world: int, per_node: int, node_var: str, host_expr: str,
                gpus: bool, args: argparse.Namespace, rest: list[str]) -> str:
    """The bash every node runs: its ranks (ranks[node * per_node + i]), one GPU each, the
    rendezvous at `host_expr`, --resume when the run folder already holds a checkpoint."""
    ckpt = f"{args.run_dir}/ckpt"
    runner = [args.python, "dist_runner.py", "--plan", args.plan_path, "--world-size",
              str(world), "--run-dir", args.run_dir, "--ckpt-dir", ckpt, *rest]
    cuda = ' --cuda-device "$i"' if gpus else ""
    return "\n".join([
        "set -u",
        f"ranks=({' '.join(map(str, ranks))})",
        f'node="${{{node_var}}}"',
        f'host={host_expr}',
        "resume=",
        f"if compgen -G {shlex.quote(ckpt)}'/rank*/step*.pt' > /dev/null; then "
        "resume=--resume; fi  # recovered or restarted: continue",
        "pids=()",
        f"for i in $(seq 0 {per_node - 1}); do",
        f'  k=$((node * {per_node} + i))',
        '  [ "$k" -lt "${#ranks[@]}" ] || break',
        f'  {shlex.join(runner)} --rank "${{ranks[$k]}}" --dist-url "tcp://$host:{args.port}"'
        f'{cuda} $resume &',
        '  pids+=($!)',
        "done",
        "status=0",
        'for p in "${pids[@]}"; do wait "$p" || status=$?; done',
        'exit "$status"', ""])


def sky_task(plan: Plan, args: argparse.Namespace, rest: list[str]) -> dict[str, Any]:
    """The SkyPilot task: num_nodes, accelerators per node, the wiring of its env vars."""
    ranks = sorted(plan.devices())
    gpus = 0
    resources: dict[str, Any] = {}
    if args.accelerator:
        name, _, count = args.accelerator.partition(":")
        gpus = int(count) if count else 1
        resources["accelerators"] = f"{name}:{gpus}"
    per_node = gpus or args.ranks_per_node or len(ranks)
    if args.use_spot:
        resources["use_spot"] = True
    for key in ("cloud", "region"):
        if getattr(args, key):
            resources[key] = getattr(args, key)
    task: dict[str, Any] = {
        "name": args.name, "num_nodes": -(-len(ranks) // per_node), "resources": resources,
        "workdir": args.workdir, "setup": args.setup,
        "run": node_script(ranks, len(ranks), per_node, "SKYPILOT_NODE_RANK",
                           '"$(echo "$SKYPILOT_NODE_IPS" | head -n1)"', gpus > 0, args, rest)}
    if args.bucket:
        task["file_mounts"] = {args.run_dir: {"name": args.bucket, "mode": "MOUNT"}}
    return task


def replica_groups(plan: Plan) -> list[list[int]]:
    """Each replica's device ids, stage order (a shard group's devices together)."""
    return [[d for entry in chain for d in as_group(entry)] for chain in plan.pipelines]


def jobset(plan: Plan, args: argparse.Namespace, rest: list[str]) -> dict[str, Any]:
    """The JobSet: one replicated job per replica, its pods an Indexed Job."""
    groups = replica_groups(plan)
    per_pod = args.gpus_per_node or args.ranks_per_node or 1
    first = next(r for r, g in enumerate(groups) if min(plan.devices()) in g)
    host = f"{args.name}-replica-{first}-0-0.{args.name}"  # JobSet's NAME-RJOB-I-POD.SUBDOMAIN
    jobs = []
    for r, group in enumerate(groups):
        script = node_script(group, len(plan.devices()), per_pod, "JOB_COMPLETION_INDEX",
                             '"$ST_RENDEZVOUS_HOST"', args.gpus_per_node > 0, args, rest)
        pods = -(-len(group) // per_pod)
        container: dict[str, Any] = {
            "name": "trainer", "image": args.image, "workingDir": args.workdir,
            "command": ["bash", "-c", script],
            "env": [{"name": "ST_RENDEZVOUS_HOST", "value": host},
                    {"name": "ST_RUN_SECRET", "valueFrom": {"secretKeyRef": {
                        "name": f"{args.name}-secret", "key": "run-secret"}}},
                    {"name": "PYTHONUNBUFFERED", "value": "1"}],
            "volumeMounts": [{"name": "run", "mountPath": args.run_dir}]}
        if args.gpus_per_node:
            container["resources"] = {"limits": {"nvidia.com/gpu": args.gpus_per_node}}
        volume = ({"name": "run", "persistentVolumeClaim": {"claimName": args.pvc}} if args.pvc
                  else {"name": "run", "emptyDir": {}})
        jobs.append({"name": f"replica-{r}", "replicas": 1, "template": {"spec": {
            "parallelism": pods, "completions": pods, "completionMode": "Indexed",
            "backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never", "containers": [container], "volumes": [volume]}}}}})
    return {"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": {"name": args.name},
            "spec": {"network": {"enableDNSHostnames": True},
                     "failurePolicy": {"maxRestarts": args.max_restarts},
                     "replicatedJobs": jobs}}


def dump(obj: dict[str, Any]) -> str:
    """YAML through PyYAML (block style, keys in order) when installed, else JSON."""
    try:
        import yaml
    except ImportError:  # JSON is YAML: every YAML parser reads it
        return json.dumps(obj, indent=2) + "\n"

    class Dumper(yaml.SafeDumper):
        """Multi-line strings (the node scripts) as literal blocks, readable as written."""

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return yaml.dump(obj, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=100)


def _name(value: str) -> str:
    name = checks.text(value, "--name", max_chars=40)
    if not set(name) <= NAME_CHARS or not name[0].isalpha() or name.endswith("-"):
        raise UserError(f"--name: {checks.shown(name)} must be lower-case letters, digits and "
                        "'-', starting with a letter (a Kubernetes name)")
    return name


def _accelerator(value: str) -> str:
    name, _, count = value.partition(":")
    if not name or (count and not (count.isdigit() and 0 < int(count) <= 64)):
        raise argparse.ArgumentTypeError(f"expected NAME[:COUNT] (e.g. A100:8), got {value!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """`sky` and `k8s`, sharing the plan, run folder and runner flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--plan", required=True, help="plan file (also shipped with the code)")
    common.add_argument("--out", required=True, help="spec file to write (atomically)")
    common.add_argument("--name", type=_name, default="scattered-train", help="job name")
    common.add_argument("--run-dir", default="/mnt/run",
                        help="run folder on the nodes (metrics, checkpoints; /mnt/run)")
    common.add_argument("--ranks-per-node", type=argtypes.integer(0, 1024), default=0,
                        help="CPU ranks per node without GPUs (0: all on one node / one pod)")
    common.add_argument("--port", type=argtypes.port(), default=DEFAULT_PORT,
                        help=f"rendezvous port ({DEFAULT_PORT})")
    common.add_argument("--python", default="python", help="python on the nodes (python)")
    s = sub.add_parser("sky", parents=[common], help="a SkyPilot task YAML")
    s.add_argument("--accelerator", type=_accelerator, help="NAME[:COUNT] per node, e.g. A100:8")
    s.add_argument("--use-spot", action="store_true", help="spot nodes (use sky jobs launch)")
    s.add_argument("--cloud", help="resources.cloud")
    s.add_argument("--region", help="resources.region")
    s.add_argument("--bucket", help="a bucket mounted at --run-dir (checkpoints survive)")
    s.add_argument("--workdir", default=".", help="code synced to every node (.)")
    s.add_argument("--setup", default="pip install -e .", help="setup command on each node")
    k = sub.add_parser("k8s", parents=[common], help="a Kubernetes JobSet manifest")
    k.add_argument("--image", required=True, help="container image with the project and torch")
    k.add_argument("--gpus-per-node", type=argtypes.integer(0, 64), default=0,
                   help="GPUs per pod (nvidia.com/gpu), one rank each")
    k.add_argument("--pvc", help="PersistentVolumeClaim mounted at --run-dir (else emptyDir)")
    k.add_argument("--workdir", default="/workspace", help="the project in the image")
    k.add_argument("--max-restarts", type=argtypes.integer(0, 1000), default=3,
                   help="JobSet failurePolicy.maxRestarts (3)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point: flags before `--` are ours, after it every rank's dist_runner flags."""
    argv, rest = split_at_dashes(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    check_runner_flags(rest)
    plan = load_plan(args.plan)
    check_runner_args(rest, args.plan, plan)
    check_output_path(args.out, "--out")
    args.plan_path = args.plan  # as given: relative to the workdir the nodes run in
    spec = sky_task(plan, args, rest) if args.cmd == "sky" else jobset(plan, args, rest)
    atomic_write_bytes(args.out, dump(spec).encode())
    what = (f"SkyPilot task, {spec['num_nodes']} node(s)" if args.cmd == "sky" else
            f"JobSet, {len(spec['spec']['replicatedJobs'])} replicated job(s)")
    print(f"wrote {args.out}: {what} for {len(plan.devices())} ranks of {args.plan}")
    return 0


def entry() -> None:
    """Console entry point: run main() under run_main."""
    run_main(main)


if __name__ == "__main__":
    entry()
