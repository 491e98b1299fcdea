"""Which runtime the performance model describes: a named profile, a calibration file, overrides.

The settings a runtime decides (config.RUNTIME_SETTINGS: MFU, activation bytes, recomputation,
the collective latency factor, DiLoCo's store round trips) come, later ones winning, from:
the generic defaults (or what a plan recorded), a profile of RUNTIME_PROFILES, a calibration
file, explicit values (the CLI's flags).

Calibration file, format `calibration/1` (JSON object; every key but `format` optional):

    {"format": "calibration/1",
     "runtime": "cpu",                  the profile the file refines (cpu | gpu)
     "mfu": 1.0,                        measured FLOP/s / the cluster's tflops, in (0, 1]
     "activation_bytes": 4,             1 | 2 | 4
     "recompute": false,                true | false
     "collective_latency_factor": 2.0,  one-way latencies per all-reduce step, [1, 10]
     "allreduce_algorithm": "gloo",     fp32 all-reduces: ring | gloo (gloo's own segments)
     "outer_store_round_trips": 3,      DiLoCo store round trips per outer step, [0, 100]
     "shared_cores": 1.9,               cores all ranks share (the CPU lab), 0 = none shared
     "background_load": 0.0,            other tasks always running beside them
     "core_contention": 0.03,           each rank computing beside another: its cost, [0, 10]
     "optimizer_flops_per_param": 40,   the optimizer step's CPU per parameter, FLOPs
     "outer_flops_per_param": 30,       DiLoCo: an outer round's CPU per parameter (fp32
     "outer_fp16_flops_per_param": 40,  payload; fp16; int8: codec included), FLOPs
     "outer_int8_flops_per_param": 60,
     "fsdp_flops_per_unit": 2e7,        shard groups: FSDP2's CPU per unit and micro-batch
     "fsdp_gathered_flops_per_unit": 1e7,   (reshard_after_forward on; off), FLOPs
     "measured": {...}}                 what was measured (free-form, e.g. calibrate.py's
                                        FLOP/s per rank and its model); not read by the model

save_calibration() writes one; load_calibration() reads one, UserError naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from formats.atomic_io import atomic_write_json
from formats.errors import UserError
from formats.jsonfile import load_json
from scheduler.simulator.config import (
    RUNTIME_NAMES,
    RUNTIME_PROFILES,
    RUNTIME_SETTINGS,
    SimConfig,
    setting_problem,
)

CALIBRATION_FORMAT = "calibration/1"
FLOAT_SETTINGS = ("mfu", "collective_latency_factor", "shared_cores", "background_load",
                  "core_contention",
                  "optimizer_flops_per_param", "outer_flops_per_param",
                  "outer_fp16_flops_per_param", "outer_int8_flops_per_param",
                  "fsdp_flops_per_unit", "fsdp_gathered_flops_per_unit")
"""Settings stored as floats whatever number the file gives (2 -> 2.0)."""


@dataclass(frozen=True)
class Calibration:
    """A calibration file's content."""

    source: str
    """Where it was read from (recorded in the plan's sim_config)."""
    runtime: str | None = None
    """The profile it refines (None: the generic defaults, or the runtime asked for)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Values of RUNTIME_SETTINGS fields, already checked."""
    measured: dict[str, Any] = field(default_factory=dict)
    """Free-form record of the measurement."""


def calibration_from_dict(obj: Any, source: str) -> Calibration:
    """Parse and check a `calibration/1` object; UserError `source: key: problem`."""
    if not isinstance(obj, dict):
        raise UserError(f"{source}: expected a JSON object, got {type(obj).__name__}")
    if obj.get("format") != CALIBRATION_FORMAT:
        raise UserError(f"{source}: format: expected '{CALIBRATION_FORMAT}', "
                        f"got {obj.get('format')!r}")
    known = ("format", "runtime", *RUNTIME_SETTINGS, "measured")
    for key in obj:
        if key not in known:
            raise UserError(f"{source}: {key}: unknown key; known: {', '.join(known)}")
    runtime = obj.get("runtime")
    if runtime is not None and runtime not in RUNTIME_NAMES:
        raise UserError(f"{source}: runtime: {setting_problem('runtime', runtime)}")
    settings = {}
    for key in RUNTIME_SETTINGS:
        if key in obj:
            problem = setting_problem(key, obj[key])
            if problem:
                raise UserError(f"{source}: {key}: {problem}")
            settings[key] = float(obj[key]) if key in FLOAT_SETTINGS else obj[key]
    measured = obj.get("measured", {})
    if not isinstance(measured, dict):
        raise UserError(f"{source}: measured: expected an object, got {measured!r}")
    return Calibration(source, runtime, settings, measured)


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration file; UserError naming the file and the key that is wrong."""
    obj = load_json(path, "calibration file")
    return calibration_from_dict(obj, str(path))


def save_calibration(path: str | Path, settings: Mapping[str, Any], runtime: str | None = None,
                     measured: Mapping[str, Any] | None = None) -> None:
    """Write a `calibration/1` file atomically (checked first, as load_calibration would)."""
    obj: dict[str, Any] = {"format": CALIBRATION_FORMAT}
    if runtime is not None:
        obj["runtime"] = runtime
    obj.update(settings)
    obj["measured"] = dict(measured or {})
    calibration_from_dict(obj, str(path))
    atomic_write_json(path, obj)


def resolve_sim_config(base: SimConfig | None = None, runtime: str | None = None,
                       calibration: Calibration | None = None, **overrides: Any) -> SimConfig:
    """The performance model: `base` (default: the generic SimConfig()), then the profile
    `runtime` (default: the calibration's own), then the calibration's values, then
    `overrides` (SimConfig fields). UserError on a bad value or a calibration made for another
    runtime than the one asked for."""
    config = base or SimConfig()
    if calibration and calibration.runtime and runtime and calibration.runtime != runtime:
        raise UserError(f"{calibration.source}: runtime: calibrates the {calibration.runtime!r} "
                        f"runtime, not the {runtime!r} one asked for")
    name = runtime or (calibration.runtime if calibration else None)
    if name is not None:
        if name not in RUNTIME_PROFILES:
            raise UserError(f"SimConfig.runtime: {setting_problem('runtime', name)}")
        profile = RUNTIME_PROFILES[name]
        config = replace(config, runtime=name, calibration=None,
                         **{k: getattr(profile, k) for k in RUNTIME_SETTINGS})
    if calibration is not None:
        config = replace(config, calibration=calibration.source, **calibration.settings)
    return replace(config, **overrides)
