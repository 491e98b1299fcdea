"""The GPU path's stream ordering, kernel arithmetic and tear-down, checked without a GPU.

A fake-CUDA seam stands in for torch.cuda's streams and events and for a recording cupy
(cupy.cuda.nccl included), so a test can assert which stream every NCCL call, event record,
copy and DLPack conversion used, that a commit waits for completion and that a group rebuilt
after a loss is aborted rather than destroyed. The int8 kernel is compiled with cupy's own
options (-ftz=true among them) and its PTX checked; a numpy model of its arithmetic with
flush-to-zero semantics is compared with the CPU codec on denormal inputs.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import shutil
import socket
import subprocess
import sys
import threading
import types
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.conftest import ROOT

# -- the seam ----------------------------------------------------------------------------------


class FakeStream:
    """A torch.cuda.Stream stand-in: a name and a raw handle."""

    def __init__(self, name: str, handle: int) -> None:
        self.name, self.cuda_stream = name, handle

    def __repr__(self) -> str:
        return f"<stream {self.name} {self.cuda_stream:#x}>"

    def wait_event(self, event: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


class FakeCuda:
    """torch.cuda's streams, events and device calls, recording what used which stream."""

    def __init__(self) -> None:
        self.default = FakeStream("default", 0)  # the legacy default stream: handle 0
        self.current = self.default
        self.log: list[tuple] = []
        self.pooled = 0
        self.elapsed_ms = 250.0

    def current_stream(self, device: object = None) -> FakeStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, s: FakeStream):
        before, self.current = self.current, s
        try:
            yield s
        finally:
            self.current = before

    def external_stream(self, handle: int, device: object = None) -> FakeStream:
        """As torch does: a null pointer gives a fresh pooled stream, not the default one."""
        if handle == 0:
            self.pooled += 1
            return FakeStream(f"pool{self.pooled}", 0x1000 + self.pooled)
        return FakeStream("external", handle)

    def event_class(self):  # noqa: ANN201
        cuda = self

        class Event:
            def __init__(self, enable_timing: bool = False, **_: object) -> None:
                self.stream = None

            def record(self, stream: FakeStream | None = None) -> None:
                self.stream = stream if stream is not None else cuda.current
                cuda.log.append(("record", self.stream))

            def query(self) -> bool:
                return True

            def synchronize(self) -> None:
                cuda.log.append(("event sync", self.stream))

            def elapsed_time(self, end: object) -> float:
                return cuda.elapsed_ms

        return Event

    def set_device(self, index: int) -> None:
        self.log.append(("set_device", index, threading.current_thread().name))

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name, value in (("current_stream", self.current_stream), ("stream", self.stream),
                            ("ExternalStream", self.external_stream),
                            ("Event", self.event_class()), ("set_device", self.set_device),
                            ("current_device", lambda: 0), ("Stream", FakeStream)):
            monkeypatch.setattr(torch.cuda, name, value)
        copy = torch.Tensor.copy_

        def logged_copy(t: torch.Tensor, src: torch.Tensor, *a, **k) -> torch.Tensor:
            self.log.append(("copy", self.current))
            return copy(t, src, *a, **k)

        monkeypatch.setattr(torch.Tensor, "copy_", logged_copy)


class FakeNcclComm:
    """cupy.cuda.nccl.NcclCommunicator: records each call with the stream handle it got."""

    def __init__(self, log: list, size: int, uid: tuple, rank: int) -> None:
        self.log = log
        log.append(("nccl init", size, uid, rank))

    def __getattr__(self, name: str):  # noqa: ANN204
        if name in ("allReduce", "allGather", "bcast", "send", "recv"):
            return lambda *args: self.log.append(("nccl", name, args[-1]))
        raise AttributeError(name)

    def abort(self) -> None:
        self.log.append(("nccl abort",))

    def destroy(self) -> None:
        self.log.append(("nccl destroy",))


def fake_cupy(log: list) -> types.ModuleType:
    """A recording cupy: Device and ExternalStream contexts, from_dlpack, cuda.nccl."""
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    nccl = types.ModuleType("cupy.cuda.nccl")
    state = {"stream": None}

    @contextlib.contextmanager
    def external_stream(handle: int):
        before, state["stream"] = state["stream"], handle
        try:
            yield
        finally:
            state["stream"] = before

    def from_dlpack(t: torch.Tensor) -> torch.Tensor:
        log.append(("dlpack", state["stream"]))
        return t

    cuda.Device = lambda index: contextlib.nullcontext()
    cuda.ExternalStream = external_stream
    cupy.from_dlpack = from_dlpack
    nccl.available = True
    for i, name in enumerate(("NCCL_FLOAT32", "NCCL_FLOAT16", "NCCL_BFLOAT16", "NCCL_FLOAT64",
                              "NCCL_INT8", "NCCL_UINT8", "NCCL_INT32", "NCCL_INT64", "NCCL_SUM",
                              "NCCL_MAX", "NCCL_MIN")):
        setattr(nccl, name, i)
    nccl.get_unique_id = lambda: tuple(range(-64, 64))
    nccl.groupStart = lambda: log.append(("nccl groupStart",))
    nccl.groupEnd = lambda: log.append(("nccl groupEnd",))
    nccl.NcclCommunicator = lambda size, uid, rank: FakeNcclComm(log, size, uid, rank)
    cuda.nccl, cupy.cuda = nccl, cuda
    return cupy


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """The fake torch.cuda and cupy, sharing one log."""
    fake = FakeCuda()
    fake.install(monkeypatch)
    cupy = fake_cupy(fake.log)
    for name, mod in (("cupy", cupy), ("cupy.cuda", cupy.cuda),
                      ("cupy.cuda.nccl", cupy.cuda.nccl)):
        monkeypatch.setitem(sys.modules, name, mod)
    return fake


def _store() -> dist.TCPStore:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


def _comm(device: str = "cuda:0", **kw):  # noqa: ANN202
    """A one-rank CupyNcclCommunicator over the fakes; its tensors are CPU tensors."""
    from modules.comm.nccl import CupyNcclCommunicator

    comm = CupyNcclCommunicator([0], 0, _store(), "seam", device, timeout_s=5, **kw)
    comm.device = torch.device("cpu")  # the fakes run the calls on CPU tensors
    return comm


def _streams(log: list, kind: str) -> list:
    return [e[-1] for e in log if e[0] == kind or e[:2] == ("nccl", kind)]


# -- defect 1: stream ordering in modules/comm/nccl.py -------------------------------------------
def test_nccl_calls_events_and_copies_use_the_current_torch_stream(gpu):
    comm = _comm()
    t = torch.arange(4, dtype=torch.float32)
    gpu.log.clear()
    comm.all_reduce(t)
    comm.broadcast(t, 0)
    comm.exchange([(t, 0)], [(torch.empty(4), 0)])
    outs = [torch.empty(4)]
    comm.all_gather(outs, t)
    nccl = [e for e in gpu.log if e[0] == "nccl"]
    assert [e[1] for e in nccl] == ["allReduce", "bcast", "send", "recv", "allGather"]
    assert all(e[2] == 0 for e in nccl)  # the raw handle of the current (default) stream
    records = _streams(gpu.log, "record")
    copies = _streams(gpu.log, "copy")
    assert records and all(s is gpu.default for s in records), records  # not a pooled stream
    assert copies and all(s is gpu.default for s in copies), copies
    comm.close()


def test_a_given_stream_carries_the_call_its_event_and_the_gather_copies(gpu):
    comm = _comm()
    side = FakeStream("side", 0x77)
    gpu.log.clear()
    comm.all_gather([torch.empty(3)], torch.ones(3), stream=side)
    assert [e[2] for e in gpu.log if e[0] == "nccl"] == [0x77]
    assert {id(s) for s in _streams(gpu.log, "record") + _streams(gpu.log, "copy")} == {id(side)}
    comm.close()


# -- defect 6: watchdog device, on_failure, event timing, unique id on aarch64 -------------------
def test_the_watchdog_thread_selects_the_ranks_device(gpu):
    comm = _comm("cuda:1")
    comm.watchdog.close()
    comm.watchdog._thread.join(2)
    assert ("set_device", 1, "comm-watchdog") in gpu.log


def test_build_communicators_hands_on_failure_to_nccl(gpu):
    from modules.comm.factory import build_communicators

    seen = []
    comms = build_communicators([[0]], 0, "nccl", _store(), torch.device("cuda", 0),
                                on_failure=seen.append)
    assert comms[(0,)].watchdog._on_failure == seen.append


def test_nccl_wait_time_is_measured_on_the_stream_with_events(gpu):
    comm = _comm()
    comm.all_reduce(torch.ones(8))
    comm.all_reduce(torch.ones(8))
    comm.stats.settle()
    assert comm.stats.wait_s == pytest.approx(2 * gpu.elapsed_ms / 1e3)
    assert comm.wait_s == pytest.approx(2 * gpu.elapsed_ms / 1e3)
    comm.close()


def test_unique_id_bytes_suit_a_signed_or_an_unsigned_char(monkeypatch):
    import platform

    from modules.comm.nccl import decode_unique_id, encode_unique_id

    unsigned = tuple((i * 37) % 256 for i in range(128))  # what cupy gives on aarch64
    signed = tuple(v - 256 if v >= 128 else v for v in unsigned)  # ... and on x86-64
    assert encode_unique_id(unsigned) == encode_unique_id(signed)
    data = encode_unique_id(signed)
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert decode_unique_id(data) == unsigned
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert decode_unique_id(data) == signed


def test_setup_requires_the_torch_with_group_dst_and_group_src():
    """gloo.py calls dist.isend/irecv(group_dst=/group_src=) and dist.broadcast(group_src=),
    first in torch 2.6."""
    text = (ROOT / "setup.py").read_text()
    found = re.search(r'"torch>=(\d+)\.(\d+)', text)
    assert found and (int(found.group(1)), int(found.group(2))) >= (2, 6), found
    for fn, arg in ((dist.isend, "group_dst"), (dist.irecv, "group_src"),
                    (dist.broadcast, "group_src")):
        assert arg in inspect.signature(fn).parameters  # the installed torch has them


# -- defect 3: cupy.from_dlpack inside the ExternalStream context ---------------------------------
def test_the_kernels_take_their_arrays_on_torchs_stream(gpu, monkeypatch):
    from modules.quant import cuda
    from modules.quant.blocks import QuantizedTensor

    launched = []
    kernel = SimpleNamespace(get_function=lambda name: lambda grid, block, args:
                             launched.append(name))
    monkeypatch.setattr(cuda, "_module", lambda index: kernel)
    gpu.current = FakeStream("training", 0x55)
    q = QuantizedTensor(torch.zeros(8, dtype=torch.int8), torch.ones(1), 8, 8)
    cuda.dequantize_int8_cuda(q)
    conversions = _streams(gpu.log, "dlpack")
    assert len(conversions) == 3 and set(conversions) == {0x55}, conversions
    cuda.quantize_int8_cuda(torch.ones(8), 8)
    assert launched == ["dequantize_blocks", "quantize_blocks"]
    conversions = _streams(gpu.log, "dlpack")
    assert len(conversions) == 7 and set(conversions) == {0x55}, conversions


def test_a_pipeline_int8_message_on_the_gpu_reads_nothing_back(gpu, monkeypatch):
    from modules.quant import cuda, rows

    calls = []
    monkeypatch.setattr(rows, "_on_gpu", lambda flat: True)
    monkeypatch.setattr(cuda, "launch", lambda name, dev, nb, tensors, scalars:
                        calls.append((name, scalars)))

    def no_sync(t: torch.Tensor) -> None:
        raise AssertionError("a host sync (.item()) per pipeline message")

    monkeypatch.setattr(torch.Tensor, "item", no_sync)
    rows.encode_rows(torch.ones(3, 16))
    assert [c[0] for c in calls] == ["quantize_blocks"] and int(calls[0][1][-1]) == 1


# -- defects 4 and 5: tear-down after a loss, commit after completion -----------------------------
class RecordingComm:
    """A Communicator double that records enqueues, waits and its tear-down."""

    def __init__(self, log: list, name: str, size: int = 2) -> None:
        self.log, self.name, self.size, self.bytes_sent = log, name, size, 0

    def all_reduce(self, tensor, op="sum", what=None) -> None:  # noqa: ANN001
        self.log.append((self.name, "all_reduce enqueued"))

    def mean_all_reduce(self, tensor, compression="int8", what=None) -> int:  # noqa: ANN001
        self.log.append((self.name, "mean enqueued"))
        return 0

    def synchronize(self, what=None) -> None:  # noqa: ANN001
        self.log.append((self.name, "synchronize"))

    def close(self) -> None:
        self.log.append((self.name, "close"))

    def abort(self) -> None:
        self.log.append((self.name, "abort"))


def _membership(log: list, monitor: object):  # noqa: ANN202
    from modules.control.elastic import Membership

    m = Membership.__new__(Membership)
    m.topo = SimpleNamespace(stage=0, replica=0, rank=0, shard=0)
    from formats.plan import Plan

    m.plan = Plan("seam", "", "gpt-tiny", [(0, 2)], [[0], [1]])  # 2 replicas of one stage
    m.replicas, m.active, m.gen, m.monitor = (0, 1), {0, 1}, 0, monitor
    m.cfg = SimpleNamespace(min_replicas=1, heartbeat_timeout_s=1.0, timeout_s=5.0)
    m.log = lambda text: log.append(("log", text))
    m.waiter = SimpleNamespace()  # the flag waits it would serve are stubbed in these tests
    return m


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_the_outer_step_commits_only_after_the_average_completed(monkeypatch, compression):
    from modules.control.elastic import Membership
    from modules.sync.average import make_group_average

    log: list = []
    m = _membership(log, SimpleNamespace(gen=0))
    monkeypatch.setattr(Membership, "_timed_wait", lambda self, *a, **k: True)
    monkeypatch.setattr(Membership, "_commit",
                        lambda self, prefix, ranks, what: log.append(("commit",)) or True)
    average = make_group_average(RecordingComm(log, "stage"), compression, "outer")
    m.outer_round(torch.ones(4), average, 0)
    steps = [e[-1] for e in log]
    assert steps[-1] == "commit" and steps[-2] == "synchronize", steps


def test_a_group_rebuilt_after_a_lost_peer_is_aborted_not_destroyed():
    from modules.control.groups import Groups

    log: list = []
    old = Groups(world=RecordingComm(log, "world"), pipeline=None,
                 stage=RecordingComm(log, "stage"), tied=None)
    new = Groups(world=RecordingComm(log, "world1"), pipeline=None, stage=None, tied=None)
    gen = SimpleNamespace(gen=1, members=(0,), replicas=(0,), stop=False, reason="lost rank 1")
    m = _membership(log, SimpleNamespace(gen=1, generation=gen, dropped=False))
    m.groups = old
    m.builder = SimpleNamespace(build=lambda g, replicas: new)
    change = m.poll(lambda: None)
    assert change is not None and change.groups is new
    torn = [e for e in log if e[0] in ("world", "stage")]
    assert sorted(torn) == [("stage", "abort"), ("world", "abort")], torn


def test_a_generation_that_only_admits_a_joiner_closes_the_old_groups():
    from modules.control.groups import Groups

    log: list = []
    old = Groups(world=RecordingComm(log, "world"), pipeline=None, stage=None, tied=None)
    gen = SimpleNamespace(gen=1, members=(0, 1), replicas=(0, 1), stop=False, reason="join")
    m = _membership(log, SimpleNamespace(gen=1, generation=gen, dropped=False))
    m.groups, m.replicas = old, (0,)
    m.active = {0, 1}  # nobody to hand over to in this test
    m.builder = SimpleNamespace(build=lambda g, replicas: old)
    m.poll(lambda: None)
    assert ("world", "close") in log and ("world", "abort") not in log


# -- defect 2: the int8 kernel under cupy's -ftz=true ---------------------------------------------
CUPY_OPTIONS = ("-ftz=true",)
"""What cupy.RawModule adds to our options before NVRTC (cupy/cuda/compiler.py,
_compile_with_cache_cuda: `options += ('-ftz=true',)`, then an -arch for the device)."""


def _ptx(tmp_path: Path, arch: str = "compute_90") -> str:
    """int8.cu compiled to PTX as cupy builds it: our COMPILE_OPTIONS + cupy's own."""
    from modules.quant.cuda import COMPILE_OPTIONS, KERNEL_SOURCE

    out = tmp_path / f"int8_{arch}.ptx"
    cmd = ["nvcc", "-ptx", *COMPILE_OPTIONS, *CUPY_OPTIONS, f"-arch={arch}", "-o", str(out),
           str(KERNEL_SOURCE)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    return out.read_text()


from modules.quant.kernel_model import DENORMAL_CASE as DENORMAL_BLOCKS  # noqa: E402


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) to "
                    "compile the kernel's PTX")
@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_the_kernel_compiled_with_cupys_flags_holds_no_flushing_arithmetic(tmp_path, arch):
    from modules.quant.kernel_model import ftz_ops

    ptx = _ptx(tmp_path, arch)
    assert ".entry quantize_blocks" in ptx and ".entry dequantize_blocks" in ptx
    flushing = [ln.strip() for ln in ptx.splitlines() if ".ftz" in ln]
    assert not flushing, flushing[:5]
    assert ftz_ops(ptx) == frozenset()


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) to "
                    "compile the kernel's PTX")
def test_the_kernel_as_cupy_compiles_it_matches_the_cpu_codec_on_denormals(tmp_path):
    """The numpy model with the .ftz operations the PTX really holds gives the codec's bytes."""
    from modules.quant.codec import dequantize_int8, quantize_int8
    from modules.quant.kernel_model import dequantize_model, ftz_ops, quantize_model

    flushing = ftz_ops(_ptx(tmp_path))
    q = quantize_int8(torch.from_numpy(DENORMAL_BLOCKS.copy()), 8)
    codes, scales = quantize_model(DENORMAL_BLOCKS, 8, flushing)
    assert codes.tolist() == q.codes.tolist()
    assert scales.tobytes() == q.scales.numpy().tobytes()
    back = dequantize_model(codes, scales, 8, flushing)
    assert back.tobytes() == dequantize_int8(q).numpy().tobytes()


def test_the_ftz_model_sees_what_flushing_does_to_denormals():
    """IEEE model == codec on random and denormal data; every op flushed != codec."""
    from modules.quant.codec import quantize_int8
    from modules.quant.kernel_model import OPS, ftz_ops, quantize_model

    x = (np.random.default_rng(0).standard_normal(4096) *
         np.repeat(10.0 ** np.arange(-40, 24, 4), 256)).astype(np.float32)
    for data, block in ((x, 256), (DENORMAL_BLOCKS, 8)):
        q = quantize_int8(torch.from_numpy(data.copy()), block)
        codes, scales = quantize_model(data, block)
        assert codes.tolist() == q.codes.tolist()
        assert scales.tobytes() == q.scales.numpy().tobytes()
    flushed, _ = quantize_model(DENORMAL_BLOCKS, 8, frozenset(OPS))
    assert flushed[:4].tolist() == [9, 0, 0, 0]  # the CPU gives 9, 1, -1, 1
    assert ftz_ops("\tdiv.rn.ftz.f32 %f1, %f2, %f3;\n\tmax.f32 %f4, %f1, %f2;\n"
                   "\tcvt.rzi.ftz.s32.f32 %r1, %f4;\n") == {"div", "rint"}


def test_cupy_14_gets_the_unique_id_as_bytes(gpu, monkeypatch):
    """cupy >= 14's NcclCommunicator takes the id as 128 bytes and refuses a tuple with the
    TypeError seen on an H100 (cupy 14.2.0); cupy <= 13 takes the tuple of C chars."""
    import cupy

    from modules.comm.nccl import encode_unique_id

    nccl, got = cupy.cuda.nccl, []

    def bytes_only(size: int, uid, rank: int) -> FakeNcclComm:  # noqa: ANN001
        if not isinstance(uid, bytes):
            raise TypeError("Argument 'commId' has incorrect type (expected bytes, got tuple)")
        got.append(uid)
        return FakeNcclComm(gpu.log, size, uid, rank)

    monkeypatch.setattr(nccl, "NcclCommunicator", bytes_only)
    _comm().close()
    assert got == [encode_unique_id(nccl.get_unique_id())]


def test_other_type_errors_from_cupy_are_not_swallowed(gpu, monkeypatch):
    import cupy

    def broken(size: int, uid, rank: int) -> None:  # noqa: ANN001
        raise TypeError("an integer is required")

    monkeypatch.setattr(cupy.cuda.nccl, "NcclCommunicator", broken)
    with pytest.raises(TypeError, match="integer"):
        _comm()
