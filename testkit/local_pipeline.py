"""One replica's pipeline run stage after stage in one process: the runtime's step without the wire.

What dist_runner does per step for one replica, on one device, so precision, torch.compile and
GPU behaviour can be checked without processes: activations and their gradients cross every
stage boundary in the precision's wire dtype (`Precision.to_wire`/`from_wire`), the last stage
scales the loss, the tied embedding copies get their summed gradient, and every stage steps
with the overflow flag agreed over the pipeline (the MAX of the stages' own flags).
AdamW has the runtime's settings (betas 0.9/0.95, eps 1e-8, weight decay 0.1), constant lr.
"""

from __future__ import annotations

import torch

from formats.models import ModelSpec
from modules.data.dataset import TextData
from modules.device.compile import maybe_compile
from modules.device.precision import Precision
from modules.device.select import to_device
from modules.model.decoder import StageModel


class LocalPipeline:
    """Stages [(start, end), ...] of `spec` on `precision.device`, trained one batch per step."""

    def __init__(self, spec: ModelSpec, splits: list[tuple[int, int]], precision: Precision,
                 seed: int = 0, compile: bool = False, lr: float = 1e-3, **scaler_kwargs) -> None:
        self.precision = precision
        self.stages = [maybe_compile(StageModel(spec, a, b, seed=seed).to(precision.device),
                                     compile) for a, b in splits]
        self.opts = [torch.optim.AdamW(s.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8,
                                       weight_decay=0.1) for s in self.stages]
        # agree=None: the pipeline's agreement is done here, as the MAX over the stages' flags
        self.scalers = [precision.loss_scaling(None, **scaler_kwargs) for _ in self.stages]
        self.skipped = 0
        """Steps skipped because some stage's gradients overflowed (fp16)."""

    def _forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[list, list]:
        """Inputs and outputs of every stage; what crosses a boundary is cast to the wire dtype."""
        p = self.precision
        ins, outs, h = [], [], x
        for i, stage in enumerate(self.stages):
            inp = h if i == 0 else p.from_wire(h).requires_grad_()
            with p.autocast():
                out = stage(inp, y) if stage.is_last else stage(inp)
            ins.append(inp)
            outs.append(out)
            if not stage.is_last:
                h = p.to_wire(out.detach())
        return ins, outs

    def _backward(self, ins: list, outs: list) -> None:
        """Last stage: the scaled loss; the others: the received (wire-dtype) gradient."""
        p, grad = self.precision, None
        for i in reversed(range(len(self.stages))):
            if i == len(self.stages) - 1:
                self.scalers[i].scale_loss(outs[i]).backward()
            else:
                outs[i].backward(p.from_wire(grad))
            if i > 0:
                grad = p.to_wire(ins[i].grad)

    def _sum_tied(self) -> None:
        """Give the embedding and the head copy the sum of their gradients, as the runtime does."""
        tied = [t for stage in self.stages for t in stage.tied_pair()]
        if len(tied) == 2:
            total = tied[0].grad + tied[1].grad
            tied[0].grad.copy_(total)
            tied[1].grad.copy_(total)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One training step on the batch (x, y); returns its (unscaled) loss."""
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)
        x, y = to_device((x, y), self.precision.device)
        ins, outs = self._forward(x, y)
        self._backward(ins, outs)
        self._sum_tied()
        overflow = any([s.found_overflow(o) for s, o in zip(self.scalers, self.opts)])
        for scaler, opt in zip(self.scalers, self.opts):
            scaler.step(opt, overflow=overflow)
        self.skipped += overflow
        return float(outs[-1].detach())


def train_losses(pipe: LocalPipeline, data: TextData, steps: int, batch: int) -> list[float]:
    """Train `steps` steps on consecutive batches of the data's seeded order; every step's loss."""
    return [pipe.step(*data.samples(k * batch, batch)) for k in range(steps)]
