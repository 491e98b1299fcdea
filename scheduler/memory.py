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

Everything is in bytes, GB = 1e9 bytes (as `memory_gb` in the cluster file).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from formats.cluster import Cluster
from formats.errors import UserError
from formats.models import ModelSpec

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
    activation_bytes: float
    reserved_bytes: float

    @property
    def total_bytes(self) -> float:
        """Everything the device must hold."""
        return self.state_bytes + self.activation_bytes + self.reserved_bytes


def stage_memory(model: ModelSpec, start: int, end: int, micro_batch_size: int,
                 num_micro_batches: int, diloco: bool,
                 config: MemoryConfig | None = None) -> StageMemory:
    """Bytes needed by a device holding layers [start, end) under GPipe."""
    config = config or MemoryConfig()
    per_param = STATE_BYTES_PER_PARAM + (DILOCO_EXTRA_BYTES_PER_PARAM if diloco else 0)
    state = float(model.stage_params(start, end)) * per_param
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
    return StageMemory(state, float(act), config.reserved_gb * 1e9)


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
                      pipelines: list[list[int]] | np.ndarray, micro_batch_size: int,
                      num_micro_batches: int, diloco: bool,
                      config: MemoryConfig | None = None) -> None:
    """UserError naming the first device whose stage does not fit in its memory_gb."""
    for r, chain in enumerate(np.asarray(pipelines).tolist()):
        for s, dev_id in enumerate(chain):
            a, b = stages[s]
            need = stage_memory(model, a, b, micro_batch_size, num_micro_batches, diloco, config)
            dev = cluster.devices[int(dev_id)]
            if need.total_bytes > dev.memory_gb * 1e9:
                raise UserError(
                    f"memory: device {dev.id} ({dev.name}, {dev.gpu}, {dev.memory_gb:g} GB) runs "
                    f"stage {s} (layers [{a}, {b}]) of replica {r} and needs "
                    f"{need.total_bytes / 1e9:.2f} GB (parameters + optimizer state "
                    f"{need.state_bytes / 1e9:.2f} GB, activations of {num_micro_batches} "
                    f"micro-batches {need.activation_bytes / 1e9:.2f} GB, reserved "
                    f"{need.reserved_bytes / 1e9:.2f} GB); give that stage fewer layers, use "
                    f"fewer or smaller micro-batches, or put a bigger GPU there")
