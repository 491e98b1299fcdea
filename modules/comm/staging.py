"""Host staging for gloo, whose transports read and write host memory: a CUDA tensor travels
through a pinned host copy (page-locked, so the device copies are DMA transfers), a CPU tensor
is used in place. Pinned blocks come from torch's caching host allocator, so repeated messages
of one size reuse them."""

from __future__ import annotations

import torch


def needs_staging(t: torch.Tensor) -> bool:
    """Whether gloo needs a host copy of `t` (it is not in host memory)."""
    return t.device.type != "cpu"


def stage_out(t: torch.Tensor, pin: bool = True) -> torch.Tensor:
    """A contiguous host copy of `t`, complete on return (the copy waits for the kernels that
    produce `t` on its device's current stream). `pin`: page-locked (CUDA tensors)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    host.copy_(t)
    return host


def stage_buffer(t: torch.Tensor, pin: bool = True) -> torch.Tensor:
    """An empty host tensor shaped like `t` to receive into."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)


def stage_in(host: torch.Tensor, target: torch.Tensor) -> None:
    """Copy what arrived in `host` into `target`, ordered on its device's current stream
    (asynchronous from pinned memory: later kernels on that stream see the data)."""
    target.copy_(host, non_blocking=host.is_pinned())


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when gloo can use it, else its pinned host copy."""
    return stage_out(t, pin=t.is_cuda) if needs_staging(t) else t


def host_buffer(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when gloo can receive into it, else a pinned host tensor shaped like it."""
    return stage_buffer(t, pin=t.is_cuda) if needs_staging(t) else t
