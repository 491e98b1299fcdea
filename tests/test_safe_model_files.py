"""Models come in only through safe parsing: damaged config.json, safetensors files and indexes,
each refused by a named error (no traceback, no hang, nothing followed outside the folder), and
models too large to build refused before anything is allocated."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from conftest import run_entry
from test_hf_config import GPT2, LLAMA, write_config

from formats.errors import UserError
from formats.hf_config import resolve_model
from formats.hf_folder import INDEX_NAME, FolderWeights
from formats.plan import Plan, SyncConfig, save_plan
from formats.safe_files import inside_folder, strict_loads
from formats.safetensors_header import read_header

WHERE = "--init-from x"


def st_bytes(header: object, data: bytes, claim: int | None = None) -> bytes:
    """A safetensors file: length, JSON header (or its text), data (`claim`: a false header
    length)."""
    raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    return struct.pack("<Q", len(raw) if claim is None else claim) + raw + data


GOOD = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "F16", "shape": [4], "data_offsets": [16, 24]},
        "__metadata__": {"format": "pt"}}


def damaged(good: bytes) -> dict[str, tuple[bytes, str]]:
    """name -> (file content, the message it must give)."""
    def tensor(**a: object) -> dict:
        return {**GOOD, "a": {**GOOD["a"], **a}}
    data = bytes(24)
    return {
        "empty": (b"", "0 bytes, too short"),
        "truncated_length": (good[:5], "5 bytes, too short"),
        "truncated_data": (good[:-3], r"data_offsets \[16, 24\] are not .* 21 data bytes"),
        "padded": (good + b"xy", "cover 24 bytes, the file holds 26"),
        "header_2_62": (st_bytes(GOOD, data, claim=2 ** 62), f"header claims {2 ** 62} bytes"),
        "header_past_end": (good[:20], "header claims"),
        "not_json": (struct.pack("<Q", 4) + b"\xff\xfe{{", "not UTF-8"),
        "header_list": (st_bytes([1, 2], b""), "not a JSON object"),
        "offsets_out": (st_bytes(tensor(data_offsets=[0, 10 ** 12]), data), "data_offsets"),
        "offsets_negative": (st_bytes(tensor(data_offsets=[-8, 8]), data), "data_offsets"),
        "offsets_text": (st_bytes(tensor(data_offsets="0-16"), data), "data_offsets"),
        "shape_too_big": (st_bytes(tensor(shape=[2 ** 40, 2 ** 40]), data), "needs"),
        "shape_negative": (st_bytes(tensor(shape=[-2, -2]), data), "shape must be"),
        "dtype_unknown": (st_bytes(tensor(dtype="F128"), data), "dtype 'F128'"),
        "overlap": (st_bytes({**GOOD, "b": {**GOOD["b"], "data_offsets": [8, 16],
                                           "shape": [4]}}, data[:16]), "overlapping"),
        "metadata_bad": (st_bytes({**GOOD, "__metadata__": {"x": 1}}, data), "__metadata__"),
        "nan_in_header": (st_bytes(json.dumps(GOOD).replace("[0, 16]", "[NaN, 1]"), data),
                          r"header: a.data_offsets\[0\] is NaN"),
    }


def test_a_sound_header_reads(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    path.write_bytes(st_bytes(GOOD, bytes(24)))
    entries = read_header(path, WHERE)
    assert entries["a"].shape == (2, 2) and (entries["b"].begin, entries["b"].end) == (16, 24)


def test_damaged_safetensors_are_named(tmp_path: Path) -> None:
    for name, (content, message) in damaged(st_bytes(GOOD, bytes(24))).items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(content)
        with pytest.raises(UserError, match=message) as e:
            read_header(path, WHERE)
        assert str(path) in str(e.value) and "\n" not in str(e.value), name


def test_special_files_named_safetensors_are_refused(tmp_path: Path) -> None:
    (tmp_path / "dir.safetensors").mkdir()
    os.mkfifo(tmp_path / "fifo.safetensors")
    (tmp_path / "zero.safetensors").symlink_to("/dev/zero")
    for name, message in (("dir", "is a directory"), ("fifo", "not a regular file"),
                          ("zero", "not a regular file")):
        with pytest.raises(UserError, match=message):
            read_header(tmp_path / f"{name}.safetensors", WHERE)
        folder = tmp_path / name
        folder.mkdir()
        os.rename(tmp_path / f"{name}.safetensors", folder / "model.safetensors")
        with pytest.raises(UserError, match=message):  # found by the folder's glob
            FolderWeights(folder, WHERE)


def index_folder(tmp_path: Path, weight_map: object, whole: object = None) -> Path:
    """A folder with one sound shard and an index (`whole`: the index object itself)."""
    folder = tmp_path / "hf"
    folder.mkdir(exist_ok=True)
    (folder / "s1.safetensors").write_bytes(st_bytes(GOOD, bytes(24)))
    (tmp_path / "outside.safetensors").write_bytes(st_bytes(GOOD, bytes(24)))
    obj = whole if whole is not None else {"metadata": {}, "weight_map": weight_map}
    (folder / INDEX_NAME).write_text(json.dumps(obj))
    return folder


@pytest.mark.parametrize("weight_map, whole, message", [
    ({"a": "../outside.safetensors"}, None, "leads outside the folder"),
    ({"a": "sub/../../outside.safetensors"}, None, "leads outside the folder"),
    ({"a": "/etc/passwd"}, None, "is an absolute path"),
    ({"a": 7}, None, "expected a file name \\(a string\\), got 7"),
    ({"a": ["s1.safetensors"]}, None, "expected a file name"),
    ({"a": None}, None, "expected a file name"),
    ([["a", "s1.safetensors"]], None, "not a safetensors index"),
    (None, [{"weight_map": {}}], "not a safetensors index"),
    ({"a": "missing.safetensors"}, None, "missing.safetensors .*does not exist"),
    ({"a": "s1.safetensors", "c": "s1.safetensors"}, None, "puts tensor c in s1.safetensors"),
])
def test_bad_index_entries_are_named(tmp_path: Path, weight_map: object, whole: object,
                                     message: str) -> None:
    folder = index_folder(tmp_path, weight_map, whole)
    with pytest.raises(UserError, match=message):
        FolderWeights(folder, WHERE).entry("c", (4,))


def test_an_index_symlink_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    folder = index_folder(tmp_path, {"a": "link.safetensors", "b": "s1.safetensors"})
    (folder / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(UserError, match="leads outside the folder"):
        FolderWeights(folder, WHERE)
    (folder / "link.safetensors").unlink()
    (folder / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": "s1.safetensors"}}))
    weights = FolderWeights(folder, WHERE)
    assert weights.entry("a", (2, 2))[0] == folder / "s1.safetensors"
    with pytest.raises(UserError, match=r"has shape \[2, 2\], the model needs \[4\]"):
        weights.entry("a", (4,))


def test_inside_folder_accepts_a_plain_name(tmp_path: Path) -> None:
    assert inside_folder(tmp_path, "a/b.bin", "x") == tmp_path / "a" / "b.bin"


def nested(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


@pytest.mark.parametrize("text, message", [
    (nested(100_000), "nested deeper than 64 levels"),
    ('{"hidden_size": ' + "9" * 5000 + "}", "hidden_size is an integer of 5000 digits"),
    ('{"rope_theta": Infinity}', "rope_theta is Infinity"),
    ('{"rope_theta": -Infinity}', "rope_theta is -Infinity"),
    ('{"x": {"y": [1, NaN]}}', r"x.y\[1\] is NaN"),
    ('{"rms_norm_eps": 1e999}', "rms_norm_eps is 1e999, beyond the float range"),
    ('{"a": 1', "not valid JSON"),
])
def test_strict_json_names_the_field(text: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        strict_loads(text, "config.json")


def config_case(tmp_path: Path, name: str) -> Path:
    """A folder whose config.json is damaged in the way `name` says."""
    folder = tmp_path / name
    folder.mkdir()
    path = folder / "config.json"
    if name == "fifo":
        os.mkfifo(path)
    elif name == "dev_zero":
        path.symlink_to("/dev/zero")
    elif name == "directory":
        path.mkdir()
    else:
        text = {"deep": nested(100_000),
                "long_int": json.dumps(LLAMA)[:-1] + ', "vocab_size": ' + "7" * 5000 + "}",
                "rope_inf": json.dumps({**LLAMA, "rope_theta": 1.0})
                .replace('"rope_theta": 1.0', '"rope_theta": Infinity'),
                "binary": "\udcff", "empty": ""}[name]
        path.write_bytes(text.encode("utf-8", "surrogateescape"))
    return folder


@pytest.mark.parametrize("name, message", [
    ("fifo", "not a regular file"), ("dev_zero", "not a regular file"),
    ("directory", "is a directory"), ("deep", "nested deeper than"),
    ("long_int", "vocab_size is an integer of 5000 digits"),
    ("rope_inf", "rope_theta is Infinity"), ("binary", "not UTF-8"), ("empty", "not valid JSON"),
])
def test_damaged_configs_are_named(tmp_path: Path, name: str, message: str) -> None:
    folder = config_case(tmp_path, name)
    with pytest.raises(UserError, match=message) as e:
        resolve_model(str(folder))
    assert "config.json" in str(e.value)


@pytest.mark.parametrize("config, message", [
    ({**GPT2, "head_dim": 8}, r"head_dim 8 != n_embd / n_head \(16\)"),
    ({**LLAMA, "head_dim": 32}, r"head_dim 32 != hidden_size / num_attention_heads \(16\)"),
    ({**LLAMA, "num_hidden_layers": 10 ** 7, "hidden_size": 8192, "num_attention_heads": 64,
      "num_key_value_heads": 64, "intermediate_size": 10 ** 6},
     "parameters .* of training memory.*most are in num_hidden_layers 10000000 layers"),
    ({**GPT2, "vocab_size": 10 ** 7, "n_embd": 10 ** 6, "n_head": 2, "n_layer": 1, "n_inner": 1},
     "most are in the embedding \\(vocab_size 10000000 x n_embd 1000000\\)"),
])
def test_inconsistent_and_absurd_configs_are_refused(tmp_path: Path, config: dict,
                                                     message: str) -> None:
    with pytest.raises(UserError, match=message):
        resolve_model(write_config(tmp_path / "m", config))


def test_a_plan_never_holds_nan_or_infinity(tmp_path: Path) -> None:
    plan = Plan("c", "", "gpt-tiny", [(0, 4)], [[0]], sync=SyncConfig(),
                predicted={"step_time_s": float("inf")})
    with pytest.raises(UserError, match="predicted.step_time_s is inf"):
        save_plan(plan, tmp_path / "plan.json")
    assert not (tmp_path / "plan.json").exists()


def test_a_stage_too_big_for_the_host_is_refused_before_it_is_built(monkeypatch) -> None:
    import torch

    from formats.hf_config import spec_from_hf
    from modules.device import memory

    spec = spec_from_hf({**LLAMA, "num_hidden_layers": 1000, "hidden_size": 4096,
                         "num_attention_heads": 32, "num_key_value_heads": 8,
                         "intermediate_size": 14336}, "big", "config.json")
    plan = Plan("c", "", spec.name, [(0, 500), (500, 1000)], [[0, 1]], sync=SyncConfig(),
                model_config=spec.fields())
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 8 * 10 ** 9)
    with pytest.raises(UserError, match="stage 1 of big \\(500 of num_layers 1000.*needs at "
                                        "least .* TB of host memory.*has 8 GB available"):
        memory.check_stage_memory(plan, 1, torch.device("cpu"))
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 10 ** 15)
    memory.check_stage_memory(plan, 1, torch.device("cpu"))


def test_the_planner_names_a_fifo_config_and_exits_2(tmp_path: Path) -> None:
    folder = config_case(tmp_path, "fifo")
    result = run_entry("scheduler/scheduler.py", "plan", "--model", str(folder),
                       "--scenario", "lab", "--out", str(tmp_path / "p.json"), timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "not a regular file" in result.stderr


@pytest.mark.timeout(120)
def test_the_runner_refuses_an_index_leading_outside_its_folder(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    from conftest import ROOT

    folder = Path(write_config(tmp_path / "hf", LLAMA))
    (tmp_path / "secret.safetensors").write_bytes(st_bytes(GOOD, bytes(24)))
    (folder / INDEX_NAME).write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "../secret.safetensors"}}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, str(ROOT / "dist_runner.py"), "--model", str(folder),
                        "--init-from", str(folder), "--dist-url", f"tcp://127.0.0.1:{port}",
                        "--world-size", "1", "--rank", "0", "--threads", "1", "--fake-data",
                        "--steps", "1", "--timeout-s", "30"], cwd=ROOT, capture_output=True,
                       text=True, timeout=100)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "leads outside the folder" in r.stderr
