"""Models from a Hugging Face config.json: parsing, refusals by name, plans that record them."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import run_entry
from test_cluster_formats import tiny_cluster_dict

from formats.errors import UserError
from formats.hf_config import hf_config, resolve_model, spec_from_hf
from formats.models import PRESETS
from formats.plan import load_plan

SCHED = "scheduler/scheduler.py"

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 96, "max_position_embeddings": 32, "vocab_size": 256,
         "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
         "hidden_act": "silu", "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
         "torch_dtype": "bfloat16", "transformers_version": "4.44.0", "initializer_range": 0.02}
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 2,
        "n_head": 4, "n_positions": 32, "n_ctx": 32, "vocab_size": 256, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-5,
        "activation_function": "gelu_new", "scale_attn_weights": True}


def write_config(folder, obj) -> str:
    """config.json in `folder` (created); returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(obj))
    return str(folder)


def test_llama_config_maps_every_field(tmp_path):
    spec = resolve_model(write_config(tmp_path / "llama-gqa", LLAMA))
    assert (spec.name, spec.arch, spec.num_layers, spec.d_model, spec.n_heads, spec.kv_heads,
            spec.d_ff, spec.seq_len, spec.vocab_size, spec.rope_theta, spec.norm_eps,
            spec.tie_embeddings) == ("llama-gqa", "llama", 4, 64, 4, 2, 96, 32, 256, 500000.0,
                                     1e-5, False)
    # grouped-query attention: k and v are half as wide as q
    assert spec.kv_dim == 32
    assert spec.layer_params() == 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96 + 2 * 64
    assert spec_from_hf(hf_config(spec), "llama-gqa", "x") == spec


def test_params_and_flops_follow_the_config(tmp_path):
    from modules.model.decoder import StageModel, count_params
    spec = resolve_model(write_config(tmp_path / "m", LLAMA))
    assert count_params(StageModel(spec, 0, spec.num_layers)) == spec.total_params()
    mha = dataclasses.replace(spec, n_kv_heads=0)
    assert spec.layer_flops_per_token() < mha.layer_flops_per_token()
    gpt = resolve_model(write_config(tmp_path / "g", GPT2))
    assert (gpt.arch, gpt.d_ff, gpt.gelu, gpt.tie_embeddings) == ("gpt", 256, "tanh", True)
    assert count_params(StageModel(gpt, 0, gpt.num_layers)) == gpt.total_params() + 256 * 64


def test_a_config_file_path_and_a_preset_name_both_work(tmp_path):
    write_config(tmp_path / "m", LLAMA)
    assert resolve_model(str(tmp_path / "m" / "config.json")).name == "m"
    assert resolve_model("gpt-tiny") is PRESETS["gpt-tiny"]
    with pytest.raises(UserError, match="unknown preset 'gpt-nano'"):
        resolve_model("gpt-nano")
    with pytest.raises(UserError, match="no such file"):
        resolve_model(str(tmp_path / "nothing" / "config.json"))


@pytest.mark.parametrize("change,message", [
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"sliding_window": 4096}, "unsupported keys ['sliding_window']"),
    ({"num_key_value_heads": 3}, "n_kv_heads"),
    ({"head_dim": 32}, "head_dim"),
    ({"hidden_size": "64"}, "d_model must be int"),
    ({"num_hidden_layers": None}, "num_layers must be int"),
])
def test_unsupported_llama_fields_are_refused_by_name(tmp_path, change, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        resolve_model(write_config(tmp_path / "m", {**LLAMA, **change}))


@pytest.mark.parametrize("change,message", [
    ({"resid_pdrop": 0.1}, "resid_pdrop = 0.1 is not supported; this runtime trains without"),
    ({"activation_function": "relu"}, "activation_function 'relu'"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"scale_attn_weights": False}, "scale_attn_weights = false is not supported"),
])
def test_unsupported_gpt2_fields_are_refused_by_name(tmp_path, change, message):
    with pytest.raises(UserError, match=message):
        resolve_model(write_config(tmp_path / "m", {**GPT2, **change}))


def test_planner_records_the_config_and_the_runner_builds_it(tmp_path):
    folder = write_config(tmp_path / "llama-gqa", LLAMA)
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps(tiny_cluster_dict(4)))
    out = tmp_path / "p.json"
    r = run_entry(SCHED, "plan", "--cluster", str(cluster), "--model", folder, "--stages", "2",
                  "--replicas", "2", "--budget", "50", "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    plan = load_plan(out)
    assert plan.model == "llama-gqa"
    assert plan.model_spec() == resolve_model(folder)
    assert plan.model_config["n_kv_heads"] == 2
    r = run_entry(SCHED, "evaluate", "--cluster", str(cluster), "--plan", str(out), "--json")
    assert r.returncode == 0, r.stderr
    bad = write_config(tmp_path / "bad", {**LLAMA, "rope_scaling": {"factor": 2}})
    r = run_entry(SCHED, "plan", "--cluster", str(cluster), "--model", bad, "--stages", "2",
                  "--replicas", "2", "--out", str(tmp_path / "q.json"))
    assert r.returncode == 2 and "rope_scaling" in r.stderr and "Traceback" not in r.stderr


def test_preset_plans_stay_as_they_were(tmp_path):
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps(tiny_cluster_dict(4)))
    out = tmp_path / "p.json"
    r = run_entry(SCHED, "plan", "--cluster", str(cluster), "--model", "gpt-tiny", "--stages",
                  "2", "--replicas", "2", "--budget", "50", "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    assert "model_config" not in json.loads(out.read_text())
