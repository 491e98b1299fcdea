"""One GPU per local rank: the local launcher's default mapping, its messages, per-task device
visibility, the compile probe's device and the socket interface NCCL is given (device counts
monkeypatched: no GPU needed)."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from formats.plan import Plan, SyncConfig, save_plan
from modules.device.select import resolve_device
from scripts import launch_local


def _mapping(monkeypatch, visible: int, gpus: int | None, ranks: list[int],
             rest: list[str]) -> tuple[dict[int, list[str]], list[str]]:
    monkeypatch.setattr(launch_local, "visible_gpus", lambda: visible)
    said: list[str] = []
    return launch_local.gpu_flags(gpus, ranks, rest, said.append), said


def test_the_default_puts_one_gpu_per_rank_on_a_multi_gpu_host(monkeypatch):
    flags, said = _mapping(monkeypatch, 2, None, [0, 1], ["--steps", "1"])
    assert flags == {0: ["--cuda-device", "0"], 1: ["--cuda-device", "1"]}
    assert said == ["launch: GPU mapping: rank 0 -> cuda:0, rank 1 -> cuda:1"]


def test_ranks_sharing_a_gpu_under_comm_auto_are_told_they_fall_back_to_gloo(monkeypatch):
    flags, said = _mapping(monkeypatch, 2, None, [0, 1, 2], [])
    assert flags[2] == ["--cuda-device", "0"]
    assert "ranks [0, 2] share cuda:0: --comm auto cannot use NCCL" in said[1]
    assert "fall back to gloo" in said[1]
    _, said = _mapping(monkeypatch, 2, None, [0, 1, 2], ["--comm", "gloo"])
    assert len(said) == 1  # gloo asked for: nothing to warn about


def test_gpus_0_on_a_multi_gpu_host_says_every_rank_gets_gpu_0(monkeypatch):
    flags, said = _mapping(monkeypatch, 4, 0, [0, 1], [])
    assert flags == {0: [], 1: []}
    assert "every rank that runs on CUDA uses GPU 0 of the 4 here" in said[0]


@pytest.mark.parametrize("rest", [["--device", "cpu"], ["--device=cpu"]])
def test_cpu_ranks_and_a_cpu_host_get_no_device_flags(monkeypatch, rest):
    assert _mapping(monkeypatch, 2, None, [0, 1], rest) == ({0: [], 1: []}, [])
    assert _mapping(monkeypatch, 0, None, [0, 1], []) == ({0: [], 1: []}, [])


def test_a_cuda_device_after_the_separator_wins(monkeypatch):
    flags, said = _mapping(monkeypatch, 2, None, [0, 1], ["--cuda-device", "1"])
    assert flags == {0: [], 1: []} and "from the arguments after --" in said[0]


def _cuda(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_local_rank_with_one_visible_device_uses_it(monkeypatch):
    """Slurm's per-task CUDA_VISIBLE_DEVICES: task 3 of a node sees its own GPU as device 0."""
    _cuda(monkeypatch, 1)
    assert resolve_device("cuda", None, {"LOCAL_RANK": "3"}) == torch.device("cuda", 0)
    assert resolve_device("auto", None, {"LOCAL_RANK": "1"}) == torch.device("cuda", 0)
    _cuda(monkeypatch, 2)  # several visible: $LOCAL_RANK must name one of them
    assert resolve_device("cuda", None, {"LOCAL_RANK": "1"}) == torch.device("cuda", 1)
    from formats.errors import UserError

    with pytest.raises(UserError, match=r"^\$LOCAL_RANK 3: only 2 CUDA devices"):
        resolve_device("cuda", None, {"LOCAL_RANK": "3"})


def test_the_compile_probe_runs_after_the_device_is_chosen(monkeypatch):
    from modules.config import RunConfig
    from modules.device import placement

    order: list[str] = []
    monkeypatch.setattr(placement, "resolve_device", lambda choice, index: torch.device("cpu"))
    monkeypatch.setattr(placement, "use_device", lambda d: order.append(f"use {d}"))
    monkeypatch.setattr(placement, "check_compile_available", lambda d: order.append("probe"))
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, device=dataclasses.replace(cfg.device, compile=True))
    plan = Plan("t", "", "gpt-tiny", [(0, 4)], [[0]], 1, 1, SyncConfig())
    placement.resolve_placement(cfg, plan, 0)
    assert order == ["use cpu", "probe"]


STUB = """import os, sys
print("env", os.environ.get("NCCL_SOCKET_IFNAME"), os.environ.get("GLOO_SOCKET_IFNAME"),
      " ".join(sys.argv[1:]), flush=True)
"""


def test_the_launcher_passes_the_mapping_and_nccls_interface(tmp_path, monkeypatch, capsys):
    save_plan(Plan("t", "", "gpt-tiny", [(0, 4)], [[0], [1]], 1, 1, SyncConfig()),
              tmp_path / "plan.json")
    (tmp_path / "stub.py").write_text(STUB)
    monkeypatch.setattr(launch_local, "visible_gpus", lambda: 2)
    monkeypatch.setattr(sys, "executable", sys.executable)
    import signal
    term_before = signal.getsignal(signal.SIGTERM)
    status = launch_local.main(["--plan", str(tmp_path / "plan.json"), "--runner",
                                str(tmp_path / "stub.py"), "--gloo-ifname", "lo",
                                "--grace-s", "1"])
    out = capsys.readouterr().out
    assert status == 0, out
    # in-process: SIGTERM handled as before, not left ignored for what this process starts
    assert signal.getsignal(signal.SIGTERM) is term_before
    assert "launch: GPU mapping: rank 0 -> cuda:0, rank 1 -> cuda:1" in out
    for r in (0, 1):
        assert f"[rank {r}] env lo lo" in out and f"--rank {r} " in out
        line = next(ln for ln in out.splitlines() if ln.startswith(f"[rank {r}] env"))
        assert f"--cuda-device {r}" in line, line
