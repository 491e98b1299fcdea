"""The emulated lab the end-to-end benchmarks train on: a calibrated cluster, one network
namespace host per device (root; loopback otherwise, and it says so), a plan's ranks launched
on it, and what a run measured (step time, tokens/s, bytes on the wire, losses)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from formats.cluster import Cluster, load_cluster, save_cluster
from formats.errors import UserError
from formats.models import get_model
from formats.plan import load_plan
from formats.run_metrics import STATUS_ENV, STATUS_PREFIX, format_status, parse_status
from scheduler.scenarios import make_scenario

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


@dataclass
class Run:
    """One plan's run: what was predicted and what was measured."""

    name: str
    plan_path: Path
    predicted_s: float = 0.0
    measured_s: float = 0.0
    tokens_per_s: float = 0.0
    wire_bytes_per_step: float = 0.0
    runtime_dp_bytes_per_step: float = 0.0
    losses: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since the first step, loss) of replica 0."""
    final_val_loss: float | None = None
    """Validation loss at the end of the run (replica 0), when the run evaluated."""
    val_losses: list[tuple[float, float]] = field(default_factory=list)
    """(training seconds since the first step began, evaluations left out; validation loss)
    of replica 0 at each evaluation (--eval-every)."""

    @property
    def error(self) -> float:
        """Relative prediction error."""
        return (self.predicted_s - self.measured_s) / self.measured_s


def log(msg: str, prefix: str = "e2e") -> None:
    """Progress on stdout, flushed (the benchmarks run for minutes)."""
    print(f"{prefix}: {msg}", flush=True)


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """Run a command; UserError with its stderr when it fails."""
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise UserError(f"{' '.join(cmd[:4])} ... failed ({p.returncode}):\n"
                        f"{(p.stderr or p.stdout)[-3000:]}")
    return p


def calibrated_cluster(scenario: str, seed: int, model: str, micro_batch_size: int,
                       path: Path) -> Cluster:
    """The scenario with each device's tflops measured with all ranks training at once."""
    from modules.device.calibrate import measure_train_flops_shared  # torch: only when measuring

    cluster = make_scenario(scenario, seed)
    log(f"measuring FLOP/s per rank: {cluster.num_devices} processes training {model} "
        f"(micro-batch {micro_batch_size}) at once on {os.cpu_count()} cores")
    flops = measure_train_flops_shared(get_model(model), micro_batch_size, cluster.num_devices)
    log(f"  {flops / 1e9:.1f} GFLOP/s per rank")
    devices = [replace(d, tflops=flops / 1e12) for d in cluster.devices]
    calibrated = Cluster(cluster.name, devices, cluster.latency_ms, cluster.bandwidth_gbps)
    save_cluster(calibrated, path)
    return calibrated


def plan_command(args: Any, cluster_path: Path, out: Path, *extra: str) -> list[str]:
    """`scheduler.py plan` for a benchmark's cluster: the CPU runtime profile (`--runtime cpu`:
    mfu 1 on the measured FLOP/s, fp32 activations, gloo collectives, the elastic DiLoCo outer
    step's store round trips; recorded in the plan, reused by `simulate`), the benchmark's
    model, batch, seed and time limit (args: .model, .micro_batch_size, .micro_batches,
    .plan_time_limit, .seed), `extra` flags after them."""
    return [PY, str(ROOT / "scheduler/scheduler.py"), "plan", "--cluster", str(cluster_path),
            "--model", args.model, "--micro-batch-size", str(args.micro_batch_size),
            "--micro-batches", str(args.micro_batches), "--runtime", "cpu", "--time-limit",
            str(args.plan_time_limit), "--search-seed", str(args.seed), "--out", str(out),
            "--quiet", *extra]


def predict(run: Run, cluster_path: Path) -> None:
    """Predicted step time by `scheduler.py simulate` (the plan's own performance model)."""
    p = sh([PY, str(ROOT / "scheduler/scheduler.py"), "simulate", "--cluster", str(cluster_path),
            "--plan", str(run.plan_path), "--json"])
    run.predicted_s = json.loads(p.stdout)["step_s"]


class Network:
    """The namespace hosts of the cluster (or loopback when they cannot be made)."""

    def __init__(self, cluster_path: Path, out: Path, use_netns: bool) -> None:
        self.prefix = f"e2e{os.getpid() % 10000}"
        self.dir = out / "net"
        self.active = False
        self.cluster_path = cluster_path
        self.reason = netns_unavailable() if use_netns else "--no-netns given"
        """Why the network is not emulated ('' when it is)."""

    def up(self) -> None:
        """Create the hosts and apply the cluster's links (or log why not)."""
        if self.reason:
            log(f"NOT shaping the network ({self.reason}): all ranks on loopback, so the "
                "measured times show compute only, not the emulated links")
            return
        log(f"bringing up {load_cluster(self.cluster_path).num_devices} namespace hosts "
            f"({self.prefix}-*) with the cluster's rates and delays")
        sh([PY, str(ROOT / "scripts/local_cluster.py"), "up", "--cluster", str(self.cluster_path),
            "--prefix", self.prefix, "--out-dir", str(self.dir), "--link-gbps", "10"])
        self.active = True
        mode = json.loads((self.dir / "netns_map.json").read_text())["delay_mode"]
        log(f"  delay applied by: {mode}")

    def down(self) -> None:
        """Remove every namespace, veth, bridge and delay line of this run."""
        if self.active:
            subprocess.run([PY, str(ROOT / "scripts/local_cluster.py"), "down", "--prefix",
                            self.prefix], capture_output=True, text=True)
            self.active = False
            log(f"removed the namespace hosts {self.prefix}-*")

    def launch_args(self) -> list[str]:
        """launch_local.py flags that put each rank in its host."""
        if not self.active:
            return ["--host", "127.0.0.1"]
        return ["--netns-map", str(self.dir / "rank_netns.json"), "--host", "198.18.0.1",
                "--gloo-ifname", "eth0"]

    def wire_bytes(self) -> int:
        """Bytes every host has sent on its eth0 so far (tc root qdisc counters)."""
        if not self.active:
            return 0
        hosts = json.loads((self.dir / "netns_map.json").read_text())["hosts"]
        total = 0
        for h in hosts:
            p = sh(["ip", "netns", "exec", h["netns"], "tc", "-s", "-j", "qdisc", "show",
                    "dev", h["iface"], "root"])
            total += sum(int(q.get("bytes", 0)) for q in json.loads(p.stdout))
        return total


def netns_unavailable() -> str:
    """Why namespace hosts cannot be made here ('' when they can)."""
    if os.geteuid() != 0:
        return "not root"
    missing = [t for t in ("ip", "tc", "iptables") if shutil.which(t) is None]
    return f"missing {', '.join(missing)}" if missing else ""


def train(run: Run, net: Network, steps: int, out: Path, extra: list[str] = ()) -> Path:
    """Run the plan's ranks for `steps` steps (dist_runner flags `extra` added); fill in the
    wire bytes per step; returns replica 0's metrics file."""
    run_dir = out / run.plan_path.stem
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    metrics = run_dir / "metrics.jsonl"
    log(f"training {run.name}: {steps} steps (predicted {run.predicted_s:.3f} s/step)")
    before = net.wire_bytes()
    cmd = [PY, str(ROOT / "scripts/launch_local.py"), "--plan", str(run.plan_path),
           *net.launch_args(), "--", "--steps", str(steps), "--threads", "1",
           "--metrics", str(metrics), "--log-every", str(max(1, steps // 5)),
           "--timeout-s", "120", *extra]
    with open(run_dir / "launch.log", "w") as logf:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, STATUS_ENV: "1"})  # pass status lines on
        for line in proc.stdout:
            logf.write(line)
            status = parse_status(line)
            if status is not None:
                print(f"    {line.split(STATUS_PREFIX)[0]}{format_status(status)}", flush=True)
            elif line.startswith("launch:") and " pid " not in line:
                print(f"    {line.rstrip()}", flush=True)
        if proc.wait() != 0:
            raise UserError(f"{run.name}: launch_local.py exited {proc.returncode}; "
                            f"see {run_dir / 'launch.log'}")
    run.wire_bytes_per_step = (net.wire_bytes() - before) / steps
    return metrics


def read_metrics(run: Run, path: Path, warmup_steps: int) -> None:
    """Measured step time and tokens/s over whole outer rounds of the run's plan after the
    warm-up (rounded up to a round), DP bytes, losses and the final validation loss, from
    replica 0's metrics."""
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    recs = [r for r in recs if "step_s" in r]  # step records (not the summary)
    round_steps = load_plan(run.plan_path).sync.inner_steps
    first = -(-warmup_steps // round_steps) * round_steps
    last = len(recs) - (len(recs) - first) % round_steps  # whole DiLoCo rounds
    if last - first < 1:
        raise UserError(f"{len(recs)} steps leave no measured steps after {first} warm-up steps")
    wall = [r["wall_time"] for r in recs]
    start = wall[0] - recs[0]["step_s"]  # when the first step began
    begin = wall[first - 1] if first else start  # the end of the warm-up
    # evaluations run after their record's wall_time: the ones inside the window left out
    evals = np.cumsum([0.0] + [r.get("eval_s", 0.0) for r in recs])
    span = wall[last - 1] - begin - (evals[last - 1] - evals[max(first - 1, 0)])
    run.measured_s = span / (last - first)
    tokens = sum(r["tokens_per_s"] * r["step_s"] for r in recs[first:last])
    run.tokens_per_s = tokens / span
    run.runtime_dp_bytes_per_step = float(np.mean([r["dp_bytes_sent"] for r in recs]))
    run.losses = [(r["wall_time"] - start, r["loss"]) for r in recs]
    vals = [r["val_loss"] for r in recs if r.get("val_loss") is not None]
    run.final_val_loss = vals[-1] if vals else None
    run.val_losses = [(r["wall_time"] - start - evals[i], r["val_loss"])
                      for i, r in enumerate(recs) if r.get("val_loss") is not None]


def seconds_to_loss(run: Run, target: float | None) -> float | None:
    """Training seconds until replica 0's validation loss first reached `target` (at an
    evaluation; evaluations' own time left out); None when it never did or nothing to reach."""
    if target is None:
        return None
    return next((t for t, v in run.val_losses if v <= target), None)
