"""formats/run_metrics.py: reading a run folder's records, whatever a damaged file holds."""

from __future__ import annotations

import pytest

from formats.run_metrics import number


@pytest.mark.parametrize("value", [10 ** 400, -10 ** 400, float("nan"), float("inf"), "1", True,
                                   None, [1]])
def test_number_is_none_for_what_is_not_a_finite_float(value):
    assert number({"x": value}, "x") is None


def test_number_reads_ints_and_floats():
    assert number({"x": 3}, "x") == 3.0 and number({"x": -0.5}, "x") == -0.5
    assert number({}, "x") is None
