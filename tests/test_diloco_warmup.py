"""DiLoCo's warm-up (sync.warmup_steps W, docs/bad_links.md): gradient all-reduce for steps 1..W on
every rank, then DiLoCo from the weights at step W. The runtime matches a hand-written
reference of that rule, the switch lands at step W on every rank (also after a resume at
W - 1, W, W + 1, bit-identical to the uninterrupted run), and a bad W is refused by name."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from formats.errors import UserError
from formats.models import get_model
from formats.plan import Plan, SyncConfig, load_plan, save_plan
from modules.config import PlanOverrideConfig, RunConfig
from modules.data.dataset import DEFAULT_CORPUS, TextData, load_tokens
from modules.train.checkpoint import step_path
from modules.train.metrics import read_metrics, replica_metrics_path
from testkit.reference import threaded_diloco_losses
from tests.conftest import run_entry

W, H = 3, 2


def _plan(warmup: int = W, stages=((0, 4),), replicas: int = 2) -> Plan:
    s = len(stages)
    return Plan("local", "", "gpt-tiny", list(stages),
                [[r * s + i for i in range(s)] for r in range(replicas)], micro_batch_size=2,
                num_micro_batches=1,
                sync=SyncConfig(mode="diloco", inner_steps=H, warmup_steps=warmup))


def _launch(tmp_path, plan, metrics, *extra):
    save_plan(plan, tmp_path / "plan.json")
    return run_entry("scripts/launch_local.py", "--plan", str(tmp_path / "plan.json"),
                     "--threads-per-rank", "1", "--grace-s", "2", "--", "--metrics",
                     str(metrics), "--timeout-s", "60", *extra, timeout=200)


@pytest.mark.timeout(240)
def test_warmup_switches_at_step_w_on_every_rank_and_matches_the_rule(tmp_path):
    if not DEFAULT_CORPUS.exists():
        pytest.skip("Debian fortunes not installed (apt-get install fortunes fortunes-min)")
    steps, plan = 7, _plan()
    proc = _launch(tmp_path, plan, tmp_path / "m.jsonl", "--steps", str(steps))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2):  # every rank switches after step W
        assert re.search(rf"^\[rank {rank}\] warm-up over after step {W}: DiLoCo", proc.stdout,
                         re.M), proc.stdout[-3000:]
    recs = [read_metrics(replica_metrics_path(tmp_path / "m.jsonl", r)) for r in range(2)]
    for rs in recs:
        # steps 1..W all-reduce gradients; then outer steps only after W + H, W + 2H
        assert [r["dp_bytes_sent"] > 0 for r in rs] == [True] * W + [False, True, False, True]
        assert [r["outer_step"] for r in rs] == [0, 0, 0, 0, 1, 1, 2]
    spec = get_model("gpt-tiny")
    torch.set_num_threads(1)
    want = threaded_diloco_losses(
        plan, TextData(load_tokens(DEFAULT_CORPUS), spec.seq_len, spec.vocab_size),
        RunConfig(steps=steps))
    got = [[r["loss"] for r in rs] for rs in recs]
    assert got == want  # bit-identical to the hand-written rule


@pytest.mark.timeout(600)
def test_resume_around_the_switch_is_bit_identical(tmp_path):
    steps, plan = W + 2 * H, _plan()
    ck = tmp_path / "ck"
    full = _launch(tmp_path, plan, tmp_path / "full.jsonl", "--steps", str(steps), "--fake-data",
                   "--ckpt-dir", str(ck), "--ckpt-every", "1", "--keep-checkpoints", "100")
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]

    def losses(m):
        return [[r["loss"] for r in read_metrics(replica_metrics_path(m, k))] for k in (0, 1)]
    want = losses(tmp_path / "full.jsonl")
    for cut in (W - 1, W, W + 1):  # the run as if it had stopped after step `cut`
        cut_dir = tmp_path / f"ck{cut}"
        shutil.copytree(ck, cut_dir)
        for rank in range(2):
            for later in range(cut + 1, steps + 1):
                step_path(cut_dir, rank, later).unlink()
        metrics = tmp_path / f"cut{cut}.jsonl"
        second = _launch(tmp_path, plan, metrics, "--steps", str(steps), "--fake-data",
                         "--ckpt-dir", str(cut_dir), "--resume")
        assert second.returncode == 0, second.stdout[-3000:]
        assert f"resumed from step {cut}" in second.stdout
        # the switch happens in the resumed run only when the cut fell before it
        assert (f"warm-up over after step {W}" in second.stdout) == (cut < W), second.stdout
        assert losses(metrics) == [rs[cut:] for rs in want], cut  # bit-identical


def test_bad_warmup_is_refused_by_name(tmp_path):
    with pytest.raises(UserError, match=r"sync.warmup_steps: must be an integer in .*, got -1"):
        SyncConfig(mode="diloco", inner_steps=2, warmup_steps=-1).validate()
    with pytest.raises(UserError, match=r"sync.warmup_steps: 5 only applies to mode 'diloco'"):
        SyncConfig(warmup_steps=5).validate()
    with pytest.raises(UserError, match=r"sync.warmup_steps: 9 is longer than the run "
                                        r"\(--steps 8\)"):
        RunConfig(steps=8).resolve(_plan(warmup=9))
    RunConfig(steps=9).resolve(_plan(warmup=9))  # all warm-up: allowed
    # the runner's flag overrides the plan's W and is checked like it
    over = RunConfig(steps=20, overrides=PlanOverrideConfig(sync_warmup_steps=12))
    assert over.resolve(_plan()).plan.sync.warmup_steps == 12
    with pytest.raises(UserError, match="--sync-warmup-steps: sync.warmup_steps: 4 only"):
        RunConfig(overrides=PlanOverrideConfig(sync_warmup_steps=4)).resolve(
            Plan("local", "", "gpt-tiny", [(0, 4)], [[0], [1]]))
    with pytest.raises(UserError, match="sync.warmup_steps: 30 is longer than the run"):
        RunConfig(steps=20, overrides=PlanOverrideConfig(sync_warmup_steps=30)).resolve(_plan())
    # through the CLI: exit 2, one line, no traceback
    plan_path = tmp_path / "plan.json"
    save_plan(_plan(warmup=50), plan_path)
    proc = run_entry("dist_runner.py", "--plan", str(plan_path), "--rank", "0", "--world-size",
                     "2", "--steps", "10", "--fake-data")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "sync.warmup_steps: 50 is longer than the run (--steps 10)" in proc.stderr
    assert "Traceback" not in proc.stderr
    # the launcher checks the runner's flags before any rank starts, overrides included (it
    # resolves the run as every rank does)
    from scripts.launch_local import check_runner_args
    save_plan(_plan(), plan_path)
    with pytest.raises(UserError, match=r"sync.warmup_steps: 30 is longer than the run"):
        check_runner_args(["--steps", "20", "--sync-warmup-steps", "30"], str(plan_path),
                          _plan())
    with pytest.raises(UserError, match=r"--fragments/--overlap: only apply to sync mode "
                                        r"diloco \(the plan's is 'allreduce'\)"):
        check_runner_args(["--sync", "allreduce", "--overlap", "on"], str(plan_path), _plan())


def test_old_plans_without_the_field_load_with_no_warmup(tmp_path):
    save_plan(_plan(), tmp_path / "p.json")
    raw = json.loads((tmp_path / "p.json").read_text())
    assert raw["sync"]["warmup_steps"] == W
    del raw["sync"]["warmup_steps"]
    (tmp_path / "old.json").write_text(json.dumps(raw))
    assert load_plan(tmp_path / "old.json").sync.warmup_steps == 0
    save_plan(_plan(warmup=0), tmp_path / "w0.json")  # no warm-up: written as before
    assert "warmup_steps" not in json.loads((tmp_path / "w0.json").read_text())["sync"]
