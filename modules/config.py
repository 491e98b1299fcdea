"""The runtime's settings: one small dataclass per component, validated where it is defined.

Each field is one `dist_runner.py` flag, declared with formats.settings.setting: the flag is
`--` + the field name with dashes (or its `flag=`), its help text is the docstring written under
the field, its default the field's default, its range or choices the setting's rule.
`modules.cli_config` turns these classes into argparse flags and back, so a setting is written
once. `__post_init__` checks every field's rule (formats.settings.check, UserError naming the
flag) and what a field cannot check alone. `RunConfig.resolve` applies the flags to the plan
once, checks what needs the plan, and returns the frozen `ResolvedRun` that dist_runner passes
down.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from formats.addresses import tcp_url
from formats.atomic_io import check_output_dir, check_output_path
from formats.errors import UserError
from formats.plan import MAX_DEVICE_ID, MAX_WORLD_SIZE, PIPELINE_COMPRESSIONS, Plan
from formats.settings import MAX_COUNT, MAX_SECONDS, MAX_SEED, check, flag_of, setting
from formats.sync_rules import sync_modes
from modules.debug_config import DebugConfig
from modules.metrics_config import MetricsConfig
from scheduler.quick_plan import OVERRIDE_FLAGS, override_attr, with_overrides

__all__ = ["MAX_COUNT", "MAX_SECONDS", "MAX_SEED", "DebugConfig", "MetricsConfig",
           "flag_of"]  # re-exported
MIN_TIMEOUT_S = 1.0
"""Shortest --timeout-s: a rendezvous and a first step take longer than that anyway."""
MAX_THREADS = 1024
MAX_CUDA_DEVICE = 1023
DEVICE_CHOICES = ("auto", "cpu", "cuda")
"""--device (modules/device/select.py resolves auto)."""
COMM_BACKENDS = ("auto", "gloo", "nccl")
"""--comm (modules/comm/choice.py resolves auto per group)."""
PRECISIONS = ("fp32", "bf16", "fp16")
"""--precision (modules/device/precision.py)."""


@dataclass(frozen=True)
class OptimConfig:
    """The inner optimizer (AdamW) and its learning-rate schedule."""

    lr: float = setting(1e-3, lo=0.0, lo_open=True)
    """AdamW (inner) learning rate"""
    weight_decay: float = setting(0.1, lo=0.0)
    """AdamW weight decay"""
    warmup_steps: int = setting(0, lo=0, hi=MAX_COUNT)
    """linear learning-rate warm-up from lr/warmup_steps to lr over this many steps"""
    lr_schedule: str = setting("constant", choices=("constant", "cosine"))
    """after warm-up: constant, or cosine decay to min_lr_ratio x lr at --steps"""
    min_lr_ratio: float = setting(0.1, lo=0.0, hi=1.0)
    """where the cosine schedule ends, as a fraction of --lr"""

    def __post_init__(self) -> None:
        check(self, flag_of)


@dataclass(frozen=True)
class CheckpointConfig:
    """Per-rank checkpoints: where, how often, how many, and whether to resume from them."""

    dir: str | None = setting(None, flag="--ckpt-dir")
    """folder for per-rank checkpoints (rank{R}/step{S}.pt), written in the background from a
    memory snapshot (temp file + rename)"""
    every: int = setting(0, flag="--ckpt-every", lo=0, hi=MAX_COUNT)
    """save every K steps and at the end (default with --ckpt-dir: only at the end)"""
    keep: int = setting(2, flag="--keep-checkpoints", lo=1, hi=MAX_COUNT)
    """complete checkpoints kept per rank, newest first"""
    sync: bool = setting(False, flag="--sync-checkpoints")
    """write checkpoints on the training thread (slower; for comparison)"""
    on_error: str = setting("stop", flag="--on-checkpoint-error", choices=("stop", "continue"))
    """a checkpoint that cannot be written, also on a retry (full disk, read-only folder, I/O
    error): stop every rank (exit 1, naming the path, the reason and the step --resume restarts
    from), or warn and train on without it"""
    resume: bool = False
    """continue from the newest step of --ckpt-dir that every rank has completely written"""
    init_from: str | None = None
    """start from pretrained weights: a folder with config.json and *.safetensors (sharded
    index included), e.g. scripts/export_hf.py's output or a Hugging Face LLaMA/GPT-2 model;
    each rank reads its own stage's tensors; its tokenizer.json is used when --tokenizer is
    not given (--resume's checkpoint wins over it)"""

    def __post_init__(self) -> None:
        check(self, flag_of)
        if self.resume and not self.dir:
            raise UserError("--resume needs --ckpt-dir")

    def interval(self, steps: int) -> int:
        """Steps between checkpoints (0: none); with a folder and no --ckpt-every, the end."""
        if not self.dir:
            return 0
        return self.every or steps


@dataclass(frozen=True)
class ElasticConfig:
    """Failure detection and membership: heartbeats, replicas that start, join and leave."""

    heartbeat_timeout_s: float = setting(5.0, lo=0.0, lo_open=True, hi=MAX_SECONDS)
    """a peer whose heartbeat (every ~1 s through the rendezvous store) is older than this is
    gone: allreduce stops (checkpoint, exit 1), DiLoCo drops its replica and goes on; also how
    long the store may stay silent"""
    min_replicas: int | None = setting(None, lo=1, hi=MAX_COUNT)
    """DiLoCo: stop (checkpoint, exit 1) when fewer replicas are alive (default: 2, or 1 for a
    one-replica plan)"""
    replicas: str | None = None
    """DiLoCo: comma-separated replicas of the plan that start now (default all); the others
    can be added later with --join"""
    join: bool = False
    """DiLoCo: join a running job: fetch the outer model and momentum of my stage from a live
    peer and take part from the next outer step"""
    wait_for_peers: bool = False
    """DiLoCo: wait (and log) for a missing peer at an outer step instead of failing"""

    def __post_init__(self) -> None:
        check(self, flag_of)
        # parsed once; frozen, so set past __setattr__ (not a field: no flag, not compared)
        object.__setattr__(self, "_start", None if self.replicas is None
                           else self._parse_replicas())

    def _parse_replicas(self) -> tuple[int, ...]:
        spec = self.replicas or ""
        try:
            out = tuple(sorted({int(v) for v in spec.split(",") if v.strip()}))
        except ValueError:
            raise UserError(f"--replicas: expected comma-separated numbers, got {spec!r}") \
                from None
        if not out or min(out) < 0:
            raise UserError(f"--replicas: expected replica numbers >= 0, got {spec!r}")
        return out

    def start_replicas(self, num_replicas: int) -> tuple[int, ...] | None:
        """Replicas that start now (None: all of the plan's)."""
        out: tuple[int, ...] | None = self._start  # type: ignore[attr-defined]
        if out is None:
            return None
        if max(out) >= num_replicas:
            raise UserError(f"--replicas: must name replicas 0..{num_replicas - 1}, got "
                            f"{self.replicas!r}")
        return out

    def resolved_min_replicas(self, starting: int) -> int:
        """--min-replicas, or its default (2, or 1 when fewer replicas start)."""
        return self.min_replicas if self.min_replicas is not None else min(2, starting)


@dataclass(frozen=True)
class DataConfig:
    """Training text and validation."""

    data: str | None = None
    """comma-separated text/.jsonl/.parquet files, folders or (quoted) globs (default:
    /usr/share/games/fortunes, Debian's fortunes packages)"""
    tokenizer: str | None = None
    """`bytes` (vocab 256) or a local Hugging Face tokenizer.json (scripts/train_tokenizer.py
    makes one); the model's embedding and head get its vocab_size (default: the --init-from
    folder's tokenizer.json, else bytes)"""
    text_field: str = "text"
    """the text field of .jsonl records and text column of .parquet files"""
    token_cache: str | None = None
    """folder of the tokenized-corpus cache, shared by runs and ranks (default:
    ~/.cache/scattered-train/tokens)"""
    fake_data: bool = False
    """seeded random tokens instead of text (speed tests)"""
    eval_every: int = setting(0, lo=0, hi=MAX_COUNT)
    """validation loss every K steps (0: only at the end when --eval-sequences > 0)"""
    eval_sequences: int = setting(0, lo=0, hi=MAX_COUNT)
    """validation sequences per evaluation (0: none)"""
    stop_at_loss: float | None = setting(None, lo=0.0, hi=MAX_COUNT)
    """end the run at the first evaluation (every --eval-every steps) whose validation loss is
    at or below this: every rank stops after that step as if it were --steps (final checkpoint,
    metrics record marked stopped_at_loss); the lowest live replica's loss decides
    (docs/runtime.md)"""
    min_steps: int = setting(0, lo=0, hi=MAX_COUNT)
    """with --stop-at-loss: train at least this many steps (an evaluation before step N does
    not stop the run)"""

    def __post_init__(self) -> None:
        check(self, flag_of)
        if self.data is not None and self.fake_data:
            raise UserError("--data and --fake-data exclude each other: pick one")
        if self.data is not None and not self.data.strip(" ,"):
            raise UserError(f"--data: names no file, folder or glob, got {self.data!r}; leave "
                            "--data out for the default corpus")
        if self.tokenizer is not None and not self.tokenizer:
            raise UserError("--tokenizer: must be `bytes` or a tokenizer.json path, got ''")
        if not self.text_field:
            raise UserError("--text-field: must name a field, got ''")
        self._check_stop_at_loss()

    def _check_stop_at_loss(self) -> None:
        """--stop-at-loss needs evaluations to decide at; --min-steps needs --stop-at-loss."""
        if self.stop_at_loss is None:
            if self.min_steps:
                raise UserError(f"--min-steps {self.min_steps}: only applies with "
                                "--stop-at-loss; drop it or give --stop-at-loss LOSS")
            return
        for flag, value in (("--eval-every", self.eval_every),
                            ("--eval-sequences", self.eval_sequences)):
            if not value:
                raise UserError(f"--stop-at-loss: needs {flag} > 0 (the run stops at an "
                                f"evaluation of the validation loss); give {flag} N")




@dataclass(frozen=True)
class DeviceConfig:
    """Where this rank computes, in which precision, and how its groups communicate."""

    device: str = setting("auto", choices=DEVICE_CHOICES)
    """where the model, optimizer state and activations live (auto: CUDA when available)"""
    cuda_device: int | None = setting(None, lo=0, hi=MAX_CUDA_DEVICE)
    """CUDA device index (default: $LOCAL_RANK under torchrun, else 0)"""
    comm: str = setting("auto", choices=COMM_BACKENDS)
    """collective backend per group (auto: NCCL for a group of CUDA ranks on distinct GPUs,
    gloo otherwise; gloo stages CUDA tensors through pinned host memory)"""
    precision: str = setting("fp32", choices=PRECISIONS)
    """compute precision of forward/backward (fp32 master weights and optimizer state;
    fp16 with a gradient scaler, CUDA only); pipeline activations cross links in it unless
    --pipeline-compression says otherwise"""
    pipeline_compression: str | None = setting(None, choices=PIPELINE_COMPRESSIONS)
    """how activations and their gradients cross pipeline links: none (the --precision dtype),
    bf16, or int8 with one fp32 scale per token row (default: the plan's pipeline_compression)"""
    reshard_after_forward: str = setting("plan", choices=("plan", "on", "off"))
    """shard groups: free a block's gathered parameters after its forward (on) or keep them
    until its backward (off; more memory, one all-gather less); default: the plan's"""
    compile: bool = False
    """torch.compile each stage's module"""
    threads: int = setting(0, lo=0, hi=MAX_THREADS)
    """torch CPU threads (0: torch's default)"""

    def __post_init__(self) -> None:
        check(self, flag_of)

    def resolved_pipeline_compression(self, plan: Plan) -> str:
        """--pipeline-compression, else the plan's pipeline_compression."""
        return self.pipeline_compression or plan.pipeline_compression

    def resolved_reshard(self, plan: Plan) -> bool:
        """--reshard-after-forward on/off, else the plan's reshard_after_forward."""
        return plan.reshard_after_forward if self.reshard_after_forward == "plan" \
            else self.reshard_after_forward == "on"


@dataclass(frozen=True)
class OuterSyncConfig:
    """DiLoCo's outer sync: overrides of the plan's sync.fragments / sync.overlap."""

    fragments: int | None = setting(None, lo=1, hi=MAX_COUNT)
    """DiLoCo: sync the stage's parameters in F contiguous fragments, each at its own step of
    the round (Streaming DiLoCo; default: the plan's sync.fragments)"""
    overlap: str = setting("plan", choices=("plan", "on", "off"))
    """DiLoCo: run the outer all-reduces in the background while the next round computes
    (on/off; default: the plan's sync.overlap)"""
    outer_state: str = setting("plan", choices=("plan", "device", "host"))
    """DiLoCo: where each rank's anchor parameters and outer momentum (of its shard) live:
    device, or host memory (default: the plan's outer_state, device unless planned)"""
    overlap_alpha: float = setting(0.5, lo=0.0, lo_open=True, hi=1.0)
    """with --overlap: params = alpha x local + (1 - alpha) x outer model when a delayed
    average is applied (Streaming DiLoCo's mixing factor; > 0: the next pseudo-gradient is
    taken after the merge, so alpha 0 would send zeros)"""

    def __post_init__(self) -> None:
        check(self, flag_of)

    def resolved_outer_state(self, plan: Plan) -> str:
        """--outer-state device/host, else the plan's outer_state."""
        return plan.outer_state if self.outer_state == "plan" else self.outer_state

    def apply(self, plan: Plan) -> Plan:
        """The plan with these overrides in its sync config (checked like a plan's)."""
        sync = plan.sync
        fragments = sync.fragments if self.fragments is None else self.fragments
        overlap = sync.overlap if self.overlap == "plan" else self.overlap == "on"
        if (fragments, overlap) == (sync.fragments, sync.overlap):
            return plan
        if not sync.rule.local_steps:
            raise UserError(f"--fragments/--overlap: only apply to sync mode diloco (the plan's "
                            f"is {sync.mode!r})")
        if not 1 <= fragments <= sync.inner_steps:
            raise UserError(f"--fragments: must be between 1 and the plan's sync.inner_steps "
                            f"{sync.inner_steps}, got {fragments}")
        return dataclasses.replace(plan, sync=dataclasses.replace(sync, fragments=fragments,
                                                                  overlap=overlap))


@dataclass(frozen=True)
class HivemindConfig:
    """DiLoCo's outer sync backend: the run's store, or hivemind over a DHT (docs/hivemind.md)."""

    outer_backend: str = setting("store", choices=("store", "hivemind"))
    """store: the stage groups average through torch.distributed and the rendezvous store;
    hivemind: through a hivemind averager over a DHT (no central store; each replica has its
    own --dist-url store for its pipeline)"""
    initial_peers: str | None = None
    """hivemind: comma-separated multiaddresses of DHT nodes to join through (what another
    replica or scripts/dht_node.py printed; none: this replica is a first node)"""
    host_maddrs: str | None = None
    """hivemind: multiaddresses this replica's DHT node listens on (default: this host's
    loopback, /ip4/127.0.0.1/tcp/0, when every --initial-peers is on it; else every interface,
    /ip4/0.0.0.0/tcp/0; a free port)"""
    announce_maddrs: str | None = None
    """hivemind: multiaddresses to announce instead of the listening ones (a public address
    in front of a NAT or port forward)"""
    client_mode: bool = False
    """hivemind: this replica accepts no incoming connections (behind a NAT): it sends its
    part and receives the average through peers that do"""
    run_id: str | None = None
    """hivemind: the id the replicas of one run share (default: a hash of the plan and the
    payload, so the same plan file agrees by itself)"""
    matchmaking_timeout_s: float | None = setting(None, lo=0.0, lo_open=True, hi=MAX_SECONDS)
    """hivemind: longest wait for an outer round's group to form (default: from the plan,
    see docs/hivemind.md)"""
    averaging_timeout_s: float | None = setting(None, lo=0.0, lo_open=True, hi=MAX_SECONDS)
    """hivemind: longest outer all-reduce once the group formed (default: from the plan)"""

    def __post_init__(self) -> None:
        check(self, flag_of)
        used = [flag_of(HivemindConfig, n) for n in ("initial_peers", "host_maddrs",
                                                      "announce_maddrs", "run_id")
                if getattr(self, n)] + (["--client-mode"] if self.client_mode else [])
        if used and self.outer_backend != "hivemind":
            raise UserError(f"{used[0]}: only applies with --outer-backend hivemind")
        if self.run_id is not None and not self.run_id.replace("-", "").isalnum():
            raise UserError(f"--run-id: letters, digits and dashes only, got {self.run_id!r}")
        if self.outer_backend == "hivemind":  # malformed addresses: exit 2 before any start
            from formats.addresses import parse_maddrs

            parse_maddrs(self.initial_peers, "--initial-peers")
            parse_maddrs(self.host_maddrs, "--host-maddrs", need_peer_id=False)
            parse_maddrs(self.announce_maddrs, "--announce-maddrs", need_peer_id=False)

    def check_plan(self, plan: Plan) -> None:
        """UserError for a plan (overrides applied) the hivemind backend does not run (yet)."""
        if self.outer_backend != "hivemind":
            return
        if not plan.sync.rule.local_steps:
            raise UserError("--outer-backend hivemind: needs sync mode diloco (the plan's is "
                            f"{plan.sync.mode!r}); allreduce averages every step")
        if plan.sync.fragments > 1:  # one averager round per outer step (docs/hivemind.md)
            raise UserError(f"--fragments {plan.sync.fragments}: --outer-backend hivemind "
                            "averages whole outer steps only; pass --fragments 1 or use "
                            "--outer-backend store")
        if plan.sync.warmup_steps:  # the warm-up all-reduces gradients over the run's store
            raise UserError("--outer-backend hivemind: not with a DiLoCo warm-up "
                            f"(sync.warmup_steps {plan.sync.warmup_steps}) yet; pass "
                            "--sync-warmup-steps 0 or use --outer-backend store")


@dataclass(frozen=True)
class PlanOverrideConfig:
    """Overrides of the plan's sync and batch (the seed projects' flags, docs/models.md; every
    rank must give the same, which the ranks check through the store)."""

    sync: str | None = setting(None, choices=sync_modes())
    """data-parallel sync: allreduce (gradients every step) or diloco (outer step every
    --inner-steps; default: the plan's sync.mode)"""
    inner_steps: int | None = setting(None, lo=1, hi=MAX_COUNT)
    """DiLoCo: inner steps H between outer steps (default: the plan's sync.inner_steps)"""
    outer_lr: float | None = setting(None, lo=0.0, lo_open=True, hi=MAX_COUNT)
    """DiLoCo: outer Nesterov SGD learning rate (default: the plan's sync.outer_lr)"""
    outer_momentum: float | None = setting(None, lo=0.0, hi=0.999999)
    """DiLoCo: outer Nesterov momentum (default: the plan's sync.outer_momentum)"""
    compression: str | None = setting(None, choices=("none", "fp16", "int8"))
    """payload of the data-parallel all-reduce (default: the plan's sync.compression)"""
    sync_warmup_steps: int | None = setting(None, lo=0, hi=MAX_COUNT)
    """DiLoCo: all-reduce gradients every step for the first W steps, then DiLoCo from the
    weights at step W (docs/bad_links.md; default: the plan's sync.warmup_steps)"""
    micro_batch_size: int | None = setting(None, lo=1, hi=MAX_COUNT)
    """sequences per micro-batch (default: the plan's micro_batch_size)"""
    total_batch_size: int | None = setting(None, lo=1, hi=MAX_COUNT)
    """sequences per step over all replicas: sets the micro-batches per replica to
    total / (replicas x micro-batch size), refused when that does not divide (default: the
    plan's)"""

    def __post_init__(self) -> None:
        check(self, flag_of)

    def sync_fields(self) -> dict[str, object]:
        """The SyncConfig fields these override (None: keep the plan's)."""
        return {name: getattr(self, override_attr(flag)) for name, flag in OVERRIDE_FLAGS.items()}

    def given(self) -> bool:
        """Whether any override is given (else the plan runs as it is)."""
        return any(v is not None for v in dataclasses.asdict(self).values())

    def apply(self, plan: Plan) -> Plan:
        """The plan with these sync and batch overrides, checked like a plan file
        (scheduler.quick_plan.with_overrides; the plan itself when none is given)."""
        if not self.given():
            return plan
        return with_overrides(plan, self.sync_fields(), self.micro_batch_size,
                              self.total_batch_size)


DEFAULT_STEPS = 1000
"""--steps when not given (a short run; long runs say how long)."""


@dataclass(frozen=True)
class RunConfig:
    """What a rank's run does besides the plan: the run's own settings and one config per
    component."""

    steps: int = setting(DEFAULT_STEPS, lo=1, hi=MAX_COUNT)
    """train until this step (total)"""
    seed: int = setting(0, lo=0, hi=MAX_SEED)
    """initialisation and data-order seed"""
    timeout_s: float = setting(60.0, lo=MIN_TIMEOUT_S, hi=MAX_SECONDS)
    """how long any wait on a peer or the rendezvous may take (seconds, >= 1: below a second no
    rendezvous can finish)"""
    log_every: int = setting(1, lo=1, hi=MAX_COUNT)
    """print a progress line every K steps"""
    optim: OptimConfig = field(default_factory=OptimConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    data: DataConfig = field(default_factory=DataConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    outer: OuterSyncConfig = field(default_factory=OuterSyncConfig)
    overrides: PlanOverrideConfig = field(default_factory=PlanOverrideConfig)
    hivemind: HivemindConfig = field(default_factory=HivemindConfig)

    def __post_init__(self) -> None:
        check(self, flag_of)
        if self.data.min_steps > self.steps:
            raise UserError(f"--min-steps {self.data.min_steps}: more than --steps "
                            f"{self.steps}, so --stop-at-loss could never stop the run; lower "
                            "it or train longer")
        if self.data.stop_at_loss is not None and self.hivemind.outer_backend == "hivemind":
            raise UserError("--stop-at-loss: not with --outer-backend hivemind (each replica "
                            "has its own store, so the replicas have none to agree on the step "
                            "to stop at); use --outer-backend store, or train to --steps")

    def check_paths(self) -> None:
        """The checks that need the file system: the metrics file, the run folder and the
        checkpoint folder can be written, the trackers' packages are installed (UserError
        naming the flag, before any rendezvous)."""
        if self.metrics.metrics is not None:
            check_output_path(self.metrics.metrics, "--metrics")
        if self.metrics.run_dir:
            check_output_dir(self.metrics.run_dir, "--run-dir")
        self.metrics.check_packages()
        if self.ckpt.dir:
            check_output_dir(self.ckpt.dir, "--ckpt-dir")

    def check_plan(self, plan: Plan) -> None:
        """The checks that need the plan (UserError naming the flag), without keeping the
        result: the launcher's, before any rank starts."""
        self.resolve(plan)

    def resolve(self, plan: Plan) -> ResolvedRun:
        """This rank's run: every override applied to the plan and every plan-dependent value
        resolved, once (UserError naming the flag when they do not fit the plan)."""
        plan = self.overrides.apply(plan)  # --sync, --inner-steps, ..., the batch
        el = self.elastic
        start = el.start_replicas(plan.num_replicas)
        if (el.join or start is not None) and not plan.sync.rule.local_steps:
            raise UserError("--join and --replicas need sync mode diloco (allreduce has no "
                            "slack for a replica to come and go)")
        ran = self.outer.apply(plan)  # --fragments, --overlap: on top of the above
        ran = dataclasses.replace(  # what the plan leaves to the flags' "plan" default
            ran, pipeline_compression=self.device.resolved_pipeline_compression(ran),
            reshard_after_forward=self.device.resolved_reshard(ran),
            outer_state=self.outer.resolved_outer_state(ran))
        if el.join and (ran.sync.overlap or ran.sync.fragments > 1):
            raise UserError("--join: not supported with sync.overlap or sync.fragments > 1 yet "
                            "(a joiner would need the pending rounds); use --overlap off "
                            "--fragments 1 on every rank")
        if el.join and self.ckpt.resume:
            raise UserError("--join fetches its state from a live peer; it cannot --resume")
        self.hivemind.check_plan(ran)
        _check_warmup(ran, self.steps)
        m = el.resolved_min_replicas(len(start) if start is not None else plan.num_replicas)
        if not 1 <= m <= plan.num_replicas:
            raise UserError(f"--min-replicas: must be between 1 and the plan's "
                            f"{plan.num_replicas} replicas, got {m}")
        return ResolvedRun(plan=ran, cfg=self, start_replicas=start, min_replicas=m)


def _check_warmup(plan: Plan, steps: int) -> None:
    """UserError for a DiLoCo warm-up (sync.warmup_steps) this run cannot execute."""
    w = plan.sync.warmup_steps
    if w > steps:
        raise UserError(f"sync.warmup_steps: {w} is longer than the run (--steps {steps}); "
                        "lower it (--sync-warmup-steps) or train longer")


@dataclass(frozen=True)
class LaunchTarget:
    """Where this rank's process joins the run (dist_runner.resolve_launch: flags, else
    torchrun's environment)."""

    rank: int
    """This process's device id in the plan."""
    world_size: int
    """Processes in the run."""
    url: str
    """tcp://HOST:PORT of the rendezvous store."""
    coordinator: bool
    """A coordinator process hosts the store and leads membership (--coordinator)."""
    store_elsewhere: bool
    """No rank hosts the store: a coordinator's, or torchrun's agent store."""

    @property
    def flag(self) -> str:
        """The flag that gave `url` (named in errors about it)."""
        return "--coordinator" if self.coordinator else "--dist-url"


@dataclass(frozen=True)
class ResolvedRun:
    """One rank's run, resolved once (`RunConfig.resolve`) and passed down unchanged: the
    effective plan, the settings as given, and what was derived from both. Nothing below
    dist_runner applies an override or re-parses a flag."""

    plan: Plan
    """The plan as this rank runs it: the overrides, --fragments, --overlap,
    --pipeline-compression, --reshard-after-forward and --outer-state applied (the plan copy
    --run-dir keeps, what `explain` replays)."""
    cfg: RunConfig
    """The settings as given (their lists parsed once, when made)."""
    start_replicas: tuple[int, ...] | None
    """Replicas that start now (--replicas; None: all of the plan's)."""
    min_replicas: int
    """DiLoCo: below this many live replicas the run stops (--min-replicas or its default)."""
    target: LaunchTarget | None = None
    """Where this rank joins (set by dist_runner; None where only the plan was checked)."""

    @property
    def overlapped(self) -> bool:
        """DiLoCo's outer all-reduces run in the background (sync.overlap, after --overlap)."""
        return self.plan.sync.rule.local_steps and self.plan.sync.overlap

    @property
    def overlap_alpha(self) -> float | None:
        """--overlap-alpha where it is used (overlapped DiLoCo), else None."""
        return self.cfg.outer.overlap_alpha if self.overlapped else None


@dataclass(frozen=True)
class LaunchConfig:
    """Which plan, which rank, and where the rendezvous is."""

    plan: str = ""
    """plan/1 or plan/2 JSON file (without it: the obvious plan of --model, --world-size and
    --stages)"""
    model: str | None = None
    """model preset or Hugging Face config.json (or its folder): without --plan, the model to
    train (default: --init-from's config.json); with --plan, checked against the plan's"""
    stages: int = setting(1, lo=1, hi=MAX_DEVICE_ID + 1)
    """without --plan: pipeline stages S; the ranks form world-size / S replicas, rank r
    running stage r mod S of replica r div S"""
    rank: int | None = setting(None, lo=0, hi=MAX_DEVICE_ID)
    """device id of this process (default: $RANK)"""
    world_size: int | None = setting(None, lo=1, hi=MAX_WORLD_SIZE)
    """number of processes (default: $WORLD_SIZE, else the plan's devices)"""
    dist_url: str | None = None
    """rendezvous tcp://HOST:PORT, hosted by rank 0 (default: tcp://$MASTER_ADDR:$MASTER_PORT)"""
    coordinator: str | None = None
    """tcp://HOST:PORT of a coordinator (scripts/coordinator.py) that hosts the rendezvous
    store and leads membership instead of rank 0, so that no rank is special and DiLoCo
    survives losing rank 0 like any replica; replaces --dist-url"""
    cluster: str | None = None
    """cluster/1 file: check that the plan was made for it"""

    def __post_init__(self) -> None:
        check(self, flag_of)
        if self.plan and self.stages != 1:
            raise UserError("--stages: only without --plan (the plan has its stages)")
        if self.coordinator is not None and self.dist_url is not None:
            raise UserError("--coordinator and --dist-url exclude each other: with a "
                            "coordinator every rank reaches the store at --coordinator")
        for flag, url in (("--dist-url", self.dist_url), ("--coordinator", self.coordinator)):
            if url is not None:
                tcp_url(url, flag)
