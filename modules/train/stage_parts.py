"""What a rank builds before its first step, from the resolved run: its stage's model, data
shard and validation set, its shard group (FSDP2, plan/2) and its membership (who it trains
with). The Trainer composes them."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from formats.models import ModelSpec
from formats.plan import Plan
from modules.comm import CommStats
from modules.config import ResolvedRun
from modules.control.dist import Topology
from modules.control.elastic import Membership, MembershipSettings
from modules.control.groups import GroupBuilder
from modules.data.dataset import FakeData, Sharder, TextData
from modules.device.compile import maybe_compile
from modules.device.placement import Placement
from modules.device.precision import Precision
from modules.device.select import to_device
from modules.model.decoder import StageModel
from modules.pipeline.stage import PipelineStage
from modules.shard.runtime import ShardRuntime
from modules.train.checkpointing import Checkpointing, checkpoint_meta
from modules.train.hf_weights import load_stage_weights

if TYPE_CHECKING:
    from modules.sync.hivemind_outer import HivemindOuter


@dataclass
class StageParts:
    """My stage's model on its device and the data it trains and evaluates on."""

    spec: ModelSpec
    """The model as trained: the plan's, its vocabulary the tokenizer's."""
    tokenizer: Any
    model: torch.nn.Module
    sharder: Sharder
    val: list
    """Validation batches on the device (empty without --eval-sequences)."""


def build_stage(run: ResolvedRun, topo: Topology, data: TextData | FakeData,
                placement: Placement, log=print) -> StageParts:
    """My stage's model (vocabulary from the tokenizer), its data shard and validation."""
    plan, cfg = run.plan, run.cfg
    # the vocabulary follows the tokenizer (modules.data.dataset.run_vocab)
    spec = dataclasses.replace(plan.model_spec(), vocab_size=data.vocab_size)
    start, end = plan.stages[topo.stage]
    # initialised on the CPU (the same weights on every device), then moved
    model = StageModel(spec, start, end, seed=cfg.seed)
    if cfg.ckpt.init_from:  # issue 25: pretrained weights, my stage's tensors only
        n = load_stage_weights(model, spec, cfg.ckpt.init_from)
        log(f"initialised {n} tensors of layers [{start}, {end}) from "
            f"--init-from {cfg.ckpt.init_from}")
    compiled = maybe_compile(model.to(placement.device), placement.compile)
    sharder = Sharder(data, len(plan.lanes()), plan.num_micro_batches, plan.micro_batch_size)
    val = (to_device(data.val_batches(cfg.data.eval_sequences, plan.micro_batch_size),
                     placement.device) if cfg.data.eval_sequences else [])
    return StageParts(spec, data.tokenizer, compiled, sharder, val)


def make_shard(run: ResolvedRun, topo: Topology, store: dist.Store, model: torch.nn.Module,
               device: torch.device, stats: CommStats, log=print) -> ShardRuntime | None:
    """Shard groups: form mine and shard my stage with FSDP2 (before any optimizer); None
    without shard groups."""
    plan, cfg = run.plan, run.cfg
    if not plan.is_sharded:
        return None
    shard = ShardRuntime(topo, store, model, device, cfg.timeout_s,  # flags applied by
                         plan.reshard_after_forward, stats)  # RunConfig.resolve
    log(f"shard {topo.shard} of {topo.shard_degree} of stage {topo.stage} with devices "
        f"{list(topo.shard_group)} (FSDP2)")
    return shard


def make_pipe(plan: Plan, topo: Topology, model: torch.nn.Module, precision: Precision,
              shard: ShardRuntime | None) -> PipelineStage:
    """My stage's pipeline (its communicator comes with each generation's groups); with shard
    groups, its backward goes through FSDP2 and the last stage's loss is over the shard's lanes."""
    pipe = PipelineStage(model, topo, None, plan.micro_batch_size, precision,
                         plan.pipeline_compression)
    if shard is not None:
        pipe.before_backward = shard.before_backward
        pipe.loss_divisor = topo.shard_degree if topo.is_last else 1
    return pipe


def make_membership(run: ResolvedRun, topo: Topology, store: dist.Store,
                    store_addr: tuple[str, int] | None, tie_embeddings: bool,
                    placement: Placement, stats: CommStats, background: CommStats | None,
                    hivemind: HivemindOuter | None, log=print) -> Membership:
    """Who this rank trains with; its groups are built with the placement's backend (with
    hivemind: my replica alone, the others are in the DHT)."""
    builder = GroupBuilder(run.plan, topo, store, tie_embeddings, run.cfg.timeout_s, stats,
                           placement.comm, log, background)
    settings = MembershipSettings.of(run, store_addr)
    if hivemind is not None:
        settings = dataclasses.replace(settings, start_replicas=(topo.replica,),
                                       store_addr=None, join=False)
    return Membership(store, run.plan, topo, settings, builder, stats, log)


def make_checkpointing(run: ResolvedRun, topo: Topology, tokenizer: Any,
                       shard: ShardRuntime | None, state: Callable[[], dict[str, Any]],
                       step: Callable[[], int], lock: threading.Lock, outer_steps: bool,
                       healthy: Callable[[str], None], log=print) -> Checkpointing:
    """This rank's checkpoints: saves, resume, and the saves of a failing rank. `state`, `step`:
    what a save holds; `lock`: the training thread's; `healthy`: raises when an aborted call
    touched the communicators (nothing it touched is saved)."""
    cfg = run.cfg
    meta = checkpoint_meta(run.plan, topo, cfg.seed, tokenizer)
    if shard is not None:  # with shard groups, what a resume must match: the shard too
        meta = {**shard.meta(), **meta}
    return Checkpointing(cfg.ckpt, topo.rank, meta, state, step, lock, outer_steps=outer_steps,
                         log=log, die_at=cfg.debug.ckpt_die_at(topo.rank),
                         fail_from=cfg.debug.ckpt_fail_at(topo.rank), healthy=healthy)
