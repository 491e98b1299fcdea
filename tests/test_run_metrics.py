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
