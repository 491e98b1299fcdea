"""DiLoCo: H local (inner) optimizer steps, then one averaged outer step.

    pseudo_grad = anchor - params              (what the inner steps moved)
    pseudo_grad = average over workers         (the only communication, every H steps)
    anchor      = outer optimizer step of anchor with pseudo_grad as the gradient
                  (Nesterov SGD unless `outer_optimizer` builds another)
    params      = anchor

as in DiLoCo (Douillard et al. 2023) and OpenDiLoCo (Jaghouar et al. 2024). Usable on its own:

    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = DiLoCoOptimizer(model.parameters(), inner, inner_steps=50)  # averages over the
    ...                                                               # default torch.distributed
    loss.backward(); opt.step(); opt.zero_grad()                      # group when initialised

Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512), two options:
- `fragments` = F: the parameters are cut into F contiguous fragments (at parameter
  boundaries, as equal in elements as they allow; `fragment_bounds`); fragment f syncs after
  inner step floor((f+1) H / F) of each round, with its own anchor and outer momentum, so one
  sync sends 1/F of the bytes and the peak bandwidth need falls F times.
- `overlap`: a fragment's all-reduce runs in the background while the next round's inner
  steps compute (overlap tau = H inner steps). At the fragment's next slot its averaged
  pseudo-gradient (from the previous round) is applied with Streaming DiLoCo's overlapped
  update: the outer step moves the global copy (the anchor) with the delayed average, and the
  local fragment is merged as  params = alpha * params + (1 - alpha) * anchor  (alpha =
  `overlap_alpha`; the paper's mixing factor, 0.5 here); the fragment's next pseudo-gradient,
  anchor - params, is taken right after and sent (so it is alpha x the local drift: with tau = H
  the merge and the next send fall on the same step; alpha must be > 0). Without overlap alpha
  is 0 (plain DiLoCo).
  Every pending round's pseudo-gradient (as sent) is in `state_dict()`, and `load_state_dict`
  re-runs those all-reduces: a resumed run continues bit-identically.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from modules.sync.overlap import OuterJob, OverlapSync

AllReduceFn = Callable[[torch.Tensor], "int | None"]
"""Averages a flat fp32 tensor in place over the workers; may return the bytes it sent."""
OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
"""Builds the outer optimizer of one fragment's anchors, whose `.grad` is the averaged
pseudo-gradient at each outer step (as torchft's DiLoCo takes any outer optimizer)."""


def nesterov_sgd(lr: float = 0.7, momentum: float = 0.9,
                 nesterov: bool = True) -> OuterOptimizerFactory:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum (plain SGD at momentum 0)."""
    def build(anchors: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(anchors, lr=lr, momentum=momentum,
                               nesterov=nesterov and momentum > 0)
    return build


class Reducer(Protocol):
    """Background all-reduces (modules.sync.overlap.OverlapSync is one)."""

    def launch(self, flat: torch.Tensor, index: int) -> OuterJob:
        """Start averaging `flat` (sync number `index`) in the background."""
        ...

    def finish(self, job: OuterJob) -> None:
        """Block until `job.flat` holds the average (OuterRoundSkipped: nobody completed the
        round; DiLoCo skips that outer step)."""
        ...


def default_all_reduce(tensor: torch.Tensor) -> int:
    """Average over the default torch.distributed group, or do nothing when not initialised."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0
    dist.all_reduce(tensor)
    tensor /= dist.get_world_size()
    return tensor.numel() * tensor.element_size()


def fragment_bounds(sizes: list[int], fragments: int) -> list[tuple[int, int]]:
    """Cut parameters of `sizes` elements into `fragments` contiguous, non-empty ranges
    [start, end) of parameter indices, each cut at the boundary nearest to an equal share."""
    n = len(sizes)
    if not 1 <= fragments <= n:
        raise ValueError(f"fragments: {fragments} fragments of {n} parameters")
    total, cum = sum(sizes), [0]
    for s in sizes:
        cum.append(cum[-1] + s)
    cuts = [0]
    for k in range(1, fragments):
        lo, hi = cuts[-1] + 1, n - (fragments - k)  # leave one parameter for each fragment left
        cuts.append(min(range(lo, hi + 1), key=lambda i: abs(cum[i] - k * total / fragments)))
    cuts.append(n)
    return list(zip(cuts[:-1], cuts[1:]))


def outer_param_order(params: list[torch.nn.Parameter], tied: list[torch.nn.Parameter],
                      fragments: int) -> list[torch.nn.Parameter]:
    """DiLoCo's parameter order on a stage: with fragments the tied embedding copies first, so
    the first and the last stage sync them in the same slot and the copies stay equal."""
    if fragments == 1:
        return list(params)
    ids = {id(p) for p in tied}
    return [p for p in params if id(p) in ids] + [p for p in params if id(p) not in ids]


def sync_slots(inner_steps: int, fragments: int) -> list[int]:
    """Inner step of the round (1..H) after which each fragment syncs: floor((f+1) H / F)."""
    return [(f + 1) * inner_steps // fragments for f in range(fragments)]


class OuterRoundSkipped(Exception):  # noqa: N818 - what happened, not an error
    """Raised by an all_reduce_fn whose round did not complete here (the hivemind backend):
    no outer step is applied; with `state`, that outer state (a replica that completed the
    round) is taken instead, else the local pseudo-gradient stays for the next round."""

    def __init__(self, state: OuterState | None) -> None:
        super().__init__("outer round skipped")
        self.state = state


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
    """Wraps an inner optimizer; every `inner_steps` calls of `step()` a round of outer steps
    (one per fragment, at its slot; see the module docstring)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], inner_optimizer: torch.optim.Optimizer,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, inner_steps: int = 500,
                 all_reduce_fn: AllReduceFn | None = None, nesterov: bool = True,
                 fragments: int = 1, overlap: bool = False, overlap_alpha: float = 0.5,
                 reducer: Reducer | None = None,
                 anchor_device: torch.device | str | None = None,
                 outer_optimizer: OuterOptimizerFactory | None = None) -> None:
        """`anchor_device`: where the anchors and outer momentum live (default: with each
        parameter; "cpu" keeps them in host memory, the pseudo-gradient is still taken and
        averaged on the parameters' device). `outer_optimizer`: builds each fragment's outer
        optimizer (default: `nesterov_sgd(outer_lr, outer_momentum, nesterov)`)."""
        self.params = [p for p in params if p.requires_grad]
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {inner_steps}")
        if not 1 <= fragments <= inner_steps:
            raise ValueError(f"fragments must be between 1 and inner_steps, got {fragments}")
        if overlap and not 0 < overlap_alpha <= 1:
            # the next pseudo-gradient is anchor - params right after the merge: alpha x the
            # local drift, so alpha 0 would send zeros and stop learning
            raise ValueError(f"overlap_alpha must be in (0, 1], got {overlap_alpha}")
        if overlap and reducer is None and all_reduce_fn is None:
            # the default group belongs to the training thread's collectives
            raise ValueError("overlap needs an all_reduce_fn on a communicator of its own (or a "
                             "reducer): the background thread must not share the default group")
        self.inner = inner_optimizer
        self.inner_steps = inner_steps
        self.all_reduce_fn = all_reduce_fn or default_all_reduce
        self.anchor = [p.detach().to(anchor_device or p.device, copy=True)
                       for p in self.params]
        """The global (outer) model; the outer optimizer steps it."""
        self.bounds = fragment_bounds([p.numel() for p in self.params], fragments)
        """Parameter index range [start, end) of each fragment."""
        self.slots = sync_slots(inner_steps, fragments)
        build = outer_optimizer or nesterov_sgd(outer_lr, outer_momentum, nesterov)
        self.outers = [build(self.anchor[a:b]) for a, b in self.bounds]
        """One outer optimizer per fragment (its own momentum)."""
        self.overlap = overlap
        self.alpha = overlap_alpha if overlap else 0.0
        self.reducer: Reducer | None = None
        if overlap:
            self.reducer = reducer or OverlapSync(
                lambda flat, index: int(self.all_reduce_fn(flat) or 0), lambda: None)
        self.pending: dict[int, OuterJob] = {}
        """Overlap: fragment -> its all-reduce launched last round, not yet applied."""
        self.inner_count = 0
        """Inner steps since the last round ended."""
        self.outer_count = 0
        """Rounds done (every H inner steps; with one fragment and no overlap: outer steps)."""
        self.syncs = 0
        """Fragment syncs started (the number of the next one)."""
        self.bytes_sent = 0
        """Bytes handed to all_reduce_fn (its return value, or the fp32 payload size)."""

    @property
    def fragments(self) -> int:
        """F: fragments of the parameters, each synced once per round."""
        return len(self.bounds)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the inner gradients."""
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step; each fragment's outer step (with communication) at its slot."""
        result = self.inner.step(closure)
        self.inner_count += 1
        for f, slot in enumerate(self.slots):
            if slot == self.inner_count:
                self.sync_fragment(f)
        if self.inner_count >= self.inner_steps:
            self.inner_count = 0
            self.outer_count += 1
        return result

    @torch.no_grad()
    def outer_step(self) -> None:
        """Sync every fragment now and end the round (a joiner's first outer step)."""
        for f in range(self.fragments):
            self.sync_fragment(f)
        self.inner_count = 0
        # one round more, or the round count of a state taken instead (OuterRoundSkipped)
        self.outer_count = self.syncs // self.fragments

    @torch.no_grad()
    def sync_fragment(self, f: int) -> None:
        """Fragment f's outer step: average its pseudo-gradient and step; with overlap, apply
        last round's average (waiting for it if late) and launch this round's."""
        if not self.overlap:
            pseudo = self._pseudo(f)
            try:
                sent = self.all_reduce_fn(pseudo)  # the one communication of DiLoCo
            except OuterRoundSkipped as e:
                self.syncs += 1
                if e.state is not None:
                    self.load_outer_state(e.state)
                return
            self.bytes_sent += int(sent) if sent is not None else pseudo.numel() * 4
            self.syncs += 1
            self._outer_update(f, pseudo)
            return
        job = self.pending.pop(f, None)
        if job is not None:
            try:
                self.reducer.finish(job)
                self._outer_update(f, job.flat)
            except OuterRoundSkipped:  # nobody completed it (hivemind): no outer step; the
                pass  # anchor stays, so the next pseudo-gradient carries this round's drift
        self.pending[f] = self.reducer.launch(self._pseudo(f), self.syncs)
        self.syncs += 1

    def _pseudo(self, f: int) -> torch.Tensor:
        a, b = self.bounds[f]
        return torch.cat([(x.to(p.device) - p.detach()).reshape(-1)
                          for x, p in zip(self.anchor[a:b], self.params[a:b])])

    @torch.no_grad()
    def _outer_update(self, f: int, average: torch.Tensor) -> None:
        """Outer step of fragment f's anchor with `average`, then merge the parameters:
        params = alpha * params + (1 - alpha) * anchor (alpha 0 without overlap: a copy)."""
        a, b = self.bounds[f]
        off = 0
        for x in self.anchor[a:b]:
            n = x.numel()
            x.grad = average[off:off + n].view_as(x).to(x.device, x.dtype)
            off += n
        self.outers[f].step()
        for x, p in zip(self.anchor[a:b], self.params[a:b]):
            x.grad = None
            if self.alpha:
                p.mul_(self.alpha).add_(x.to(p.device), alpha=1 - self.alpha)
            else:
                p.copy_(x)

    @torch.no_grad()
    def restart(self) -> None:
        """Start the outer optimizer afresh from the parameters as they are now (the end of a
        gradient all-reduce warm-up): anchor = params, no momentum, a new round."""
        if self.pending or self.syncs:
            raise RuntimeError("DiLoCo restart: only before the first outer sync")
        for a, p in zip(self.anchor, self.params):
            a.copy_(p.detach())
        for o in self.outers:
            o.state.clear()
        self.inner_count = 0

    @torch.no_grad()
    def outer_state(self) -> OuterState:
        """The outer model, momentum and count, flat (copies: safe to send while training).
        The momentum is SGD's buffer: with another outer optimizer a joiner takes the outer
        model and count, and its optimizer starts afresh (momentum None)."""
        anchor = torch.cat([a.reshape(-1) for a in self.anchor])
        sgd = all(isinstance(o, torch.optim.SGD) for o in self.outers)
        if not sgd or not any(o.state for o in self.outers):
            return OuterState(anchor, None, self.outer_count)
        momentum = torch.cat([self._momentum(a).reshape(-1) for a in self.anchor])
        return OuterState(anchor, momentum, self.outer_count)

    def _momentum(self, a: torch.Tensor) -> torch.Tensor:
        for o in self.outers:
            buf = o.state.get(a, {}).get("momentum_buffer")
            if buf is not None:
                return buf
        return torch.zeros_like(a)

    @torch.no_grad()
    def load_outer_state(self, state: OuterState) -> None:
        """Take over another replica's outer state: parameters and anchor become its outer
        model, the momentum its, inner steps start from zero."""
        n = sum(p.numel() for p in self.params)
        if state.anchor.numel() != n:
            raise ValueError(f"outer state: {state.anchor.numel()} values for {n} parameters")
        off = 0
        for i, (a, p) in enumerate(zip(self.anchor, self.params)):
            k = p.numel()
            a.copy_(state.anchor[off:off + k].view_as(a))
            p.copy_(a)
            outer = self.outers[next(f for f, (lo, hi) in enumerate(self.bounds) if lo <= i < hi)]
            if state.momentum is not None and isinstance(outer, torch.optim.SGD):
                outer.state[a]["momentum_buffer"] = state.momentum[off:off + k].view_as(a).clone()
            off += k
        self.outer_count = state.outer_count
        self.syncs = state.outer_count * self.fragments  # handed over at a round's start
        self.inner_count = 0

    def state_dict(self) -> dict[str, Any]:
        """Inner and outer optimizer state, anchor parameters, counters, and the pseudo-
        gradients of the rounds still pending (as sent; tensors + ints)."""
        pending = [(f, j.index, j.keep.clone())
                   for f, j in sorted(self.pending.items(), key=lambda kv: kv[1].index)]
        return {"inner": self.inner.state_dict(), "outer": [o.state_dict() for o in self.outers],
                "anchor": [a.clone() for a in self.anchor], "inner_count": self.inner_count,
                "outer_count": self.outer_count, "bytes_sent": self.bytes_sent,
                "syncs": self.syncs, "pending": pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict saved, and re-launch the pending all-reduces in order."""
        self.inner.load_state_dict(state["inner"])
        outer = state["outer"] if isinstance(state["outer"], list) else [state["outer"]]
        if len(outer) != len(self.outers):
            raise ValueError(f"DiLoCo state: {len(outer)} fragments, this run has "
                             f"{len(self.outers)}")
        for o, s in zip(self.outers, outer):
            o.load_state_dict(s)
        if len(state["anchor"]) != len(self.anchor):
            raise ValueError("DiLoCo state: number of parameters differs")
        for a, s in zip(self.anchor, state["anchor"]):
            a.copy_(s)
        self.inner_count = int(state["inner_count"])
        self.outer_count = int(state["outer_count"])
        self.bytes_sent = int(state["bytes_sent"])
        self.syncs = int(state.get("syncs", self.outer_count))
        pending = state.get("pending", [])
        if pending and not self.overlap:
            raise ValueError("DiLoCo state: has overlapped all-reduces pending; run with overlap")
        for f, index, keep in pending:
            self.pending[int(f)] = self.reducer.launch(keep.to(self.anchor[0].device).clone(),
                                                       int(index))
