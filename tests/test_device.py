"""--device/--cuda-device resolution (CUDA faked where this machine has none) and moving state
to a device; the gpu-marked tests repeat the moves on a real CUDA device."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from formats.errors import UserError
from modules.device.select import (
    describe_device,
    resolve_device,
    rng_states,
    set_rng_states,
    to_device,
)
from modules.train.checkpoint import snapshot
from tests.conftest import ROOT


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend two CUDA devices are visible (only resolution is under test, nothing runs)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cpu_and_auto_without_cuda_resolve_to_cpu(no_cuda):
    assert resolve_device("cpu", None, {}) == torch.device("cpu")
    assert resolve_device("auto", None, {"LOCAL_RANK": "3"}) == torch.device("cpu")


def test_cuda_without_a_visible_device_names_the_flag(no_cuda):
    with pytest.raises(UserError, match=r"^--device cuda: no CUDA device is visible "
                       r"\(torch.cuda.is_available\(\) is False"):
        resolve_device("cuda", None, {})
    with pytest.raises(UserError, match=r"^--cuda-device 1: no CUDA device is visible"):
        resolve_device("auto", 1, {})


def test_index_from_flag_then_local_rank_then_zero(fake_cuda):
    assert resolve_device("cuda", None, {}) == torch.device("cuda", 0)
    assert resolve_device("auto", None, {}) == torch.device("cuda", 0)
    assert resolve_device("cuda", None, {"LOCAL_RANK": "1"}) == torch.device("cuda", 1)
    assert resolve_device("auto", 0, {"LOCAL_RANK": "1"}) == torch.device("cuda", 0)


@pytest.mark.parametrize("choice, index, env, message", [
    ("cuda", 3, {}, r"^--cuda-device 3: only 2 CUDA devices are visible \(indices 0..1\)$"),
    ("cuda", None, {"LOCAL_RANK": "2"},
     r"^\$LOCAL_RANK 2: only 2 CUDA devices are visible .*; pass --cuda-device N$"),
    ("cuda", None, {"LOCAL_RANK": "x"}, r"^\$LOCAL_RANK: expected an integer, got 'x'$"),
    ("cuda", -1, {}, r"^--cuda-device -1: must be >= 0$"),
    ("cpu", 1, {}, r"^--cuda-device 1: has no effect with --device cpu"),
    ("gpu", None, {}, r"^--device: 'gpu' is not one of auto, cpu, cuda$"),
])
def test_devices_that_do_not_exist_are_user_errors(fake_cuda, choice, index, env, message):
    with pytest.raises(UserError, match=message):
        resolve_device(choice, index, env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine "
                    "without CUDA; this one has a CUDA device")
def test_entry_point_exits_2_with_the_message():
    code = ("from formats.errors import run_main\n"
            "from modules.device.select import resolve_device\n"
            "run_main(lambda argv: resolve_device('cuda', None) and 0)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: --device cuda: no CUDA device is visible")
    assert "Traceback" not in r.stderr


def test_describe_cpu():
    assert describe_device(torch.device("cpu")) == f"cpu ({torch.get_num_threads()} threads)"


def _state() -> dict:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return {"step": 7, "model": model.state_dict(), "opt": opt.state_dict(),
            "xs": [torch.zeros(2), (torch.ones(1), "tag")]}


def test_to_device_moves_every_tensor_and_keeps_the_rest():
    state = _state()
    moved = to_device(state, torch.device("meta"))  # a device every build has
    assert moved["step"] == 7 and moved["xs"][1][1] == "tag"
    assert moved["model"]["weight"].is_meta and moved["xs"][1][0].is_meta
    assert all(t.is_meta for t in moved["opt"]["state"][0].values())
    assert to_device(state, torch.device("cpu"))["model"]["weight"] is state["model"]["weight"]


def test_rng_states_round_trip_and_accept_a_bare_cpu_state():
    cpu = torch.device("cpu")
    saved = rng_states(cpu)
    assert set(saved) == {"cpu"}
    first = torch.rand(3)
    set_rng_states(saved, cpu)
    assert torch.equal(torch.rand(3), first)
    set_rng_states(saved["cpu"], cpu)  # the form older checkpoints hold
    assert torch.equal(torch.rand(3), first)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
def test_real_cuda_device_resolves_and_missing_index_is_refused():
    count = torch.cuda.device_count()
    assert resolve_device("auto", None, {}) == torch.device("cuda", 0)
    assert resolve_device("cuda", count - 1, {}) == torch.device("cuda", count - 1)
    with pytest.raises(UserError, match=rf"^--cuda-device {count}: only {count} CUDA"):
        resolve_device("cuda", count, {})


@pytest.mark.gpu
@gpu
def test_checkpoint_round_trip_through_cpu_onto_cuda():
    dev = torch.device("cuda", 0)
    model = torch.nn.Linear(8, 8).to(dev)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8, device=dev)).sum().backward()
    opt.step()
    saved = snapshot({"model": model.state_dict(), "opt": opt.state_dict(),
                      "rng": rng_states(dev)})  # what a checkpoint holds: CPU tensors
    assert not any(t.is_cuda for t in saved["model"].values())
    assert set(saved["rng"]) == {"cpu", "cuda"}
    fresh = torch.nn.Linear(8, 8).to(dev)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    fresh.load_state_dict(to_device(saved["model"], dev))
    fresh_opt.load_state_dict(saved["opt"])  # the optimizer moves its state to the params'
    assert torch.equal(fresh.weight, model.weight)
    assert fresh_opt.state[fresh.weight]["exp_avg"].is_cuda
    assert describe_device(dev).startswith(f"cuda:0 ({torch.cuda.get_device_name(0)}, ")
    first = torch.rand(4, device=dev)
    set_rng_states(saved["rng"], dev)  # taken before `first` was drawn
    assert torch.equal(torch.rand(4, device=dev), first)
