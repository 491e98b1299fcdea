"""The flags of the simulated objective's performance model (every subcommand but `scenario`
has them) and the SimConfig they resolve to."""

from __future__ import annotations

import argparse

from formats.plan import Plan
from scheduler.cli.fields import SIM_FLAGS, add_field_flags, arg, field_dest
from scheduler.simulator.config import (
    RUNTIME_PROFILES,
    RUNTIME_SETTINGS,
    SimConfig,
    sim_config_from_record,
)
from scheduler.simulator.runtime import load_calibration, resolve_sim_config


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
                   dest=field_dest(SimConfig, "runtime"),
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
    g.add_argument("--recompute", choices=("on", "off"), dest=field_dest(SimConfig, "recompute"),
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
    recompute = arg(args, SimConfig, "recompute")
    if recompute is not None:
        given["recompute"] = recompute == "on"
    assert set(RUNTIME_SETTINGS) == {*SIM_FLAGS, "recompute"}
    return resolve_sim_config(base, arg(args, SimConfig, "runtime"), calibration, **given)
