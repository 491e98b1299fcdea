"""NCCL across ranks that cannot hang or apply garbage, on CPU: the real CupyNcclCommunicator
over a fake cupy.cuda.nccl and torch.cuda (tests/fake_nccl.py) with NCCL's documented
semantics: a first call to a peer blocks until the peer answers, an aborted kernel ends as if
done with its buffers never written, an abort ends a blocked call, an asynchronous error is
what ncclCommGetAsyncError reports. Ranks are threads of this process, one device each."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from modules.comm.errors import CommError
from modules.comm.keys import member_key, nccl_arrival_prefix
from tests.fake_nccl import Fabric, install

BOUND_S = 30.0
"""How long a test waits for a thread before calling it hung (never reached when it passes)."""


@pytest.fixture
def fabric(monkeypatch: pytest.MonkeyPatch) -> Fabric:
    f = Fabric()
    install(monkeypatch, f)
    return f


@pytest.fixture
def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        p = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", p, 1, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    yield p
    del master


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=10))


def _make(port: int, rank: int, ranks=(0, 1), name: str = "g", timeout_s: float = 1.0,
          **kw):  # noqa: ANN001, ANN202
    """Rank `rank`'s communicator (on cuda:rank; its tensors are CPU tensors for the fake)."""
    from modules.comm.nccl import CupyNcclCommunicator

    comm = CupyNcclCommunicator(list(ranks), rank, _client(port), name, f"cuda:{rank}",
                                timeout_s=timeout_s, **kw)
    comm.device = torch.device("cpu")
    return comm


def _threads(*fns: Callable[[], object]) -> list[object]:
    """Run each fn on its own thread; their results (or the exception each raised). A thread
    still running after BOUND_S fails the test: that is the hang these tests rule out."""
    out: list[object] = [None] * len(fns)

    def run(i: int, fn: Callable[[], object]) -> None:
        try:
            out[i] = fn()
        except BaseException as e:  # handed to the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True)
               for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
        assert not t.is_alive(), "an NCCL call hung"
    return out


def _pair(port: int, connect: bool = True, **kw):  # noqa: ANN202
    """Both ranks' communicators (made on two threads, as two processes would), connected."""
    c0, c1 = _threads(lambda: _make(port, 0, **kw), lambda: _make(port, 1, **kw))
    assert not isinstance(c0, BaseException) and not isinstance(c1, BaseException), (c0, c1)
    if connect:
        assert _threads(c0.connect, c1.connect) == [None, None]
    return c0, c1


def _aborts(fabric: Fabric, rank: int) -> int:
    return sum(1 for e in fabric.log if e == ("abort", rank))


# -- a peer that is gone ---------------------------------------------------------------------
def test_a_peer_gone_at_the_first_collective_is_a_comm_error_not_a_hang(fabric, port):
    c0, c1 = _pair(port, connect=False)  # rank 1 made its communicator, then died
    t = torch.ones(4)
    [err] = _threads(lambda: c0.all_reduce(t, what="first all-reduce"))
    assert isinstance(err, CommError), err
    assert "first all-reduce (NCCL host call): no answer from rank 1" in str(err)
    assert err.peers == (1,)
    assert _aborts(fabric, 0) == 1  # the watchdog ended the blocked connection
    c0.abort()  # the runtime's own abort afterwards: no second ncclCommAbort
    assert _aborts(fabric, 0) == 1 and fabric.misuse == []
    c1.abort()


def test_a_peer_gone_while_connecting_at_init_is_a_comm_error(fabric, port):
    c0, c1 = _pair(port, connect=False)
    [err] = _threads(c0.connect)  # build_communicators connects right after init
    assert isinstance(err, CommError) and "no answer from rank 1" in str(err), err
    assert fabric.misuse == []
    c1.abort()


def test_a_peer_that_never_joins_the_nccl_init_is_a_comm_error(fabric, port):
    store = _client(port)
    store.set(member_key(nccl_arrival_prefix("g", (0, 1)), 1), "1")  # met, never inits
    [err] = _threads(lambda: _make(port, 0))
    assert isinstance(err, CommError), err
    assert "did not join within 1 s (NCCL init)" in str(err) and err.peers == (1,)


# -- nothing of an aborted step is used ------------------------------------------------------
def _dead_average(fabric: Fabric, port: int, **kw):  # noqa: ANN202
    """Rank 0's communicator after its peer died with an all-reduce of rank 0 in flight."""
    c0, c1 = _pair(port, **kw)
    c1.abort()  # rank 1 is gone: its part of anything later never comes
    return c0


def test_an_aborted_gradient_average_is_never_applied(fabric, port):
    from modules.sync.average import average_grads, make_group_average

    c0 = _dead_average(fabric, port)
    p, q = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(1))
    p.grad, q.grad = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0])
    average = make_group_average(c0, "none", "the stage's gradient average")
    [err] = _threads(lambda: average_grads([p, q], average))
    assert isinstance(err, CommError) and "no answer from rank 1" in str(err), err
    # the gradients never took the flat buffer's garbage
    assert p.grad.tolist() == [1.0, 2.0, 3.0] and q.grad.tolist() == [4.0]
    assert _aborts(fabric, 0) == 1 and fabric.misuse == []


def _stub_trainer(groups: object) -> SimpleNamespace:
    """What Trainer.train_step reads, for one stage without a peer of its own (allreduce)."""
    taken: list[str] = []
    return SimpleNamespace(
        topo=SimpleNamespace(is_first=False, is_last=False),
        plan=SimpleNamespace(num_micro_batches=1), opt=torch.optim.SGD([torch.zeros(1)]),
        pipe=SimpleNamespace(train_step=lambda x, y, n, scale: None),
        model=SimpleNamespace(tied_pair=lambda: []), shard=None, groups=groups,
        scaling=SimpleNamespace(scale_loss=None, found_overflow=lambda opt: False,
                                step=lambda *a: taken.append("step")),
        _check_finite=lambda loss: None, warming=False, outer=None,
        params=[torch.nn.Parameter(torch.zeros(1))],
        average=lambda flat: 0, dp_bytes=0, outer_count=None, state_lock=threading.Lock(),
        inner=None, step=0, cfg=None, tokens=0, tokens_per_step=1, taken=taken)


def test_the_optimizer_step_is_not_taken_after_an_abort(fabric, port, monkeypatch):
    from modules.control.groups import Groups
    from modules.train import trainer

    c0 = _dead_average(fabric, port)
    c0.all_reduce(torch.ones(2), what="activations' gradient")  # enqueued; never completes
    monkeypatch.setattr(trainer, "set_lr", lambda *a: None)
    stub = _stub_trainer(Groups(world=SimpleNamespace(), pipeline=c0, stage=None, tied=None))
    [err] = _threads(lambda: trainer.Trainer.train_step(stub))
    assert isinstance(err, CommError) and "activations' gradient" in str(err), err
    assert stub.taken == [] and stub.step == 0


def test_a_checkpoint_is_not_written_after_an_abort(fabric, port, tmp_path):
    from modules.config import CheckpointConfig
    from modules.control.groups import Groups
    from modules.train.checkpointing import Checkpointing

    c0 = _dead_average(fabric, port)
    c0.broadcast(torch.ones(2), 1, what="a broadcast")
    groups = Groups(world=SimpleNamespace(), pipeline=None, stage=c0, tied=None)
    ckpt = Checkpointing(CheckpointConfig(dir=str(tmp_path), sync=True), 0, {},
                         lambda: {"step": 1}, lambda: 1, threading.Lock(), False,
                         log=lambda m: None, healthy=groups.check_health)
    [err] = _threads(ckpt.save)
    assert isinstance(err, CommError) and "a broadcast" in str(err), err
    assert not any(tmp_path.rglob("*.pt")), list(tmp_path.rglob("*"))


def test_a_healthy_pair_moves_the_data_and_passes_the_health_check(fabric, port):
    from modules.control.groups import Groups

    c0, c1 = _pair(port)
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])
    _threads(lambda: c0.all_reduce(a), lambda: c1.all_reduce(b))
    for comm in (c0, c1):
        Groups(world=SimpleNamespace(), pipeline=None, stage=comm,
               tied=None).check_health("a step")
    assert a.tolist() == b.tolist() == [4.0, 7.0]
    _threads(c0.close, c1.close)
    assert fabric.misuse == [] and ("destroy", 0) in fabric.log


# -- aborts: once, never under a call that is enqueueing -------------------------------------
def test_a_double_abort_is_safe(fabric, port):
    c0, c1 = _pair(port)
    _threads(c0.abort, c0.abort, c0.host.abort)
    c0.abort()
    c0.close()
    assert _aborts(fabric, 0) == 1 and fabric.misuse == []
    with pytest.raises(CommError, match="is aborted: no call can start"):
        c0.all_reduce(torch.ones(1))
    assert fabric.misuse == []  # the refused call never reached NCCL
    c1.abort()


def test_an_abort_waits_for_a_call_that_is_enqueueing(fabric, port):
    c0, c1 = _pair(port)
    fabric.enqueue_delay_s = 0.2

    def abort_mid_call() -> None:
        while fabric.inside.get(0) != 1:  # rank 0's call is inside NCCL, enqueueing
            time.sleep(0.001)
        c0.abort()

    _threads(lambda: c0.all_reduce(torch.ones(1), what="late"), abort_mid_call)
    log = fabric.log
    enqueued = max(i for i, e in enumerate(log) if e == ("enqueued", "allReduce", 0))
    assert enqueued < log.index(("abort", 0)), log[-4:]
    assert fabric.misuse == []
    c1.abort()


# -- asynchronous errors ---------------------------------------------------------------------
def test_an_async_error_ends_the_wait_long_before_the_timeout(fabric, port):
    c0, c1 = _pair(port, timeout_s=600.0)  # the test's bound is far shorter
    c0.all_reduce(torch.ones(3), what="the step's all-reduce")  # rank 1 never comes
    fabric.async_error(0, "NCCL error: remote process exited or there was a network error")
    [err] = _threads(lambda: c0.check_health("the optimizer step"))
    assert isinstance(err, CommError), err
    assert "asynchronous error (NCCL error: remote process exited" in str(err)
    assert err.peers == (1,) and _aborts(fabric, 0) == 1
    c1.abort()


# -- one communicator inside NCCL per device -------------------------------------------------
def test_two_communicators_of_one_device_never_call_nccl_at_once(fabric, port):
    """The training thread's communicator and the overlapped outer sync's, on one GPU."""
    (a0, a1), (b0, b1) = _pair(port, name="train"), _pair(port, name="outer")
    fabric.enqueue_delay_s = 0.05
    fabric.most_inside.clear()

    buffers = [torch.ones(2) for _ in range(16)]  # alive until the peers' parts arrive

    def calls(comm, i: int) -> Callable[[], None]:  # noqa: ANN001
        return lambda: [comm.all_reduce(t) for t in buffers[4 * i:4 * i + 4]]

    _threads(calls(a0, 0), calls(b0, 1), calls(a1, 2), calls(b1, 3))
    assert fabric.most_inside == {0: 1, 1: 1}
    _threads(*(comm.synchronize for comm in (a0, b0, a1, b1)))
    assert [t.tolist() for t in buffers] == [[2.0, 2.0]] * 16


# -- the int8 mean on CUDA reads nothing back per chunk ---------------------------------------
def test_the_int8_mean_across_ranks_reads_nothing_back_and_matches_the_cpu_codec(
        fabric, port, monkeypatch):
    """The CUDA branch of the codec (kernels replaced by the CPU codec with the kernel's
    marking rule) over two fake NCCL ranks: every chunk is quantised without a read-back and
    both ranks end with the CPU reference's bytes."""
    from modules.quant import codec
    from modules.quant.allreduce import reference_compressed_mean

    modes = []

    def kernel(x: torch.Tensor, block: int, mark_nonfinite: bool = False):  # noqa: ANN202
        modes.append(mark_nonfinite)
        finite = torch.isfinite(x)  # the kernel's marking: NaN/inf as 0, their block's scale NaN
        q = codec.quantize_int8_torch(torch.where(finite, x, torch.zeros_like(x)), block)
        if mark_nonfinite:
            q.scales[~torch.nn.functional.pad(finite, (0, -len(x) % block), value=True)
                     .view(-1, block).all(dim=1)] = float("nan")
        elif not bool(finite.all()):
            raise codec.NonFiniteError("non-finite")
        return q

    monkeypatch.setattr(codec, "_on_gpu", lambda x: True)
    monkeypatch.setattr(codec, "quantize_int8_cuda", kernel)
    monkeypatch.setattr(codec, "dequantize_int8_cuda", _cpu_dequant)
    fabric.blocking = True
    c0, c1 = _pair(port)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(3000, generator=gen) for _ in range(2)]
    want = reference_compressed_mean(xs, "int8", block=64, segment=1024)
    got = [x.clone() for x in xs]
    modes.clear()  # the reference's own encodes
    _threads(lambda: c0.mean_all_reduce(got[0], "int8", block=64, segment=1024),
             lambda: c1.mean_all_reduce(got[1], "int8", block=64, segment=1024))
    assert torch.equal(got[0], want) and torch.equal(got[1], want)
    assert modes and not any(m is False for m in modes), modes  # no per-chunk read-back


def _cpu_dequant(q):  # noqa: ANN001, ANN202
    """codec.dequantize_int8's CPU arithmetic (the kernel's)."""
    out = q.codes[: q.numel].to(torch.float32)
    scales = q.scales.repeat_interleave(q.block)[: q.numel]
    return out * scales


# -- the cupy to install -----------------------------------------------------------------------
@pytest.mark.parametrize(("cuda", "package"), [("13.0", "cupy-cuda13x"), ("12.8", "cupy-cuda12x"),
                                               ("11.8", "cupy-cuda11x"), (None, "cupy-cuda13x")])
def test_the_cupy_named_matches_torchs_cuda_major(cuda, package, monkeypatch):
    from modules.comm import nccl

    assert nccl.cupy_package(cuda) == package
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy", None)  # not installed: the import fails
    monkeypatch.delitem(sys.modules, "cupy.cuda", raising=False)
    with pytest.raises(CommError, match=f"pip install {package} "):
        nccl.load_nccl()


def test_the_gpu_extra_offers_the_cuda_13_cupy():
    from tests.conftest import ROOT

    text = (ROOT / "setup.py").read_text()
    assert '"gpu": ["cupy-cuda13x' in text and '"gpu-cuda12": ["cupy-cuda12x' in text
