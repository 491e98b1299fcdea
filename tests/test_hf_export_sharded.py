"""scripts/export_hf.py of a run whose stage is held by a shard group (FSDP2, D = 2): every
shard of the replica gathered, the export equal to the same run without shard groups; a
missing shard named."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import run_entry
from test_hf_config import LLAMA, write_config

from formats.hf_config import resolve_model
from formats.models import model_record
from formats.plan import Plan, save_plan

transformers = pytest.importorskip("transformers", reason="pip install -e .[dev] installs it")


def _train(tmp_path, spec, pipelines, name):
    """2 steps of `pipelines` (one stage of the whole model), checkpointed; the ckpt folder."""
    plan = Plan("local", "", spec.name, [(0, spec.num_layers)], pipelines, micro_batch_size=2,
                num_micro_batches=1, model_config=model_record(spec))
    save_plan(plan, tmp_path / f"{name}.json")
    ck = tmp_path / f"{name}-ck"
    r = run_entry("scripts/launch_local.py", "--plan", str(tmp_path / f"{name}.json"),
                  "--threads-per-rank", "1", "--grace-s", "2", "--", "--fake-data", "--steps",
                  "2", "--ckpt-dir", str(ck), "--timeout-s", "60", timeout=200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return ck


def _logits(folder, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.timeout(400)
def test_a_sharded_replica_exports_like_the_unsharded_run(tmp_path):
    spec = resolve_model(write_config(tmp_path / "tiny-llama", LLAMA))
    sharded = _train(tmp_path, spec, [[[0, 1]]], "sharded")
    flat = _train(tmp_path, spec, [[0], [1]], "flat")  # the same batch: 2 lanes = 2 replicas
    for ck, out in ((sharded, tmp_path / "hf-sharded"), (flat, tmp_path / "hf-flat")):
        r = run_entry("scripts/export_hf.py", str(ck), "--out", str(out))
        assert r.returncode == 0, r.stderr
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_len),
                           generator=torch.Generator().manual_seed(3))
    got, want = _logits(tmp_path / "hf-sharded", tokens), _logits(tmp_path / "hf-flat", tokens)
    assert (got - want).abs().max().item() < 1e-4
    # a shard's checkpoint missing: named, nothing written
    shutil.rmtree(sharded / "rank1")
    r = run_entry("scripts/export_hf.py", str(sharded), "--out", str(tmp_path / "partial"))
    assert r.returncode == 2 and "stage 0 of replica 0 is sharded D = 2 ways but shard(s) " \
        "[1] have no checkpoint" in r.stderr, r.stderr
    assert not (tmp_path / "partial").exists()
