"""launch_local.py --netns-map: ranks started inside network namespaces (`ip netns exec`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from formats.plan import Plan, save_plan
from tests.conftest import run_entry

pytestmark = pytest.mark.netns


@pytest.fixture
def netns():
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2 (`ip`)")
    name = f"rt{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


@pytest.mark.timeout(120)
def test_ranks_run_inside_the_mapped_namespace(tmp_path, netns):
    plan = Plan("local", "", "gpt-tiny", [(0, 2), (2, 4)], [[0, 1]], micro_batch_size=1)
    save_plan(plan, tmp_path / "plan.json")
    (tmp_path / "map.json").write_text(json.dumps({"0": netns, "1": netns}))
    proc = run_entry("scripts/launch_local.py", "--plan", str(tmp_path / "plan.json"),
                     "--netns-map", str(tmp_path / "map.json"), "--gloo-ifname", "lo",
                     "--threads-per-rank", "1", "--", "--steps", "2", "--fake-data",
                     "--timeout-s", "30", timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "launch: rank 0 pid" in proc.stdout and f"in netns {netns}" in proc.stdout
    assert "[rank 1] step 2/2 loss" in proc.stdout
