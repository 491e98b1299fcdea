"""The seeds' flags (OpenDiLoCo, DT-FM) on dist_runner.py: refused in one line naming the flag
to use here, hidden from --help."""

from __future__ import annotations

import pytest
from conftest import run_entry

from formats.errors import UserError
from modules.cli_config import runner_parser
from modules.seed_flags import SEED_FLAGS


@pytest.mark.parametrize("argv,named", [
    (["--path-model", "PrimeIntellect/llama-150m-fresh"], "--model"),
    (["--path_model", "x"], "--model"),
    (["--hv.initial-peers", "/ip4/1.2.3.4/tcp/1"], "--initial-peers"),
    (["--per-device-train-batch-size", "32"], "--micro-batch-size"),
    (["--total-steps", "88000"], "--steps"),
    (["--pipeline-group-size", "4"], "--stages"),
    (["--data-group-size", "2"], "--stages"),
    (["--hv.fail-rank-drop"], "--min-replicas"),
    (["--hv.averaging-timeout", "60"], "--averaging-timeout-s"),
])
def test_seed_flags_name_the_equivalent(argv, named):
    with pytest.raises(UserError) as e:
        runner_parser().parse_args(["--model", "gpt-tiny", *argv])
    assert str(e.value).startswith(f"{argv[0]} is ") and named in str(e.value)


def test_path_model_exits_2_in_one_line_and_help_stays_truthful():
    r = run_entry("dist_runner.py", "--path-model", "PrimeIntellect/llama-150m-fresh",
                  "--fake-data")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "--model" in lines[0], r.stderr
    assert lines[0].startswith("error: --path-model is OpenDiLoCo's flag")
    text = runner_parser().format_help()
    assert not any(flag in text for flag in SEED_FLAGS)
    assert "--total-batch-size" in text and "--micro-batch-size" in text
