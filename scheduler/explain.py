"""Measured vs predicted, per stage and rank, and which difference matters most (`explain`).

Every rank's step splits the same way on both sides, so the columns compare:

    step = compute + waiting + exposed communication (+ FSDP with shard groups)

- compute: the rank's own forward/backward/optimizer seconds (measured: step_s - comm_s;
  predicted: (t_fwd + t_bwd) x micro-batches of the simulator's kernel);
- waiting: idle time that the ranks' compute alone explains, with free links (pipeline
  bubble, a slower peer): the makespan of the GPipe replay with zero transfers minus the rank's
  compute. Measured: the same replay run on the measured compute of every rank;
- exposed communication: the rest of the time the rank waited on the network; `pp` the part
  in pipeline transfers, `dp` in the data-parallel sync and the tied-embedding sum;
- FSDP (plans with shard groups): the seconds inside FSDP2's collectives of the rank's shard
  group (measured: the runtime's fsdp_s; predicted: simulator/sharded.py's exposed FSDP time).
  A device that runs several lanes (a stage of fewer devices than another) is predicted by
  its first lane, whose times are the device's.

The diagnosis looks for the cause that explains the most seconds of the difference:
a mis-estimated FLOP/s (every rank's compute off by the same factor), a straggler device (one
rank's compute off by far more than the others'), a slow stage (every rank of one stage off
by far more than the other stages: its layers cost more than the model says), a slow pipeline
link (both ends of one link
expose more pipeline communication than predicted), a slow data-parallel sync (every member
of a stage group exposes more sync than predicted) or slow FSDP collectives (every member of a
shard group spends more in them than predicted). Pure: no files, no printing.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from formats.cluster import Cluster
from formats.compact import bound_problem
from formats.errors import UserError
from formats.plan import Plan, as_group
from formats.run_metrics import number
from scheduler.simulator.collectives import LinkTables
from scheduler.simulator.config import SimConfig
from scheduler.simulator.kernel import StepInputs, build_inputs, no_transfers
from scheduler.simulator.replay import replay_fast
from scheduler.simulator.sharded import build_sharded_inputs, shard_array

FLOPS_TOLERANCE = 1.1
"""A median compute ratio (measured / predicted) beyond this factor either way is a
mis-estimated FLOP/s (named when it also explains SIGNIFICANT_SHARE of the step: at 1.25, a
demo row whose every rank computed 1.22x its prediction, 16% of its step, went unnamed)."""
STRAGGLER_FACTOR = 1.5
"""A rank whose compute ratio is this many times the median one is a straggler."""
SIGNIFICANT_SHARE = 0.1
"""A cause must explain at least this share of the measured step to be named."""


@dataclass(frozen=True)
class Split:
    """One rank's step in seconds: compute + waiting + exposed communication (pp + dp)."""

    compute_s: float
    waiting_s: float
    pp_s: float
    """Exposed pipeline communication."""
    dp_s: float
    """Exposed data-parallel sync and tied-embedding sum."""
    fsdp_s: float = 0.0
    """Inside FSDP2's collectives of the shard group (0 without shard groups)."""

    @property
    def exposed_s(self) -> float:
        """All exposed communication (FSDP's apart)."""
        return self.pp_s + self.dp_s

    @property
    def step_s(self) -> float:
        """The whole step."""
        return self.compute_s + self.waiting_s + self.exposed_s + self.fsdp_s


@dataclass(frozen=True)
class RankRow:
    """One rank: where it sits, measured and predicted."""

    rank: int
    replica: int
    stage: int
    steps: int
    """Steps averaged (`steady_window`: the start left out, whole DiLoCo rounds)."""
    measured: Split
    predicted: Split


@dataclass(frozen=True)
class Cause:
    """A difference between measurement and prediction, and what would fix the plan."""

    name: str
    """e.g. `straggler device 3`, `slow link 1-2`, `mis-estimated FLOP/s`."""
    seconds: float
    """Seconds per step it explains."""
    detail: str
    fix: str


@dataclass(frozen=True)
class Explanation:
    """Every rank's row and the causes found, biggest first."""

    rows: list[RankRow]
    causes: list[Cause]
    measured_step_s: float
    predicted_step_s: float
    window: str = "the first step left out"
    """Which steps the measured means cover, and why (`steady_window`)."""


@dataclass(frozen=True)
class Measured:
    """A rank's mean timing over its steps."""

    step_s: float
    compute_s: float
    comm_s: float
    pp_wait_s: float
    steps: int
    fsdp_s: float = 0.0


def steady_window(plan: Plan) -> tuple[int, int, str]:
    """(steps left out at the start, steps per outer round, why) for the steady step the
    simulator predicts: the first step (start-up), and with DiLoCo its all-reduce warm-up
    (sync.warmup_steps), rounded up to whole rounds, over which the means then run (a DiLoCo
    step's share of the outer sync is only right per whole round). Before, a DiLoCo plan
    with a warm-up was compared with a mean that held its every-step all-reduces: -15% on a
    run the benchmark measured +18% (the hierarchical lab's planner row)."""
    sync = plan.sync
    if not sync.rule.local_steps:
        return 1, 1, "the first step left out"
    skip, rounds = max(1, sync.warmup_steps), sync.inner_steps
    why = (f"the all-reduce warm-up ({sync.warmup_steps} steps) and the rest of its round"
           if sync.warmup_steps else "the first outer round")
    return skip, rounds, f"{why} left out; whole rounds of {rounds} steps"


def mean_timing(records: list[dict[str, Any]], skip: int = 1, round_steps: int = 1
                ) -> Measured:
    """Mean step, compute, communication wait and pipeline wait of a rank's records after step
    `skip` rounded up to a multiple of `round_steps`, over whole rounds (a run too short for
    one: all but its first step); UserError when none has the numbers."""
    recs = sorted((r for r in records if _timed(r)), key=lambda r: r["step"])
    first = -(-skip // round_steps) * round_steps
    last = first + (recs[-1]["step"] - first) // round_steps * round_steps if recs else 0
    kept = [r for r in recs if first < r["step"] <= last]
    recs = kept or recs[1:] or recs
    if not recs:
        raise UserError("no timing records with step_s, compute_s and comm_s (seconds, "
                        "finite and >= 0; 1e15 at most)")

    def mean(key: str) -> float:
        return float(np.mean([number(r, key) or 0.0 for r in recs]))
    return Measured(mean("step_s"), mean("compute_s"), mean("comm_s"), mean("pp_wait_s"),
                    len(recs), mean("fsdp_s"))


def _timed(rec: dict[str, Any]) -> bool:
    """Whether a record has the seconds a step splits into (a negative one is damage)."""
    return all((v := number(rec, k)) is not None and v >= 0
               for k in ("step_s", "compute_s", "comm_s"))


def positions(plan: Plan) -> dict[int, tuple[int, int]]:
    """Device id -> (replica, stage) of every device of the plan (shard groups' too)."""
    return {d: (r, s) for r, pipe in enumerate(plan.pipelines) for s, e in enumerate(pipe)
            for d in as_group(e)}


def check_records(plan: Plan, ranks: dict[int, list[dict[str, Any]]]) -> None:
    """UserError when the records are not of this plan (a rank outside it, or where it sits)."""
    where = positions(plan)
    for rank, recs in ranks.items():
        if rank not in where:
            raise UserError(f"--metrics: rank {rank} has records but is not in the plan "
                            f"(devices {sorted(where)}): the run trained another plan")
        r, s = where[rank]
        # compared with ==, not hashed or sorted: a damaged record may hold a list or a None
        bad = next((sr for sr in ((x.get("replica"), x.get("stage")) for x in recs)
                    if sr not in ((r, s), (r, None), (None, None))), None)
        if bad is not None:
            raise UserError(f"--metrics: rank {rank} recorded replica/stage {bad[0]!r}/"
                            f"{bad[1]!r}, the plan puts it at replica {r} stage {s}: the run "
                            "trained another plan")


@dataclass(frozen=True)
class Prediction:
    """The simulator's step of a plan, split per rank."""

    inputs: StepInputs
    step_s: float
    ranks: dict[int, Split]
    """Per device id: predicted compute, waiting and exposed communication."""


def predict(plan: Plan, cluster: Cluster, config: SimConfig) -> Prediction:
    """Replay one step of `plan` (the simulator's kernel; with shard groups, over its lanes)
    and split it per rank."""
    tables, model = LinkTables(cluster, config), plan.model_spec()
    if plan.is_sharded:
        inputs, fsdp = build_sharded_inputs(
            tables, model, list(plan.stages), shard_array(plan.pipelines), plan.sync,
            plan.micro_batch_size, plan.num_micro_batches, config, plan.pipeline_compression,
            plan.reshard_after_forward)
    else:
        inputs = build_inputs(tables, model, list(plan.stages),
                              np.asarray(plan.pipelines, dtype=np.int64), plan.sync,
                              plan.micro_batch_size, plan.num_micro_batches, config,
                              pipeline_compression=plan.pipeline_compression)
        fsdp = np.zeros_like(inputs.t_fwd)
    times = replay_fast(inputs)
    busy = (inputs.t_fwd + inputs.t_bwd) * inputs.num_micro_batches  # (lanes, S), FSDP in
    free = replay_fast(no_transfers(inputs)).makespan_s
    # the tied-embedding sum counts as dp on both sides (the runtime times it outside its
    # pipeline receives, pp_wait_s): pp ends with the pipeline, before the sums
    pp, dp = times.pipeline_s - free, times.step_s - times.pipeline_s
    ranks: dict[int, Split] = {}
    for (lane, s), d in np.ndenumerate(inputs.pipelines):
        if int(d) not in ranks:  # a device's first lane (each of its lanes has its times)
            b, f = float(busy[lane, s]), float(fsdp[lane, s])
            ranks[int(d)] = Split(b - f, max(0.0, free - b), pp, dp, f)
    return Prediction(inputs, times.step_s, ranks)


def free_makespan(inputs: StepInputs, compute_s: np.ndarray, backward_factor: float) -> float:
    """Makespan of the step with free links when each lane's device computes `compute_s`
    (lanes, S: the replicas' pipelines without shard groups)."""
    t_fwd = compute_s / inputs.num_micro_batches / (1.0 + backward_factor)
    return replay_fast(replace(no_transfers(inputs), t_fwd=t_fwd,
                               t_bwd=t_fwd * backward_factor)).makespan_s


def measured_split(m: Measured, free_s: float) -> Split:
    """A rank's measured step split like the prediction, given the free-link makespan of the
    measured compute (and FSDP): waiting first, then the pipeline's share of the rest."""
    waiting = min(m.comm_s, max(0.0, free_s - m.compute_s - m.fsdp_s))
    exposed = m.comm_s - waiting
    pp = min(exposed, max(0.0, m.pp_wait_s - waiting))
    return Split(m.compute_s, waiting, pp, exposed - pp, m.fsdp_s)


def explain(plan: Plan, cluster: Cluster, config: SimConfig,
            ranks: dict[int, list[dict[str, Any]]]) -> Explanation:
    """Rows per rank (measured vs the simulator's prediction of `plan`) and the causes."""
    check_records(plan, ranks)
    missing = sorted(set(plan.devices()) - set(ranks))
    if missing:
        raise UserError(f"--metrics: no timing records of ranks {missing} of the plan")
    pred = predict(plan, cluster, config)
    skip, round_steps, window = steady_window(plan)
    try:
        meas = {d: mean_timing(ranks[d], skip, round_steps) for d in plan.devices()}
    except UserError as e:
        bad = [d for d in plan.devices() if not any(_timed(r) for r in ranks[d])]
        raise UserError(f"--metrics: ranks {bad}: {e}") from None
    busy_m = np.array([[meas[int(d)].compute_s + meas[int(d)].fsdp_s for d in lane]
                       for lane in pred.inputs.pipelines])
    free_m = free_makespan(pred.inputs, busy_m, config.backward_factor)
    where = positions(plan)
    rows = sorted((RankRow(d, *where[d], meas[d].steps, measured_split(meas[d], free_m),
                           pred.ranks[d]) for d in plan.devices()),
                  key=lambda x: (x.stage, x.rank))
    step_m = float(np.mean([m.step_s for m in meas.values()]))
    if step_m <= 0:
        raise UserError("--metrics: every rank's step_s is 0: the run recorded no time to "
                        "compare with the prediction (damaged timing records?)")
    return Explanation(rows, diagnose(rows, plan, config), step_m, pred.step_s, window)


def measured_cluster(cluster: Cluster, rows: list[RankRow]) -> Cluster:
    """`cluster` with each of the run's devices at the speed its compute measured: tflops
    divided by its measured / predicted compute ratio (the model's sharing of cores, MFU and
    FLOPs unchanged), so that a plan made for it predicts this run's compute; devices the run
    did not time keep theirs."""
    ratio = {x.rank: x.measured.compute_s / x.predicted.compute_s for x in rows
             if x.predicted.compute_s > 0 and x.measured.compute_s > 0}
    for d in cluster.devices:  # never write a figure the planner would refuse to read
        if d.id in ratio:
            tflops = d.tflops / ratio[d.id]
            why = (bound_problem("tflops", tflops) if math.isfinite(tflops)
                   else "is not a finite number")
            if why is not None:
                raise UserError(f"--write-cluster: rank {d.id}'s measured compute "
                                f"({ratio[d.id]:.3g} x its predicted time) gives tflops "
                                f"{tflops:.3g}, which {why}; its timing is not usable, so "
                                "no cluster file was written")
    return cluster.with_devices([replace(d, tflops=d.tflops / ratio[d.id]) if d.id in ratio
                                 else d for d in cluster.devices])


def diagnose(rows: list[RankRow], plan: Plan, config: SimConfig) -> list[Cause]:
    """The causes that explain a significant share of the step, biggest first."""
    step = float(np.mean([x.measured.step_s for x in rows]))
    slow_stages = _slow_stage_causes(rows, plan)
    found = [*_flops_causes(rows, config, {c.stage for c in slow_stages}, plan.is_sharded),
             *slow_stages,
             *_link_causes(rows, plan), *_sync_causes(rows, plan), *_fsdp_causes(rows, plan)]
    return sorted((c for c in found if c.seconds >= SIGNIFICANT_SHARE * step),
                  key=lambda c: -c.seconds)


def _ratio(x: RankRow) -> float:
    return x.measured.compute_s / max(x.predicted.compute_s, 1e-12)


@dataclass(frozen=True)
class StageCause(Cause):
    """A cause that is one stage's (all its ranks)."""

    stage: int = 0


def _slow_stage_causes(rows: list[RankRow], plan: Plan) -> list[StageCause]:
    """Stages (of 2 replicas or more) whose every rank computes STRAGGLER_FACTOR x slower,
    relative to the prediction, than the other stages' median: that stage's layers cost more
    than the model's FLOPs say (not one slow device)."""
    out = []
    for s, (a, b) in enumerate(plan.stages):
        mine = [_ratio(x) for x in rows if x.stage == s]
        ref = [_ratio(x) for x in rows if x.stage != s]
        if len(mine) < 2 or not ref:
            continue
        g = statistics.median(ref)
        if g > 0 and min(mine) > STRAGGLER_FACTOR * g:
            seconds = statistics.median(x.measured.compute_s - g * x.predicted.compute_s
                                        for x in rows if x.stage == s)
            out.append(StageCause(
                f"slow stage {s}", seconds,
                f"every rank of stage {s} (layers {a}-{b}) computes "
                f"{statistics.median(mine) / g:.1f}x slower than the other stages relative to "
                f"the prediction: the FLOPs the model preset gives these layers understate them",
                f"give stage {s} fewer layers (edit the plan's stages, check it with `scheduler.py "
                f"simulate`) and re-measure this model's FLOP/s per stage", stage=s))
    return out


def _flops_causes(rows: list[RankRow], config: SimConfig,
                  slow_stages: set[int] | frozenset[int] = frozenset(),
                  sharded: bool = False) -> list[Cause]:
    """Mis-estimated FLOP/s (the median rank) and stragglers (beyond the median; the ranks of
    a slow stage are named with it instead). `sharded`: the plan has shard groups."""
    g = statistics.median(_ratio(x) for x in rows)
    out: list[Cause] = []
    if g <= 0:  # the median rank recorded no compute: no ratio to judge by
        return out
    if not 1 / FLOPS_TOLERANCE <= g <= FLOPS_TOLERANCE:
        off = statistics.median(abs(x.measured.compute_s - x.predicted.compute_s) for x in rows)
        word = "slower" if g > 1 else "faster"
        out.append(Cause(
            "mis-estimated FLOP/s", off,
            f"compute takes {g:.2f}x the predicted time on the median rank: the devices are "
            f"{word} than the cluster's tflops x mfu {config.mfu:g} says"
            + ("; with shard groups FSDP2's own CPU work outside its collectives (copying "
               "parameters in and out of its buffers, its hooks) counts as compute, and the "
               "model does not charge it" if sharded and g > 1 else ""),
            f"take this run's speeds (explain ... --write-cluster FILE, then plan --cluster "
            f"FILE), or measure this model's FLOP/s on the hosts (python scripts/measure.py "
            f"--hosts FILE --model MODEL --out cluster.json, then plan --cluster cluster.json) "
            f"({_flops_flag(config.mfu / g, g)})"))
    for x in rows:
        if _ratio(x) > STRAGGLER_FACTOR * g and x.stage not in slow_stages:
            excess = x.measured.compute_s - g * x.predicted.compute_s
            out.append(Cause(
                f"straggler device {x.rank}", excess,
                f"rank {x.rank} (stage {x.stage}, replica {x.replica}) computes "
                f"{_ratio(x) / g:.1f}x slower than the other ranks relative to the prediction "
                f"({x.measured.compute_s:.3f} s vs {x.predicted.compute_s:.3f} s predicted)",
                f"re-measure device {x.rank}'s tflops and put it in the cluster file, or leave "
                f"device {x.rank} out (drop it from the cluster file) and re-plan"))
    return out


def _flops_flag(mfu: float, ratio: float) -> str:
    """The quick fix: --mfu when the corrected value is a fraction, else faster tflops."""
    if mfu <= 1.0:
        return f"or --mfu {mfu:.3g}"
    return f"or multiply every device's tflops in the cluster file by {1 / ratio:.2f}"


def _link_causes(rows: list[RankRow], plan: Plan) -> list[Cause]:
    """Pipeline links whose two ends both expose more pipeline communication than predicted."""
    excess = {x.rank: x.measured.pp_s - x.predicted.pp_s for x in rows}
    replica = {x.rank: x.replica for x in rows}
    out, seen = [], set()
    for lane in plan.lanes():  # the replicas' pipelines without shard groups
        for s, (a, b) in enumerate(zip(lane, lane[1:])):
            seconds, r = min(excess[a], excess[b]), replica[a]
            if seconds > 0 and (a, b) not in seen:
                seen.add((a, b))
                out.append(Cause(
                    f"slow link {a}-{b}", seconds,
                    f"ranks {a} and {b} (replica {r}, stages {s}-{s + 1}) each wait "
                    f"{seconds:.3f} s more on pipeline transfers than predicted",
                    f"re-measure link {a}-{b} (`python scripts/tc.py probe --cluster "
                    f"cluster.json --hosts ip_list --out measured.json`), put its latency_ms and "
                    "bandwidth_gbps in the cluster file, and re-plan"))
    return out


def _fewer_sync_bytes(plan: Plan) -> str:
    """The sync settings the plan does not use yet that send fewer bytes per step."""
    sync = plan.sync
    out = [] if sync.compression == "int8" else ["--compression int8"]
    if not sync.rule.local_steps:
        out.append("--sync diloco --inner-steps H")
    else:
        out.append(f"more --inner-steps than {sync.inner_steps}")
    return ", ".join(out)


def _sync_rings(rows: list[RankRow], plan: Plan) -> list[tuple[str, list[int], list[RankRow]]]:
    """(name, devices, their rows) of every data-parallel sync ring of two or more timed
    ranks: a stage group, or with shard groups each shard's ring across the replicas
    (Plan.shard_peers)."""
    out = []
    by_rank = {x.rank: x for x in rows}
    for s in range(plan.num_stages):
        shards = range(plan.shard_degree(s)) if plan.is_sharded else [None]
        for shard in shards:
            devices = (plan.shard_peers(s, shard) if shard is not None
                       else [x.rank for x in rows if x.stage == s])
            group = [by_rank[d] for d in devices if d in by_rank]
            if len(group) >= 2:
                what = f"stage {s}" + (f" shard {shard}" if shard is not None else "")
                out.append((what, devices, group))
    return out


def _sync_causes(rows: list[RankRow], plan: Plan) -> list[Cause]:
    """Sync rings whose every member exposes more data-parallel sync than predicted, or less
    (the model over-charges it: the planner may have ranked this plan below worse ones)."""
    out = []
    for what, devices, group in _sync_rings(rows, plan):
        slow = min(x.measured.dp_s - x.predicted.dp_s for x in group)
        fast = min(x.predicted.dp_s - x.measured.dp_s for x in group)
        if slow > 0:
            out.append(Cause(
                f"slow data-parallel sync of {what}", slow,
                f"every rank of {what} (devices {devices}) waits {slow:.3f} s more on "
                "the data-parallel sync than predicted",
                f"re-measure the links between devices {devices} (`python scripts/tc.py "
                f"probe ...`) and re-plan, or cut the sync's bytes: {_fewer_sync_bytes(plan)}"))
        elif fast > 0:
            hidden = " (or hides more of it behind compute)" if plan.sync.overlap else ""
            out.append(Cause(
                f"data-parallel sync of {what} faster than predicted", fast,
                f"every rank of {what} (devices {devices}) waits {fast:.3f} s less on the "
                f"data-parallel sync than predicted: the run moves it faster{hidden} than the "
                "model charges",
                f"re-measure the links between devices {devices} (`python scripts/tc.py probe "
                "...`) and re-plan: a plan predicted slower than it runs may have lost to "
                "worse ones in the search"))
    return out


def _fsdp_causes(rows: list[RankRow], plan: Plan) -> list[Cause]:
    """Shard groups whose every member spends more in FSDP's collectives than predicted."""
    out = []
    for r, chain in enumerate(plan.pipelines):
        for s, entry in enumerate(chain):
            group = [x for x in rows if x.rank in as_group(entry)]
            if len(group) < 2:
                continue
            seconds = min(x.measured.fsdp_s - x.predicted.fsdp_s for x in group)
            if seconds > 0:
                devices = [x.rank for x in group]
                fewer = ("plan with --no-reshard-after-forward (one gather a step instead "
                         "of two per micro-batch), or " if plan.reshard_after_forward else "")
                out.append(Cause(
                    f"slow FSDP collectives of shard group {devices}", seconds,
                    f"every device of replica {r} stage {s}'s shard group (devices {devices}) "
                    f"spends {seconds:.3f} s more in FSDP's all-gathers and reduce-scatters "
                    "than predicted",
                    f"re-measure the links between devices {devices} (`python scripts/tc.py "
                    f"probe ...`) and re-plan, {fewer}bound the shard groups with plan "
                    "--max-shard"))
    return out


def format_explanation(ex: Explanation) -> str:
    """The per-rank table and the causes, as `explain` prints them (an FSDP column with shard
    groups)."""
    fsdp = any(x.measured.fsdp_s or x.predicted.fsdp_s for x in ex.rows)
    head = (f"{'stage':>5} {'rank':>4} {'replica':>7}  {'compute s':>17}  {'waiting s':>17}  "
            f"{'exposed comm s':>17}  {'(pp / dp measured)':>18}"
            + (f"  {'FSDP s':>17}" if fsdp else ""))
    lines = [f"measured / predicted seconds per step (mean over steps: {ex.window})", head]
    for x in ex.rows:
        m, p = x.measured, x.predicted
        lines.append(f"{x.stage:>5} {x.rank:>4} {x.replica:>7}  "
                     f"{m.compute_s:8.3f} / {p.compute_s:6.3f}  "
                     f"{m.waiting_s:8.3f} / {p.waiting_s:6.3f}  "
                     f"{m.exposed_s:8.3f} / {p.exposed_s:6.3f}  "
                     f"{m.pp_s:8.3f} / {m.dp_s:7.3f}"
                     + (f"  {m.fsdp_s:8.3f} / {p.fsdp_s:6.3f}" if fsdp else ""))
    error = (ex.predicted_step_s / ex.measured_step_s - 1) * 100
    lines.append(f"step: measured {ex.measured_step_s:.3f} s, predicted {ex.predicted_step_s:.3f}"
                 f" s (prediction error {error:+.0f}%)")
    if not ex.causes and abs(error) < SIGNIFICANT_SHARE * 100:
        lines.append("no single cause explains 10% of the step or more: the plan's model "
                     "matches this run")
    elif not ex.causes:
        lines.append("no single cause explains 10% of the step or more: the difference is "
                     "spread over the ranks' compute, waits and communication")
    for i, c in enumerate(ex.causes):
        lead = "biggest difference" if i == 0 else "also"
        lines.append(f"{lead}: {c.name} ({c.seconds:.3f} s per step): {c.detail}")
        lines.append(f"  fix: {c.fix}")
    return "\n".join(lines)


def explanation_dict(ex: Explanation) -> dict[str, Any]:
    """JSON-ready form of an explanation."""
    def split(s: Split) -> dict[str, float]:
        return {"compute_s": round(s.compute_s, 6), "waiting_s": round(s.waiting_s, 6),
                "pp_s": round(s.pp_s, 6), "dp_s": round(s.dp_s, 6),
                "fsdp_s": round(s.fsdp_s, 6)}
    return {"measured_step_s": ex.measured_step_s, "predicted_step_s": ex.predicted_step_s,
            "window": ex.window,
            "rows": [{"rank": x.rank, "replica": x.replica, "stage": x.stage, "steps": x.steps,
                      "measured": split(x.measured), "predicted": split(x.predicted)}
                     for x in ex.rows],
            "causes": [vars(c) for c in ex.causes]}
