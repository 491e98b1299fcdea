"""Whether this rank's stage can fit this host before any of it is allocated.

The model is built on the CPU in fp32 (the same initial weights on every device), then moved:
a stage too large for the host ends in a MemoryError, or the kernel's OOM killer, minutes into a
launch; one too large for its GPU in an allocator dump. The figures here are lower bounds (the
stage's transformer layers only: the embedding follows the tokenizer, unknown until the data is
loaded), so a refusal is certain, never a guess; the planner's memory model is the full check.
"""

from __future__ import annotations

import torch

from formats.errors import UserError
from formats.model_size import TRAIN_BYTES_PER_PARAM, gigabytes
from formats.plan import Plan

INIT_BYTES_PER_PARAM = 4
"""fp32 weights, the least the CPU holds while it builds the stage."""


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping); None: unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def device_total_bytes(device: torch.device) -> int | None:
    """Total memory of a CUDA device (None for the CPU: the host figure applies)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


def check_stage_memory(plan: Plan, stage: int, device: torch.device) -> None:
    """UserError naming the model's fields, the stage's need and this host's or device's memory
    when the stage's layers alone cannot fit; call before the rendezvous."""
    spec = plan.model_spec()
    start, end = plan.stages[stage]
    params = (end - start) * spec.layer_params()
    what = (f"stage {stage} of {plan.model} ({end - start} of num_layers {spec.num_layers}, "
            f"d_model {spec.d_model}, d_ff {spec.d_ff}: {params:.3g} parameters)")
    train = params * TRAIN_BYTES_PER_PARAM // plan.shard_degree(stage)
    on_device = device_total_bytes(device)
    host = host_available_bytes()
    need_host = params * INIT_BYTES_PER_PARAM + (train if on_device is None else 0)
    if host is not None and need_host > host:
        raise UserError(f"{what} needs at least {gigabytes(need_host)} of host memory to build "
                        f"and train, this host has {gigabytes(host)} available; use a smaller "
                        "model or more stages")
    if on_device is not None and train > on_device:
        raise UserError(f"{what} needs at least {gigabytes(train)} of training memory "
                        f"({TRAIN_BYTES_PER_PARAM} bytes a parameter), {device} has "
                        f"{gigabytes(on_device)}; use a smaller model or more stages")

