"""The plan format: which devices run which pipeline stage of which data-parallel replica.

`plan/1`: `pipelines[r][s]` is one device id. `plan/2` (hierarchical replicas, issue 22) also
allows a *shard group*: `pipelines[r][s]` = a list of D device ids that hold stage s of replica
r together with FSDP2 (each keeps 1/D of the stage's parameters, gradients and optimizer
state). A plan without a shard group is written as `plan/1`, so old readers keep working; both
versions load. See docs/hierarchical.md for the semantics (lanes, per-shard outer sync).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from formats import checks
from formats.atomic_io import atomic_write_json
from formats.cluster import Cluster
from formats.errors import UserError
from formats.jsonfile import load_json
from formats.models import ModelSpec, get_model, spec_from_fields
from formats.safe_files import refuse_non_finite
from formats.sync_rules import ALLREDUCE, SyncRule, local_step_modes, sync_rule

PLAN_FORMAT = "plan/1"
"""Written when every stage is held by one device (D = 1)."""
PLAN_FORMAT_SHARDED = "plan/2"
"""Written when a stage is held by a shard group; adds `reshard_after_forward` and
`outer_state`."""
PLAN_FORMATS = (PLAN_FORMAT, PLAN_FORMAT_SHARDED)
OUTER_STATES = ("device", "host")
"""Where DiLoCo's anchor parameters and outer momentum (per shard) live."""
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
MAX_WORLD_SIZE = 65536
"""Most ranks one run may have: each is a process and a client of one TCPStore, and the
plan lists each device (2^31 ranks would be built for hours and never meet)."""


@dataclass
class SyncConfig:
    """How the replicas of a stage keep their parameters in step."""

    mode: str = ALLREDUCE.name
    """A registered sync rule (formats/sync_rules.py): `allreduce` averages gradients every
    step; `diloco` takes an outer step every `inner_steps`."""
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
    warmup_steps: int = 0
    """DiLoCo: W steps of gradient all-reduce (every step, as mode allreduce) before the first
    inner step; the outer optimizer starts from the weights at step W (docs/bad_links.md). A
    fresh model needs it: DiLoCo from step 0 ends far behind all-reduce."""

    def to_dict(self) -> dict[str, Any]:
        """The plan's `sync` object; `warmup_steps` only when set, so a plan without a warm-up
        stays readable by readers that predate the field."""
        out = asdict(self)
        if not self.warmup_steps:
            del out["warmup_steps"]
        return out

    @property
    def rule(self) -> SyncRule:
        """The registered rule `mode` names (UserError naming sync.mode when none does)."""
        return sync_rule(self.mode)

    def validate(self) -> None:
        """Raise UserError on a bad field."""
        local = self.rule.local_steps
        if self.compression not in COMPRESSIONS:
            raise UserError(
                f"sync.compression: {self.compression!r} is not one of {', '.join(COMPRESSIONS)}")
        checks.integer(self.inner_steps, "sync.inner_steps", 1, MAX_INNER_STEPS)
        if not local and self.inner_steps != 1:
            raise UserError(f"sync.inner_steps: {self.inner_steps} only makes sense with mode "
                            f"{local_step_modes()}")
        checks.finite_number(self.outer_lr, "sync.outer_lr", 0, lo_open=True)
        checks.finite_number(self.outer_momentum, "sync.outer_momentum", 0, 1, hi_open=True)
        if not isinstance(self.overlap, bool):
            raise UserError(
                f"sync.overlap: expected true or false, got {checks.shown(self.overlap)}")
        checks.integer(self.fragments, "sync.fragments", 1, MAX_FRAGMENTS)
        checks.integer(self.warmup_steps, "sync.warmup_steps", 0, MAX_INNER_STEPS)
        if not local and self.warmup_steps:
            raise UserError(f"sync.warmup_steps: {self.warmup_steps} only applies to mode "
                            f"{local_step_modes()} (mode {self.mode!r} all-reduces every step "
                            "anyway)")
        if not local and (self.overlap or self.fragments != 1):
            raise UserError(f"sync.overlap and sync.fragments only apply to mode "
                            f"{local_step_modes()} (mode is {self.mode!r})")
        if self.fragments > self.inner_steps:
            raise UserError(f"sync.fragments: {self.fragments} fragments need at least as many "
                            f"inner steps per round (sync.inner_steps is {self.inner_steps})")


class Place(NamedTuple):
    """Where a device sits in a plan."""

    replica: int
    stage: int
    shard: int
    """Index of the device in its shard group (0 when D = 1)."""


Entry = int | list[int]
"""`pipelines[r][s]`: one device id (D = 1) or a shard group of D device ids."""


def as_group(entry: Entry) -> list[int]:
    """A `pipelines[r][s]` entry as its list of device ids (one id -> [id])."""
    return list(entry) if isinstance(entry, list) else [entry]


@dataclass
class Plan:
    """An assignment of pipeline stages x data-parallel replicas to device ids (or to shard
    groups of device ids: see the module docstring)."""

    cluster: str
    """Name of the cluster the plan was made for."""
    cluster_sha256: str
    """Digest of that cluster file's content (Cluster.sha256), to catch a mismatch."""
    model: str
    """Model preset name (or, with model_config, the name of the config it was made for)."""
    stages: list[tuple[int, int]]
    """Half-open layer range [start, end) of each stage; contiguous, covering the model."""
    pipelines: list[list[Entry]]
    """pipelines[r][s] = device id running stage s of replica r, or the list of D device ids
    of its shard group (FSDP2 over them; a stage's D is the same in every replica and divides
    the largest D of the plan)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch."""
    num_micro_batches: int = 1
    """Micro-batches per lane per step (global batch = replicas x L x this x micro_batch_size;
    L = the largest D of the plan's stages, 1 without shard groups)."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    pipeline_compression: str = "none"
    """How activations and activation gradients cross pipeline links: `none` (the compute
    dtype), `bf16`, or `int8` with one scale per token row."""
    predicted: dict[str, Any] = field(default_factory=dict)
    """What the planner predicted: objective, cost (s) and its parts."""
    search: dict[str, Any] = field(default_factory=dict)
    """How the plan was found: method, seed, evaluations, wall_s."""
    reshard_after_forward: bool = True
    """Shard groups: FSDP2 frees each block's gathered parameters after its forward and
    gathers them again for the backward (less memory, one more all-gather per micro-batch);
    false keeps the stage's parameters gathered from the first forward to the last backward
    of a step (one all-gather and one reduce-scatter per step)."""
    outer_state: str = "device"
    """DiLoCo with shard groups: where the planner assumed each shard's anchor and outer
    momentum live (`device` or `host`); the runner's `--outer-state` decides at run time."""
    model_config: dict[str, Any] | None = None
    """The model's fields (ModelSpec.fields) when it came from a config.json rather than a
    preset: what the runner builds and checks its --model against (None: the preset)."""

    def model_spec(self) -> ModelSpec:
        """The model the plan was made for: its recorded config, else the preset."""
        if self.model_config is None:
            return get_model(self.model)
        return spec_from_fields(self.model_config, "plan.model_config")

    @property
    def num_stages(self) -> int:
        """Pipeline depth S."""
        return len(self.stages)

    @property
    def num_replicas(self) -> int:
        """Data-parallel width R."""
        return len(self.pipelines)

    @property
    def is_sharded(self) -> bool:
        """Whether any stage is held by a shard group (written as plan/2)."""
        return any(isinstance(e, list) for chain in self.pipelines for e in chain)

    def shard_group(self, replica: int, stage: int) -> list[int]:
        """Device ids holding `stage` of `replica`, in shard order ([id] when D = 1)."""
        return as_group(self.pipelines[replica][stage])

    def shard_degree(self, stage: int) -> int:
        """D of a stage (the same in every replica once validated)."""
        return len(self.shard_group(0, stage))

    def shard_degrees(self) -> list[int]:
        """D of every stage."""
        return [self.shard_degree(s) for s in range(self.num_stages)]

    def shard_peers(self, stage: int, shard: int) -> list[int]:
        """Device `shard` of `stage` in every replica, by replica: the group that averages that
        shard across replicas (the per-shard outer sync, or the per-step all-reduce)."""
        return [self.shard_group(r, stage)[shard] for r in range(self.num_replicas)]

    @property
    def lanes_per_replica(self) -> int:
        """L = the largest D of any stage: a replica runs L lanes (1 without shard groups)."""
        return max(self.shard_degrees(), default=1)

    def lane_device(self, replica: int, stage: int, lane: int) -> int:
        """The device of `stage` that runs lane `lane` (0..L-1) of `replica`: the L lanes are
        cut into D equal blocks, device i of a stage of D devices runs block i."""
        group = self.shard_group(replica, stage)
        return group[lane * len(group) // self.lanes_per_replica]

    def lanes(self) -> list[list[int]]:
        """The chains that run micro-batches: lane r*L + i runs through
        `lane_device(r, s, i)` of every stage (with the same D everywhere: device i of every
        stage). Equal to `pipelines` when D = 1."""
        lanes = self.lanes_per_replica
        return [[self.lane_device(r, s, i) for s in range(self.num_stages)]
                for r in range(self.num_replicas) for i in range(lanes)]

    def lanes_of(self, device_id: int) -> list[int]:
        """The lanes (global indices r*L + i) a device runs, ascending: L / D of them."""
        place = self.locate(device_id)
        lanes, degree = self.lanes_per_replica, self.shard_degree(place.stage)
        per = lanes // degree
        return [place.replica * lanes + place.shard * per + k for k in range(per)]

    def locate(self, device_id: int) -> Place:
        """(replica, stage, shard index) of a device; UserError when it is not in the plan."""
        for r, chain in enumerate(self.pipelines):
            for s, entry in enumerate(chain):
                group = as_group(entry)
                if device_id in group:
                    return Place(r, s, group.index(device_id))
        raise UserError(f"rank {device_id} is not in the plan (devices: {sorted(self.devices())})")

    def stage_of(self, device_id: int) -> tuple[int, int]:
        """(replica, stage) of a device; UserError when the device is not in the plan."""
        place = self.locate(device_id)
        return place.replica, place.stage

    def devices(self) -> list[int]:
        """All device ids used by the plan."""
        return [d for chain in self.pipelines for e in chain for d in as_group(e)]

    def to_dict(self) -> dict[str, Any]:
        """The plan's JSON object: `plan/1` without shard groups, else `plan/2`."""
        out = {
            "format": PLAN_FORMAT_SHARDED if self.is_sharded else PLAN_FORMAT,
            "cluster": self.cluster,
            "cluster_sha256": self.cluster_sha256,
            "model": self.model,
            "num_stages": self.num_stages,
            "num_replicas": self.num_replicas,
            "micro_batch_size": self.micro_batch_size,
            "num_micro_batches": self.num_micro_batches,
            "stages": [{"layers": [a, b]} for a, b in self.stages],
            "pipelines": [[[int(d) for d in e] if isinstance(e, list) else int(e)
                           for e in chain] for chain in self.pipelines],
            "sync": self.sync.to_dict(),
            "pipeline_compression": self.pipeline_compression,
            "predicted": self.predicted,
            "search": self.search,
        }
        if self.model_config is not None:
            out["model_config"] = self.model_config
        if self.is_sharded:
            out.update(reshard_after_forward=self.reshard_after_forward,
                       outer_state=self.outer_state)
        return out


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
    seen = _check_devices(plan)
    for name in ("micro_batch_size", "num_micro_batches"):
        checks.integer(getattr(plan, name), f"plan.{name}", 1, MAX_BATCH_COUNT)
    plan.sync.validate()
    if plan.pipeline_compression not in PIPELINE_COMPRESSIONS:
        raise UserError(f"plan.pipeline_compression: {checks.shown(plan.pipeline_compression)} "
                        f"is not one of {', '.join(PIPELINE_COMPRESSIONS)}")
    if not isinstance(plan.reshard_after_forward, bool):
        raise UserError(f"plan.reshard_after_forward: expected true or false, got "
                        f"{checks.shown(plan.reshard_after_forward)}")
    if plan.outer_state not in OUTER_STATES:
        raise UserError(f"plan.outer_state: {checks.shown(plan.outer_state)} is not one of "
                        f"{', '.join(OUTER_STATES)}")
    model = model or plan.model_spec()
    if plan.model_config is not None and model.name != plan.model:
        raise UserError(f"plan.model_config.name: {model.name!r} differs from plan.model "
                        f"{plan.model!r}")
    _check_layers(plan.stages, model)
    _check_shard_degrees(plan, model)
    if cluster is not None:
        bad = [d for d in seen if not 0 <= d < cluster.num_devices]
        if bad:
            raise UserError(
                f"pipelines: device ids {sorted(bad)} are not in cluster '{cluster.name}' "
                f"(ids 0..{cluster.num_devices - 1}); was the plan made for another cluster?")


def _check_devices(plan: Plan) -> dict[int, tuple[int, int]]:
    """Every entry an id or a non-empty list of ids, no device twice; {device: (r, s)}."""
    seen: dict[int, tuple[int, int]] = {}
    for r, chain in enumerate(plan.pipelines):
        for s, entry in enumerate(chain):
            where = f"pipelines[{r}][{s}]"
            if isinstance(entry, list) and not entry:
                raise UserError(f"{where}: empty shard group; list at least one device id")
            for dev in as_group(entry):
                checks.integer(dev, f"{where}: device id", 0, MAX_DEVICE_ID)
                if dev in seen:
                    raise UserError(f"{where}: device {dev} appears twice "
                                    f"(also pipelines[{seen[dev][0]}][{seen[dev][1]}])")
                seen[dev] = (r, s)
    return seen


def _check_shard_degrees(plan: Plan, model: ModelSpec) -> None:
    """Same D for a stage in every replica, every stage's D dividing the largest (lanes), the
    same D on the first and last stage with tied embeddings, D <= the model's shard limit."""
    lanes = plan.lanes_per_replica
    for s in range(plan.num_stages):
        degree = plan.shard_degree(s)
        for r in range(1, plan.num_replicas):
            other = len(plan.shard_group(r, s))
            if other != degree:
                raise UserError(
                    f"pipelines[{r}][{s}]: shard group of {other} devices but replica 0 holds "
                    f"stage {s} with {degree}; a stage's shard groups must have the same D in "
                    f"every replica (device i of each averages the same shard)")
        if lanes % degree:
            raise UserError(
                f"pipelines[0][{s}]: stage {s} has D = {degree}, which does not divide the "
                f"largest D = {lanes} of the plan; each device of a stage runs L / D of the "
                f"replica's L = {lanes} lanes, so every stage's D must divide L")
    first, last = plan.shard_degree(0), plan.shard_degree(plan.num_stages - 1)
    if model.tie_embeddings and plan.num_stages > 1 and first != last:
        raise UserError(
            f"pipelines: stage 0 has D = {first} but the last stage has D = {last}; "
            f"{model.name} ties its embeddings, whose two copies (first and last stage) are "
            f"summed shard by shard, so both stages need the same D")
    limit = model.shard_limit()
    if lanes > limit:
        raise UserError(
            f"pipelines: D = {lanes} devices per shard group, but {model.name}'s "
            f"smallest parameter has {limit} rows along dim 0 (FSDP2 shards each parameter "
            f"along dim 0); use at most {limit} devices per shard group")


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
    """Parse a `plan/1` or `plan/2` object (structure only; validate_plan checks the rest)."""
    if not isinstance(obj, dict):
        raise UserError(f"plan: expected a JSON object, got {type(obj).__name__}")
    if obj.get("format") not in PLAN_FORMATS:
        raise UserError(f"plan.format: expected one of {', '.join(PLAN_FORMATS)}, got "
                        f"{checks.shown(obj.get('format'))}")
    for key in ("model", "stages", "pipelines"):
        if key not in obj:
            raise UserError(f"plan: missing key '{key}'")
    stages = _parse_stages(obj["stages"])
    if not isinstance(obj["pipelines"], list) or not all(
            isinstance(c, list) for c in obj["pipelines"]):
        raise UserError("plan.pipelines: expected a list of device-id lists (one per replica)")
    sharded = any(isinstance(e, list) for c in obj["pipelines"] for e in c)
    if sharded and obj["format"] != PLAN_FORMAT_SHARDED:
        raise UserError(f"plan.pipelines: shard groups (lists of device ids) need format "
                        f"'{PLAN_FORMAT_SHARDED}', the file says {checks.shown(obj['format'])}")
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
        reshard_after_forward=obj.get("reshard_after_forward", True),
        outer_state=obj.get("outer_state", "device"),
        model_config=obj.get("model_config"),
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
    obj = plan.to_dict()
    refuse_non_finite(obj, f"plan {path}")  # NaN/Infinity: JSON other tools cannot read
    atomic_write_json(path, obj)
