"""Hugging Face `config.json` <-> ModelSpec, for the two families the model code builds.

`--model` (planner and runner) takes a preset name or the path of a config.json (or of the folder
holding one). Supported: `model_type` llama (RMSNorm, SwiGLU, RoPE with rope_theta, grouped-query
attention, tied or untied embeddings; transformers 5's `rope_parameters` of rope type
"default" too) and gpt2 (LayerNorm, GELU, learned positions, biases).
Every key of the file is either mapped, checked to have the one value the model code implements,
or known to describe nothing the training computes (ids, dtype, generation settings); any other
key is refused by name, so a setting is never silently ignored. The sequence length is the
config's `max_position_embeddings` (`n_positions` for GPT-2). Pure python: no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from formats.errors import UserError
from formats.model_size import check_model_size
from formats.models import PRESETS, ModelSpec, check_spec, get_model
from formats.safe_files import load_strict_json

CONFIG_NAME = "config.json"
INERT_KEYS = frozenset({
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
    "_name_or_path", "name_or_path", "output_attentions", "output_hidden_states",
    "return_dict", "is_decoder", "task_specific_params", "tokenizer_class", "use_return_dict",
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
    "summary_first_dropout", "n_ctx", "max_length", "id2label", "label2id",
    "problem_type", "keys_to_ignore_at_inference"})
"""Keys that change nothing the training computes (token ids, dtype, generation, metadata)."""

LLAMA_MAP = {"num_hidden_layers": "num_layers", "hidden_size": "d_model",
             "num_attention_heads": "n_heads", "intermediate_size": "d_ff",
             "max_position_embeddings": "seq_len", "vocab_size": "vocab_size",
             "num_key_value_heads": "n_kv_heads", "rope_theta": "rope_theta",
             "rms_norm_eps": "norm_eps", "tie_word_embeddings": "tie_embeddings"}
LLAMA_DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                  "num_key_value_heads": 0}
LLAMA_FIXED = {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,),
               "rope_scaling": (None,), "pretraining_tp": (1,), "attention_dropout": (0, 0.0)}
GPT2_MAP = {"n_layer": "num_layers", "n_embd": "d_model", "n_head": "n_heads",
            "n_inner": "d_ff", "n_positions": "seq_len", "vocab_size": "vocab_size",
            "layer_norm_epsilon": "norm_eps", "tie_word_embeddings": "tie_embeddings",
            "activation_function": "gelu"}
GPT2_DEFAULTS = {"layer_norm_epsilon": 1e-5, "tie_word_embeddings": True, "n_inner": None,
                 "activation_function": "gelu_new"}
GPT2_FIXED = {"resid_pdrop": (0, 0.0), "embd_pdrop": (0, 0.0), "attn_pdrop": (0, 0.0),
              "scale_attn_by_inverse_layer_idx": (False,), "reorder_and_upcast_attn": (False,),
              "add_cross_attention": (False,), "scale_attn_weights": (True,)}
GELUS = {"gelu": "exact", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
FAMILIES = {"llama": (LLAMA_MAP, LLAMA_DEFAULTS, LLAMA_FIXED),
            "gpt2": (GPT2_MAP, GPT2_DEFAULTS, GPT2_FIXED)}
HINT = {"dropout": "this runtime trains without dropout: set it to 0.0",
        "rope_scaling": "RoPE scaling (long-context) is not implemented: set it to null"}


def config_path(text: str) -> Path | None:
    """The config.json `--model` names (a file or a folder holding one); None: not a path."""
    path = Path(text)
    if path.is_dir():
        path = path / CONFIG_NAME
    if path.suffix == ".json" or path.exists():
        return path
    return None


def resolve_model(text: str, flag: str = "--model") -> ModelSpec:
    """A preset by name, or the spec of a Hugging Face config.json (UserError naming `flag`)."""
    if text in PRESETS:
        return get_model(text)
    path = config_path(text)
    if path is None:
        if "/" in text or text.endswith(".json"):
            raise UserError(f"{flag} {text}: no such file or folder with a {CONFIG_NAME}")
        return get_model(text)  # unknown preset: lists the known ones
    if not path.exists() and not path.is_symlink():
        raise UserError(f"{flag} {text}: no such file ({path})")
    # a regular file of bounded size, depth and numbers: a FIFO, /dev/zero, NaN... refused
    obj = load_strict_json(path, flag)
    name = path.parent.name if path.name == CONFIG_NAME else path.stem
    return spec_from_hf(obj, name or "model", f"{flag} {path}")


def spec_from_hf(obj: Any, name: str, where: str) -> ModelSpec:
    """The ModelSpec of a Hugging Face config object; UserError naming any unsupported key."""
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object")
    family = obj.get("model_type")
    if family not in FAMILIES:
        raise UserError(f"{where}: model_type {family!r} is not supported; supported: "
                        f"{', '.join(FAMILIES)} (architectures LlamaForCausalLM, "
                        "GPT2LMHeadModel)")
    mapping, defaults, fixed = FAMILIES[family]
    if family == "llama" and "rope_parameters" in obj:
        obj = _flatten_rope(obj, where)
    _check_keys(obj, mapping, fixed, where)
    values = {**defaults, **obj}
    out: dict[str, Any] = {"name": name, "arch": "llama" if family == "llama" else "gpt"}
    for key, field in mapping.items():
        if key not in values:
            raise UserError(f"{where}: missing {key!r}")
        out[field] = values[key]
    if family == "gpt2":
        out["d_ff"] = out["d_ff"] or 4 * out["d_model"]
        if out["gelu"] not in GELUS:
            raise UserError(f"{where}: activation_function {out['gelu']!r} is not supported; "
                            f"supported: {', '.join(GELUS)}")
        out["gelu"] = GELUS[out["gelu"]]
    out["n_kv_heads"] = out.get("n_kv_heads") or 0
    _check_types(out, where)
    spec = ModelSpec(**out)
    check_spec(spec, where)
    if obj.get("head_dim", spec.d_model // spec.n_heads) != spec.d_model // spec.n_heads:
        width, heads = (("hidden_size", "num_attention_heads") if family == "llama"
                        else ("n_embd", "n_head"))
        raise UserError(f"{where}: head_dim {obj['head_dim']} != {width} / {heads} "
                        f"({spec.d_model // spec.n_heads}) is not supported")
    # before anything is built: 10^7 layers of 10^7 wide pass every per-field bound
    check_model_size(spec, where, {field: key for key, field in mapping.items()})
    return spec


def _flatten_rope(obj: dict, where: str) -> dict:
    """transformers 5's `rope_parameters` (rope_type "default" with rope_theta) read as the
    `rope_theta` key transformers 4 writes; any other rope type is refused by name."""
    rope, out = obj["rope_parameters"], {k: v for k, v in obj.items() if k != "rope_parameters"}
    if rope is None:
        return out
    if not isinstance(rope, dict):
        raise UserError(f"{where}: rope_parameters must be an object, got {json.dumps(rope)}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise UserError(f"{where}: rope_parameters.rope_type {json.dumps(kind)} is not "
                        "supported; only \"default\" (RoPE scaling is not implemented)")
    extra = sorted(set(rope) - {"rope_type", "type", "rope_theta"})
    if extra:
        raise UserError(f"{where}: unsupported keys {extra} in rope_parameters; the model code "
                        "implements rope_type \"default\" with rope_theta")
    if "rope_theta" in rope:
        if "rope_theta" in obj and obj["rope_theta"] != rope["rope_theta"]:
            raise UserError(f"{where}: rope_theta {obj['rope_theta']} and "
                            f"rope_parameters.rope_theta {rope['rope_theta']} differ")
        out["rope_theta"] = rope["rope_theta"]
    return out


def _check_keys(obj: dict, mapping: dict, fixed: dict, where: str) -> None:
    """Refuse keys this code does not implement, and fixed keys with another value."""
    allowed = set(mapping) | set(fixed) | INERT_KEYS | {"head_dim"}
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise UserError(f"{where}: unsupported keys {unknown}; the model code implements "
                        f"{sorted(set(mapping) | set(fixed))} (remove them or convert the model)")
    for key, ok in fixed.items():
        if key in obj and not any(type(obj[key]) is type(v) and obj[key] == v for v in ok):
            hint = HINT.get("dropout" if "drop" in key else key, f"only {ok[0]!r} is supported")
            raise UserError(f"{where}: {key} = {json.dumps(obj[key])} is not supported; {hint}")


def _check_types(out: dict, where: str) -> None:
    for key, value in out.items():
        if key in ("name", "arch", "gelu"):
            continue
        want = (bool if key == "tie_embeddings" else float if key in ("rope_theta", "norm_eps")
                else int)
        ok = (type(value) is bool if want is bool else
              isinstance(value, (int, float)) and not isinstance(value, bool) if want is float
              else type(value) is int)
        if not ok:
            raise UserError(f"{where}: {key} must be {want.__name__}, got {value!r}")
    for key in ("rope_theta", "norm_eps"):
        if key in out:
            out[key] = float(out[key])


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """The Hugging Face config object of a spec (what scripts/export_hf.py writes)."""
    if spec.arch == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": spec.d_model, "num_hidden_layers": spec.num_layers,
                "num_attention_heads": spec.n_heads, "num_key_value_heads": spec.kv_heads,
                "intermediate_size": spec.d_ff, "max_position_embeddings": spec.seq_len,
                "vocab_size": spec.vocab_size, "rope_theta": spec.rope_theta,
                "rms_norm_eps": spec.norm_eps, "tie_word_embeddings": spec.tie_embeddings,
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                "rope_scaling": None, "torch_dtype": "float32"}
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "n_embd": spec.d_model, "n_layer": spec.num_layers, "n_head": spec.n_heads,
            "n_inner": spec.d_ff, "n_positions": spec.seq_len, "vocab_size": spec.vocab_size,
            "layer_norm_epsilon": spec.norm_eps, "tie_word_embeddings": spec.tie_embeddings,
            "activation_function": "gelu" if spec.gelu == "exact" else "gelu_new",
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "torch_dtype": "float32"}
