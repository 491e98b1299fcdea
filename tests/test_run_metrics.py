"""formats/run_metrics.py: reading a run folder's records, whatever a damaged file holds."""

from __future__ import annotations

import pytest

from formats.run_metrics import number, read_jsonl


@pytest.mark.parametrize("value", [10 ** 400, -10 ** 400, float("nan"), float("inf"), "1", True,
                                   None, [1]])
def test_number_is_none_for_what_is_not_a_finite_float(value):
    assert number({"x": value}, "x") is None


def test_number_reads_ints_and_floats():
    assert number({"x": 3}, "x") == 3.0 and number({"x": -0.5}, "x") == -0.5
    assert number({}, "x") is None


def test_read_jsonl_skips_lines_it_cannot_parse(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step": 1}\n' + b"[" * 100_000 + b"\n" + b'{"step": 2, "lo\n[]\n'
                     + b'{"step": 3}\n')
    assert [r["step"] for r in read_jsonl(path)] == [1, 3]


def test_status_lines_round_trip_and_ignore_other_lines():
    from formats.run_metrics import format_status, parse_status, status_line

    line = status_line({"step": 5, "steps": 10, "loss": 2.34567, "tokens_per_s": 1234.4,
                        "step_s": 0.5, "comm_s": 0.1, "mfu": 0.2})
    assert line.startswith("STATUS {") and "mfu" not in line
    rec = parse_status(f"[rank 3] rank 3: {line}")
    assert rec == {"step": 5, "steps": 10, "loss": 2.34567, "tokens_per_s": 1234.4,
                   "step_s": 0.5, "comm_s": 0.1}
    assert format_status(rec) == "step 5/10 loss 2.3457 tok/s 1234"
    for other in ("step 5/10 loss 2.3 tok/s 12", "STATUS {not json", 'STATUS {"loss": 1}',
                  "STATUS [1]"):
        assert parse_status(other) is None
