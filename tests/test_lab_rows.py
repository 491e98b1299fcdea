"""The lab row runner (testkit/lab_rows.py): the lab benchmarks declare their rows to it, and a
flag of every row is declared once (ROW_FLAGS). Nothing trains here: the runner's own sequence
is checked with lab_training.train_row and lab.predict replaced, on loopback (--no-netns)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks import bad_network, end_to_end, hierarchical
from testkit import lab, lab_network, lab_rows, lab_training
from testkit.lab_rows import ROW_FLAGS, LabRow, RowFlag

BENCHMARKS = (end_to_end, bad_network, hierarchical)


@pytest.mark.parametrize("bench", BENCHMARKS, ids=lambda m: m.__name__)
def test_every_lab_benchmark_takes_the_row_flags_with_their_defaults(bench):
    args = bench.parse_args([])
    assert (args.eval_sequences, args.eval_every, args.no_netns, args.mtu) == (
        32, 5, False, lab_network.LAB_MTU)
    args = bench.parse_args(["--eval-every", "10", "--eval-sequences", "8", "--no-netns"])
    assert lab_rows.runner_flags(args, seed_ranks=False) == [
        "--eval-sequences", "8", "--eval-every", "10"]
    assert lab_rows.runner_flags(args)[-2:] == ["--seed", "0"]


def test_a_flag_added_to_row_flags_reaches_every_benchmark_and_every_rows_launch(monkeypatch):
    monkeypatch.setattr(lab_rows, "ROW_FLAGS", (*ROW_FLAGS, RowFlag("--toy-every", 3, "toy")))
    for bench in BENCHMARKS:
        args = bench.parse_args(["--toy-every", "7"])
        assert args.toy_every == 7, bench.__name__
        assert lab_rows.runner_flags(args)[-4:] == ["--toy-every", "7", "--seed", "0"]


class Recorder:
    """lab.predict and lab_training.train_row stand-ins: what the runner asked, in order."""

    def __init__(self, fail_at: str = "") -> None:
        self.calls: list[tuple] = []
        self.fail_at = fail_at
        self.counter = 0.0

    def predict(self, run: lab.Run, cluster_path: Path) -> None:
        self.calls.append(("predict", run.name))

    def train_row(self, run, net, out, extra, steps, warmup_steps, eval_every, base=None):
        if run.name == self.fail_at:
            raise RuntimeError("rank died")
        self.calls.append(("train", run.name, list(extra), steps, warmup_steps, eval_every,
                           base and base.name))
        run.steps_trained = steps + 2  # it trained on past its steps (lab_training.train_on)
        self.counter += 100.0 * run.steps_trained


def lab_args(**kw) -> argparse.Namespace:
    args = end_to_end.parse_args(["--no-netns", "--steps", "12", "--inner-steps", "2"])
    return argparse.Namespace(**{**vars(args), **kw})


def test_train_rows_predicts_all_then_trains_in_order_after_the_first_row(monkeypatch,
                                                                          tmp_path):
    rec = Recorder()
    monkeypatch.setattr(lab, "predict", rec.predict)
    monkeypatch.setattr(lab_training, "train_row", rec.train_row)
    runs = [lab.Run(n, tmp_path / f"{n}.json") for n in ("allreduce", "diloco", "wide")]
    done = lab_rows.train_rows([runs[0], runs[1], LabRow(runs[2], steps=4)], lab_args(),
                               tmp_path / "cluster.json", tmp_path,
                               counters={"bytes": lambda net: rec.counter})
    flags = ["--eval-sequences", "32", "--eval-every", "5", "--seed", "0"]
    warmup = 6  # end_to_end's --warmup-steps 5, rounded up to whole rounds of H 2
    assert rec.calls == [("predict", "allreduce"), ("predict", "diloco"), ("predict", "wide"),
                         ("train", "allreduce", flags, 12, warmup, 5, None),
                         ("train", "diloco", flags, 12, warmup, 5, "allreduce"),
                         ("train", "wide", flags, 4, warmup, 5, "allreduce")]
    assert done.why_not_shaped == "--no-netns given"
    assert done.per_step == {"bytes": {"allreduce": 100.0, "diloco": 100.0, "wide": 100.0}}


def test_train_rows_takes_the_network_down_after_a_row_fails(monkeypatch, tmp_path):
    rec = Recorder(fail_at="diloco")
    monkeypatch.setattr(lab, "predict", rec.predict)
    monkeypatch.setattr(lab_training, "train_row", rec.train_row)
    downs = []
    monkeypatch.setattr(lab_network.Network, "down", lambda self: downs.append(self.cluster_path))
    runs = [lab.Run(n, tmp_path / f"{n}.json") for n in ("allreduce", "diloco", "wide")]
    with pytest.raises(RuntimeError, match="rank died"):
        lab_rows.train_rows(runs, lab_args(), tmp_path / "cluster.json", tmp_path,
                            seed_ranks=False)
    assert downs == [tmp_path / "cluster.json"]
    assert [c[1] for c in rec.calls if c[0] == "train"] == ["allreduce"]
    assert rec.calls[3][2] == ["--eval-sequences", "32", "--eval-every", "5"]


def test_hierarchical_declares_equal_token_rows_and_counts_cross_site_bytes_per_step(
        monkeypatch, tmp_path):
    from formats.cluster import save_cluster
    from formats.plan import Plan, SyncConfig, save_plan
    from scheduler.scenarios import make_scenario

    cluster = make_scenario("badlink", 0)
    save_cluster(cluster, tmp_path / "cluster.json")
    common = {"micro_batch_size": 2, "num_micro_batches": 2}
    dil = SyncConfig("diloco", 5, "int8")
    plans = {"allreduce": Plan(cluster.name, cluster.sha256(), "gpt-tiny", [(0, 4)],
                               [[d] for d in range(8)], **common),  # 8 lanes, H 1
             "pipelined": Plan(cluster.name, cluster.sha256(), "gpt-tiny", [(0, 2), (2, 4)],
                               [[2 * k, 2 * k + 1] for k in range(4)], sync=dil,
                               **common),  # 4 lanes: twice the steps for as many tokens
             "hier": Plan(cluster.name, cluster.sha256(), "gpt-tiny", [(0, 4)],
                          [[s] for s in hierarchical.sites(cluster)], sync=dil, **common)}
    runs = []
    for name, plan in plans.items():
        save_plan(plan, tmp_path / f"{name}.json")
        runs.append(lab.Run(name, tmp_path / f"{name}.json"))
    rec = Recorder()
    monkeypatch.setattr(lab, "predict", rec.predict)
    monkeypatch.setattr(lab_training, "train_row", rec.train_row)
    monkeypatch.setattr(hierarchical, "cross_site_bytes", lambda net, kbit: rec.counter * 1e4)
    args = hierarchical.parse_args(["--no-netns", "--steps", "20", "--inner-steps", "5"])
    why_not, cross = hierarchical.train_all(runs, args, tmp_path / "cluster.json", tmp_path)
    assert why_not == "--no-netns given"
    assert [(c[1], c[3]) for c in rec.calls if c[0] == "train"] == [
        ("allreduce", 20), ("pipelined", 40), ("hier", 20)]
    assert cross == pytest.approx({"allreduce": 1.0, "pipelined": 1.0, "hier": 1.0})  # MB
