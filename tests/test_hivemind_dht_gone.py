"""A replica whose DHT process dies ends with one named error instead of hanging: every DHT
get/store of the training process is bounded (`dht_call`), and a dead DHT process is named."""

from __future__ import annotations

import time

import pytest

from modules.comm import PeerError
from modules.sync.hivemind_dht import DhtGone, dht_call
from testkit.hivemind_runs import FakeDHT


def test_a_dht_call_returns_what_the_dht_answers() -> None:
    dht = FakeDHT()
    dht.answers["k"] = "value"
    assert dht_call(dht, "get", "k", latest=True) == "value"
    assert dht.calls == [("get", "k", True)]


def test_a_dead_dht_process_is_named_at_once() -> None:
    t0 = time.monotonic()
    with pytest.raises(DhtGone, match=r"DHT process \(pid 4242\) ended \(exit code -9\)"):
        dht_call(FakeDHT(alive=False), "get", "k", timeout_s=60)
    assert time.monotonic() - t0 < 10  # not the 60 s deadline


def test_a_live_dht_that_does_not_answer_times_out_by_name() -> None:
    with pytest.raises(PeerError, match=r"DHT process \(pid 4242\) within 0.3 s: it is alive"):
        dht_call(FakeDHT(answering=False), "get", "k", timeout_s=0.3)


def _dht_process_of(pid: int) -> int:
    """The pid of a rank's hivemind DHT process: its child that is the parent of a p2pd."""
    import subprocess

    rows = [r.split(None, 2) for r in subprocess.run(
        ["ps", "-ww", "-eo", "pid,ppid,args"], capture_output=True,
        text=True).stdout.splitlines()[1:]]  # -ww: pytest sets COLUMNS, ps cut the names
    kids = {int(p) for p, pp, *_ in rows if int(pp) == pid}
    found = [int(pp) for p, pp, *a in rows if a and "p2pd" in a[0] and int(pp) in kids]
    assert found, (pid, kids, [r for r in rows if int(r[1]) in kids | {pid}])
    return found[0]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_replica_whose_dht_process_is_killed_ends_naming_it(tmp_path) -> None:
    """Two hivemind replicas; replica 1's DHT process is killed (-9) after round 2: it ends
    with one line naming its dead DHT process (it hung for good before), the other with the
    --min-replicas error, and neither prints a traceback (asyncio's included)."""
    import os
    import signal

    from testkit.fault_harness import write_trial_plan
    from testkit.hivemind_runs import HivemindRun

    pytest.importorskip("hivemind", reason="the hivemind extra is not installed")
    run = HivemindRun(write_trial_plan(tmp_path / "plan.json", 2, 1, "diloco", inner_steps=4),
                      tmp_path)
    flags = ("--steps", "60", "--fake-data", "--heartbeat-timeout-s", "3", "--timeout-s", "15")
    try:
        run.start(0, *flags)
        run.start(1, *flags, peers=run.peers_of(0))
        assert run.wait_for(1, r"outer_step 2:", 120), run.output(1)
        os.kill(_dht_process_of(run.procs[1].pid), signal.SIGKILL)
        codes = run.wait(120)
        out0, out1 = run.output(0), run.output(1)
        assert codes == {0: 1, 1: 1}, (codes, out0[-2000:], out1[-2000:])
        assert "error: this replica's DHT process (pid " in out1 and "ended" in out1, out1
        assert "fewer than --min-replicas 2" in out0, out0[-2000:]
        assert "Traceback" not in out0 + out1, (out0[-3000:], out1[-3000:])
    finally:
        run.stop()
    assert run.p2pd_left() == []
