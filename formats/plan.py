"""The `plan/1` format: which device runs which pipeline stage of which data-parallel replica."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from formats.atomic_io import atomic_write_json
from formats.cluster import Cluster
from formats.errors import UserError
from formats.models import ModelSpec, get_model

PLAN_FORMAT = "plan/1"
SYNC_MODES = ("allreduce", "diloco")
COMPRESSIONS = ("none", "fp16", "int8")


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

    def validate(self) -> None:
        """Raise UserError on a bad field."""
        if self.mode not in SYNC_MODES:
            raise UserError(f"sync.mode: {self.mode!r} is not one of {', '.join(SYNC_MODES)}")
        if self.compression not in COMPRESSIONS:
            raise UserError(
                f"sync.compression: {self.compression!r} is not one of {', '.join(COMPRESSIONS)}")
        if isinstance(self.inner_steps, bool) or not isinstance(self.inner_steps, int) \
                or self.inner_steps < 1:
            raise UserError(f"sync.inner_steps: must be an integer >= 1, got {self.inner_steps!r}")
        if self.mode == "allreduce" and self.inner_steps != 1:
            raise UserError(
                f"sync.inner_steps: {self.inner_steps} only makes sense with mode 'diloco'")
        lr, mom = self.outer_lr, self.outer_momentum
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
            raise UserError(f"sync.outer_lr: must be a number > 0, got {lr!r}")
        if isinstance(mom, bool) or not isinstance(mom, (int, float)) or not 0 <= mom < 1:
            raise UserError(f"sync.outer_momentum: must be a number in [0, 1), got {mom!r}")


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
            if isinstance(dev, bool) or not isinstance(dev, int):
                raise UserError(f"pipelines[{r}][{s}]: expected a device id, got {dev!r}")
            if dev in seen:
                raise UserError(f"pipelines[{r}][{s}]: device {dev} appears twice "
                                f"(also pipelines[{seen[dev][0]}][{seen[dev][1]}])")
            seen[dev] = (r, s)
    for name in ("micro_batch_size", "num_micro_batches"):
        value = getattr(plan, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"plan.{name}: must be an integer >= 1, got {value!r}")
    plan.sync.validate()
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


def plan_from_dict(obj: Any) -> Plan:
    """Parse a `plan/1` object (structure only; call validate_plan for the full check)."""
    if not isinstance(obj, dict):
        raise UserError(f"plan: expected a JSON object, got {type(obj).__name__}")
    if obj.get("format") != PLAN_FORMAT:
        raise UserError(f"plan.format: expected '{PLAN_FORMAT}', got {obj.get('format')!r}")
    for key in ("model", "stages", "pipelines"):
        if key not in obj:
            raise UserError(f"plan: missing key '{key}'")
    try:
        stages = [(int(st["layers"][0]), int(st["layers"][1])) for st in obj["stages"]]
    except (TypeError, KeyError, IndexError, ValueError):
        raise UserError("plan.stages: expected a list of {\"layers\": [start, end]}") from None
    if not isinstance(obj["pipelines"], list) or not all(
            isinstance(c, list) for c in obj["pipelines"]):
        raise UserError("plan.pipelines: expected a list of device-id lists (one per replica)")
    for key in ("predicted", "search"):
        if not isinstance(obj.get(key, {}), dict):
            raise UserError(f"plan.{key}: expected an object, got {obj[key]!r}")
    sync_raw = obj.get("sync", {})
    if not isinstance(sync_raw, dict):
        raise UserError("plan.sync: expected an object")
    known = set(SyncConfig.__dataclass_fields__)
    unknown = set(sync_raw) - known
    if unknown:
        raise UserError(f"plan.sync: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    plan = Plan(
        cluster=str(obj.get("cluster", "")),
        cluster_sha256=str(obj.get("cluster_sha256", "")),
        model=str(obj["model"]),
        stages=stages,
        pipelines=obj["pipelines"],
        micro_batch_size=obj.get("micro_batch_size", 1),
        num_micro_batches=obj.get("num_micro_batches", 1),
        sync=SyncConfig(**sync_raw),
        predicted=dict(obj.get("predicted", {})),
        search=dict(obj.get("search", {})),
    )
    for key, value in (("num_stages", plan.num_stages), ("num_replicas", plan.num_replicas)):
        if key in obj and obj[key] != value:
            raise UserError(f"plan.{key}: says {obj[key]!r} but the plan lists {value}")
    return plan


def load_plan(path: str | Path, cluster: Cluster | None = None) -> Plan:
    """Read and validate a plan file (against `cluster` when given)."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
    except OSError as e:
        raise UserError(f"cannot read plan file {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
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
