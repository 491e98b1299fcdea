"""The runtime's per-component configs: flags generated from fields, validation naming the flag."""

from __future__ import annotations

import dataclasses

import pytest

import dist_runner
from formats.errors import UserError
from modules.cli_config import field_docs
from modules.config import (
    CheckpointConfig,
    DataConfig,
    DebugConfig,
    DeviceConfig,
    ElasticConfig,
    HivemindConfig,
    LaunchConfig,
    MetricsConfig,
    OptimConfig,
    OuterSyncConfig,
    PlanOverrideConfig,
    RunConfig,
)
from tests.conftest import run_entry

CONFIGS = (LaunchConfig, RunConfig, OptimConfig, CheckpointConfig, ElasticConfig, DataConfig,
           MetricsConfig, DeviceConfig, DebugConfig, OuterSyncConfig, PlanOverrideConfig,
           HivemindConfig)

# every flag dist_runner had before the configs generated them: none may disappear
OLD_FLAGS = [
    "--plan", "--rank", "--world-size", "--dist-url", "--cluster", "--data", "--fake-data",
    "--steps", "--lr", "--warmup-steps", "--lr-schedule", "--weight-decay", "--seed",
    "--ckpt-dir", "--ckpt-every", "--keep-checkpoints", "--sync-checkpoints", "--resume",
    "--metrics", "--eval-every", "--eval-sequences", "--timeout-s", "--wait-for-peers",
    "--heartbeat-timeout-s", "--min-replicas", "--replicas", "--join", "--threads",
    "--debug-vanish", "--debug-ckpt-die", "--log-every",
]


def test_every_setting_has_a_docstring_that_is_its_help() -> None:
    for cls in CONFIGS:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.type not in [c.__name__ for c in CONFIGS]:  # nested configs: their class doc
                assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
    help_text = dist_runner.build_parser().format_help()
    assert "AdamW weight decay" in help_text
    assert "--debug-vanish" not in help_text  # test hooks stay hidden


def test_old_flags_all_exist_and_defaults_match_the_dataclasses() -> None:
    parser = dist_runner.build_parser()
    known = {s for a in parser._actions for s in a.option_strings}
    assert set(OLD_FLAGS) <= known
    launch, cfg = dist_runner.parse_args(["--plan", "p.json", "--steps", "7"])
    assert launch == LaunchConfig(plan="p.json")
    assert cfg == RunConfig(steps=7)


def test_nested_values_reach_their_component() -> None:
    _, cfg = dist_runner.parse_args(
        ["--plan", "p", "--steps", "5", "--lr", "0.01", "--ckpt-dir", "d", "--keep-checkpoints",
         "3", "--replicas", "1,0", "--precision", "bf16", "--debug-vanish", "2:4:9"])
    assert cfg.optim.lr == 0.01 and cfg.ckpt.dir == "d" and cfg.ckpt.keep == 3
    assert cfg.ckpt.interval(cfg.steps) == 5  # --ckpt-dir alone: save at the end
    assert cfg.elastic.start_replicas(2) == (0, 1)
    assert cfg.device.precision == "bf16"
    assert cfg.debug.vanish_at(2) == (4, 9) and cfg.debug.vanish_at(1) == (0, 0)


@pytest.mark.parametrize("argv, flag", [
    (["--lr", "nan"], "--lr"),
    (["--timeout-s", "inf"], "--timeout-s"),
    (["--heartbeat-timeout-s", "-1"], "--heartbeat-timeout-s"),
    (["--steps", "0"], "--steps"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints"),
    (["--threads", "-2"], "--threads"),
    (["--resume"], "--resume"),
    (["--data", "x.txt", "--fake-data"], "--fake-data"),
    (["--replicas", "a,b"], "--replicas"),
    (["--debug-vanish", "1"], "--debug-vanish"),
    (["--cuda-device", "-1"], "--cuda-device"),
    (["--peak-tflops", "0"], "--peak-tflops"),
    (["--run-dir", ""], "--run-dir"),
])
def test_bad_values_name_the_flag(argv: list[str], flag: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--plan", "p.json", "--steps", "3", *argv]
    if "--steps" in argv[4:]:
        argv = ["--plan", "p.json", *argv[4:]]
    try:
        dist_runner.parse_args(argv)
    except UserError as e:
        assert flag in str(e)
        return
    except SystemExit as e:  # argparse's own check (e.g. a number that does not parse)
        assert e.code == 2
        assert flag in capsys.readouterr().err
        return
    pytest.fail(f"{argv} was accepted")


def test_bad_value_is_exit_2_without_traceback() -> None:
    r = run_entry("dist_runner.py", "--plan", "p.json", "--steps", "2", "--lr", "inf")
    assert r.returncode == 2
    assert "--lr" in r.stderr and "Traceback" not in r.stderr


def test_the_plan_overrides_are_declared_once() -> None:
    """OVERRIDE_FLAGS names each sync override once: PlanOverrideConfig has a field per flag
    (plus the batch's two), each key is a SyncConfig field, and the ranks' agreement and
    sync_fields follow it."""
    from formats.plan import SyncConfig
    from modules.plan_flags import agreed_plan_fields
    from scheduler.quick_plan import OVERRIDE_FLAGS, override_attr

    fields = {f.name for f in dataclasses.fields(PlanOverrideConfig)}
    assert fields == {override_attr(f) for f in OVERRIDE_FLAGS.values()} | {
        "micro_batch_size", "total_batch_size"}
    assert set(OVERRIDE_FLAGS) <= {f.name for f in dataclasses.fields(SyncConfig)}
    over = PlanOverrideConfig(sync="diloco", inner_steps=8, sync_warmup_steps=5)
    assert over.sync_fields() == {"mode": "diloco", "inner_steps": 8, "outer_lr": None,
                                  "outer_momentum": None, "compression": None,
                                  "warmup_steps": 5}
    from formats.models import get_model
    from scheduler.quick_plan import obvious_plan

    plan = over.apply(obvious_plan(get_model("gpt-tiny"), 2, 1))
    agreed = agreed_plan_fields(plan)
    assert {f: agreed[f] for f in OVERRIDE_FLAGS.values()} == {
        "--sync": "diloco", "--inner-steps": 8, "--outer-lr": 0.7, "--outer-momentum": 0.9,
        "--compression": "none", "--sync-warmup-steps": 5}


@pytest.mark.parametrize("reshard, outer, want", [
    ("plan", "plan", (True, "device")), ("off", "host", (False, "host")),
    ("on", "device", (True, "device"))])
def test_resolve_applies_every_plan_valued_flag(reshard, outer, want) -> None:
    """--reshard-after-forward and --outer-state ("plan": the plan's) are applied once, by
    RunConfig.resolve, into the plan the rank runs: nothing below re-reads the flags."""
    from formats.models import get_model
    from scheduler.quick_plan import obvious_plan

    plan = obvious_plan(get_model("gpt-tiny"), 2, 1)
    cfg = RunConfig(device=DeviceConfig(reshard_after_forward=reshard),
                    outer=OuterSyncConfig(outer_state=outer))
    ran = cfg.resolve(plan).plan
    assert (ran.reshard_after_forward, ran.outer_state) == want
