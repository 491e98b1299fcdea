"""scripts/export_hf.py: a run's checkpoints -> a folder transformers loads with the same logits
(pipelined and unpipelined, LLaMA with GQA and GPT-2); refusals named."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_entry
from test_hf_config import GPT2, LLAMA, write_config

from formats.hf_config import resolve_model
from formats.models import model_record
from formats.plan import Plan, SyncConfig, save_plan
from modules.model.decoder import StageModel
from modules.train.checkpoint import complete_steps, load_checkpoint, step_path

transformers = pytest.importorskip("transformers", reason="pip install -e .[dev] installs it")


def train(tmp_path, spec, stages, steps=2, extra=()):
    """Train `steps` steps of one replica with --ckpt-dir; returns the checkpoint folder."""
    plan = Plan("local", "", spec.name, stages, [list(range(len(stages)))], micro_batch_size=2,
                num_micro_batches=2, sync=SyncConfig(), model_config=model_record(spec))
    save_plan(plan, tmp_path / "plan.json")
    ck = tmp_path / "ck"
    r = run_entry("scripts/launch_local.py", "--plan", str(tmp_path / "plan.json"),
                  "--threads-per-rank", "1", "--grace-s", "2", "--", "--fake-data", "--steps",
                  str(steps), "--ckpt-dir", str(ck), "--metrics", str(tmp_path / "m.jsonl"),
                  "--timeout-s", "60", *extra, timeout=150)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return ck


def runtime_logits(ck, spec, stages, tokens):
    """Logits of the trained stages, run one after the other in our model code."""
    h = tokens
    for s, (a, b) in enumerate(stages):
        model = StageModel(spec, a, b, seed=None)
        model.load_state_dict(load_checkpoint(step_path(ck, s, complete_steps(ck, s)[-1]),
                                              {})["model"])
        h = model.eval()(h)
    return h


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,stages", [("llama", [(0, 2), (2, 4)]), ("gpt2", [(0, 2)])])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, family, stages):
    config = dict(LLAMA) if family == "llama" else {**GPT2, "tie_word_embeddings": True}
    spec = resolve_model(write_config(tmp_path / f"tiny-{family}", config))
    ck = train(tmp_path, spec, stages)
    out = tmp_path / "hf"
    r = run_entry("scripts/export_hf.py", str(ck), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert f"{len(stages)} stage(s)" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_len),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(tokens).logits
        ours = runtime_logits(ck, spec, stages, tokens)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-4
    # the trained weights moved away from the initialisation: a real comparison
    with torch.no_grad():
        fresh = StageModel(spec, 0, spec.num_layers, seed=0).eval()(tokens)
    assert (fresh - theirs).abs().max().item() > 1e-3


@pytest.mark.timeout(200)
def test_sharded_export_and_refusals(tmp_path):
    spec = resolve_model(write_config(tmp_path / "tiny", {**LLAMA, "vocab_size": 4096}))
    ck = train(tmp_path, spec, [(0, 4)], steps=1)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert run_entry("scripts/export_hf.py", str(ck), "--out", str(whole)).returncode == 0
    r = run_entry("scripts/export_hf.py", str(ck), "--out", str(parts), "--max-shard-mb", "1")
    assert r.returncode == 0, r.stderr
    index = json.loads((parts / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    tokens = torch.randint(0, 4096, (1, 16), generator=torch.Generator().manual_seed(2))
    logits = [transformers.AutoModelForCausalLM.from_pretrained(d).eval()(tokens).logits
              for d in (whole, parts)]
    assert torch.equal(logits[0], logits[1])
    for args, message in [
        ((str(ck), "--out", str(whole)), "exists and is not an empty folder"),
        ((str(tmp_path / "tiny"), "--out", str(tmp_path / "x")), "no rank*/ checkpoint folders"),
        ((str(ck), "--out", str(tmp_path / "x"), "--replica", "1"), "--replica 1: no complete"),
        ((str(ck), "--out", str(tmp_path / "x"), "--step", "7"), "--step 7: not complete"),
    ]:
        r = run_entry("scripts/export_hf.py", *args)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "x").exists()
