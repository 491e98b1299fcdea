"""Which device a rank computes on (--device, --cuda-device), and moving state to and from it.

`resolve_device` turns the flags into a `torch.device` and refuses a device that does not exist
with a UserError naming the flag, so a bad choice exits 2 before any rendezvous. The rest keeps
a rank's tensors on its device: `to_device` moves nested state (a CPU checkpoint, micro-batches)
onto it, and `rng_states`/`set_rng_states` save and restore the CPU and CUDA generators.
Saving needs nothing new: `modules.train.checkpoint.snapshot` already copies every tensor, CUDA ones
included, to CPU memory, so checkpoints hold CPU tensors whatever device trained them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from formats.errors import UserError
from modules.config import DEVICE_CHOICES


def resolve_device(choice: str, cuda_device: int | None,
                   env: Mapping[str, str] = os.environ) -> torch.device:
    """--device auto|cpu|cuda and --cuda-device N -> the torch.device this rank computes on.

    auto is CUDA when a CUDA device is visible, else CPU. The CUDA index is --cuda-device, else
    $LOCAL_RANK (set by torchrun: one GPU per local process; with one visible device, as a
    per-task CUDA_VISIBLE_DEVICES gives each rank, that device), else 0. A device that does not
    exist is a UserError naming the flag and the value; nothing is initialised here beyond
    torch.cuda's device count, so call it before any rendezvous.
    """
    if choice not in DEVICE_CHOICES:
        raise UserError(f"--device: {choice!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if cuda_device is not None and cuda_device < 0:
        raise UserError(f"--cuda-device {cuda_device}: must be >= 0")
    if choice == "cpu":
        if cuda_device is not None:
            raise UserError(f"--cuda-device {cuda_device}: has no effect with --device cpu; "
                            "leave one of them out")
        return torch.device("cpu")
    visible = torch.cuda.is_available()
    if choice == "auto" and not visible and cuda_device is None:
        return torch.device("cpu")
    if not visible:
        flag = "--device cuda" if choice == "cuda" else f"--cuda-device {cuda_device}"
        raise UserError(f"{flag}: no CUDA device is visible (torch.cuda.is_available() is "
                        f"False{_why_no_cuda(env)}); use --device cpu")
    index, flag = _cuda_index(cuda_device, env)
    count = torch.cuda.device_count()
    if flag.startswith("$LOCAL_RANK") and count == 1:  # per-task CUDA_VISIBLE_DEVICES (Slurm):
        index = 0  # this task's one GPU, whatever its local rank
    if index >= count:
        plural = "device is" if count == 1 else "devices are"
        raise UserError(f"{flag}: only {count} CUDA {plural} visible (indices 0..{count - 1})"
                        + ("; pass --cuda-device N" if flag.startswith("$") else ""))
    return torch.device("cuda", index)


def _cuda_index(cuda_device: int | None, env: Mapping[str, str]) -> tuple[int, str]:
    """(index, the flag or variable it came from, for messages)."""
    if cuda_device is not None:
        return cuda_device, f"--cuda-device {cuda_device}"
    raw = env.get("LOCAL_RANK")
    if raw is None:
        return 0, "--cuda-device 0 (the default)"
    try:
        index = int(raw)
    except ValueError:
        raise UserError(f"$LOCAL_RANK: expected an integer, got {raw!r}") from None
    if index < 0:
        raise UserError(f"$LOCAL_RANK {index}: must be >= 0")
    return index, f"$LOCAL_RANK {index}"


def _why_no_cuda(env: Mapping[str, str]) -> str:
    """The likeliest reason CUDA is not visible, as a clause for the error message."""
    if torch.version.cuda is None:
        return f"; this torch {torch.__version__} is a CPU-only build"
    if env.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return f"; CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r} hides every GPU"
    return ""


def use_device(device: torch.device) -> None:
    """Make a CUDA `device` this process's current one (NCCL, cupy kernels and torch's
    default stream follow it); nothing for CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def describe_device(device: torch.device) -> str:
    """One line for the log: `cuda:0 (NVIDIA H100 80GB HBM3, 79.1 GiB)` or `cpu (4 threads)`."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{device} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"
    return f"{device} ({torch.get_num_threads()} threads)"


def to_device(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Nested dicts/lists/tuples with every tensor moved to `device` (others kept as they are).

    For loading a CPU checkpoint's state onto the rank's device and for putting micro-batches
    there. A tensor already on `device` is returned as is (no copy). `non_blocking` only
    overlaps with compute when the source is in pinned memory.
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, dict):
        return {k: to_device(v, device, non_blocking) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_device(v, device, non_blocking) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_device(v, device, non_blocking) for v in obj)
    return obj


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """The generators a rank's randomness comes from: CPU always, and `device`'s if CUDA."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, torch.Tensor] | torch.Tensor,
                   device: torch.device) -> None:
    """Restore what `rng_states` saved; a bare tensor is a CPU state (older checkpoints).

    A checkpoint written on CPU and resumed on CUDA leaves the CUDA generator as seeded; one
    written on CUDA and resumed on CPU ignores the CUDA state.
    """
    if isinstance(states, torch.Tensor):
        states = {"cpu": states}
    torch.set_rng_state(states["cpu"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)
