"""Configs as the installed transformers writes them (transformers 5: `rope_parameters`): read,
planned, trained by path and exported (with a byte-level tokenizer.json AutoTokenizer loads);
other rope types refused by name."""

from __future__ import annotations

import json

import pytest
from conftest import run_entry
from test_cluster_formats import tiny_cluster_dict
from test_hf_config import LLAMA, write_config

from formats.errors import UserError
from formats.hf_config import resolve_model
from modules.train.metrics import read_metrics

transformers = pytest.importorskip("transformers", reason="pip install -e .[dev] installs it")

SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 96, "max_position_embeddings": 32,
         "vocab_size": 256}


def test_rope_parameters_read_as_rope_theta(tmp_path):
    old = resolve_model(write_config(tmp_path / "m", LLAMA))
    new = {k: v for k, v in LLAMA.items() if k != "rope_theta"}
    new["rope_parameters"] = {"rope_type": "default", "rope_theta": LLAMA["rope_theta"]}
    assert resolve_model(write_config(tmp_path / "m", new)) == old


@pytest.mark.parametrize("rope,message", [
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
     'rope_parameters.rope_type "linear" is not supported; only "default"'),
    ({"rope_type": "llama3", "factor": 8.0}, 'rope_type "llama3"'),
    ({"rope_type": "default", "rope_theta": 1e4, "factor": 2.0},
     r"unsupported keys \['factor'\] in rope_parameters"),
    ({"rope_type": "default", "rope_theta": 1e4}, "rope_theta 500000.0 and rope_parameters"),
    ("default", "rope_parameters must be an object"),
])
def test_other_rope_parameters_refused_by_name(tmp_path, rope, message):
    with pytest.raises(UserError, match=message):
        resolve_model(write_config(tmp_path / "m", {**LLAMA, "rope_parameters": rope}))


@pytest.mark.timeout(240)
def test_a_saved_llama_is_planned_and_trained_by_path(tmp_path):
    import torch
    torch.manual_seed(0)
    folder = tmp_path / "saved-llama"
    config = transformers.LlamaConfig(**SMALL)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    written = json.loads((folder / "config.json").read_text())
    spec = resolve_model(str(folder))
    assert (spec.name, spec.num_layers, spec.kv_heads, spec.rope_theta) == \
        ("saved-llama", 2, 2, float(getattr(config, "rope_theta", None) or
                                    config.rope_parameters["rope_theta"]))
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps(tiny_cluster_dict(2)))
    plan = tmp_path / "p.json"
    r = run_entry("scheduler/scheduler.py", "plan", "--cluster", str(cluster), "--model",
                  str(folder), "--stages", "2", "--replicas", "1", "--micro-batches", "2",
                  "--budget", "20", "--out", str(plan), "--quiet")
    assert r.returncode == 0, r.stderr
    metrics = tmp_path / "m.jsonl"
    r = run_entry("scripts/launch_local.py", "--plan", str(plan), "--threads-per-rank", "1",
                  "--grace-s", "2", "--", "--init-from", str(folder), "--fake-data", "--steps",
                  "3", "--metrics", str(metrics), "--timeout-s", "60", "--ckpt-dir",
                  str(tmp_path / "ck"), "--ckpt-every", "3", timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [m["step"] for m in read_metrics(metrics)] == [1, 2, 3]
    # what this transformers writes is what the test covers (4.x: rope_theta; 5.x: both forms)
    assert "rope_parameters" in written or "rope_theta" in written
    check_export(tmp_path, tmp_path / "ck")


def check_export(tmp_path, ck) -> None:
    """The byte-tokenized run's export loads with AutoTokenizer (the runtime's byte ids) and
    AutoModelForCausalLM, and --init-from of it reads bytes again."""
    import numpy as np
    import torch

    from modules.data.tokenizer import ByteTokenizer
    from modules.train.hf_weights import init_tokenizer

    out = tmp_path / "exported"
    r = run_entry("scripts/export_hf.py", str(ck), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "tokenizer.json" in r.stdout
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "Grüße, world!\n\t<s> 42 €"
    ids = tok(text)["input_ids"]
    assert ids == ByteTokenizer().encode([text.encode()], "x")[0].astype(np.int64).tolist()
    assert tok.decode(ids) == text
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 256) and torch.isfinite(logits).all()
    assert init_tokenizer(str(out), None) == "bytes"


def test_measure_takes_a_config_path_like_the_planner(tmp_path):
    hosts = tmp_path / "ip_list"
    hosts.write_text("root@127.0.0.1:1\n")
    (tmp_path / "kh").write_text("")
    bad = write_config(tmp_path / "bad", {**LLAMA, "rope_parameters": {"rope_type": "yarn"}})
    r = run_entry("scripts/measure.py", "--hosts", str(hosts), "--known-hosts",
                  str(tmp_path / "kh"), "--model", bad, "--out", str(tmp_path / "c.json"))
    assert r.returncode == 2 and f"--model {bad}/config.json: rope_parameters.rope_type " \
        '"yarn" is not supported' in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run_entry("scripts/measure.py", "--hosts", str(hosts), "--known-hosts",
                  str(tmp_path / "kh"), "--model", "gpt-huge", "--out", str(tmp_path / "c.json"))
    assert r.returncode == 2 and "unknown preset 'gpt-huge'" in r.stderr, r.stderr
