"""The inner optimizer and its learning-rate schedule, the same in the runtime (the Trainer) and
in single-process references (testkit.reference)."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from modules.config import RunConfig


def make_inner_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """AdamW with GPT-style betas; the same in the runtime and in single-process references."""
    params = list(model.parameters())
    # FSDP's DTensor parameters: the multi-tensor (foreach) kernels, one DTensor dispatch per
    # op for all of them; the per-parameter loop dispatched each op of each parameter
    sharded = any(isinstance(p, DTensor) for p in params)
    return torch.optim.AdamW(params, lr=cfg.optim.lr, betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=cfg.optim.weight_decay, foreach=sharded or None)


def lr_factor(step: int, cfg: RunConfig) -> float:
    """Multiplier of the learning rate for optimizer step `step` (0-based): warm-up, then the
    schedule."""
    if step < cfg.optim.warmup_steps:
        return (step + 1) / cfg.optim.warmup_steps
    if cfg.optim.lr_schedule == "cosine":
        span = max(1, cfg.steps - cfg.optim.warmup_steps)
        progress = min(1.0, (step - cfg.optim.warmup_steps) / span)
        low = cfg.optim.min_lr_ratio
        return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0


def set_lr(opt: torch.optim.Optimizer, step: int, cfg: RunConfig) -> None:
    """Set the (inner) optimizer's learning rate for step `step`; a pure function of the step."""
    for group in opt.param_groups:
        group["lr"] = cfg.optim.lr * lr_factor(step, cfg)
