"""benchmarks/hivemind_checks_cost.py runs real rounds and writes the share its checks take."""

import json

import pytest

pytest.importorskip("hivemind", reason="hivemind is not installed (pip install -e .[hivemind])")


@pytest.mark.timeout(120)
def test_the_checks_cost_benchmark_writes_a_share_of_measured_rounds(tmp_path):
    from benchmarks import hivemind_checks_cost

    assert hivemind_checks_cost.main(["--out-dir", str(tmp_path), "--numel", "20000",
                                      "--peers", "2", "--rounds", "2"]) == 0
    got = json.loads((tmp_path / "results.json").read_text())
    assert len(got["rounds_s"]) == len(got["checks_s"]) == 2
    assert got["round_s"] == got["rounds_s"][1] > 0 and got["check_s"] > 0
    assert got["share"] == pytest.approx(got["check_s"] / got["round_s"])
    assert got["meets_target"] == (got["share"] <= 0.05)
