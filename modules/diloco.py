"""DiLoCo: H local (inner) optimizer steps, then one averaged outer step.

    pseudo_grad = anchor - params              (what the inner steps moved)
    pseudo_grad = average over workers         (the only communication, every H steps)
    params      = anchor; outer SGD(Nesterov) step with pseudo_grad as the gradient
    anchor      = params

as in DiLoCo (Douillard et al. 2023) and OpenDiLoCo (Jaghouar et al. 2024). Usable on its own:

    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = DiLoCoOptimizer(model.parameters(), inner, inner_steps=50)  # averages over the
    ...                                                               # default torch.distributed
    loss.backward(); opt.step(); opt.zero_grad()                      # group when initialised
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

AllReduceFn = Callable[[torch.Tensor], "int | None"]
"""Averages a flat fp32 tensor in place over the workers; may return the bytes it sent."""


def default_all_reduce(tensor: torch.Tensor) -> int:
    """Average over the default torch.distributed group, or do nothing when not initialised."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0
    dist.all_reduce(tensor)
    tensor /= dist.get_world_size()
    return tensor.numel() * tensor.element_size()


@dataclass
class OuterState:
    """What a replica joining mid-run needs: the outer model, its Nesterov momentum, the count."""

    anchor: torch.Tensor
    """The outer model (the parameters after the last outer step), flat fp32."""
    momentum: torch.Tensor | None
    """The outer optimizer's momentum buffer, flat (None before the first outer step)."""
    outer_count: int
    """Outer steps done."""


class DiLoCoOptimizer:
    """Wraps an inner optimizer; every `inner_steps` calls of `step()` it runs the outer step."""

    def __init__(self, params: Iterable[torch.nn.Parameter], inner_optimizer: torch.optim.Optimizer,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, inner_steps: int = 500,
                 all_reduce_fn: AllReduceFn | None = None, nesterov: bool = True) -> None:
        self.params = [p for p in params if p.requires_grad]
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {inner_steps}")
        self.inner = inner_optimizer
        self.outer = torch.optim.SGD(self.params, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=nesterov and outer_momentum > 0)
        self.inner_steps = inner_steps
        self.all_reduce_fn = all_reduce_fn or default_all_reduce
        self.anchor = [p.detach().clone() for p in self.params]
        self.inner_count = 0
        """Inner steps since the last outer step."""
        self.outer_count = 0
        """Outer steps done."""
        self.bytes_sent = 0
        """Bytes handed to all_reduce_fn (its return value, or the fp32 payload size)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the inner gradients."""
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step; the outer step (with communication) after every `inner_steps`."""
        result = self.inner.step(closure)
        self.inner_count += 1
        if self.inner_count >= self.inner_steps:
            self.outer_step()
        return result

    @torch.no_grad()
    def outer_step(self) -> None:
        """Average the pseudo-gradient over workers and apply the outer Nesterov SGD step."""
        pseudo = torch.cat([(a - p.detach()).reshape(-1) for a, p in zip(self.anchor, self.params)])
        sent = self.all_reduce_fn(pseudo)  # the one communication of DiLoCo
        self.bytes_sent += int(sent) if sent is not None else pseudo.numel() * 4
        saved_grads = [p.grad for p in self.params]
        offset = 0
        for a, p in zip(self.anchor, self.params):
            n = p.numel()
            p.copy_(a)
            p.grad = pseudo[offset:offset + n].view_as(p).to(p.dtype)
            offset += n
        self.outer.step()
        for a, p, g in zip(self.anchor, self.params, saved_grads):
            a.copy_(p)
            p.grad = g
        self.inner_count = 0
        self.outer_count += 1

    @torch.no_grad()
    def outer_state(self) -> OuterState:
        """The outer model, momentum and count, flat (copies: safe to send while training)."""
        anchor = torch.cat([a.reshape(-1) for a in self.anchor])
        if not self.outer.state:
            return OuterState(anchor, None, self.outer_count)
        momentum = torch.cat([self._momentum(p).reshape(-1) for p in self.params])
        return OuterState(anchor, momentum, self.outer_count)

    def _momentum(self, p: torch.nn.Parameter) -> torch.Tensor:
        buf = self.outer.state.get(p, {}).get("momentum_buffer")
        return buf if buf is not None else torch.zeros_like(p)

    @torch.no_grad()
    def load_outer_state(self, state: OuterState) -> None:
        """Take over another replica's outer state: parameters and anchor become its outer
        model, the momentum its, inner steps start from zero."""
        n = sum(p.numel() for p in self.params)
        if state.anchor.numel() != n:
            raise ValueError(f"outer state: {state.anchor.numel()} values for {n} parameters")
        off = 0
        for a, p in zip(self.anchor, self.params):
            k = p.numel()
            a.copy_(state.anchor[off:off + k].view_as(a))
            p.copy_(a)
            if state.momentum is not None:
                self.outer.state[p]["momentum_buffer"] = \
                    state.momentum[off:off + k].view_as(p).clone()
            off += k
        self.outer_count = state.outer_count
        self.inner_count = 0

    def state_dict(self) -> dict[str, Any]:
        """Inner and outer optimizer state, anchor parameters and counters (tensors + ints)."""
        return {"inner": self.inner.state_dict(), "outer": self.outer.state_dict(),
                "anchor": [a.clone() for a in self.anchor], "inner_count": self.inner_count,
                "outer_count": self.outer_count, "bytes_sent": self.bytes_sent}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict saved."""
        self.inner.load_state_dict(state["inner"])
        self.outer.load_state_dict(state["outer"])
        if len(state["anchor"]) != len(self.anchor):
            raise ValueError("DiLoCo state: number of parameters differs")
        for a, s in zip(self.anchor, state["anchor"]):
            a.copy_(s)
        self.inner_count = int(state["inner_count"])
        self.outer_count = int(state["outer_count"])
        self.bytes_sent = int(state["bytes_sent"])
