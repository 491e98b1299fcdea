"""The `plan/1` format: which device runs which pipeline stage of which data-parallel replica."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from formats import checks
from formats.atomic_io import atomic_write_json
from formats.cluster import Cluster
from formats.errors import UserError
from formats.jsonfile import load_json
from formats.models import ModelSpec, get_model

PLAN_FORMAT = "plan/1"
SYNC_MODES = ("allreduce", "diloco")
COMPRESSIONS = ("none", "fp16", "int8")
PIPELINE_COMPRESSIONS = ("none", "bf16", "int8")
"""How activations (forward) and activation gradients (backward) cross pipeline links."""
MAX_FRAGMENTS = 1024
"""Most Streaming-DiLoCo fragments per stage (the paper uses up to a few dozen)."""
MAX_BATCH_COUNT = 65_536
"""Most sequences per micro-batch, and most micro-batches per step: far above real runs
(DT-FM: 61 micro-batches of 1), and a bound on the simulator's and runtime's per-micro-batch
work and allocations."""
MAX_INNER_STEPS = 10 ** 9
"""Most DiLoCo inner steps per outer step (the papers use 500)."""
MAX_DEVICE_ID = 2 ** 31 - 1
"""torch.distributed ranks are 32-bit."""


@dataclass
class SyncConfig:
    """How the replicas of a stage keep their parameters in step."""

    mode: str = "allreduce"
    """`allreduce`: average gradients every step; `diloco`: outer step every `inner_steps`."""
    inner_steps: int = 1
    """H: inner optimizer steps between two outer (communicating) steps; 1 for allreduce."""
    compression: str = "none"
    """Payload of the data-parallel all-reduce: `none` (fp32), `fp16` or `int8`."""
    outer_lr: float = 0.7
    """DiLoCo outer SGD learning rate."""
    outer_momentum: float = 0.9
    """DiLoCo outer Nesterov momentum."""
    overlap: bool = False
    """DiLoCo: run each outer all-reduce in the background while the next round's inner
    steps compute, and apply its averaged pseudo-gradient when it arrives (one round late)."""
    fragments: int = 1
    """DiLoCo: F contiguous parameter fragments (by layer) per stage, each synced at its own
    offset in the round (Streaming DiLoCo), so the peak bandwidth need falls F times."""

    def validate(self) -> None:
        """Raise UserError on a bad field."""
        if self.mode not in SYNC_MODES:
            raise UserError(f"sync.mode: {self.mode!r} is not one of {', '.join(SYNC_MODES)}")
        if self.compression not in COMPRESSIONS:
            raise UserError(
                f"sync.compression: {self.compression!r} is not one of {', '.join(COMPRESSIONS)}")
        checks.integer(self.inner_steps, "sync.inner_steps", 1, MAX_INNER_STEPS)
        if self.mode == "allreduce" and self.inner_steps != 1:
            raise UserError(
                f"sync.inner_steps: {self.inner_steps} only makes sense with mode 'diloco'")
        checks.finite_number(self.outer_lr, "sync.outer_lr", 0, lo_open=True)
        checks.finite_number(self.outer_momentum, "sync.outer_momentum", 0, 1, hi_open=True)
        if not isinstance(self.overlap, bool):
            raise UserError(
                f"sync.overlap: expected true or false, got {checks.shown(self.overlap)}")
        checks.integer(self.fragments, "sync.fragments", 1, MAX_FRAGMENTS)
        if self.mode != "diloco" and (self.overlap or self.fragments != 1):
            raise UserError("sync.overlap and sync.fragments only apply to mode 'diloco' "
                            f"(mode is {self.mode!r})")
        if self.fragments > self.inner_steps:
            raise UserError(f"sync.fragments: {self.fragments} fragments need at least as many "
                            f"inner steps per round (sync.inner_steps is {self.inner_steps})")


@dataclass
class Plan:
    """An assignment of pipeline stages x data-parallel replicas to device ids."""

    cluster: str
    """Name of the cluster the plan was made for."""
    cluster_sha256: str
    """Digest of that cluster file's content (Cluster.sha256), to catch a mismatch."""
    model: str
    """Model preset name."""
    stages: list[tuple[int, int]]
    """Half-open layer range [start, end) of each stage; contiguous, covering the model."""
    pipelines: list[list[int]]
    """pipelines[r][s] = device id running stage s of replica r."""
    micro_batch_size: int = 1
    """Sequences per micro-batch."""
    num_micro_batches: int = 1
    """Micro-batches per replica per step (global batch = replicas x this x micro_batch_size)."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    pipeline_compression: str = "none"
    """How activations and activation gradients cross pipeline links: `none` (the compute
    dtype), `bf16`, or `int8` with one scale per token row."""
    predicted: dict[str, Any] = field(default_factory=dict)
    """What the planner predicted: objective, cost (s) and its parts."""
    search: dict[str, Any] = field(default_factory=dict)
    """How the plan was found: method, seed, evaluations, wall_s."""

    @property
    def num_stages(self) -> int:
        """Pipeline depth S."""
        return len(self.stages)

    @property
    def num_replicas(self) -> int:
        """Data-parallel width R."""
        return len(self.pipelines)

    def stage_of(self, device_id: int) -> tuple[int, int]:
        """(replica, stage) of a device; UserError when the device is not in the plan."""
        for r, chain in enumerate(self.pipelines):
            for s, dev in enumerate(chain):
                if dev == device_id:
                    return r, s
        raise UserError(f"rank {device_id} is not in the plan (devices: {sorted(self.devices())})")

    def devices(self) -> list[int]:
        """All device ids used by the plan."""
        return [d for chain in self.pipelines for d in chain]

    def to_dict(self) -> dict[str, Any]:
        """The `plan/1` JSON object."""
        return {
            "format": PLAN_FORMAT,
            "cluster": self.cluster,
            "cluster_sha256": self.cluster_sha256,
            "model": self.model,
            "num_stages": self.num_stages,
            "num_replicas": self.num_replicas,
            "micro_batch_size": self.micro_batch_size,
            "num_micro_batches": self.num_micro_batches,
            "stages": [{"layers": [a, b]} for a, b in self.stages],
            "pipelines": [list(map(int, chain)) for chain in self.pipelines],
            "sync": asdict(self.sync),
            "pipeline_compression": self.pipeline_compression,
            "predicted": self.predicted,
            "search": self.search,
        }


def validate_plan(plan: Plan, cluster: Cluster | None = None,
                  model: ModelSpec | None = None) -> None:
    """Check the plan's structure, and its fit to a cluster and model when given."""
    if plan.num_stages < 1 or plan.num_replicas < 1:
        raise UserError("plan: needs at least one stage and one replica")
    for r, chain in enumerate(plan.pipelines):
        if len(chain) != plan.num_stages:
            raise UserError(
                f"pipelines[{r}]: has {len(chain)} devices, expected one per stage "
                f"({plan.num_stages})")
    seen: dict[int, tuple[int, int]] = {}
    for r, chain in enumerate(plan.pipelines):
        for s, dev in enumerate(chain):
            checks.integer(dev, f"pipelines[{r}][{s}]: device id", 0, MAX_DEVICE_ID)
            if dev in seen:
                raise UserError(f"pipelines[{r}][{s}]: device {dev} appears twice "
                                f"(also pipelines[{seen[dev][0]}][{seen[dev][1]}])")
            seen[dev] = (r, s)
    for name in ("micro_batch_size", "num_micro_batches"):
        checks.integer(getattr(plan, name), f"plan.{name}", 1, MAX_BATCH_COUNT)
    plan.sync.validate()
    if plan.pipeline_compression not in PIPELINE_COMPRESSIONS:
        raise UserError(f"plan.pipeline_compression: {checks.shown(plan.pipeline_compression)} "
                        f"is not one of {', '.join(PIPELINE_COMPRESSIONS)}")
    model = model or get_model(plan.model)
    _check_layers(plan.stages, model)
    if cluster is not None:
        bad = [d for d in seen if not 0 <= d < cluster.num_devices]
        if bad:
            raise UserError(
                f"pipelines: device ids {sorted(bad)} are not in cluster '{cluster.name}' "
                f"(ids 0..{cluster.num_devices - 1}); was the plan made for another cluster?")


def id_ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5' (short error messages for long id lists)."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def _check_layers(stages: list[tuple[int, int]], model: ModelSpec) -> None:
    expect = 0
    for s, (a, b) in enumerate(stages):
        if a != expect or b <= a:
            raise UserError(
                f"stages[{s}].layers: [{a}, {b}] must start at {expect} and hold at least one "
                f"layer; stages must cover layers 0..{model.num_layers} of {model.name} in order")
        if b > model.num_layers:
            raise UserError(f"stages[{s}].layers: [{a}, {b}] ends past the {model.num_layers} "
                            f"layers of {model.name}")
        expect = b
    if expect != model.num_layers:
        raise UserError(f"stages: cover layers [0, {expect}) but {model.name} has "
                        f"{model.num_layers} layers")


def _parse_stages(raw: Any) -> list[tuple[int, int]]:
    """`[{"layers": [start, end]}, ...]` with integer bounds (not 2.0, "2" or true)."""
    if not isinstance(raw, list):
        raise UserError(f"plan.stages: expected a list of {{\"layers\": [start, end]}}, got "
                        f"{checks.shown(raw)}")
    stages = []
    for s, stage in enumerate(raw):
        layers = stage.get("layers") if isinstance(stage, dict) else None
        if not isinstance(layers, list) or len(layers) != 2:
            raise UserError(f"stages[{s}]: expected {{\"layers\": [start, end]}}, got "
                            f"{checks.shown(stage)}")
        a, b = (checks.integer(x, f"stages[{s}].layers", 0) for x in layers)
        stages.append((a, b))
    return stages


def _optional_text(obj: dict, key: str) -> str:
    value = obj.get(key, "")
    return checks.text(value, f"plan.{key}", max_chars=4096, empty=True)


def plan_from_dict(obj: Any) -> Plan:
    """Parse a `plan/1` object (structure only; call validate_plan for the full check)."""
    if not isinstance(obj, dict):
        raise UserError(f"plan: expected a JSON object, got {type(obj).__name__}")
    if obj.get("format") != PLAN_FORMAT:
        raise UserError(f"plan.format: expected '{PLAN_FORMAT}', got "
                        f"{checks.shown(obj.get('format'))}")
    for key in ("model", "stages", "pipelines"):
        if key not in obj:
            raise UserError(f"plan: missing key '{key}'")
    stages = _parse_stages(obj["stages"])
    if not isinstance(obj["pipelines"], list) or not all(
            isinstance(c, list) for c in obj["pipelines"]):
        raise UserError("plan.pipelines: expected a list of device-id lists (one per replica)")
    for key in ("predicted", "search"):
        if not isinstance(obj.get(key, {}), dict):
            raise UserError(f"plan.{key}: expected an object, got {checks.shown(obj[key])}")
    sync_raw = obj.get("sync", {})
    if not isinstance(sync_raw, dict):
        raise UserError("plan.sync: expected an object")
    known = set(SyncConfig.__dataclass_fields__)
    unknown = set(sync_raw) - known
    if unknown:
        raise UserError(f"plan.sync: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    plan = Plan(
        cluster=_optional_text(obj, "cluster"),
        cluster_sha256=_optional_text(obj, "cluster_sha256"),
        model=checks.text(obj["model"], "plan.model", max_chars=256),
        stages=stages,
        pipelines=obj["pipelines"],
        micro_batch_size=obj.get("micro_batch_size", 1),
        num_micro_batches=obj.get("num_micro_batches", 1),
        sync=SyncConfig(**sync_raw),
        pipeline_compression=obj.get("pipeline_compression", "none"),
        predicted=dict(obj.get("predicted", {})),
        search=dict(obj.get("search", {})),
    )
    for key, value in (("num_stages", plan.num_stages), ("num_replicas", plan.num_replicas)):
        if key in obj and (type(obj[key]) is not int or obj[key] != value):
            raise UserError(f"plan.{key}: says {checks.shown(obj[key])} but the plan lists "
                            f"{value}")
    return plan


def load_plan(path: str | Path, cluster: Cluster | None = None) -> Plan:
    """Read and validate a plan file (against `cluster` when given)."""
    path = Path(path)
    obj = load_json(path, "plan file")
    try:
        plan = plan_from_dict(obj)
        validate_plan(plan, cluster)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    return plan


def save_plan(plan: Plan, path: str | Path) -> None:
    """Validate and write a plan file atomically (temp file + rename)."""
    validate_plan(plan)
    atomic_write_json(path, plan.to_dict())
