"""Planner CLI: export scenarios, plan a cluster, evaluate any plan.

    python scheduler/scheduler.py scenario worldwide --seed 0 --out cluster.json
    python scheduler/scheduler.py plan --scenario worldwide --seed 0 --model gpt3-xl \\
        --stages 8 --replicas 8 --out plan.json
    python scheduler/scheduler.py evaluate --cluster cluster.json --plan plan.json
    python scheduler/scheduler.py simulate --cluster cluster.json --plan plan.json
    python scheduler/scheduler.py explain --cluster cluster.json --plan plan.json --metrics RUN

User mistakes print `error: ...` and exit with status 2; nothing is written then.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()
"""When this command started: `plan --time-limit` counts from here (imports included)."""
IMPORT_GRACE_S = 10.0
"""main() called later than this after the import counts its time from its own start."""

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

if __package__ in (None, ""):
    # Run as a script: this file shares the package's name, so put the repo root first.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    # The planner's matrices are small: OpenBLAS's other threads only spin (0.2 CPU s of a
    # 1 s plan measured on 2 cores, the same wall time). A caller's own setting is kept.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from formats import argtypes, settings  # noqa: E402
from formats.atomic_io import check_output_path  # noqa: E402
from formats.cluster import (  # noqa: E402
    CLUSTER_FORMAT,
    COMPACT_FORMAT,
    MAX_DENSE_DEVICES,
    Cluster,
    load_cluster,
    save_cluster,
)
from formats.errors import UserError, run_main  # noqa: E402
from formats.hf_config import resolve_model  # noqa: E402
from formats.models import PRESETS, ModelSpec  # noqa: E402
from formats.plan import (  # noqa: E402
    COMPRESSIONS,
    MAX_FRAGMENTS,
    MAX_INNER_STEPS,
    SYNC_MODES,
    Plan,
    SyncConfig,
    id_ranges,
    load_plan,
    save_plan,
)
from formats.settings import MAX_SEED  # noqa: E402
from scheduler.cost_simulated import SimulatedObjective  # noqa: E402
from scheduler.memory import check_plan_memory  # noqa: E402
from scheduler.objective import CostBreakdown  # noqa: E402
from scheduler.planning import (  # noqa: E402
    DEFAULT_BUDGETS,
    DEFAULT_OBJECTIVE,
    DEFAULT_WINDOWS,
    OBJECTIVES,
    PlanOutcome,
    PlanRequest,
    per_replica_cost,
    plan_best_shape,
)
from scheduler.scenarios import SCENARIOS, make_scenario  # noqa: E402
from scheduler.search import SearchConfig  # noqa: E402
from scheduler.shard_search import Candidate, plan_hierarchical  # noqa: E402
from scheduler.simulator.config import (  # noqa: E402
    RUNTIME_PROFILES,
    RUNTIME_SETTINGS,
    SimConfig,
    sim_config_from_record,
)
from scheduler.simulator.report import format_sim_table, sync_label  # noqa: E402
from scheduler.simulator.runtime import load_calibration, resolve_sim_config  # noqa: E402
from scheduler.simulator.step import simulate_plan  # noqa: E402
from scheduler.sync_search import (  # noqa: E402
    AutoOutcome,
    SyncBounds,
    anchor_choices,
    plan_sync_auto,
)
from scheduler.time_to_target import explain_rows, simulate_rows, target_rows  # noqa: E402

PLAN_FLAGS: dict[type, tuple[str, ...]] = {
    PlanRequest: ("num_stages", "num_replicas", "objective", "micro_batch_size",
                  "num_micro_batches", "tokens_per_replica"),
    SearchConfig: ("budget", "window", "time_limit_s", "seed"),
}
"""The library fields `plan` has a flag for, generated from their declarations
(formats.settings), in --help order; the sync and performance-model groups add theirs."""
SYNC_FLAGS: dict[type, tuple[str, ...]] = {
    PlanRequest: ("pipeline_compression",),
    SyncBounds: ("max_inner_steps", "max_pipeline_compression", "train_steps",
                 "target_loss"),
}
SHARD_FLAGS = ("max_shard", "outer_state")
"""The PlanRequest fields of the shard-group group (--no-reshard-after-forward: below)."""
SIM_FLAGS = ("mfu", "activation_bytes", "collective_latency_factor", "allreduce_algorithm",
             "outer_store_round_trips",
             "shared_cores", "background_load", "core_contention", "optimizer_flops_per_param",
             "outer_flops_per_param", "outer_fp16_flops_per_param", "outer_int8_flops_per_param",
             "fsdp_flops_per_unit", "fsdp_gathered_flops_per_unit")
"""The SimConfig fields with a generated flag (--runtime, --calibration, --recompute: below)."""
FLAG_OF_FIELD: dict[str, str] = {
    settings.qualified(cls, name): settings.flag_of(cls, name)
    for cls, names in (*PLAN_FLAGS.items(), *SYNC_FLAGS.items(),
                       (SyncBounds, ("max_compression",)), (PlanRequest, ("random_samples",)),
                       (SimConfig, (*SIM_FLAGS, "runtime", "recompute")),
                       (PlanRequest, SHARD_FLAGS))
    for name in names} | {"PlanRequest.reshard_after_forward": "--no-reshard-after-forward"}
"""The flag that sets each library field: the library's errors name fields, ours name flags."""
CLI_DEFAULTS: dict[type, dict[str, Any]] = {
    PlanRequest: {"num_stages": 0, "num_replicas": 0, "objective": DEFAULT_OBJECTIVE,
                  "pipeline_compression": None},
    SearchConfig: {"budget": None, "window": None, "time_limit_s": 60.0},
    SyncBounds: {"max_inner_steps": None, "max_pipeline_compression": None,
                 "train_steps": None, "target_loss": None},
    SimConfig: {name: None for name in SIM_FLAGS},
}
"""Where a flag's default differs from its field's (None: not given; the command resolves it:
--budget by objective, the performance model from the plan, profile and calibration)."""
DEFAULT_WORDS = {
    "SearchConfig.budget": "default: " + ", ".join(f"{v} for {k}"
                                                   for k, v in DEFAULT_BUDGETS.items()),
    "SearchConfig.window": "default: " + ", ".join(f"{v} for {k}"
                                                   for k, v in DEFAULT_WINDOWS.items()),
    "SearchConfig.time_limit_s": "default 60, a safety net; here it bounds the whole command: "
    "loading the cluster, the search of every shape (sharing it), the baselines; not --plot. A "
    "search cut by it is not reproducible, one ended by the budget or convergence is",
    "PlanRequest.pipeline_compression": "default none",
    "SyncBounds.max_inner_steps": "default 1: allreduce only",
    "SyncBounds.max_pipeline_compression": "default none",
    "SyncBounds.train_steps": "default 1000, the runner's --steps default",
    "SyncBounds.target_loss": "default: none, the target is set by --train-steps",
}
"""What --help says of a flag's default where the command, not the field, decides it."""
MAX_SCENARIO_DEVICES = 1_000_000
"""Largest random scenario (compact form: 1M devices take about 30 s and 170 MB)."""
SEED = argtypes.integer(0, MAX_SEED)


def in_flag_words(message: str) -> str:
    """A library error message with every field this CLI sets named by its flag."""
    for name in sorted(FLAG_OF_FIELD, key=len, reverse=True):
        message = message.replace(name, FLAG_OF_FIELD[name])
    return message


def add_field_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                    names: tuple[str, ...]) -> None:
    """Flags for fields `names` of `cls`: rules and help from their declarations, the command's
    defaults (CLI_DEFAULTS), values checked by the fields' rules (argparse errors, exit 2)."""
    words = {n: DEFAULT_WORDS[settings.qualified(cls, n)] for n in names
             if settings.qualified(cls, n) in DEFAULT_WORDS}
    settings.add_flags(parser, cls, names, defaults=CLI_DEFAULTS.get(cls, {}),
                       default_words=words, bounded=True, flag_metavar=True,
                       help_words=in_flag_words)


def arg(args: argparse.Namespace, cls: type, name: str) -> Any:
    """The value of a generated flag (add_field_flags)."""
    return settings.value_of(args, cls, name)


def _cluster_from_args(args: argparse.Namespace) -> Cluster:
    if args.cluster and args.scenario:
        raise UserError("give either --cluster FILE or --scenario NAME, not both")
    if args.cluster:
        if args.seed is not None:
            raise UserError("--seed shuffles a --scenario's device ids; a --cluster file has "
                            "its own ids (leave --seed out)")
        return load_cluster(args.cluster)
    if args.scenario:
        return make_scenario(args.scenario, args.seed or 0)
    raise UserError("which cluster? give --cluster FILE or --scenario NAME")


def describe_profile(config: SimConfig) -> str:
    """One line of --help per runtime profile."""
    return (f"{config.runtime}: mfu {config.mfu:g}, {config.activation_bytes}-byte activations, "
            f"recompute {'on' if config.recompute else 'off'}, collective latency factor "
            f"{config.collective_latency_factor:g}, {config.allreduce_algorithm} fp32 "
            f"all-reduce, {config.outer_store_round_trips} DiLoCo store round trips")


def add_perf_model_args(p: argparse.ArgumentParser) -> None:
    """Flags of the simulated objective's performance model (see sim_config_from_args)."""
    g = p.add_argument_group(
        "performance model of the simulated objective (default: what the plan was made with, "
        "else the generic model: mfu 0.4, fp16 activations, recompute, collective latency "
        "factor 1, no store round trips; --runtime starts from a runtime's profile, "
        "--calibration FILE overrides it, the flags below override both)")
    g.add_argument("--runtime", choices=sorted(RUNTIME_PROFILES),
                   help="the runtime the plan will run on; " + "; ".join(
                       describe_profile(c) for c in RUNTIME_PROFILES.values()))
    g.add_argument("--calibration", metavar="FILE",
                   help="calibration/1 JSON file: measured values of these settings (keys "
                        "runtime, mfu, activation_bytes, recompute, collective_latency_factor, "
                        "allreduce_algorithm, outer_store_round_trips, shared_cores, "
                        "background_load, core_contention, "
                        "optimizer_flops_per_param, outer_flops_per_param, "
                        "outer_fp16_flops_per_param, outer_int8_flops_per_param, "
                        "fsdp_flops_per_unit, fsdp_gathered_flops_per_unit, all optional)")
    add_field_flags(g, SimConfig, SIM_FLAGS)
    g.add_argument("--recompute", choices=("on", "off"),
                   help="activation recomputation in backward (off: the CPU runtime)")


def sim_config_from_args(args: argparse.Namespace, plan: Plan | None = None) -> SimConfig:
    """The plan's recorded performance model (or the generic one), then --runtime, then
    --calibration, then the explicit flags."""
    base = None
    if plan is not None:
        base = sim_config_from_record(plan.search.get("sim_config"),
                                      f"{args.plan}: search.sim_config")
    calibration = load_calibration(args.calibration) if args.calibration else None
    given = {name: arg(args, SimConfig, name) for name in SIM_FLAGS
             if arg(args, SimConfig, name) is not None}
    if args.recompute is not None:
        given["recompute"] = args.recompute == "on"
    assert set(RUNTIME_SETTINGS) == {*SIM_FLAGS, "recompute"}
    return resolve_sim_config(base, args.runtime, calibration, **given)


def cmd_scenario(args: argparse.Namespace) -> int:
    """Export a built-in scenario as a cluster file."""
    check_output_path(args.out, "--out")
    given = {k: v for k, v in (("num_devices", args.devices), ("num_regions", args.regions))
             if v is not None}
    if given and args.name != "random":
        raise UserError(f"--devices/--regions apply to the random scenario only; "
                        f"'{args.name}' has a fixed layout")
    if args.devices is not None and args.devices > MAX_DENSE_DEVICES and not args.compact:
        raise UserError(f"--devices {args.devices}: the full form holds {args.devices} x "
                        f"{args.devices} link matrices; above {MAX_DENSE_DEVICES} devices give "
                        "--compact")
    if given.get("num_regions", 0) > given.get("num_devices", 64):
        raise UserError(f"--regions {args.regions}: more regions than the "
                        f"{given.get('num_devices', 64)} --devices")
    kwargs = {"num_devices": 64, "num_regions": 4, **given} if args.name == "random" else {}
    if args.name == "random" and args.compact:
        kwargs["compact"] = True  # built by region: never makes the N x N matrices
    cluster = make_scenario(args.name, args.seed, **kwargs)
    if args.compact:
        cluster = cluster.to_compact()
    save_cluster(cluster, args.out)
    form = f"compact form ({COMPACT_FORMAT})" if cluster.is_compact else \
        f"full form ({CLUSTER_FORMAT})"
    print(f"wrote {args.out}: {cluster.name}, {cluster.num_devices} devices in "
          f"{len(set(cluster.regions()))} regions, {form}")
    return 0


def _progress(evaluations: int, best: float) -> None:
    print(f"\rsearching: {evaluations:7d} evaluations, best {best:10.4f} s", end="",
          file=sys.stderr, flush=True)


def _plan_table(out: PlanOutcome) -> str:
    ours, p = out.ours, out.plan
    taken = p.search.get("taken_from")  # a baseline beat a search cut short by the clock
    keys = [k for k in ours.parts if not k.endswith("bytes_per_step")]
    head = f"  {'':28s} {'cost (s)':>10s}" + "".join(f" {k:>12s}" for k in keys) + \
        f" {'ours / it':>10s}"

    def row(label: str, b: CostBreakdown) -> str:
        parts = "".join(f" {b.parts.get(k, float('nan')):12.3f}" for k in keys)
        return f"  {label:28s} {b.cost_s:10.3f}{parts} {ours.cost_s / b.cost_s:10.3f}"

    rows = [
        f"plan {p.model} on {p.cluster}: {p.num_stages} stages x {p.num_replicas} replicas, "
        f"objective {ours.objective}",
        head,
        row(f"ours = {taken.split(' (')[0]}" if taken else "ours (evolutionary)", ours),
        *(row(label, b) for label, b in out.baselines.items()),
        f"  search: {p.search['evaluations']} evaluations in {p.search['wall_s']:.2f} s "
        f"(seed {p.search['seed']}, stopped by {p.search['stopped_by']}); best starting plan "
        f"{out.best_structured[1]:.3f} s",
    ]
    return "\n".join(rows)


def _plan_json(out: PlanOutcome, path: str) -> dict:
    ours = out.ours
    return {
        "plan": path, "objective": ours.objective, "cost": ours.cost_s, "parts": ours.parts,
        "predicted": out.plan.predicted, "search": out.plan.search,
        "evaluations": out.plan.search["evaluations"], "wall_s": out.plan.search["wall_s"],
        "baselines": {label: {"cost": b.cost_s, "parts": b.parts,
                              "ratio_ours_to_it": ours.cost_s / b.cost_s}
                      for label, b in out.baselines.items()},
        "hand_structured": out.hand_structured,
        "random_cost": out.random_cost, "index_cost": out.index_cost,
        "random_scored": out.random_scored,
        "best_structured_cost": out.best_structured[1],
        "ratio_vs_random": ours.cost_s / out.random_cost,
        "ratio_vs_index": ours.cost_s / out.index_cost,
    }


def sync_from_args(args: argparse.Namespace) -> tuple[SyncConfig, SyncBounds | None]:
    """The fixed sync configuration, or (with --sync auto) the bounds of the choice; UserError
    naming a flag that does not go with the --sync given."""
    if args.removed_max_loss_ratio is not None:
        raise UserError("--max-loss-ratio: removed; --sync auto now ranks plans by predicted time "
                        "to a target loss, which prices the loss DiLoCo costs (set the target "
                        "with --train-steps or --target-loss; docs/planner.md)")
    if args.sync == "auto":
        for flag, value in (("--inner-steps", args.inner_steps), ("--fragments", args.fragments),
                            ("--overlap", True if args.overlap else None),
                            ("--sync-warmup-steps", args.sync_warmup_steps),
                            ("--pipeline-compression",
                             arg(args, PlanRequest, "pipeline_compression"))):
            if value is not None:
                raise UserError(f"{flag}: --sync auto chooses it; bound the choice with "
                                f"--max-inner-steps, --compression and "
                                f"--allow-pipeline-compression instead")
        objective = arg(args, PlanRequest, "objective")
        if objective != "simulated":
            raise UserError(f"--objective {objective}: --sync auto needs --objective "
                            f"simulated (the only cost model of overlap, fragments and "
                            f"pipeline compression)")
        given = {k: arg(args, SyncBounds, k) for k in ("train_steps", "target_loss")}
        bounds = SyncBounds(arg(args, SyncBounds, "max_inner_steps") or 1, args.compression,
                            arg(args, SyncBounds, "max_pipeline_compression") or "none",
                            **{k: v for k, v in given.items() if v is not None})
        return SyncConfig(), bounds
    for flag, value in (("--max-inner-steps", arg(args, SyncBounds, "max_inner_steps")),
                        ("--allow-pipeline-compression",
                         arg(args, SyncBounds, "max_pipeline_compression")),
                        ("--train-steps", arg(args, SyncBounds, "train_steps")),
                        ("--target-loss", arg(args, SyncBounds, "target_loss"))):
        if value is not None:
            raise UserError(f"{flag} bounds what --sync auto may choose; with --sync "
                            f"{args.sync} give the setting itself")
    if args.sync != "diloco" and (args.overlap or args.fragments is not None
                                  or args.sync_warmup_steps is not None):
        raise UserError(f"--overlap, --fragments and --sync-warmup-steps apply to --sync "
                        f"diloco, not {args.sync}")
    inner = 1 if args.inner_steps is None else args.inner_steps  # SyncConfig checks it
    fragments = 1 if args.fragments is None else args.fragments
    if args.fragments is not None and fragments > inner >= 1:
        raise UserError(f"--fragments {fragments}: needs at least as many --inner-steps "
                        f"(got {inner})")
    if args.inner_steps is not None and args.sync == "allreduce" and inner != 1:
        raise UserError(f"--inner-steps {inner}: only with --sync diloco")
    return SyncConfig(args.sync, inner, args.compression, overlap=args.overlap,
                      fragments=fragments, warmup_steps=args.sync_warmup_steps or 0), None


def plan_request_from_args(args: argparse.Namespace, sync: SyncConfig) -> PlanRequest:
    """The PlanRequest of `plan`'s flags (the generated flags' values, the budget by objective
    when not given); the fields' rules check every value."""
    search = {f: arg(args, SearchConfig, f) for f in PLAN_FLAGS[SearchConfig]}
    given = {f: arg(args, PlanRequest, f) for f in (*PLAN_FLAGS[PlanRequest], "random_samples")}
    if search["budget"] is None:
        search["budget"] = DEFAULT_BUDGETS[given["objective"]]
    if search["window"] is None:
        search["window"] = DEFAULT_WINDOWS[given["objective"]]
    return PlanRequest(**given, sync=sync, search=SearchConfig(**search),
                       sim=sim_config_from_args(args),
                       pipeline_compression=arg(args, PlanRequest, "pipeline_compression")
                       or "none", max_shard=arg(args, PlanRequest, "max_shard"),
                       outer_state=arg(args, PlanRequest, "outer_state"),
                       reshard_after_forward=args.reshard_after_forward)


def cmd_plan(args: argparse.Namespace) -> int:
    """Search a plan, print it beside the baselines (or, with --sync auto, beside the best
    allreduce plan), write it atomically."""
    check_output_path(args.out, "--out")
    if args.plot:
        check_output_path(args.plot, "--plot", ".png")
    if args.allreduce_out:
        check_output_path(args.allreduce_out, "--allreduce-out")
        if args.sync != "auto":
            raise UserError("--allreduce-out: only with --sync auto")
    sync, bounds = sync_from_args(args)
    cluster = _cluster_from_args(args)
    model = resolve_model(args.model)
    req = plan_request_from_args(args, sync)
    progress = None if args.quiet else _progress
    out, auto, shards = _search(cluster, model, req, bounds, progress)
    if not args.quiet and out is not None:
        _print_search_notes(args, out)
    chosen = shards[0].plan if shards else out.plan  # type: ignore[union-attr]
    if args.plot and (out is None or chosen is not out.plan):
        raise UserError("--plot: draws D = 1 plans only; the plan chosen has shard groups "
                        "(leave out --plot, or --max-shard 1)")
    if args.plot:  # first: a plot that fails leaves no plan file behind
        from scheduler.plots import plot_plan  # matplotlib only when asked
        plot_plan(cluster, out.plan, out.history, args.plot)  # type: ignore[union-attr]
    save_plan(chosen, args.out)
    if auto is not None and args.allreduce_out:
        save_plan(auto.allreduce, args.allreduce_out)
    if args.json:
        found = {} if out is None else \
            _auto_json(auto, args.out) if auto else _plan_json(out, args.out)
        print(json.dumps({**found, **(_shard_json(shards, args.out) if shards else {})}))
    else:
        if out is not None:
            print(_auto_table(auto) if auto else _plan_table(out))
        if shards is not None:
            print(_shard_table(shards))
        extra = [f for f in (args.allreduce_out if auto else None, args.plot) if f]
        print(f"wrote {args.out}" + "".join(f" and {f}" for f in extra))
    return 0


def _search(cluster: Cluster, model: ModelSpec, req: PlanRequest, bounds: SyncBounds | None,
            progress: Callable[[int, float], None] | None
            ) -> tuple[PlanOutcome | None, AutoOutcome | None,
                       tuple[Candidate, list[Candidate]] | None]:
    """The D = 1 search (with --sync auto or not) and, with --max-shard above 1, the sharded
    layouts beside it: (outcome or None when no D = 1 plan fits, auto, shards or None)."""
    out = auto = None
    try:
        if bounds is not None:
            auto = plan_sync_auto(cluster, model, req, bounds, progress, STARTED)
            out = auto.outcome
        else:
            out = plan_best_shape(cluster, model, req, progress, STARTED)
    except UserError:
        if req.max_shard <= 1:
            raise
        # no D = 1 plan (e.g. the model fits no device): the sharded layouts may fit
    if req.max_shard <= 1:
        return out, auto, None
    syncs = (req.sync,) if bounds is None else tuple(c.sync for c in anchor_choices(bounds))
    shards = plan_hierarchical(cluster, model, req, syncs, out.plan if out else None, STARTED)
    return out, auto, shards



def _print_search_notes(args: argparse.Namespace, out: PlanOutcome) -> None:
    """The notes on stderr that say where the --time-limit cut the search short."""
    print(file=sys.stderr)
    if out.plan.search["stopped_by"] == "time":
        print(f"note: the --time-limit of {arg(args, SearchConfig, 'time_limit_s'):g} s ended "
              f"the search: the plan "
              f"may differ from run to run (raise --time-limit, or lower --budget, to "
              f"reproduce it from --search-seed)", file=sys.stderr)
    taken = out.plan.search.get("taken_from")
    if taken:
        print(f"note: the search, cut short by --time-limit, ended at "
              f"{out.plan.search['search_cost']:.3f} s, behind the {taken} plan: that "
              f"plan is the one written", file=sys.stderr)
    skipped = out.plan.search.get("shapes_skipped")
    if skipped:
        print(f"note: the --time-limit ran out before shapes "
              f"{', '.join(f'{a} x {b}' for a, b in skipped)} could be searched (give "
              f"more time, or --stages/--replicas)", file=sys.stderr)
    refused = out.plan.search.get("shapes_refused")
    if refused:
        print(f"note: {len(refused)} shape(s) not searched: " + "; ".join(refused),
              file=sys.stderr)
    samples = arg(args, PlanRequest, "random_samples")
    if out.random_scored < samples:
        print(f"note: the --time-limit left time to score {out.random_scored} of "
              f"{samples} random plans for the baseline", file=sys.stderr)


def _shard_table(shards: tuple[Candidate, list[Candidate]]) -> str:
    """Every layout the --max-shard comparison scored, by time per sequence."""
    best, every = shards
    rows = ["shard groups (--max-shard): S x D-way x R by simulated time per sequence "
            "(step / (R x D))",
            f"  {'layout':44s} {'step (s)':>10s} {'s/sequence':>12s}"]
    for c in every:
        mark = "  <- written" if c.label == best.label else ""
        rows.append(f"  {c.label:44s} {c.step_s:10.3f} {c.per_sequence_s:12.5f}{mark}")
    if best.shard_degree > 1:
        rows.append("  the sharded layout is written, not the D = 1 plan above (predicted "
                    f"{every[0].per_sequence_s / best.per_sequence_s:.2f}x its sequences/s)"
                    if every[0].shard_degree == 1 else "  no D = 1 plan fits: the sharded "
                    "layout is written")
    return "\n".join(rows)


def _shard_json(shards: tuple[Candidate, list[Candidate]], path: str) -> dict:
    """The --max-shard comparison for --json."""
    best, every = shards
    return {"plan": path, "shard_degree": best.shard_degree, "chosen": best.label,
            "shard_candidates": [{"label": c.label, "stages": c.num_stages,
                                  "shard_degree": c.shard_degree, "replicas": c.num_replicas,
                                  "step_s": c.step_s, "per_sequence_s": c.per_sequence_s}
                                 for c in every]}


AUTO_ROWS = (("step time (s)", "step_s", 1.0), ("  compute (busiest device)", "compute_s", 1.0),
             ("  pipeline bubble", "bubble_s", 1.0),
             ("  exposed pipeline comm", "pp_comm_s", 1.0),
             ("  tied-embedding sum", "tied_comm_s", 1.0),
             ("  exposed DP / outer sync", "dp_comm_s", 1.0),
             ("hidden DP / outer sync (s)", "dp_hidden_s", 1.0),
             ("pipeline MB per step", "pp_bytes_per_step", 1e-6),
             ("DP / outer MB per step", "dp_bytes_per_step", 1e-6),
             ("tokens/s", "tokens_per_s", 1.0))
"""The rows of the --sync auto table: label, part, scale."""


def _auto_table(auto: AutoOutcome) -> str:
    """The chosen plan's breakdown beside the best allreduce plan's."""
    ours, p, ar, arp = auto.outcome.ours, auto.outcome.plan, auto.allreduce_cost, auto.allreduce
    shape = lambda plan: f"{plan.num_stages} stages x {plan.num_replicas} replicas"  # noqa: E731
    rows = [f"plan {p.model} on {p.cluster}: objective {ours.objective}, --sync auto "
            f"({auto.choices} configurations within the bounds, {auto.scored} scored on "
            f"{len(auto.anchors)} searched assignments)",
            f"  chosen:    {sync_label(p.sync, p.pipeline_compression)}; {shape(p)}",
            f"  allreduce: {sync_label(arp.sync, arp.pipeline_compression)}; {shape(arp)}",
            *target_rows(p.predicted.get("to_target"), arp.predicted.get("to_target")),
            f"  {'':32s} {'chosen':>12s} {'allreduce':>12s}"]
    for label, key, scale in AUTO_ROWS:
        rows.append(f"  {label:32s} {ours.parts.get(key, float('nan')) * scale:12.3f} "
                    f"{ar.parts.get(key, float('nan')) * scale:12.3f}")
    rows.append(f"  the chosen plan trains {_speedup(auto):.2f}x the sequences per second of the "
                f"best allreduce plan (predicted; step {ar.cost_s / ours.cost_s:.2f}x shorter)")
    if p.sync.warmup_steps:
        run_s = p.predicted["run_step_s"]
        rows.append(f"  warm-up: {p.sync.warmup_steps} all-reduce steps of "
                    f"{p.predicted['train_steps']}: the run's mean step {run_s:.3f} s "
                    f"({ar.cost_s / run_s:.2f}x shorter than allreduce's)")
    return "\n".join(rows)


def _speedup(auto: AutoOutcome) -> float:
    """Sequences per second of the chosen plan over the allreduce plan's (widths may differ)."""
    ours, p, ar, arp = auto.outcome.ours, auto.outcome.plan, auto.allreduce_cost, auto.allreduce
    return (per_replica_cost(ar.cost_s, arp.num_replicas)
            / per_replica_cost(ours.cost_s, p.num_replicas))


def _auto_json(auto: AutoOutcome, path: str) -> dict:
    """--sync auto --json: the chosen plan and the best allreduce plan, each with its parts."""
    ours, p, ar, arp = auto.outcome.ours, auto.outcome.plan, auto.allreduce_cost, auto.allreduce

    def entry(plan: Plan, cost: CostBreakdown) -> dict:
        return {"cost": cost.cost_s, "parts": cost.parts,
                "sync": plan.to_dict()["sync"], "pipeline_compression": plan.pipeline_compression,
                "num_stages": plan.num_stages, "num_replicas": plan.num_replicas}

    return {"plan": path, "objective": ours.objective, "cost": ours.cost_s, "parts": ours.parts,
            "predicted": p.predicted, "search": p.search, "chosen": entry(p, ours),
            "allreduce": entry(arp, ar), "speedup_vs_allreduce": _speedup(auto),
            "anchors": auto.anchors, "scored": auto.scored, "configurations": auto.choices}


def _load_cluster_and_plan(args: argparse.Namespace) -> tuple[Cluster, Plan]:
    """Load both files; warn when the plan was made for a cluster with other contents."""
    cluster = load_cluster(args.cluster)
    plan = load_plan(args.plan, cluster)
    if plan.cluster_sha256 and plan.cluster_sha256 != cluster.sha256():
        print(f"warning: {args.plan} was made for cluster '{plan.cluster}' with other "
              f"contents than {args.cluster}", file=sys.stderr)
    unused = sorted(set(range(cluster.num_devices)) - set(plan.devices()))
    if unused:
        print(f"note: {args.plan} leaves devices {id_ranges(unused)} of {args.cluster} idle",
              file=sys.stderr)
    return cluster, plan


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Print the cost of any plan file under an objective."""
    cluster, plan = _load_cluster_and_plan(args)
    model = plan.model_spec()
    if plan.is_sharded:
        return _evaluate_sharded(args, cluster, plan)
    objective_name = arg(args, PlanRequest, "objective")
    if objective_name == "simulated":
        sim = sim_config_from_args(args, plan)
        try:  # a plan that does not fit costs inf to the search; here it is the user's error
            check_plan_memory(cluster, model, list(plan.stages), plan.pipelines,
                              plan.micro_batch_size, plan.num_micro_batches,
                              plan.sync.mode == "diloco", sim.memory())
        except UserError as e:
            raise UserError(f"{args.plan}: {e}") from None
        # Score the plan as written: its own layer split, not one the objective would choose.
        objective = SimulatedObjective(cluster, model, plan.sync, plan.micro_batch_size,
                                       plan.num_micro_batches, sim, stages=list(plan.stages),
                                       pipeline_compression=plan.pipeline_compression)
    else:
        req = PlanRequest(plan.num_stages, plan.num_replicas, plan.micro_batch_size,
                          plan.num_micro_batches, objective_name, plan.sync)
        objective = OBJECTIVES[objective_name](cluster, model, req)
    result = objective.breakdown(np.asarray(plan.pipelines))
    if args.json:
        print(json.dumps({"objective": result.objective, "cost": result.cost_s, **result.parts}))
    else:
        unit = lambda k: "" if k == "tokens_per_s" else \
            " B" if k.endswith("bytes_per_step") else " s"  # noqa: E731
        parts = ", ".join(f"{k} {v:.3f}{unit(k)}" for k, v in result.parts.items())
        print(f"{args.plan} on {cluster.name}: {result.objective} cost {result.cost_s:.3f} s "
              f"({parts})")
    return 0


def _evaluate_sharded(args: argparse.Namespace, cluster: Cluster, plan: Plan) -> int:
    """`evaluate` of a plan with shard groups: the simulator's step (the only objective that
    models FSDP and the per-shard sync)."""
    objective = arg(args, PlanRequest, "objective")
    if objective != "simulated":
        raise UserError(f"--objective {objective}: {args.plan} has shard groups, which only "
                        f"the simulated objective models; use --objective simulated")
    try:
        result = simulate_plan(cluster, None, plan, sim_config_from_args(args, plan),
                               timeline=False)
    except UserError as e:
        raise UserError(f"{args.plan}: {e}") from None
    parts = {**result.parts(), "fsdp_comm_s": result.fsdp_comm_s,
             "tokens_per_s": result.tokens_per_s,
             "pp_bytes_per_step": result.pp_bytes_per_step,
             "dp_bytes_per_step": result.dp_bytes_per_step,
             "fsdp_bytes_per_step": result.fsdp_bytes_per_step}
    if args.json:
        print(json.dumps({"objective": "simulated", "cost": result.step_s, **parts}))
    else:
        text = ", ".join(f"{k} {v:.3f}" for k, v in parts.items())
        print(f"{args.plan} on {cluster.name}: simulated cost {result.step_s:.3f} s "
              f"(D = {' '.join(map(str, result.shard_degrees))}; {text})")
    return 0


def add_scenario_command(sub: argparse._SubParsersAction) -> None:
    """`scenario NAME --seed S --out FILE`."""
    sc = sub.add_parser("scenario", help="export a built-in cluster scenario")
    sc.add_argument("name", choices=sorted(SCENARIOS))
    sc.add_argument("--seed", type=SEED, default=0, help="shuffles device ids (default 0)")
    sc.add_argument("--devices", type=argtypes.integer(1, MAX_SCENARIO_DEVICES),
                    help=f"random only: device count (default 64; above {MAX_DENSE_DEVICES} "
                    "only with --compact)")
    sc.add_argument("--regions", type=argtypes.integer(1, MAX_SCENARIO_DEVICES),
                    help="random only: region count, at most --devices (default 4)")
    sc.add_argument("--compact", action="store_true",
                    help=f"write the compact form ({COMPACT_FORMAT}: links per region pair, "
                         f"other links as exact pair links) instead of N x N matrices; what "
                         f"swarms of thousands of devices need")
    sc.add_argument("--out", required=True, help="cluster file to write")
    sc.set_defaults(func=cmd_scenario)


def add_plan_command(sub: argparse._SubParsersAction) -> None:
    """`plan (--scenario NAME | --cluster FILE) --model M --stages S --replicas R --out FILE`."""
    pl = sub.add_parser("plan", help="search a plan for a cluster and model")
    src = pl.add_argument_group("cluster (one of)")
    src.add_argument("--scenario", choices=sorted(SCENARIOS))
    src.add_argument("--seed", type=SEED, help="scenario seed: shuffles device ids (default 0)")
    src.add_argument("--cluster", help="cluster JSON file (cluster/1, or cluster/2: compact)")
    pl.add_argument("--model", required=True,
                    help=f"preset ({', '.join(PRESETS)}) or a Hugging Face config.json (or its "
                         "folder): llama or gpt2, see docs/models.md")
    add_field_flags(pl, PlanRequest, PLAN_FLAGS[PlanRequest])
    add_sync_args(pl)
    add_shard_args(pl)
    add_field_flags(pl, SearchConfig, PLAN_FLAGS[SearchConfig])
    add_field_flags(pl, PlanRequest, ("random_samples",))
    pl.add_argument("--out", required=True, help="plan file to write (atomically)")
    pl.add_argument("--plot", help="PNG: assignment by region and convergence curve")
    pl.add_argument("--json", action="store_true", help="one JSON object on stdout")
    pl.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_perf_model_args(pl)
    pl.set_defaults(func=cmd_plan)


SYNC_HELP = (
    "--sync auto searches the sync configuration together with the assignment (objective "
    "simulated): allreduce or DiLoCo with H in 2, 4, 8, ... up to --max-inner-steps, "
    "overlapped or not, in 1, 2 or 4 fragments, each data-parallel payload up to "
    "--compression and each pipeline compression up to --allow-pipeline-compression, each "
    "DiLoCo one also with all-reduce warm-ups of 0, 10, 30 and 60 steps; it takes the "
    "configuration of the least predicted wall time to the target (within 2% of it: the "
    "least risky): the target is the validation loss the best allreduce plan reaches after "
    "--train-steps steps (or --target-loss), the steps to it predicted by a quality model "
    "fitted on measured loss curves (replicas, global batch, H, warm-up, payload, overlap, "
    "fragments; docs/planner.md), each step's time by the simulator. It prints the predicted "
    "time, steps and tokens to the target beside the best allreduce plan's; a configuration "
    "outside the fitted ranges is flagged and charged extra steps. The bounds are how much "
    "you allow; the defaults allow nothing (allreduce, no compression).")


def add_sync_args(pl: argparse.ArgumentParser) -> None:
    """The sync group of `plan`: the plan's sync config (or --sync auto and its bounds)."""
    sy = pl.add_argument_group(
        "sync (how replicas of a stage stay in step, and how activations cross pipeline links)",
        SYNC_HELP)
    sy.add_argument("--sync", default="allreduce", choices=(*SYNC_MODES, "auto"),
                    help="allreduce (default), diloco, or auto (see above)")
    sy.add_argument("--inner-steps", type=argtypes.integer(),  # SyncConfig checks
                    help="DiLoCo H (with --sync diloco; default 1)")
    sy.add_argument("--overlap", action="store_true",
                    help="--sync diloco: run each outer all-reduce behind the next round's "
                         "inner steps, its average applied one round late")
    sy.add_argument("--fragments", type=argtypes.integer(1, MAX_FRAGMENTS),
                    help="--sync diloco: sync the stage's parameters in F fragments by layer, "
                         "each at its own offset in the round (Streaming DiLoCo; F <= H)")
    sy.add_argument("--sync-warmup-steps", type=argtypes.integer(0, MAX_INNER_STEPS),
                    metavar="W",
                    help="--sync diloco: all-reduce gradients every step for the first W "
                         "steps, then DiLoCo from the weights at step W (docs/bad_links.md; "
                         "default 0)")
    # --compression sets SyncConfig.compression, or with --sync auto SyncBounds.max_compression
    sy.add_argument("--compression", default="none", choices=COMPRESSIONS,
                    help="data-parallel payload (default none = fp32); with --sync auto the "
                         "most lossy one it may choose")
    add_field_flags(sy, PlanRequest, SYNC_FLAGS[PlanRequest])
    add_field_flags(sy, SyncBounds, SYNC_FLAGS[SyncBounds])
    sy.add_argument("--max-loss-ratio", type=float, help=argparse.SUPPRESS,
                    dest="removed_max_loss_ratio")  # replaced: refused by name in sync_from_args
    sy.add_argument("--allreduce-out", metavar="FILE",
                    help="--sync auto: also write the best allreduce plan there")


def add_shard_args(pl: argparse.ArgumentParser) -> None:
    """The shard-group group of `plan` (hierarchical replicas)."""
    sh = pl.add_argument_group("shard groups (hierarchical replicas, docs/hierarchical.md)")
    add_field_flags(sh, PlanRequest, SHARD_FLAGS)
    sh.add_argument("--no-reshard-after-forward", dest="reshard_after_forward",
                    action="store_false",
                    help="sharded plans: keep each stage's parameters gathered for the whole "
                         "step (fewer all-gathers, more memory)")


def add_evaluate_command(sub: argparse._SubParsersAction) -> None:
    """`evaluate --cluster FILE --plan FILE [--objective NAME] [--json]`."""
    ev = sub.add_parser("evaluate", help="cost of any plan file")
    ev.add_argument("--cluster", required=True,
                    help="cluster JSON file (cluster/1, or cluster/2: compact)")
    ev.add_argument("--plan", required=True, help="plan/1 or plan/2 JSON file (ours or anyone's)")
    add_field_flags(ev, PlanRequest, ("objective",))
    ev.add_argument("--json", action="store_true", help="one JSON object on stdout")
    add_perf_model_args(ev)
    ev.set_defaults(func=cmd_evaluate)


def cmd_simulate(args: argparse.Namespace) -> int:
    """Replay one training step of any plan and print its breakdown."""
    if args.timeline:
        check_output_path(args.timeline, "--timeline", ".png")
    cluster, plan = _load_cluster_and_plan(args)
    if args.timeline and plan.is_sharded:
        raise UserError(f"--timeline: {args.plan} has shard groups; the event timeline draws "
                        f"D = 1 plans only (leave out --timeline)")
    try:
        result = simulate_plan(cluster, None, plan, sim_config_from_args(args, plan),
                               timeline=bool(args.timeline))
    except UserError as e:  # e.g. memory: say which plan file does not fit
        raise UserError(f"{args.plan}: {e}") from None
    if args.timeline:
        from scheduler.timeline import save_timeline_png  # matplotlib only when asked
        save_timeline_png(result, args.timeline, f"{plan.model} on {cluster.name}")
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print("\n".join([format_sim_table(result),
                         *simulate_rows(plan.predicted, result.run_step_s or result.step_s)]))
        if args.timeline:
            print(f"wrote {args.timeline}")
    return 0


def add_simulate_command(sub: argparse._SubParsersAction) -> None:
    """`simulate --cluster FILE --plan FILE [--timeline out.png] [--json]`."""
    si = sub.add_parser("simulate", help="replay one step of a plan: step time and breakdown")
    si.add_argument("--cluster", required=True,
                    help="cluster JSON file (cluster/1, or cluster/2: compact)")
    si.add_argument("--plan", required=True, help="plan/1 or plan/2 JSON file (ours or anyone's)")
    si.add_argument("--timeline", help="Gantt chart PNG: one row per device")
    si.add_argument("--json", action="store_true", help="one JSON object on stdout")
    add_perf_model_args(si)
    si.set_defaults(func=cmd_simulate)


def cmd_explain(args: argparse.Namespace) -> int:
    """Measured time per stage and rank of a run beside the simulator's prediction."""
    from formats.run_metrics import CLUSTER_NAME, load_run
    from scheduler.explain import (
        explain,
        explanation_dict,
        format_explanation,
        measured_cluster,
    )

    if args.write_cluster:
        check_output_path(args.write_cluster, "--write-cluster")
    run = load_run(args.metrics, "--metrics", need_ranks=True)
    if args.cluster is None:
        copy = run.run_dir / CLUSTER_NAME
        if not copy.is_file():
            raise UserError(f"--cluster: not given and {copy} does not exist; give the cluster "
                            "file the plan was made for")
        args.cluster = str(copy)
    cluster, plan = _load_cluster_and_plan(args)
    if run.plan_path is not None and not same_run_plan(load_plan(run.plan_path), plan):
        raise UserError(f"--plan {args.plan}: not the plan the run in {args.metrics} trained "
                        f"(compare {run.plan_path}); give that plan")
    result = explain(plan, cluster, sim_config_from_args(args, plan), run.ranks)
    to_target = explain_rows(plan.predicted, run.replicas.get(0, []))
    if args.json:
        print(json.dumps({**explanation_dict(result), "to_target": to_target}))
    else:
        print("\n".join([format_explanation(result), *to_target]))
    if args.write_cluster:
        save_cluster(measured_cluster(cluster, result.rows), args.write_cluster)
        print(f"wrote {args.write_cluster}: the cluster with each device's tflops as its "
              "compute measured in this run (plan with it: scheduler.py plan --cluster "
              f"{args.write_cluster} ...)", file=sys.stderr if args.json else sys.stdout)
    return 0


def same_run_plan(a: Plan, b: Plan) -> bool:
    """Whether two plans train the same run (model, split, placement, batch, sync)."""
    def key(p: Plan) -> tuple:
        return (p.model, [list(s) for s in p.stages], p.pipelines, p.micro_batch_size,
                p.num_micro_batches, p.sync.mode, p.sync.inner_steps, p.sync.compression)
    return key(a) == key(b)


def add_explain_command(sub: argparse._SubParsersAction) -> None:
    """`explain --plan FILE --metrics RUN_DIR [--cluster FILE] [--json]`."""
    ex = sub.add_parser("explain", help="measured vs predicted time per stage and rank of a "
                        "run, and the biggest difference")
    ex.add_argument("--plan", required=True, help="plan/1 JSON file the run trained")
    ex.add_argument("--metrics", required=True, metavar="RUN_DIR",
                    help="the run's --run-dir (ranks/rank*.jsonl)")
    ex.add_argument("--cluster", help="cluster file the plan was made for (default: "
                    "RUN_DIR/cluster.json)")
    ex.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ex.add_argument("--write-cluster", metavar="FILE",
                    help="also write the cluster with each device's tflops as its compute "
                         "measured in this run (calibrates the planner from the run's own "
                         "steps: plan again with --cluster FILE and the same performance "
                         "model, e.g. the same --calibration)")
    add_perf_model_args(ex)
    ex.set_defaults(func=cmd_explain)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_scenario_command, add_plan_command, add_evaluate_command, add_simulate_command,
    add_explain_command]
"""Each adds one subcommand; a new one (e.g. `simulate`) appends its adder here."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="scheduler.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; user errors exit 2 without a traceback."""
    global STARTED
    if time.perf_counter() - STARTED > IMPORT_GRACE_S:  # called in-process long after import
        STARTED = time.perf_counter()  # (tests, notebooks): the command starts now
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"error: {in_flag_words(str(e))}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # e.g. the disk filled up while writing: say which file, no traceback
        print(f"error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1


def entry() -> None:
    """Console entry point (setup.py): run main() under run_main (every output is written
    atomically and closed by then: no interpreter teardown)."""
    run_main(main, skip_teardown=True)


if __name__ == "__main__":
    entry()
