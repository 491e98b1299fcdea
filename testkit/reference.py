"""Single-process reference training: the full model on the runtime's global batches.

A plan of S stages x R replicas with sync `allreduce` must reproduce these losses; tests and
benchmarks compare against it. A DiLoCo plan (its warm-up included) must reproduce
`threaded_diloco_losses`: R full models in threads, DiLoCoOptimizer used by hand.
"""

from __future__ import annotations

import threading

import torch

from formats.plan import Plan
from modules.config import RunConfig
from modules.data.dataset import FakeData, Sharder, TextData
from modules.model.decoder import StageModel, tie_weights_
from modules.sync.diloco import DiLoCoOptimizer
from modules.train.trainer import make_inner_optimizer, set_lr


def reference_losses(plan: Plan, data: TextData | FakeData, cfg: RunConfig) -> list[float]:
    """Train the whole (truly tied) model on every step's global batch; loss of each step."""
    spec = plan.model_spec()
    model = StageModel(spec, 0, spec.num_layers, seed=cfg.seed)
    if spec.tie_embeddings:
        tie_weights_(model)
    opt = make_inner_optimizer(model, cfg)
    sharder = Sharder(data, plan.num_replicas, plan.num_micro_batches, plan.micro_batch_size)
    losses = []
    for step in range(cfg.steps):
        x, y = data.samples(step * sharder.global_batch, sharder.global_batch)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        set_lr(opt, step, cfg)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def threaded_diloco_losses(plan: Plan, data: TextData | FakeData,
                           cfg: RunConfig) -> list[list[float]]:
    """DiLoCo's rule by hand, each replica's loss of each step: R full (tied) models in
    threads; steps 0..W-1 (plan.sync.warmup_steps) average the gradients through a thread
    barrier and step AdamW, then DiLoCoOptimizer (restarted at the weights of step W) averages
    its pseudo-gradients the same way every H steps. The average sums in replica order and
    divides by R, as the runtime's all-reduce does."""
    spec, R, w = plan.model_spec(), plan.num_replicas, plan.sync.warmup_steps
    sharder = Sharder(data, R, plan.num_micro_batches, plan.micro_batch_size)
    slots: list = [None] * R
    barrier = threading.Barrier(R, timeout=60)
    losses: list[list[float]] = [[] for _ in range(R)]

    def reduce(r: int, t: torch.Tensor) -> None:
        slots[r] = t.clone()
        barrier.wait()
        t.copy_(sum(slots[1:], slots[0]) / R)
        barrier.wait()

    def worker(r: int) -> None:
        model = tie_weights_(StageModel(spec, 0, spec.num_layers, seed=cfg.seed))
        inner = make_inner_optimizer(model, cfg)
        opt = DiLoCoOptimizer(model.parameters(), inner, inner_steps=plan.sync.inner_steps,
                              all_reduce_fn=lambda t: reduce(r, t))
        for step in range(cfg.steps):
            xs, ys = sharder.micro_batches(step, r)
            opt.zero_grad()
            loss = model(torch.cat(xs), torch.cat(ys))
            loss.backward()
            set_lr(inner, step, cfg)
            if step < w:
                for p in model.parameters():
                    reduce(r, p.grad)
                inner.step()
                if step + 1 == w:
                    opt.restart()
            else:
                opt.step()
            losses[r].append(float(loss.detach()))

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(R)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return losses
