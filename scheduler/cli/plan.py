"""`plan (--scenario NAME | --cluster FILE) --model M --stages S --replicas R --out FILE`:
search a plan, print it beside the baselines, write it atomically."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from formats.atomic_io import check_output_path
from formats.cluster import Cluster
from formats.errors import UserError
from formats.hf_config import resolve_model
from formats.models import PRESETS, ModelSpec
from formats.plan import SyncConfig, save_plan
from scheduler.cli import clock
from scheduler.cli import plan_report as report
from scheduler.cli.fields import PLAN_FLAGS, SEED, SHARD_FLAGS, add_field_flags, arg, field_dest
from scheduler.cli.inputs import cluster_from_args
from scheduler.cli.perf_model import add_perf_model_args, sim_config_from_args
from scheduler.cli.plan_sync import add_sync_args, sync_from_args
from scheduler.planning import PlanOutcome, PlanRequest, plan_best_shape, search_defaults
from scheduler.scenarios import SCENARIOS
from scheduler.search import SearchConfig
from scheduler.shard_search import Candidate, plan_hierarchical
from scheduler.sync_search import AutoOutcome, SyncBounds, anchor_choices, plan_sync_auto


def plan_request_from_args(args: argparse.Namespace, sync: SyncConfig) -> PlanRequest:
    """The PlanRequest of `plan`'s flags (the generated flags' values, the budget by objective
    when not given); the fields' rules check every value."""
    search = {f: arg(args, SearchConfig, f) for f in PLAN_FLAGS[SearchConfig]}
    given = {f: arg(args, PlanRequest, f) for f in (*PLAN_FLAGS[PlanRequest], "random_samples")}
    budget, window = search_defaults(given["objective"])  # what the objective declares
    if search["budget"] is None:
        search["budget"] = budget
    if search["window"] is None:
        search["window"] = window
    return PlanRequest(**given, sync=sync, search=SearchConfig(**search),
                       sim=sim_config_from_args(args),
                       pipeline_compression=arg(args, PlanRequest, "pipeline_compression")
                       or "none", max_shard=arg(args, PlanRequest, "max_shard"),
                       outer_state=arg(args, PlanRequest, "outer_state"),
                       reshard_after_forward=arg(args, PlanRequest, "reshard_after_forward"))


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
    cluster = cluster_from_args(args)
    model = resolve_model(args.model)
    req = plan_request_from_args(args, sync)
    out, auto, shards = search(cluster, model, req, bounds,
                               None if args.quiet else report.progress)
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
            report.auto_json(auto, args.out) if auto else report.plan_json(out, args.out)
        print(json.dumps({**found, **(report.shard_json(shards, args.out) if shards else {})}))
    else:
        if out is not None:
            print(report.auto_table(auto) if auto else report.plan_table(out))
        if shards is not None:
            print(report.shard_table(shards))
        extra = [f for f in (args.allreduce_out if auto else None, args.plot) if f]
        print(f"wrote {args.out}" + "".join(f" and {f}" for f in extra))
    return 0


def search(cluster: Cluster, model: ModelSpec, req: PlanRequest, bounds: SyncBounds | None,
           progress: Callable[[int, float], None] | None
           ) -> tuple[PlanOutcome | None, AutoOutcome | None,
                      tuple[Candidate, list[Candidate]] | None]:
    """The D = 1 search (with --sync auto or not) and, with --max-shard above 1, the sharded
    layouts beside it: (outcome or None when no D = 1 plan fits, auto, shards or None)."""
    out = auto = None
    try:
        if bounds is not None:
            auto = plan_sync_auto(cluster, model, req, bounds, progress, clock.started())
            out = auto.outcome
        else:
            out = plan_best_shape(cluster, model, req, progress, clock.started())
    except UserError:
        if req.max_shard <= 1:
            raise
        # no D = 1 plan (e.g. the model fits no device): the sharded layouts may fit
    if req.max_shard <= 1:
        return out, auto, None
    syncs = (req.sync,) if bounds is None else tuple(c.sync for c in anchor_choices(bounds))
    shards = plan_hierarchical(cluster, model, req, syncs, out.plan if out else None,
                               clock.started())
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


def add_shard_args(pl: argparse.ArgumentParser) -> None:
    """The shard-group group of `plan` (hierarchical replicas)."""
    sh = pl.add_argument_group("shard groups (hierarchical replicas, docs/hierarchical.md)")
    add_field_flags(sh, PlanRequest, SHARD_FLAGS)
    sh.add_argument("--no-reshard-after-forward", action="store_false",
                    dest=field_dest(PlanRequest, "reshard_after_forward"),
                    help="sharded plans: keep each stage's parameters gathered for the whole "
                         "step (fewer all-gathers, more memory)")


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
