"""Single-process reference training: the full model on the runtime's global batches.

A plan of S stages x R replicas with sync `allreduce` must reproduce these losses; tests and
benchmarks compare against it.
"""

from __future__ import annotations

from formats.plan import Plan
from modules.config import RunConfig
from modules.data.dataset import FakeData, Sharder, TextData
from modules.train.model import StageModel, tie_weights_
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
