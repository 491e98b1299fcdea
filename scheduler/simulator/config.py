"""The performance model's settings (SimConfig) and the runtimes they describe."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from formats import settings
from formats.errors import UserError
from formats.settings import setting
from formats.wire import INT8_BLOCK
from scheduler.memory import MemoryConfig

RUNTIME_NAMES = ("cpu", "gpu")
"""The runtimes with a profile in RUNTIME_PROFILES."""
MAX_INT8_BLOCK = 1 << 20
"""Largest int8 block (values per scale): far above the 256 the codec uses."""
ALLREDUCE_ALGORITHMS = ("ring", "gloo")
"""How an fp32 all-reduce is modelled (SimConfig.allreduce_algorithm)."""
RUNTIME_SETTINGS = ("mfu", "activation_bytes", "recompute", "collective_latency_factor",
                    "allreduce_algorithm", "outer_store_round_trips", "shared_cores",
                    "background_load", "core_contention", "optimizer_flops_per_param",
                    "outer_flops_per_param", "outer_fp16_flops_per_param",
                    "outer_int8_flops_per_param", "fsdp_flops_per_unit",
                    "fsdp_gathered_flops_per_unit")
"""The SimConfig fields a runtime decides: what a profile or a calibration file sets."""


def setting_problem(name: str, value: Any) -> str | None:
    """What is wrong with `value` for the SimConfig field `name`, or None when it is fine.

    The field's declared rule (formats.settings), worded without the field's name, so that
    every front end (the dataclass, the CLI's flags, a calibration file, a plan's record) can
    name it its own way.
    """
    return settings.problem(SimConfig, name, value)


@dataclass(frozen=True)
class SimConfig:
    """Knobs of the performance model. The defaults are the generic model (GPU-like, no runtime
    overheads); RUNTIME_PROFILES holds the values of this project's runtimes."""

    mfu: float = setting(0.4, lo=0.0, lo_open=True, hi=1.0)
    """Fraction of a device's peak `tflops` that training reaches on the FLOPs it runs (a
    recomputed forward counts)."""
    recompute: bool = True
    """Activation checkpointing: backward re-runs the forward (1 extra forward of FLOPs)."""
    reserved_gb: float = setting(1.0, lo=0.0)
    """Per-device memory overhead (CUDA context, buffers), GB."""
    int8_block: int = setting(INT8_BLOCK, lo=1, hi=MAX_INT8_BLOCK)
    """Values per fp32 scale in the int8 all-reduce payload."""
    activation_bytes: int = setting(2, choices=(1, 2, 4))
    """Bytes per value of the hidden state sent between stages: 2 for fp16/bf16 activations on
    GPUs, 4 for the fp32 CPU runtime."""
    collective_latency_factor: float = setting(1.0, lo=1.0, hi=10.0)
    """One-way latencies each all-reduce step costs. 1: data leaves as soon as it is ready;
    2: gloo, whose point-to-point is a rendezvous (a step's receiver announces its buffer
    before the data flows; measured: a 2-rank all-reduce of 0.9-4 MB over a 59 ms link takes
    2 x (2 x 59 ms + transfer)). Not applied to gloo's own fp32 all-reduce
    (allreduce_algorithm "gloo"), which charges its rendezvous itself."""
    allreduce_algorithm: str = setting("ring", choices=ALLREDUCE_ALGORITHMS)
    """How an fp32 all-reduce (a stage group's with compression none, the tied-embedding sum)
    runs. ring: 2(n-1) steps, each as long as its slowest link (latency x
    collective_latency_factor + B/n over the link): NCCL's ring. gloo: torch's gloo backend,
    whose ring (gloo::allreduce) splits B into segments of at most 1 MiB (at least 2 per
    member), keeps two in flight per link and sends each only after its receiver announced
    its buffer (collectives.gloo_allreduce_s); the members in ascending rank order, each sending
    to the one below. On the lab's links (benchmarks/gloo_allreduce.py) this model came to
    0.99-1.17x the measured all-reduces of 1,000-4,000,000 values but one, the ring model to
    1.12-1.35x on groups of 4 and 8 from 100,000 values (docs/simulator.md)."""
    outer_store_round_trips: int = setting(0, lo=0, hi=100)
    """DiLoCo: sequential round trips to the rendezvous store (hosted by device 0) that each
    outer step spends agreeing on the live replicas before and after averaging. The elastic
    runtime does 3: wait for every member, wait for every member's confirmation, the
    commit decision (a TCPStore `set` is one-way; `wait` and `compare_set` take one round trip,
    measured over a 67 ms link)."""
    shared_cores: float = setting(0.0, lo=0.0, hi=4096.0)
    """Cores that all the cluster's devices share (the CPU lab: every rank a single-thread
    process on one machine); 0: every device has its own (GPU hosts, separate machines). When
    set, a device's tflops is its speed computing alone and ranks computing at once share the
    cores (simulator/sharing.py); a calibration measures it (testkit/calibrate.py)."""
    background_load: float = setting(0.0, lo=0.0, hi=4096.0)
    """With shared_cores: tasks of other work that always run beside the ranks and take their
    share of the cores (a loaded machine); 0: a quiet one."""
    core_contention: float = setting(0.0, lo=0.0, hi=10.0)
    """With shared_cores: what each other rank computing at the same time costs a rank beyond
    its share of the cores (cache refills as the kernel switches between more runnable
    processes, memory bandwidth): its compute is stretched by 1 + core_contention x (n - 1)
    when n compute at once; 0: none. The calibration fits it to the speeds of 1, 2 and all
    ranks at once (measured 0.02-0.03 on the lab's 2-core Xeon)."""
    fsdp_flops_per_unit: float = setting(0.0, lo=0.0, hi=1e15)
    """Shard groups: FSDP2's own CPU per FSDP unit (a block, or a stage's root) and micro-batch
    outside its collectives (its hooks, copying parameters into and out of its buffers), with
    reshard_after_forward, in FLOPs at the device's training speed; 0: not charged (GPU
    hosts). The CPU lab's calibration measures it at the lab's micro-batch count."""
    fsdp_gathered_flops_per_unit: float = setting(0.0, lo=0.0, hi=1e15)
    """As fsdp_flops_per_unit, without reshard_after_forward (parameters gathered once a
    step)."""
    optimizer_flops_per_param: float = setting(0.0, lo=0.0, hi=1e6)
    """The optimizer step's CPU per parameter, in FLOPs at the device's training speed (its
    seconds x the measured FLOP/s / the parameters); 0: not charged (GPU hosts, where it is
    small beside the step). The CPU lab's calibration measures AdamW's."""
    outer_flops_per_param: float = setting(0.0, lo=0.0, hi=1e6)
    """DiLoCo: the CPU one rank spends per parameter on an outer round with an fp32 payload
    (pseudo-gradient, the gloo all-reduce's own reductions and copies, the Nesterov step, the
    merge), in FLOPs at the device's training speed; 0: not charged (GPU hosts). Charged
    (with R > 1) as compute spread over the round's H steps: the overlapped round's background
    thread takes its CPU beside them, a blocking one all ranks at once (the CPU lab's
    calibration measures it: testkit/calibrate.py)."""
    outer_fp16_flops_per_param: float = setting(0.0, lo=0.0, hi=1e6)
    """As outer_flops_per_param, for a round with an fp16 payload (the codec's encode and
    decode included)."""
    outer_int8_flops_per_param: float = setting(0.0, lo=0.0, hi=1e6)
    """As outer_flops_per_param, for a round with an int8 payload (the codec's encode and
    decode included)."""
    runtime: str | None = setting(None, choices=RUNTIME_NAMES, noun="runtime")
    """The RUNTIME_PROFILES entry these settings started from (None: the generic defaults).
    Recorded in the plan; fields given explicitly afterwards may differ from the profile."""
    calibration: str | None = None
    """The calibration file whose values were applied over the profile (None: none)."""

    def __post_init__(self) -> None:
        """UserError naming the field (`SimConfig.mfu`) that is out of range."""
        settings.check(self)

    def memory(self) -> MemoryConfig:
        """The memory estimate's settings."""
        return MemoryConfig(recompute=self.recompute, reserved_gb=self.reserved_gb)

    @property
    def backward_factor(self) -> float:
        """Backward compute time as a multiple of forward."""
        return 3.0 if self.recompute else 2.0


RUNTIME_PROFILES: dict[str, SimConfig] = {
    # This project's CPU runtime (dist_runner.py with gloo), as measured by the end-to-end demo:
    # the cluster's tflops are the FLOP/s testkit/calibrate.py measures for the model at
    # hand, so no further derating (mfu 1); fp32 activations; no recomputation; gloo's rendezvous
    # point-to-point costs two latencies per all-reduce step (fp32 all-reduces: gloo's own
    # segmented ring, modelled as it runs); the elastic DiLoCo outer step makes 3 store round
    # trips.
    "cpu": SimConfig(runtime="cpu", mfu=1.0, activation_bytes=4, recompute=False,
                     collective_latency_factor=2.0, allreduce_algorithm="gloo",
                     outer_store_round_trips=3),
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
