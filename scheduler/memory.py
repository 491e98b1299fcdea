"""Does a stage fit on a device? Bytes of parameters, optimizer state and activations.

Per device holding layers [a, b) of the model (P = model.stage_params(a, b) parameters):

- weights, gradients and AdamW state: P x (4 + 4 + 8) bytes (fp32 master weights, fp32
  gradients, two fp32 moments); DiLoCo adds P x (4 + 4): the fp32 copy of the parameters at the
  last outer step and the outer optimizer's momentum;
- activations of the in-flight micro-batches. GPipe keeps all m micro-batches of a stage alive
  until their backward. Per layer and sequence a transformer block stores about
  seq * d * (34 + 5 * heads * seq / d) bytes in fp16 (Korthikanti et al. 2022, no recomputation).
  For GPT3-XL that is 0.48 GB per layer and sequence, so 61 micro-batches of even 3 layers need
  87 GB: no V100 holds that. With `recompute` (activation checkpointing, the default, what
  GPipe and DT-FM use) a stage stores only each layer's fp16 input (seq * d * 2 bytes) for all m
  micro-batches, plus the full activations of one layer of one micro-batch while it is recomputed
  in the backward pass. The backward pass then costs one extra forward (see simulator/);
- the last stage also holds the logits of a micro-batch: seq * vocab * 6 bytes (fp16 logits +
  fp32 softmax); all m of them without recomputation;
- `reserved_gb` for the CUDA context, allocator fragmentation and communication buffers.

A stage held by a shard group of D devices (FSDP2, plan/2) divides the parameters, gradients,
AdamW state and DiLoCo's outer state by D on each device (its 1/D shard). Activations are not
sharded: each device runs its own micro-batches (a lane, docs/hierarchical.md). FSDP adds the
gathered full parameters transiently: with reshard_after_forward one unit at a time (a block,
or the embedding / the head, whichever is largest) in fp32 plus its unsharded fp32 gradient
before the reduce-scatter; without it the whole stage's (parameters and gradients stay
gathered through the step). DiLoCo's outer state (anchor + outer momentum, 8 bytes a
parameter, per shard) is on the device with outer_state `device`, in host memory with `host`
(counted in host_bytes, not in what the device must hold).

Everything is in bytes, GB = 1e9 bytes (as `memory_gb` in the cluster file).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from formats.cluster import Cluster, Device
from formats.errors import UserError
from formats.models import ModelSpec
from formats.plan import Entry, as_group

STATE_BYTES_PER_PARAM = 4 + 4 + 8
"""fp32 weights + fp32 gradients + AdamW's two fp32 moments."""
DILOCO_EXTRA_BYTES_PER_PARAM = 4 + 4
"""DiLoCo: fp32 snapshot of the parameters at the last outer step + outer Nesterov momentum."""


@dataclass(frozen=True)
class MemoryConfig:
    """What the memory estimate assumes."""

    recompute: bool = True
    """Activation checkpointing per layer: keep only layer inputs, recompute in backward."""
    reserved_gb: float = 1.0
    """Fixed overhead per device: CUDA context, workspace, communication buffers (GB)."""


def layer_activation_bytes(model: ModelSpec) -> float:
    """Bytes one transformer block keeps for the backward pass, per sequence (fp16, Korthikanti)."""
    s, d, a = model.seq_len, model.d_model, model.n_heads
    return s * d * (34.0 + 5.0 * a * s / d)


def logits_bytes(model: ModelSpec) -> float:
    """Bytes of the LM head's logits for one sequence (fp16 logits + fp32 softmax)."""
    return model.seq_len * model.vocab_size * 6.0


@dataclass(frozen=True)
class StageMemory:
    """Bytes a device needs for one stage, by part."""

    state_bytes: float
    """Parameters, gradients, AdamW state (and DiLoCo's outer state on the device): the
    device's 1/D shard of them."""
    activation_bytes: float
    reserved_bytes: float
    gathered_bytes: float = 0.0
    """FSDP's all-gathered full parameters and unsharded gradients, transiently (0 when D = 1)."""
    host_bytes: float = 0.0
    """DiLoCo's outer state kept in host memory (outer_state `host`); not on the device."""

    @property
    def total_bytes(self) -> float:
        """Everything the device must hold."""
        return self.state_bytes + self.activation_bytes + self.reserved_bytes + self.gathered_bytes


def gathered_bytes(model: ModelSpec, start: int, end: int, shard_degree: int,
                   reshard_after_forward: bool = True) -> float:
    """FSDP's transient full fp32 parameters + unsharded fp32 gradients on a device of a shard
    group holding layers [start, end): the largest unit (block, embedding, head) with
    reshard_after_forward, else the whole stage; 0 when D = 1."""
    if shard_degree <= 1:
        return 0.0
    if not reshard_after_forward:
        return float(model.stage_params(start, end)) * 8.0
    units = [model.layer_params()]
    if start == 0:
        units.append(model.embedding_params())
    if end == model.num_layers:
        units.append(model.stage_params(end - 1, end) - model.layer_params())
    return float(max(units)) * 8.0


def stage_memory(model: ModelSpec, start: int, end: int, micro_batch_size: int,
                 num_micro_batches: int, diloco: bool,
                 config: MemoryConfig | None = None, shard_degree: int = 1,
                 reshard_after_forward: bool = True,
                 outer_state: str = "device") -> StageMemory:
    """Bytes needed by a device holding layers [start, end) under GPipe, as one of the
    `shard_degree` devices of a shard group (1: the whole stage)."""
    config = config or MemoryConfig()
    params = float(model.stage_params(start, end)) / shard_degree
    outer = params * DILOCO_EXTRA_BYTES_PER_PARAM if diloco else 0.0
    state = params * STATE_BYTES_PER_PARAM + (outer if outer_state == "device" else 0.0)
    layers = end - start
    seqs_in_flight = micro_batch_size * num_micro_batches
    last = end == model.num_layers
    if config.recompute:
        act = seqs_in_flight * layers * model.activation_bytes_per_sequence(2)
        act += micro_batch_size * layer_activation_bytes(model)
        act += micro_batch_size * logits_bytes(model) if last else 0.0
    else:
        act = seqs_in_flight * layers * layer_activation_bytes(model)
        act += seqs_in_flight * logits_bytes(model) if last else 0.0
    return StageMemory(state, float(act), config.reserved_gb * 1e9,
                       gathered_bytes(model, start, end, shard_degree, reshard_after_forward),
                       outer if outer_state == "host" else 0.0)


def memory_table(model: ModelSpec, micro_batch_size: int, num_micro_batches: int, diloco: bool,
                 config: MemoryConfig | None = None) -> np.ndarray:
    """(L+1, L+1) bytes needed for a stage [a, b) at [a, b]; inf where b <= a."""
    n = model.num_layers
    table = np.full((n + 1, n + 1), np.inf)
    for a in range(n):
        for b in range(a + 1, n + 1):
            table[a, b] = stage_memory(model, a, b, micro_batch_size, num_micro_batches, diloco,
                                       config).total_bytes
    return table


def check_plan_memory(cluster: Cluster, model: ModelSpec, stages: list[tuple[int, int]],
                      pipelines: list[list[Entry]] | np.ndarray, micro_batch_size: int,
                      num_micro_batches: int, diloco: bool,
                      config: MemoryConfig | None = None, reshard_after_forward: bool = True,
                      outer_state: str = "device") -> None:
    """UserError naming the first device whose stage (its shard of it, in a shard group) does
    not fit in its memory_gb."""
    rows = pipelines.tolist() if isinstance(pipelines, np.ndarray) else pipelines
    lanes = max(len(as_group(e)) for chain in rows for e in chain)  # L: the largest D
    for r, chain in enumerate(rows):
        for s, entry in enumerate(chain):
            a, b = stages[s]
            group = as_group(entry)
            # a device of a smaller shard group runs L / D lanes: that many micro-batches more
            need = stage_memory(model, a, b, micro_batch_size,
                                num_micro_batches * max(1, lanes // len(group)), diloco, config,
                                len(group), reshard_after_forward, outer_state)
            for dev_id in group:
                dev = cluster.devices[int(dev_id)]
                if need.total_bytes > dev.memory_gb * 1e9:
                    raise UserError(_overflow_message(dev, r, s, (a, b), len(group), need,
                                                      num_micro_batches))


def _overflow_message(dev: Device, r: int, s: int, layers: tuple[int, int], degree: int,
                      need: StageMemory, num_micro_batches: int) -> str:
    """The memory error: which device, what it needs by part, what to change."""
    a, b = layers
    shard = f" as 1 of {degree} shards" if degree > 1 else ""
    gathered = (f", FSDP's gathered parameters {need.gathered_bytes / 1e9:.2f} GB"
                if degree > 1 else "")
    more = ", shard the stage over more devices" if degree > 1 else ""
    return (f"memory: device {dev.id} ({dev.name}, {dev.gpu}, {dev.memory_gb:g} GB) runs "
            f"stage {s} (layers [{a}, {b}]) of replica {r}{shard} and needs "
            f"{need.total_bytes / 1e9:.2f} GB (parameters + optimizer state "
            f"{need.state_bytes / 1e9:.2f} GB, activations of {num_micro_batches} "
            f"micro-batches {need.activation_bytes / 1e9:.2f} GB, reserved "
            f"{need.reserved_bytes / 1e9:.2f} GB{gathered}); give that stage fewer layers, use "
            f"fewer or smaller micro-batches{more}, or put a bigger GPU there")
