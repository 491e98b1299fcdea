"""The performance model's settings (SimConfig) and the runtimes they describe."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from formats import checks
from formats.errors import UserError
from formats.wire import INT8_BLOCK
from scheduler.memory import MemoryConfig

RUNTIME_NAMES = ("cpu", "gpu")
"""The runtimes with a profile in RUNTIME_PROFILES."""
MAX_INT8_BLOCK = 1 << 20
"""Largest int8 block (values per scale): far above the 256 the codec uses."""
RUNTIME_SETTINGS = ("mfu", "activation_bytes", "recompute", "collective_latency_factor",
                    "outer_store_round_trips")
"""The SimConfig fields a runtime decides: what a profile or a calibration file sets."""


def _is_number(value: Any) -> bool:
    return checks.as_finite(value) is not None  # (an int beyond the float range is not)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def setting_problem(name: str, value: Any) -> str | None:
    """What is wrong with `value` for the SimConfig field `name`, or None when it is fine.

    One rule per field, worded without the field's name, so that every front end (the
    dataclass, the CLI's flags, a calibration file, a plan's record) can name it its own way.
    """
    if name == "mfu" and not (_is_number(value) and 0.0 < value <= 1.0):
        return f"must be in (0, 1], got {checks.shown(value)}"
    if name == "activation_bytes" and not (_is_int(value) and value in (1, 2, 4)):
        return f"must be 1, 2 or 4, got {checks.shown(value)}"
    if name == "recompute" and not isinstance(value, bool):
        return f"must be true or false, got {checks.shown(value)}"
    if name == "collective_latency_factor" and not (_is_number(value) and 1.0 <= value <= 10.0):
        return f"must be in [1, 10], got {checks.shown(value)}"
    if name == "outer_store_round_trips" and not (_is_int(value) and 0 <= value <= 100):
        return f"must be in [0, 100], got {checks.shown(value)}"
    if name == "reserved_gb" and not (_is_number(value) and value >= 0.0):
        return f"must be a number >= 0, got {checks.shown(value)}"
    if name == "int8_block" and not (_is_int(value) and 1 <= value <= MAX_INT8_BLOCK):
        return f"must be an integer in [1, {MAX_INT8_BLOCK}], got {checks.shown(value)}"
    if name == "runtime" and value is not None and value not in RUNTIME_NAMES:
        return f"unknown runtime {checks.shown(value)}; known: {', '.join(RUNTIME_NAMES)}"
    if name == "calibration" and value is not None and not isinstance(value, str):
        return f"must be a file name, got {checks.shown(value)}"
    return None


@dataclass(frozen=True)
class SimConfig:
    """Knobs of the performance model. The defaults are the generic model (GPU-like, no runtime
    overheads); RUNTIME_PROFILES holds the values of this project's runtimes."""

    mfu: float = 0.4
    """Fraction of a device's peak `tflops` that training reaches on the FLOPs it runs (a
    recomputed forward counts)."""
    recompute: bool = True
    """Activation checkpointing: backward re-runs the forward (1 extra forward of FLOPs)."""
    reserved_gb: float = 1.0
    """Per-device memory overhead (CUDA context, buffers), GB."""
    int8_block: int = INT8_BLOCK
    """Values per fp32 scale in the int8 all-reduce payload."""
    activation_bytes: int = 2
    """Bytes per value of the hidden state sent between stages: 2 for fp16/bf16 activations on
    GPUs, 4 for the fp32 CPU runtime."""
    collective_latency_factor: float = 1.0
    """One-way latencies each all-reduce step costs. 1: data leaves as soon as it is ready;
    2: gloo, whose point-to-point is a rendezvous (a step's receiver announces its buffer
    before the data flows; measured: a 2-rank all-reduce of 0.9-4 MB over a 59 ms link takes
    2 x (2 x 59 ms + transfer))."""
    outer_store_round_trips: int = 0
    """DiLoCo: sequential round trips to the rendezvous store (hosted by device 0) that each
    outer step spends agreeing on the live replicas before and after averaging. The elastic
    runtime does 3: wait for every member, wait for every member's confirmation, the
    commit decision (a TCPStore `set` is one-way; `wait` and `compare_set` take one round trip,
    measured over a 67 ms link)."""
    runtime: str | None = None
    """The RUNTIME_PROFILES entry these settings started from (None: the generic defaults).
    Recorded in the plan; fields given explicitly afterwards may differ from the profile."""
    calibration: str | None = None
    """The calibration file whose values were applied over the profile (None: none)."""

    def __post_init__(self) -> None:
        """UserError naming the field (`SimConfig.mfu`) that is out of range."""
        for f in fields(self):
            problem = setting_problem(f.name, getattr(self, f.name))
            if problem:
                raise UserError(f"SimConfig.{f.name}: {problem}")

    def memory(self) -> MemoryConfig:
        """The memory estimate's settings."""
        return MemoryConfig(recompute=self.recompute, reserved_gb=self.reserved_gb)

    @property
    def backward_factor(self) -> float:
        """Backward compute time as a multiple of forward."""
        return 3.0 if self.recompute else 2.0


RUNTIME_PROFILES: dict[str, SimConfig] = {
    # This project's CPU runtime (dist_runner.py with gloo), as measured by the end-to-end demo:
    # the cluster's tflops are the FLOP/s modules/device/calibrate.py measures for the model at
    # hand, so no further derating (mfu 1); fp32 activations; no recomputation; gloo's rendezvous
    # point-to-point costs two latencies per all-reduce step; the elastic DiLoCo outer step
    # makes 3 store round trips.
    "cpu": SimConfig(runtime="cpu", mfu=1.0, activation_bytes=4, recompute=False,
                     collective_latency_factor=2.0, outer_store_round_trips=3),
    # The GPU runtime: bf16 activations, activation checkpointing (GPipe keeps every
    # micro-batch's activations alive otherwise, see memory.py), NCCL collectives
    # (modules/comm/: data leaves as soon as it is ready, one latency per step), and the same
    # elastic DiLoCo outer step (its membership agreement goes through the TCPStore whatever
    # the backend: 3 round trips).
    # MFU 0.4 is an estimate, not a measurement (no GPU has been lent to this work yet) of
    # what the runtime's eager PyTorch (SDPA attention; no fused optimizer, no CUDA graphs,
    # no tensor parallelism) reaches of peak dense bf16 tensor-core FLOP/s. SimConfig.mfu
    # counts the recomputed forward as work, so 0.4 with recomputation is 0.3 model FLOPs
    # utilisation in the papers' sense (3 of the 4 forwards' worth of FLOPs are the model's):
    # the low end of what tuned large-model training reports, as an untuned runtime should
    # be. PaLM (Chowdhery et al. 2022, Table 3) lists 0.21-0.46 for GPT-3, Gopher, MT-NLG and
    # PaLM; Megatron-LM (Korthikanti et al. 2022) 0.42 with full recomputation, 0.54 with
    # selective. A calibration file replaces it once it is measured.
    "gpu": SimConfig(runtime="gpu", mfu=0.4, activation_bytes=2, recompute=True,
                     collective_latency_factor=1.0, outer_store_round_trips=3),
}
"""The performance model of each runtime (`scheduler.py plan --runtime NAME`)."""
assert tuple(RUNTIME_PROFILES) == RUNTIME_NAMES


def sim_config_from_record(record: Mapping[str, Any] | None, where: str) -> SimConfig:
    """The SimConfig a plan recorded (`search.sim_config`); UserError naming `where`.key.

    Keys this version does not know are ignored (a newer planner may record more).
    """
    if record is None:
        return SimConfig()
    if not isinstance(record, Mapping):
        raise UserError(f"{where}: expected an object, got {record!r}")
    known = {f.name for f in fields(SimConfig)}
    values = {k: v for k, v in record.items() if k in known}
    for key, value in values.items():
        problem = setting_problem(key, value)
        if problem:
            raise UserError(f"{where}.{key}: {problem}")
    return SimConfig(**values)
