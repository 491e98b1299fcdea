"""benchmarks/outer_backends.py's bookkeeping (the runs themselves are the benchmark's): rows
named, ratios against the store row of the same kind, the fault row's stall, refusals."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import outer_backends as ob


def _row(name: str, backend: str, sync_s: float, loss: float, tps: float) -> dict:
    return {"name": name, "backend": backend, "s_per_outer_sync": {"mean": sync_s, "max": sync_s,
                                                             "mean_after_round1": sync_s / 2},
            "final_loss": loss, "tokens_per_s": tps}


def test_ratios_against_the_store_row_of_the_same_kind():
    rows = [_row("store_shaped", "store", 0.5, 4.0, 100.0),
            _row("hivemind_shaped", "hivemind", 1.0, 4.04, 95.0),
            _row("store_fault", "store", 0.2, 3.0, 10.0),
            {"name": "hivemind_overlap", "backend": "hivemind", "skipped": "refused"}]
    ob.ratios(rows)
    hv = rows[1]
    assert (hv["loss_ratio_vs_store"], hv["sync_s_vs_store"], hv["tokens_per_s_vs_store"]) == (
        1.01, 2.0, 0.95)
    assert rows[0]["loss_ratio_vs_store"] == 1.0 and "sync_s_vs_store" not in rows[0]
    assert "loss_ratio_vs_store" not in rows[3]


def test_the_nat_row_is_compared_with_the_store_loopback_row():
    """No store row can run behind the NATs (gloo connects both ways): the loopback one."""
    rows = [_row("store_loopback", "store", 0.1, 4.0, 100.0),
            dict(_row("hivemind_nat", "hivemind", 0.4, 4.0, 50.0), net="nat")]
    ob.ratios(rows)
    assert (rows[1]["loss_ratio_vs_store"], rows[1]["sync_s_vs_store"]) == (1.0, 4.0)


def test_stall_is_the_survivors_longest_step_after_the_kill_over_their_median(tmp_path):
    for r, name in ((0, "m.jsonl"), (1, "m.r1.jsonl"), (2, "m.r2.jsonl")):
        recs = [{"step_s": 0.1, "wall_time": 10.0 + i} for i in range(9)]
        recs.append({"step_s": 3.0 + r, "wall_time": 30.0})  # the round after the kill
        (tmp_path / name).write_text("\n".join(json.dumps(x) for x in recs))
    assert ob.stall(tmp_path, killed_at=20.0) == pytest.approx(5.0 - 0.1)


def test_rows_flag_and_refusals():
    assert ob.rows_arg("shaped,fault,nat") == ("shaped", "fault", "nat")
    with pytest.raises(argparse.ArgumentTypeError, match="expected some of loopback"):
        ob.rows_arg("shaped,wan")


def test_overlap_rows_run_with_both_backends(tmp_path):
    """dist_runner's own check refuses neither overlap row (--overlap on runs over hivemind)."""
    plan = ob.make_plan(tmp_path, overlap=True)
    assert ob.refusal("hivemind", plan) == ""
    assert ob.refusal("store", plan) == ""
    assert ob.refusal("hivemind", ob.make_plan(tmp_path)) == ""


def test_throughput_is_tokens_over_time_not_the_mean_of_rates():
    """Two steps of 64 tokens x 4 replicas, 0.01 s and 0.03 s: 512 tokens in 0.04 s = 12800
    tokens/s (the mean of the two rates would say 17067)."""
    recs = [{"tokens_per_s": 256 / 0.01, "step_s": 0.01},
            {"tokens_per_s": 256 / 0.03, "step_s": 0.03}]
    assert ob.throughput(recs) == pytest.approx(12800.0)


def test_bytes_per_round_counts_every_step_of_an_overlapped_round():
    """The store's overlap counts a round's bytes on the steps its background all-reduce
    spans (two halves here), the last round's at the final drain."""
    recs = [{"dp_bytes_sent": b} for b in (0, 0, 660, 0, 661, 0, 660, 661)]
    assert ob.bytes_per_round(recs, 2) == pytest.approx(1321.0)
