"""--init-from: each stage loads its own tensors of a Hugging Face folder, checked; the export
of a run, loaded back, gives the first-step loss that run's weights give."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_entry
from safetensors.torch import load_file, save_file
from test_hf_config import LLAMA, write_config
from test_hf_export import train

from formats.errors import UserError
from formats.hf_config import resolve_model
from modules.data.dataset import FakeData, Sharder
from modules.model.decoder import StageModel
from modules.train.checkpoint import complete_steps, load_checkpoint, step_path
from modules.train.hf_weights import (
    check_init_from,
    init_tokenizer,
    load_stage_weights,
    to_hf,
)
from modules.train.metrics import read_metrics


def hf_folder(tmp_path, config=LLAMA, seed=5):
    """A Hugging Face folder of a seeded model (our export's layout)."""
    spec = resolve_model(write_config(tmp_path / "hf", config))
    full = StageModel(spec, 0, spec.num_layers, seed=seed)
    save_file(to_hf(spec, full.state_dict()), str(tmp_path / "hf" / "model.safetensors"))
    return spec, full, tmp_path / "hf"


def test_each_stage_loads_its_own_layers(tmp_path):
    spec, full, folder = hf_folder(tmp_path)
    for a, b in ((0, 1), (1, 3), (3, 4)):
        stage = StageModel(spec, a, b, seed=0)
        assert load_stage_weights(stage, spec, str(folder)) == len(stage.state_dict())
        for name, tensor in stage.state_dict().items():
            assert torch.equal(tensor, full.state_dict()[name]), name


def test_missing_mismatched_and_foreign_tensors_are_named(tmp_path):
    spec, _, folder = hf_folder(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    stage = StageModel(spec, 2, 4, seed=0)
    for change, message in [
        (lambda t: t.pop("model.layers.3.self_attn.k_proj.weight"),
         "tensor model.layers.3.self_attn.k_proj.weight is missing"),
        (lambda t: t.__setitem__("lm_head.weight", torch.zeros(255, 64)),
         r"tensor lm_head.weight has shape \[255, 64\], the model needs \[256, 64\]"),
        (lambda t: t.__setitem__("model.norm.weight", torch.zeros(64, dtype=torch.int32)),
         "tensor model.norm.weight has dtype I32, not a float"),
    ]:
        bad = dict(tensors)
        change(bad)
        save_file(bad, str(folder / "model.safetensors"))
        with pytest.raises(UserError, match=message):
            load_stage_weights(stage, spec, str(folder))
    # stage 0 needs none of what was changed: it still loads
    save_file({k: v for k, v in tensors.items() if "layers.3" not in k},
              str(folder / "model.safetensors"))
    load_stage_weights(StageModel(spec, 0, 2, seed=0), spec, str(folder))


def test_config_and_tokenizer_of_the_folder(tmp_path):
    spec, _, folder = hf_folder(tmp_path)
    check_init_from(str(folder), spec)
    with pytest.raises(UserError, match=r"differs from the run's model .*d_ff 96 \(run: 128\)"):
        check_init_from(str(folder), resolve_model(write_config(
            tmp_path / "other", {**LLAMA, "intermediate_size": 128})))
    with pytest.raises(UserError, match="not a folder"):
        check_init_from(str(tmp_path / "nope"), spec)
    assert init_tokenizer(str(folder), None) == "bytes"
    (folder / "tokenizer.json").write_text("{}")
    assert init_tokenizer(str(folder), None) == str(folder / "tokenizer.json")
    assert init_tokenizer(str(folder), "bytes") == "bytes"


def reference_loss(ck, spec, stages):
    """Mean loss of the run's final weights on the first step's batch of a fresh run."""
    x, y = Sharder(FakeData(spec.seq_len, spec.vocab_size, seed=0), 1, 2, 2).micro_batches(0, 0)
    models = []
    for s, (a, b) in enumerate(stages):
        models.append(StageModel(spec, a, b, seed=None).eval())
        path = step_path(ck, s, complete_steps(ck, s)[-1])
        models[-1].load_state_dict(load_checkpoint(path, {})["model"])
    losses = []
    with torch.no_grad():
        for xi, yi in zip(x, y, strict=True):
            h = xi
            for m in models[:-1]:
                h = m(h)
            losses.append(models[-1](h, yi).item())
    return sum(losses) / len(losses)


@pytest.mark.timeout(400)
def test_init_from_the_export_gives_the_runs_loss(tmp_path):
    spec = resolve_model(write_config(tmp_path / "tiny-llama", LLAMA))
    stages = [(0, 2), (2, 4)]
    ck = train(tmp_path / "a", spec, stages, steps=3)
    out = tmp_path / "hf"
    assert run_entry("scripts/export_hf.py", str(ck), "--out", str(out)).returncode == 0
    want = reference_loss(ck, spec, stages)
    train(tmp_path / "b", spec, stages, steps=1, extra=("--init-from", str(out)))
    got = [r["loss"] for r in read_metrics(tmp_path / "b" / "m.jsonl")]
    first_a = [r["loss"] for r in read_metrics(tmp_path / "a" / "m.jsonl")][0]
    assert abs(got[0] - want) < 1e-5, (got, want)
    assert abs(got[0] - first_a) > 1e-3  # not the fresh initialisation's loss
    # a folder of another model is refused before any rendezvous
    (out / "config.json").write_text(json.dumps({**LLAMA, "num_hidden_layers": 2}))
    with pytest.raises(AssertionError, match="num_layers 2"):
        train(tmp_path / "c", spec, stages, steps=1, extra=("--init-from", str(out)))


@pytest.mark.timeout(300)
def test_the_runs_tokenizer_travels_with_the_export_and_back(tmp_path):
    from test_data_formats import _docs

    from formats.models import get_model
    from modules.data.tokenizer import HFTokenizer
    from modules.train.checkpoint import load_checkpoint_meta
    from scripts import train_tokenizer

    (tmp_path / "corpus.txt").write_text("\n\n".join(_docs(300, seed=1)), encoding="utf-8")
    tok = tmp_path / "tok.json"
    assert train_tokenizer.main(["--data", str(tmp_path / "corpus.txt"), "--vocab-size", "400",
                                 "--out", str(tok)]) == 0
    spec = get_model("gpt-tiny")
    ck = train(tmp_path / "a", spec, [(0, 4)], steps=1, extra=("--tokenizer", str(tok)))
    out = tmp_path / "hf"
    r = run_entry("scripts/export_hf.py", str(ck), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert (out / "tokenizer.json").read_bytes() == tok.read_bytes()
    vocab = HFTokenizer(tok).ident.vocab_size
    assert json.loads((out / "config.json").read_text())["vocab_size"] == vocab != 256
    # no --tokenizer: the folder's tokenizer.json gives the vocabulary the weights have
    ck_b = train(tmp_path / "b", spec, [(0, 4)], steps=1, extra=("--init-from", str(out)))
    meta = load_checkpoint_meta(step_path(ck_b, 0, 1), {})[0]
    assert meta["tokenizer"] == load_checkpoint_meta(step_path(ck, 0, 1), {})[0]["tokenizer"]
    assert meta["tokenizer"]["vocab_size"] == vocab
