"""S stages x R replicas with sync allreduce train exactly like one process on the global batch.

Each case starts every rank of a plan with scripts/launch_local.py (gloo on 127.0.0.1, one thread
per rank) on the real corpus, and compares the per-step mean loss over replicas with
testkit.reference (the full, truly tied model) within 1e-5 relative.
"""

from __future__ import annotations

import pytest
import torch

from formats.models import get_model
from formats.plan import Plan, save_plan
from modules.config import RunConfig
from modules.data.dataset import DEFAULT_CORPUS, TextData, load_tokens
from modules.train.metrics import read_metrics, replica_metrics_path
from testkit.reference import reference_losses
from tests.conftest import run_entry

STEPS = 4


def corpus_or_skip():
    if not DEFAULT_CORPUS.exists():
        pytest.skip("Debian fortunes not installed (apt-get install fortunes fortunes-min)")
    return DEFAULT_CORPUS


def run_plan(tmp_path, plan: Plan, *extra: str, timeout: float = 150):
    """Launch all ranks of `plan`; returns (completed process, metrics path)."""
    plan_path, metrics = tmp_path / "plan.json", tmp_path / "metrics.jsonl"
    save_plan(plan, plan_path)
    proc = run_entry("scripts/launch_local.py", "--plan", str(plan_path),
                     "--threads-per-rank", "1", "--", "--metrics", str(metrics),
                     "--timeout-s", "60", *extra, timeout=timeout)
    return proc, metrics


def replica_mean_losses(metrics, num_replicas: int) -> list[float]:
    per_replica = [[r["loss"] for r in read_metrics(replica_metrics_path(metrics, k))]
                   for k in range(num_replicas)]
    return torch.tensor(per_replica, dtype=torch.float64).mean(0).tolist()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stages,pipelines,mbs,nmb", [
    ([(0, 2), (2, 4)], [[0, 3], [2, 1]], 2, 2),        # 2 stages x 2 replicas, shuffled ids
    ([(0, 1), (1, 3), (3, 4)], [[2, 0, 1]], 2, 3),      # 3 uneven stages x 1 replica
], ids=["2x2", "3x1"])
def test_pipeline_matches_single_process(tmp_path, stages, pipelines, mbs, nmb):
    corpus = corpus_or_skip()
    plan = Plan("local", "", "gpt-tiny", stages, pipelines, micro_batch_size=mbs,
                num_micro_batches=nmb)
    proc, metrics = run_plan(tmp_path, plan, "--steps", str(STEPS), "--data", str(corpus))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = replica_mean_losses(metrics, plan.num_replicas)
    spec = get_model("gpt-tiny")
    torch.set_num_threads(1)
    want = reference_losses(plan, TextData(load_tokens(corpus), spec.seq_len, spec.vocab_size),
                            RunConfig(steps=STEPS))
    assert len(got) == STEPS
    assert want[-1] < want[0]  # it trains
    got_t, want_t = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    print("max relative difference", float(((got_t - want_t).abs() / want_t).max()))
    torch.testing.assert_close(got_t, want_t, rtol=1e-5, atol=0)
