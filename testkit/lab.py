"""The emulated lab the end-to-end benchmarks train on: a calibrated cluster, one network
namespace host per device (root; loopback otherwise, and it says so), a plan's ranks launched
on it, and what a run measured (step time, tokens/s, bytes on the wire, losses)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from formats.cluster import load_cluster, save_cluster
from formats.errors import UserError
from formats.models import get_model
from formats.plan import load_plan
from formats.run_metrics import (
    METRICS_NAME,
    STATUS_ENV,
    STATUS_PREFIX,
    format_status,
    parse_status,
    replica_metrics_path,
)
from scheduler.scenarios import make_scenario
from scheduler.simulator.kernel import OUTER_CPU_FIELD as OUTER_FIELD

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
    """(training seconds since the first step began, evaluations and relaunches left out;
    validation loss) of replica 0 at each evaluation (--eval-every)."""
    trained_s: float = 0.0
    """Training seconds over every step it trained (the same clock as val_losses)."""
    steps_trained: int = 0
    """Steps it trained, extensions (train_on) included."""
    resumed_at: list[int] = field(default_factory=list)
    """Steps at which train_on resumed it (each a new launch: its gap is left out)."""
    emulation_cpu_s_per_step: float = 0.0
    """CPU seconds per step the lab's userspace delay lines used (scripts/delay_line.py, where
    the kernel has no sch_netem): the link emulation's own CPU, on the cores the ranks use and
    not in the performance model (0 with netem or on loopback)."""

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


PREDICTION_BAR = 0.15
"""The benchmarks' target: every prediction within 15% of what was measured."""
NOISE_LIMIT = PREDICTION_BAR
"""The most the machine's measured speed may move (between the calibration's rounds, or between
the calibration before the runs and the check after) for a miss of PREDICTION_BAR to be blamed
on the model. Tied to the bar: a drift that alone could make a prediction miss by the bar makes
a miss NOISY (not judged); a smaller one cannot, so the miss is the model's (MISS). On a quiet
2-core machine the check after the runs moves 5-10% (2 rounds of 5 steps), so a limit equal to
that (the former 10%) said NOISY on quiet machines. A prediction within the bar is PASS
whatever the noise."""


def verdict(error: float, noisy: str) -> str:
    """PASS when |error| <= PREDICTION_BAR; else NOISY when the machine did not hold still
    (`noisy`: noise_verdict's reason), MISS when it did."""
    if abs(error) <= PREDICTION_BAR:
        return "PASS"
    return "NOISY" if noisy else "MISS"


def machine() -> dict[str, Any]:
    """The machine the figures are measured on: cores, the CPU's model name, the load."""
    name = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from testkit.calibrate import usable_cores  # the fit's cap: the same count

    cores = usable_cores()
    return {"cores": cores, "cpu": name, "load_1min": round(os.getloadavg()[0], 2)}


def describe_machine(m: dict[str, Any]) -> str:
    """One line for the logs."""
    return f"{m['cores']} cores, {m['cpu']}, load average {m['load_1min']}"


@dataclass
class LabCalibration:
    """The lab's calibration: the cluster (tflops = one rank computing alone), the calibration
    file (shared_cores), and what was measured."""

    cluster_path: Path
    calibration_path: Path
    sharing: Any
    """testkit.calibrate.CoreSharing of the calibration before the runs."""
    machine: dict[str, Any]
    micro_batches: int = 1
    """Micro-batches per measured step (the plans' num_micro_batches)."""
    after: Any = None
    """CoreSharing of the check after the runs (None until check_after)."""

    def record(self) -> dict[str, Any]:
        """For results.json: the machine and both calibrations."""
        return {"machine": self.machine, "calibration": sharing_record(self.sharing),
                "check_after_runs": self.after and sharing_record(self.after),
                "too_noisy": self.noisy()}

    def noisy(self) -> str:
        """Why the machine was too noisy to judge the predictions by ('' when it was not)."""
        return noise_verdict(self.sharing, self.after)


def sharing_record(c: Any) -> dict[str, Any]:
    """A CoreSharing measurement, for calibration.json and results.json."""
    return {"alone_gflops": [f / 1e9 for f in c.alone_flops],
            "pair_gflops": [f / 1e9 for f in c.pair_flops],
            "shared_gflops": [f / 1e9 for f in c.shared_flops], "processes": c.processes,
            "core_gflops": c.core_flops / 1e9, "shared_cores": c.shared_cores,
            "background_load": c.background_load, "core_contention": c.contention,
            "spread": c.spread,
            "outer_cpu_s": dict(c.outer_cpu_s)}


def noise_verdict(before: Any, after: Any = None) -> str:
    """'' when the speed held steady within NOISE_LIMIT between calibration rounds and (when
    given) between the calibration before the runs and the check after; else why not."""
    why = []
    if before.spread - 1 > NOISE_LIMIT:
        why.append(f"the calibration's rounds differ by {(before.spread - 1) * 100:.0f}%")
    if after is not None:
        for what, a, b in (("one rank alone", before.alone, after.alone),
                           ("all ranks at once", before.shared, after.shared)):
            moved = max(a, b) / min(a, b) - 1
            if moved > NOISE_LIMIT:
                why.append(f"the speed of {what} moved {moved * 100:.0f}% between the "
                           f"calibration and the check after the runs ({a / 1e9:.1f} -> "
                           f"{b / 1e9:.1f} GFLOP/s)")
    return "; ".join(why)


def calibrate_lab(scenario: str, seed: int, model: str, micro_batch_size: int,
                  cluster_path: Path, micro_batches: int, fsdp: bool = False) -> LabCalibration:
    """The scenario with each device's tflops = one rank training alone, and a calibration file
    (beside the cluster, `calibration.json`) with the cores the ranks share and the other work
    beside them: measured side by side, all ranks at once, 2 at once and one alone, 3 rounds,
    medians, fitted (testkit/calibrate.py); each measured step `micro_batches`
    micro-batches in the runtime's order (all forwards, then all backwards). `fsdp`: also
    FSDP2's own CPU per unit (for plans with shard groups)."""
    from scheduler.simulator import save_calibration
    from testkit.calibrate import (  # torch: only when measuring
        measure_core_sharing,
        measure_fsdp_cpu,
    )

    cluster = make_scenario(scenario, seed)
    m = machine()
    log(f"machine: {describe_machine(m)}")
    log(f"measuring FLOP/s per rank: processes training {model} ({micro_batches} micro-batches "
        f"of {micro_batch_size}), {cluster.num_devices} at once, 2 at once, 1 alone, 3 rounds, "
        "each process a session of its own (as the ranks are)")
    sharing = measure_core_sharing(get_model(model), micro_batch_size, cluster.num_devices,
                                   micro_batches=micro_batches)
    log(f"  alone {sharing.alone / 1e9:.1f}, 2 at once {sharing.pair / 1e9:.1f}, "
        f"{cluster.num_devices} at once {sharing.shared / 1e9:.1f} GFLOP/s per rank (rounds "
        f"within {(sharing.spread - 1) * 100:.0f}%): {sharing.core_flops / 1e9:.1f} GFLOP/s "
        f"with a core to itself, {sharing.shared_cores:.2f} cores shared with "
        f"{sharing.background_load:.1f} tasks of other work, each rank computing beside "
        f"another {sharing.contention * 100:.1f}% slower")
    log(f"  AdamW step: {sharing.optimizer_flops_per_param:.0f} FLOPs per parameter; DiLoCo "
        "outer round (all at once, gloo on loopback): " + ", ".join(
            f"{p} {sharing.outer_flops_per_param(p):.0f}" for p in sharing.outer_cpu_s)
        + " FLOPs per parameter")
    fsdp_keys = {}
    if fsdp:
        per_unit = measure_fsdp_cpu(get_model(model), micro_batch_size, micro_batches)
        log(f"  FSDP2's own CPU per unit and micro-batch (alone): {per_unit['reshard'] * 1e3:.2f}"
            f" ms with reshard_after_forward, {per_unit['gathered'] * 1e3:.2f} ms without")
        fsdp_keys = {"fsdp_flops_per_unit": round(per_unit["reshard"] * sharing.alone, 1),
                     "fsdp_gathered_flops_per_unit": round(per_unit["gathered"] * sharing.alone,
                                                           1)}
    save_cluster(cluster.with_devices([replace(d, tflops=sharing.core_flops / 1e12)  # s
                                       for d in cluster.devices]), cluster_path)
    cal_path = cluster_path.with_name("calibration.json")
    save_calibration(cal_path, {
        "shared_cores": round(sharing.shared_cores, 4),
        "background_load": round(sharing.background_load, 4),
        "core_contention": round(sharing.contention, 4),
        "optimizer_flops_per_param": round(sharing.optimizer_flops_per_param, 2),
        **{OUTER_FIELD[p]: round(sharing.outer_flops_per_param(p), 2)
           for p in sharing.outer_cpu_s}, **fsdp_keys},
        runtime="cpu", measured={"machine": m} | sharing_record(sharing))
    return LabCalibration(cluster_path, cal_path, sharing, m, micro_batches)


def check_after(cal: LabCalibration, model: str, micro_batch_size: int) -> str:
    """Measure again after the runs (the same way, 2 rounds); returns the noise verdict."""
    from testkit.calibrate import measure_core_sharing

    log("checking the machine's speed again after the runs")
    cal.after = measure_core_sharing(get_model(model), micro_batch_size,
                                     cal.sharing.processes, rounds=2, outer=False,
                                     micro_batches=cal.micro_batches)
    log(f"  alone {cal.after.alone / 1e9:.1f}, at once {cal.after.shared / 1e9:.1f} GFLOP/s "
        f"per rank ({cal.after.shared_cores:.2f} cores, {cal.after.background_load:.1f} tasks "
        "of other work)")
    why = cal.noisy()
    if why:
        log(f"  TOO NOISY to judge the predictions: {why}")
    return why


def plan_command(args: Any, cluster_path: Path, out: Path, *extra: str) -> list[str]:
    """`scheduler.py plan` for a benchmark's cluster: the CPU runtime profile (`--runtime cpu`:
    mfu 1 on the measured FLOP/s, fp32 activations, gloo collectives, the elastic DiLoCo outer
    step's store round trips; recorded in the plan, reused by `simulate`), the benchmark's
    model, batch, seed and time limit (args: .model, .micro_batch_size, .micro_batches,
    .plan_time_limit, .seed; .calibration: the lab's calibration file, when set), `extra` flags
    after them."""
    return [PY, str(ROOT / "scheduler/scheduler.py"), "plan", "--cluster", str(cluster_path),
            "--model", args.model, "--micro-batch-size", str(args.micro_batch_size),
            "--micro-batches", str(args.micro_batches), "--runtime", "cpu", "--time-limit",
            str(args.plan_time_limit), "--search-seed", str(args.seed), "--out", str(out),
            "--quiet", *calibration_flags(args), *extra]


def calibration_flags(args: Any) -> list[str]:
    """--calibration FILE when the benchmark calibrated the lab (args.calibration)."""
    path = getattr(args, "calibration", None)
    return ["--calibration", str(path)] if path else []


def predict(run: Run, cluster_path: Path) -> None:
    """Predicted step time by `scheduler.py simulate` (the plan's own performance model)."""
    p = sh([PY, str(ROOT / "scheduler/scheduler.py"), "simulate", "--cluster", str(cluster_path),
            "--plan", str(run.plan_path), "--json"])
    run.predicted_s = json.loads(p.stdout)["step_s"]


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds process `pid` has used (None: no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


LAB_MTU = 65000
"""The lab's hosts' MTU: packets as large as a real host's segmentation offload hands its NIC
(64 KB), so that without sch_netem the userspace delay lines (Python per packet, on the ranks'
own cores) handle few packets: their CPU per MB is 0.13x 1500's, 0.47x 9000's
(benchmarks/delay_line_cpu.py). On the badlink lab's 2 x 4-way FSDP plan, one after the other,
9000 -> 65000: delay lines 0.785 -> 0.423 CPU s a step, the step 1.787 -> 1.504 s; the links'
probed rates and RTTs hold as well (`local_cluster.py probe`: rates 0.98-1.00x the cluster's).
What it changes: TCP's initial window is 10 segments, so a fresh or idle connection's first
flight is 640 KB (90 KB at 9000; 15 KB on a 1500-byte WAN): slow start is not emulated, as
the simulator does not model it either (docs/emulator.md)."""


def add_network_args(p: Any) -> None:
    """The lab benchmarks' network flags (argparse parser `p`): --no-netns, --mtu."""
    p.add_argument("--no-netns", action="store_true",
                   help="run on loopback without shaping even when root")
    p.add_argument("--mtu", type=int, default=LAB_MTU,
                   help="the namespace hosts' MTU (local_cluster.py up --mtu; default "
                   f"{LAB_MTU}: fewer packets for the userspace delay lines, docs/emulator.md)")


class Network:
    """The namespace hosts of the cluster (or loopback when they cannot be made)."""

    def __init__(self, cluster_path: Path, out: Path, use_netns: bool, mtu: int = LAB_MTU
                 ) -> None:
        self.prefix = f"e2e{os.getpid() % 10000}"
        self.mtu = mtu
        """The hosts' MTU (local_cluster.py up --mtu)."""
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
            "--prefix", self.prefix, "--out-dir", str(self.dir), "--link-gbps", "10",
            "--mtu", str(self.mtu)])
        self.active = True
        mode = json.loads((self.dir / "netns_map.json").read_text())["delay_mode"]
        log(f"  delay applied by: {mode}; MTU {self.mtu}")

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

    def emulation_cpu_s(self) -> float:
        """CPU seconds this lab's userspace delay lines have used so far (0 without any)."""
        if not self.active:
            return 0.0
        from scripts.netemu.netns import load_state

        # a delay line that is gone counts up to its last reading only
        return sum(process_cpu_s(pid) or 0.0
                   for pid in load_state(self.prefix).delay_pids.values())

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


def train(run: Run, net: Network, steps: int, out: Path, extra: list[str] = (),
          checkpoint: bool = False, resume: bool = False) -> Path:
    """Run the plan's ranks for `steps` steps (dist_runner flags `extra` added); fill in the
    wire bytes per step (not when resuming: those of the first launch stay); returns replica
    0's metrics file. `checkpoint`: every rank saves at the end (what `resume` continues from,
    bit-identically: train_on)."""
    run_dir = out / run.plan_path.stem
    if not resume:
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
    metrics = run_dir / METRICS_NAME  # what --run-dir writes for replica 0
    what = f"on to step {steps}" if resume else f"{steps} steps"
    log(f"training {run.name}: {what} (predicted {run.predicted_s:.3f} s/step)")
    before, cpu_before = net.wire_bytes(), net.emulation_cpu_s()
    ckpt = ["--ckpt-dir", str(run_dir / "ckpt")] if checkpoint or resume else []
    cmd = [PY, str(ROOT / "scripts/launch_local.py"), "--plan", str(run.plan_path),
           *net.launch_args(), "--", "--steps", str(steps), "--threads", "1",
           "--run-dir", str(run_dir),  # metrics.jsonl and the per-rank timings
           "--log-every", str(max(1, steps // 5)),
           "--timeout-s", "120", "--heartbeat-timeout-s", str(LAB_HEARTBEAT_TIMEOUT_S),
           *ckpt, *(["--resume"] if resume else []), *extra]
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
    trained = step_records(metrics)
    if trained < steps:  # --stop-at-loss (stop_flags) ended it at an evaluation
        log(f"  {run.name}: stopped after step {trained} of {steps} (--stop-at-loss: reached "
            "the target)")
    if not resume:
        run.wire_bytes_per_step = (net.wire_bytes() - before) / trained
        run.emulation_cpu_s_per_step = (net.emulation_cpu_s() - cpu_before) / trained
        if run.emulation_cpu_s_per_step:
            log(f"  the delay lines used {run.emulation_cpu_s_per_step:.3f} CPU s a step "
                "(link emulation, not in the model)")
    return metrics


def step_records(path: Path) -> int:
    """The step records in a metrics file (steps trained, over every launch it holds)."""
    return len(step_records_of(path))


def stop_flags(target: float | None, measured_steps: int) -> list[str]:
    """dist_runner flags that end a row once its validation loss reached `target` (the
    allreduce row's final one) at an evaluation at or after step `measured_steps` (the
    equal-steps columns need those steps): --stop-at-loss, --min-steps; none without a
    target. The loss is written as repr: the runtime compares the same float."""
    if target is None:
        return []
    return ["--stop-at-loss", repr(target), "--min-steps", str(measured_steps)]


def read_metrics(run: Run, path: Path, warmup_steps: int, measured_steps: int | None = None
                 ) -> None:
    """From replica 0's metrics: the measured step time and tokens/s over every whole outer
    round of the run's first launch after the warm-up and the plan's W (rounded up to a
    round; more than the first `measured_steps` steps: one round of H = 8 is too few to judge
    a prediction by, and a DiLoCo row reaches its steady step only after its first rounds),
    DP bytes, and the final validation loss at `measured_steps` (None: the last; train_on's
    extension past them only adds to the losses, val_losses and trained_s)."""
    recs = step_records_of(path)
    clock = run_clock(recs, path, run.resumed_at)
    run.trained_s, run.steps_trained = (clock[-1] if clock else 0.0), len(recs)
    run.losses = [(t, r["loss"]) for t, r in zip(clock, recs)]
    run.val_losses = [(t, r["val_loss"]) for t, r in zip(clock, recs)
                      if r.get("val_loss") is not None]
    if measured_steps and len(recs) < measured_steps:  # not with stop_flags' --min-steps
        log(f"  note: {run.name} trained {len(recs)} steps, fewer than the {measured_steps} "
            "of the equal-steps loss: its loss ratio is that of its last evaluation")
    launch = recs[:run.resumed_at[0]] if run.resumed_at else recs  # one launch: one clock
    sync = load_plan(run.plan_path).sync  # its all-reduce warm-up W is not the predicted step
    round_steps, skip = sync.inner_steps, max(warmup_steps, sync.warmup_steps)
    first = -(-skip // round_steps) * round_steps
    last = len(launch) - (len(launch) - first) % round_steps  # whole DiLoCo rounds
    if last - first < 1:
        raise UserError(f"{len(launch)} steps leave no measured steps after {first} warm-up "
                        "steps")
    span = clock[last - 1] - (clock[first - 1] if first else 0.0)
    run.measured_s = span / (last - first)
    tokens = sum(r["tokens_per_s"] * r["step_s"] for r in launch[first:last])
    run.tokens_per_s = tokens / span
    run.runtime_dp_bytes_per_step = float(np.mean([r["dp_bytes_sent"] for r in recs]))
    equal = recs[:measured_steps] if measured_steps else recs
    vals = [r["val_loss"] for r in equal if r.get("val_loss") is not None]
    run.final_val_loss = vals[-1] if vals else None


def step_records_of(path: Path) -> list[dict[str, Any]]:
    """The step records of a metrics file (not the summaries)."""
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in recs if "step_s" in r]


def run_clock(recs: list[dict[str, Any]], path: Path, resumed_at: list[int] = ()
              ) -> list[float]:
    """The run's training clock at each of `recs`' steps (replica 0's, metrics file `path`):
    that of its slowest replica (the run goes at its pace), with each evaluation's seconds the
    slowest replica's (the run loses that much: a replica that evaluates sooner waits it out at
    its next blocking sync). Replicas' metrics files sit beside `path`; one that left or joined
    is not compared. Measured on the lab (bad_network's rows, 2026-11-26): replica 0 of the
    blocking DiLoCo row waited 0.035 s a step for replicas 1-2's longer evaluations (its own
    clock 0.805 s/step, theirs 0.770; 0.786 with no evaluations at all), while in the overlapped
    rows replica 0 ran ahead of replicas 1-2 (0.497 s/step vs 0.54-0.55: their pipeline links
    are slower, and an overlapped round does not wait for a laggard within a short run)."""
    steps = [r["step"] for r in recs]
    replicas = [recs]
    k = 1
    while (other := replica_metrics_path(path, k)).exists():
        theirs = step_records_of(other)
        if [r["step"] for r in theirs] == steps:
            replicas.append(theirs)
        k += 1
    slowest: dict[int, float] = {}
    for rep in replicas:
        for r in rep:
            if r.get("eval_s"):
                slowest[r["step"]] = max(slowest.get(r["step"], 0.0), r["eval_s"])
    clocks = [training_clock([r | {"eval_s": slowest[r["step"]]} if r["step"] in slowest else r
                              for r in rep], resumed_at) for rep in replicas]
    return max(clocks, key=lambda c: c[-1] if c else 0.0)


def training_clock(recs: list[dict[str, Any]], resumed_at: list[int] = ()) -> list[float]:
    """Training seconds at the end of each step record: wall time since its launch's first
    step began, less the evaluations and --stop-at-loss checks (both run after their record's
    wall_time: the check is the benchmark's own, a store round trip to the deciding replica,
    0.2-1 s each on the loaded lab) before it in that launch, plus what the launches before it
    trained; a launch begins at the first record and after each step of `resumed_at` (the
    relaunch's gap left out)."""
    out: list[float] = []
    start = evals = 0.0
    for i, r in enumerate(recs):
        if i == 0 or r["step"] - 1 in resumed_at:
            start, evals = r["wall_time"] - r["step_s"] - (out[-1] if out else 0.0), 0.0
        out.append(r["wall_time"] - start - evals)
        evals += r.get("eval_s", 0.0) + r.get("stop_check_s", 0.0)
    return out


LAB_HEARTBEAT_TIMEOUT_S = 30.0
"""--heartbeat-timeout-s of the lab's ranks (the runtime's default: 5 s). Eight ranks and eight
userspace delay lines share 2 cores here, and a heartbeat crosses a delay line starved of CPU:
the demo's 1 x 8 row once lost a live rank to a 5 s gap at load 3 (2026-11-26). The benchmarks
measure speed, not failure detection (tests/test_fault_elastic.py and the kill trials do)."""


BUDGET_MARGIN = 1.1
"""budget_steps plans this much more than the budget over the predicted s/step (the lab's
predictions were measured within about 10% on a quiet machine; train_on covers the rest)."""
BUDGET_COVERED = 0.97
"""train_on stops extending a run once it trained this share of the budget (a relaunch costs
more than the last few steps would tell)."""
MAX_EXTENSIONS = 2
"""train_on's relaunches per run at most (the first usually covers the budget)."""


def budget_steps(run: Run, budget_s: float | None, steps: int, round_steps: int = 1,
                 eval_every: int = 0) -> int:
    """Steps to launch `run` with so that it likely trains `budget_s` training seconds in one
    launch (a relaunch costs a fresh start): the budget over its predicted s/step with
    BUDGET_MARGIN, at least `steps`, rounded up to whole rounds of `round_steps`. Just `steps`
    when a longer launch would not evaluate at step `steps` (not a multiple of `eval_every`):
    the equal-steps loss needs that evaluation (train_on relaunches for the rest)."""
    if not (budget_s and run.predicted_s > 0 and eval_every and steps % eval_every == 0):
        return steps
    want = math.ceil(budget_s * BUDGET_MARGIN / run.predicted_s)
    return max(steps, -(-want // round_steps) * round_steps)


def train_on(run: Run, net: Network, out: Path, extra: list[str], target: float | None,
             budget_s: float, warmup_steps: int, measured_steps: int) -> None:
    """Equal wall time: resume `run` (trained by `train(..., checkpoint=True)`) from its last
    checkpoint and train it on until it has trained `budget_s` training seconds, unless its
    validation loss already reached `target`. Steps to add: the budget left over the run's
    measured s/step, plus one (the relaunch's first step is slower). The steps before
    `measured_steps` keep the equal-steps columns; resuming is bit-identical to having
    trained that many steps in one launch (constant learning rate; the plan's warm-up W is
    a step count, unchanged by a longer run)."""
    for _ in range(MAX_EXTENSIONS):
        left = budget_s - run.trained_s
        if (target is None or seconds_to_loss(run, target) is not None
                or left <= budget_s * (1 - BUDGET_COVERED) or run.measured_s <= 0):
            return
        more = int(np.ceil(left / run.measured_s)) + 1
        log(f"  {run.name}: allreduce's loss not reached in {run.trained_s:.1f} s: "
            f"{more} more steps for its {budget_s:.1f} s")
        run.resumed_at.append(run.steps_trained)
        metrics = train(run, net, run.steps_trained + more, out, extra, resume=True)
        read_metrics(run, metrics, warmup_steps, measured_steps)


def train_row(run: Run, net: Network, out: Path, extra: list[str], steps: int,
              warmup_steps: int, eval_every: int, base: Run | None = None) -> None:
    """One benchmark row: `steps` steps (the equal-steps columns), read (read_metrics). After
    `base` (the allreduce row, trained first): launched for base's training seconds
    (budget_steps), stopped once at base's final validation loss from step `steps` on
    (stop_flags), resumed for the rest of the budget if it fell short (train_on)."""
    round_steps = load_plan(run.plan_path).sync.inner_steps
    launched = budget_steps(run, base and base.trained_s, steps, round_steps, eval_every)
    if base is not None:
        extra = [*extra, *stop_flags(base.final_val_loss, steps)]
    read_metrics(run, train(run, net, launched, out, extra, checkpoint=base is not None),
                 warmup_steps, steps)
    if base is not None:
        train_on(run, net, out, extra, base.final_val_loss, base.trained_s, warmup_steps, steps)


def seconds_to_loss(run: Run, target: float | None) -> float | None:
    """Training seconds until replica 0's validation loss first reached `target` (at an
    evaluation; evaluations' own time left out); None when it never did or nothing to reach."""
    if target is None:
        return None
    return next((t for t, v in run.val_losses if v <= target), None)
