"""--outer-backend hivemind across real NATs (the hole-punching tests' namespace lab: two LANs
behind MASQUERADE NATs that drop unsolicited packets, a public side): a bare DHT node and one
replica on the public side, two replicas each behind its own NAT with --client-mode; the run
completes with identical parameters and leaves no p2pd (benchmarks/outer_backends.py's `nat`
row, small). Run under `flock /tmp/netns.lock` (namespaces collide between parallel runs)."""

from __future__ import annotations

import json
import subprocess

import pytest

pytest.importorskip("hivemind", reason="hivemind is not installed (pip install -e .[hivemind])")

from benchmarks.outer_backends import nat_hosts, run_nat  # noqa: E402
from testkit.fault_harness import write_trial_plan  # noqa: E402
from testkit.hivemind_runs import load_models, max_param_diff  # noqa: E402
from udp_hole_punching_test.netns_lab import CLIENT_IPS  # noqa: E402
from udp_hole_punching_test.netns_lab import missing_requirements as lab_missing  # noqa: E402

pytestmark = pytest.mark.netns


_REASON = lab_missing()  # root, tools, a namespace with a NAT table
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)


@pytest.mark.timeout(120)
def test_replicas_behind_nats_take_part_with_identical_parameters(tmp_path):
    """1 public replica + 2 behind NATs (client mode), 2 rounds of H = 5: every replica
    exits 0, the three end bit-identical, the public side cannot open a connection to a NATed
    replica (so the clients really were behind the NAT), and no p2pd is left."""
    plan = write_trial_plan(tmp_path / "plan.json", 3, 1, "diloco", inner_steps=5)
    data = json.loads(plan.read_text())
    data["sync"]["compression"] = "int8"
    plan.write_text(json.dumps(data))
    with nat_hosts(tmp_path, {1: "a", 2: "b"}, replicas=3) as hosts:
        route = subprocess.run(["ip", "netns", "exec", hosts["netns"][0], "ip", "route", "get",
                                CLIENT_IPS["a"]], capture_output=True, text=True)
        assert route.returncode != 0, "the public side has a route to a NATed replica"
        run_nat(plan, tmp_path, 10, hosts, replicas=3)  # raises on a failed rank or a p2pd left
    for r in (1, 2):  # the NATed replicas synced both rounds
        recs = [json.loads(x) for x in (tmp_path / f"m.r{r}.jsonl").read_text().splitlines()]
        assert max(x.get("outer_step", 0) for x in recs) == 2
    models = load_models(tmp_path / "ck", [0, 1, 2], 10)
    assert max_param_diff(models) == 0.0
