"""--precision fp32|bf16|fp16: autocast, the dtype activations cross links in, fp16 loss scaling.

Master weights, gradients and optimizer state stay fp32 in every mode: autocast only changes the
dtype that matmuls and attention compute in. Between pipeline stages, activations (forward) and
their gradients (backward) travel in the compute dtype (half the bytes of fp32 for bf16/fp16):
the sender casts with `to_wire`, the receiver turns the buffer back into fp32 with `from_wire`,
so every stage's residual stream and every `backward(grad)` stays fp32.

fp16 needs loss scaling, and a pipeline makes that a distributed decision:

- Only the last stage multiplies the loss by the scale (`scale_loss`). Every other stage's
  gradients arrive through the pipeline's backward messages already multiplied by that same
  scale, so all stages' backward passes use one scale by construction and none rescales.
- Whether a step overflowed must be the same on every rank that steps together, or the ranks'
  parameters and scales drift apart: one stage finding inf/NaN in its own gradients does not
  mean another stage does. `found_overflow` checks this rank's gradients and MAXes the flag
  with the `agree` callback over those ranks: the pipeline's ranks (this replica) for DiLoCo,
  whose replicas step independently; every rank of the run for all-reduce, whose stage groups
  average gradients. It runs before the data-parallel average, so an overflowed step sends no
  gradients (and int8/fp16 compression, which refuses inf/NaN, never sees one).
- The scale is torch.amp.GradScaler's dynamic scale (x0.5 after an overflow, x2 after
  `growth_interval` clean steps). It is a deterministic function of the agreed flags, and every
  rank starts from the same `init_scale`, so the scale is equal on every rank at every step
  without sending it. To make GradScaler's own inf check (inside `unscale_`) return the agreed
  flag, a rank whose own gradients are finite while another rank overflowed writes one inf into
  its gradients before unscaling; the step is skipped and its gradients discarded anyway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from formats.errors import UserError
from modules.config import PRECISIONS

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

AgreeMax = Callable[[torch.Tensor], None]
"""In-place MAX of a 1-element fp32 tensor over the ranks that must take the same decision."""


@dataclass(frozen=True)
class Precision:
    """How one rank computes and what dtype its pipeline activations travel in."""

    name: str
    """fp32, bf16 or fp16 (--precision)."""
    device: torch.device
    """The device this rank computes on."""

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype autocast computes matmuls and attention in."""
        return COMPUTE_DTYPES[self.name]

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype of activations and activation gradients sent between pipeline stages."""
        return self.compute_dtype

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for a stage's forward (backward follows the dtypes forward chose)."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        """What to send for an fp32 activation or gradient (itself for fp32)."""
        return t.to(self.wire_dtype)

    def from_wire(self, t: torch.Tensor) -> torch.Tensor:
        """The fp32 tensor a received buffer stands for (itself for fp32)."""
        return t.float()

    def loss_scaling(self, agree: AgreeMax | None = None, **scaler_kwargs: Any) -> LossScaling:
        """The training step's loss scaling: PipelineGradScaler for fp16, else none.

        `agree` MAXes the overflow flag over the ranks that step together (see the module
        docstring); None when this rank steps alone (one stage, one replica or DiLoCo).
        """
        if self.name == "fp16":
            return PipelineGradScaler(self.device, agree, **scaler_kwargs)
        return NoLossScaling()


def make_precision(name: str, device: torch.device) -> Precision:
    """--precision and the resolved device -> Precision; UserError for what cannot run there."""
    if name not in PRECISIONS:
        raise UserError(f"--precision: {name!r} is not one of {', '.join(PRECISIONS)}")
    if name == "fp16" and device.type != "cuda":
        raise UserError(f"--precision fp16: needs a CUDA device, this rank runs on {device} "
                        "(use bf16 on CPU)")
    return Precision(name, device)


class LossScaling(Protocol):
    """The calls a training step makes, the same for every precision."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The last stage's loss to call backward on."""
        ...

    def found_overflow(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this step's gradients overflowed on any rank that steps with this one."""
        ...

    def step(self, optimizer: Any, inner: torch.optim.Optimizer | None = None,
             overflow: bool = False) -> bool:
        """Unscale, then step `optimizer` (or skip the update); True when it updated."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`."""
        ...


class NoLossScaling:
    """fp32 and bf16 (bf16 has fp32's exponent range): the loss and the step as they are."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss unchanged."""
        return loss

    def found_overflow(self, optimizer: torch.optim.Optimizer) -> bool:
        """Never: nothing is scaled, so nothing is checked."""
        return False

    def step(self, optimizer: Any, inner: torch.optim.Optimizer | None = None,
             overflow: bool = False) -> bool:
        """optimizer.step()."""
        optimizer.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        """Nothing to keep."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""


class PipelineGradScaler:
    """fp16 loss scaling whose skip decisions and scale are the same on every rank.

    Per step: the last stage calls `scale_loss` before backward; every rank then calls
    `found_overflow(inner)` (before the data-parallel average; skip that average when it is
    True) and `step(optimizer, inner, overflow)`. `inner` is the torch optimizer that owns the
    gradients (DiLoCo's inner AdamW); `optimizer` is what the step calls (DiLoCoOptimizer, or
    the same AdamW). A skipped step drops the gradients and still calls `optimizer.step()`:
    AdamW leaves parameters and state alone without gradients, and DiLoCo counts the inner
    step, so its outer steps stay on the same training steps on every replica.
    """

    def __init__(self, device: torch.device, agree: AgreeMax | None = None,
                 init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.device = device
        self.agree = agree
        self.scaler = torch.amp.GradScaler(device.type, init_scale=init_scale,
                                           growth_interval=growth_interval)
        # GradScaler creates its scale at the first scale(); stages other than the last never
        # scale a loss but must unscale, so create it now
        self.scaler.scale(torch.zeros((), device=device))

    @property
    def scale(self) -> float:
        """The current loss scale (a host sync)."""
        return float(self.scaler.get_scale())

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss x scale (on the last stage only: the other stages receive scaled gradients)."""
        return self.scaler.scale(loss)

    def local_overflow(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """1.0 (a 1-element fp32 tensor on the device) if this rank's gradients hold inf/NaN
        (with shard groups: its own shards of them)."""
        grads = [_local(g) for g in _grads(optimizer)]
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
        return (~finite).float().reshape(1)

    def found_overflow(self, optimizer: torch.optim.Optimizer) -> bool:
        """This rank's flag MAXed over the ranks that step together (one host sync)."""
        flag = self.local_overflow(optimizer)
        if self.agree is not None:
            self.agree(flag)
        return bool(flag.item())

    def step(self, optimizer: Any, inner: torch.optim.Optimizer | None = None,
             overflow: bool = False) -> bool:
        """Unscale the gradients, step or skip as agreed, update the scale; True if stepped."""
        inner = optimizer if inner is None else inner
        if overflow:  # make GradScaler's own check agree (see the module docstring)
            # (a shard may be empty: a parameter of fewer rows than the shard group's D)
            grad = next((g for g in map(_local, _grads(inner)) if g.numel()), None)
            assert grad is not None, "every local shard is empty (D above a parameter's rows)"
            grad[(0,) * grad.dim()] = float("inf")
        self.scaler.unscale_(inner)
        if overflow:
            for group in inner.param_groups:
                for p in group["params"]:
                    p.grad = None
        optimizer.step()
        self.scaler.update()
        return not overflow

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's scale and growth tracker (for checkpoints)."""
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`."""
        self.scaler.load_state_dict(state)


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient: the local shard of an FSDP2 (DTensor) one."""
    # an all() over a DTensor would be a collective of its own, and writing into one would
    # go through DTensor's dispatch: both work on the local shard instead
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None]
    assert grads, "loss scaling: the optimizer's parameters have no gradients"
    return grads
