"""A fake cupy.cuda.nccl and torch.cuda for several ranks in one process (threads), with the
semantics NCCL and cupy document, so that the real CupyNcclCommunicator runs on CPU tensors:

- ncclCommInitRank blocks until every rank of the unique id joined;
- the first call of a rank to a peer connects to it and blocks until that peer makes its own
  first call to the rank (NCCL 2.22+'s lazy connection); a peer that is gone never does;
- a call returns once enqueued; its kernel is done when every rank posted its part (the data
  then moves: the fake reads and writes the tensors behind the pointers it is given), or when
  the communicator is aborted (done, the buffers never written: garbage);
- ncclCommAbort ends a call blocked inside (NcclError) and every pending kernel; a call after
  it, a second abort or a destroy after it is a use of a freed communicator: recorded in
  `misuse` (the tests require it empty);
- `check_async_error` raises what `Fabric.async_error` was given (ncclCommGetAsyncError);
- events are done when the kernels enqueued on their stream before them are;
- `Fabric.blocking`: a call (a group: its groupEnd) returns once its kernels are done, for code
  that reads CPU buffers at once where a GPU would order the read on the stream.
`install(monkeypatch, fabric)` puts them in sys.modules / torch.cuda.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import sys
import threading
import time
import types
from dataclasses import dataclass, field

import pytest
import torch

DTYPES = {"NCCL_FLOAT32": torch.float32, "NCCL_FLOAT16": torch.float16,
          "NCCL_BFLOAT16": torch.bfloat16, "NCCL_FLOAT64": torch.float64,
          "NCCL_INT8": torch.int8, "NCCL_UINT8": torch.uint8, "NCCL_INT32": torch.int32,
          "NCCL_INT64": torch.int64}
OPS = {"NCCL_SUM": "sum", "NCCL_MAX": "max", "NCCL_MIN": "min"}
CODES = {name: i for i, name in enumerate([*DTYPES, *OPS])}
WAIT_S = 30.0
"""The fake's own bound on any wait (a test that would hang fails instead)."""


class NcclError(RuntimeError):
    """cupy.cuda.nccl.NcclError."""


def view(ptr: int, count: int, dtype_code: int) -> torch.Tensor:
    """The CPU tensor behind a data pointer the communicator passed."""
    dtype = DTYPES[next(n for n, c in CODES.items() if c == dtype_code)]
    size = torch.empty(0, dtype=dtype).element_size()
    buf = (ctypes.c_byte * (count * size)).from_address(ptr)
    return torch.frombuffer(buf, dtype=dtype, count=count) if count else torch.empty(0, dtype=dtype)


@dataclass
class Kernel:
    """One rank's part of an operation, on a stream."""

    comm: FakeComm
    run: _Run | None = None
    done: bool = False
    aborted: bool = False


@dataclass
class Clique:
    """The ranks of one unique id."""

    size: int
    comms: dict[int, FakeComm] = field(default_factory=dict)
    hello: set[tuple[int, int]] = field(default_factory=set)
    """(rank, peer): rank made its first call to peer."""
    posts: dict[tuple, dict[int, Kernel]] = field(default_factory=dict)


class Fabric:
    """Everything the fake ranks share; `log` records NCCL calls in order."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.cliques: dict[bytes, Clique] = {}
        self.queues: dict[int, list[Kernel]] = {}
        self.handles = itertools.count(0x100)
        self.ids = itertools.count(1)
        self.log: list[tuple] = []
        self.misuse: list[str] = []
        self.async_errors: dict[int, str] = {}
        self.inside: dict[int, int] = {}
        self.most_inside: dict[int, int] = {}
        """Per rank (one device each): host calls enqueueing at once, now and at most."""
        self.blocking = False
        """Host calls return when their kernel is done (for code that reads buffers without
        waiting for events: CPU tensors standing in for CUDA ones)."""
        self.enqueue_delay_s = 0.0
        """How long a host call takes to enqueue (an abort must wait for it)."""
        self.local = threading.local()

    def async_error(self, group_rank: int, message: str) -> None:
        """What ncclCommGetAsyncError reports from now on for `group_rank`'s communicators."""
        self.async_errors[group_rank] = message

    def wait(self, pred, comm: FakeComm | None = None) -> None:  # noqa: ANN001
        """Block on `pred()` (fabric lock held); NcclError when `comm` is aborted meanwhile."""
        deadline = time.monotonic() + WAIT_S
        while not pred():
            if comm is not None and comm.aborted:
                raise NcclError("NCCL error: internal error - communicator aborted")
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("fake NCCL: a wait outlived the test's bound")
            self.cond.wait(min(left, 0.05))

    def _group_start(self) -> None:
        self.local.group = []

    def _group_end(self) -> None:
        group, self.local.group = self.local.group, None
        with self.cond:
            self.wait(lambda: all(k.done for k in group))

    def module(self) -> types.ModuleType:
        """cupy.cuda.nccl over this fabric."""
        nccl = types.ModuleType("cupy.cuda.nccl")
        nccl.available = True
        nccl.NcclError = NcclError
        for name, code in CODES.items():
            setattr(nccl, name, code)
        nccl.get_unique_id = lambda: tuple([next(self.ids) % 100] + [0] * 127)
        nccl.groupStart = self._group_start
        nccl.groupEnd = self._group_end
        nccl.NcclCommunicator = lambda size, uid, rank: FakeComm(self, size, bytes(
            int(v) & 0xFF for v in uid), rank)
        return nccl


class FakeComm:
    """cupy.cuda.nccl.NcclCommunicator of one rank."""

    def __init__(self, fabric: Fabric, size: int, uid: bytes, rank: int) -> None:
        self.f, self.rank, self.size = fabric, rank, size
        self.aborted = self.destroyed = False
        self.seq: dict[tuple, int] = {}
        with fabric.cond:
            clique = self.clique = fabric.cliques.setdefault(uid, Clique(size))
            clique.comms[rank] = self
            fabric.log.append(("init", rank))
            fabric.cond.notify_all()
            fabric.wait(lambda: len(clique.comms) == size)

    # -- the host calls ------------------------------------------------------------------------
    def _host_call(self, name: str, peers: list[int], key: tuple, run, stream: int) -> None:  # noqa: ANN001
        f = self.f
        with f.cond:
            if self.aborted or self.destroyed:
                f.misuse.append(f"{name} on rank {self.rank} after abort/destroy")
                raise NcclError("NCCL error: invalid usage")
            f.log.append((name, self.rank))
            for p in peers:  # the lazy connection: both sides must reach it
                self.clique.hello.add((self.rank, p))
            f.cond.notify_all()
            f.wait(lambda: all((p, self.rank) in self.clique.hello for p in peers), self)
            f.inside[self.rank] = inside = f.inside.get(self.rank, 0) + 1
            f.most_inside[self.rank] = max(f.most_inside.get(self.rank, 0), inside)
        if f.enqueue_delay_s:
            time.sleep(f.enqueue_delay_s)
        with f.cond:
            f.inside[self.rank] -= 1
            f.log.append(("enqueued", name, self.rank))
            n = self.seq[key] = self.seq.get(key, -1) + 1
            kernel = Kernel(self, run)
            f.queues.setdefault(stream, []).append(kernel)
            posts = self.clique.posts.setdefault((*key, n), {})
            posts[self.rank] = kernel
            if len(posts) == len(peers) + 1:
                self._complete(posts)
            f.cond.notify_all()
            if f.blocking:  # a group's calls are waited for at groupEnd, together
                group = getattr(f.local, "group", None)
                if group is not None:
                    group.append(kernel)
                else:
                    f.wait(lambda: kernel.done, self)

    def _complete(self, posts: dict[int, Kernel]) -> None:
        """Every part posted: move the data, mark the kernels done."""
        if any(k.aborted for k in posts.values()):
            return
        runs = {r: k.run for r, k in posts.items()}
        first = next(iter(runs.values()))
        first(runs)
        for k in posts.values():
            k.done = True

    def allReduce(self, send: int, recv: int, count: int, dtype: int, op: int,  # noqa: N802
                  stream: int) -> None:
        ops = {CODES[n]: v for n, v in OPS.items()}

        def run(runs: dict) -> None:
            parts = [view(s, count, dtype).clone() for s, _ in (r.args for r in runs.values())]
            total = parts[0]
            for p in parts[1:]:
                total = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[
                    ops[op]](total, p)
            for _, dst in (r.args for r in runs.values()):
                view(dst, count, dtype).copy_(total)

        self._host_call("allReduce", self._others(), ("coll",), _Run(run, (send, recv)), stream)

    def allGather(self, send: int, recv: int, count: int, dtype: int,  # noqa: N802
                  stream: int) -> None:
        def run(runs: dict) -> None:
            for r in runs.values():
                out = view(r.args[1], count * self.size, dtype)
                for j in range(self.size):
                    out[j * count:(j + 1) * count].copy_(view(runs[j].args[0], count, dtype))

        self._host_call("allGather", self._others(), ("coll",), _Run(run, (send, recv)), stream)

    def bcast(self, buf: int, count: int, dtype: int, root: int, stream: int) -> None:
        def run(runs: dict) -> None:
            src = view(runs[root].args[0], count, dtype).clone()
            for r in runs.values():
                view(r.args[0], count, dtype).copy_(src)

        self._host_call("bcast", self._others(), ("coll",), _Run(run, (buf,)), stream)

    def send(self, buf: int, count: int, dtype: int, peer: int, stream: int) -> None:
        def run(runs: dict) -> None:
            view(runs[peer].args[0], count, dtype).copy_(view(runs[self.rank].args[0], count,
                                                              dtype))

        self._host_call("send", [peer], ("p2p", self.rank, peer), _Run(run, (buf,)), stream)

    def recv(self, buf: int, count: int, dtype: int, peer: int, stream: int) -> None:
        def run(runs: dict) -> None:
            view(runs[self.rank].args[0], count, dtype).copy_(view(runs[peer].args[0], count,
                                                                   dtype))

        self._host_call("recv", [peer], ("p2p", peer, self.rank), _Run(run, (buf,)), stream)

    def _others(self) -> list[int]:
        return [r for r in range(self.size) if r != self.rank]

    # -- management ------------------------------------------------------------------------
    def check_async_error(self) -> None:
        message = self.f.async_errors.get(self.rank)
        if message is not None and not self.aborted:
            raise NcclError(message)

    def abort(self) -> None:
        with self.f.cond:
            self.f.log.append(("abort", self.rank))
            if self.aborted or self.destroyed:
                self.f.misuse.append(f"second abort/destroy of rank {self.rank}'s comm")
                return
            self.aborted = True
            for posts in self.clique.posts.values():
                k = posts.get(self.rank)
                if k is not None and not k.done:
                    k.done = k.aborted = True  # the kernel exits; nothing was received
            self.f.cond.notify_all()

    def destroy(self) -> None:
        with self.f.cond:
            self.f.log.append(("destroy", self.rank))
            if self.aborted or self.destroyed:
                self.f.misuse.append(f"destroy after abort/destroy on rank {self.rank}")
            self.destroyed = True


class _Run:
    """A kernel's data movement and its pointer arguments."""

    def __init__(self, fn, args: tuple) -> None:  # noqa: ANN001
        self.fn, self.args = fn, args

    def __call__(self, runs: dict) -> None:
        self.fn(runs)


# -- torch.cuda ------------------------------------------------------------------------------
class FakeStream:
    """A torch.cuda.Stream stand-in with its own handle."""

    def __init__(self, fabric: Fabric, handle: int | None = None) -> None:
        self.f = fabric
        self.cuda_stream = next(fabric.handles) if handle is None else handle

    def wait_event(self, event: object) -> None:
        pass

    def wait_stream(self, other: object) -> None:
        pass

    def synchronize(self) -> None:
        ev = make_event_class(self.f)()
        ev.record(self)
        ev.synchronize()


def make_event_class(fabric: Fabric) -> type:
    """torch.cuda.Event: done when the kernels on its stream before it are."""

    class Event:
        def __init__(self, enable_timing: bool = False, **_: object) -> None:
            self.kernels: list[Kernel] = []

        def record(self, stream: FakeStream | None = None) -> None:
            stream = stream if stream is not None else current_stream(fabric)
            with fabric.cond:
                self.kernels = list(fabric.queues.get(stream.cuda_stream, []))

        def query(self) -> bool:
            with fabric.cond:
                return all(k.done for k in self.kernels)

        def synchronize(self) -> None:
            with fabric.cond:
                fabric.wait(lambda: all(k.done for k in self.kernels))

        def elapsed_time(self, end: object) -> float:
            return 0.0

    return Event


def current_stream(fabric: Fabric, device: object = None) -> FakeStream:
    """The calling thread's current stream (each rank thread starts on its own default)."""
    local = fabric.local
    if not hasattr(local, "stream"):
        local.stream = FakeStream(fabric)
    return local.stream


def install(monkeypatch: pytest.MonkeyPatch, fabric: Fabric) -> None:
    """The fake cupy (its nccl over `fabric`) and torch.cuda's streams and events."""
    cupy, cuda = types.ModuleType("cupy"), types.ModuleType("cupy.cuda")
    cuda.Device = lambda index=None: contextlib.nullcontext()
    cuda.nccl, cupy.cuda = fabric.module(), cuda
    for name, mod in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", cuda.nccl)):
        monkeypatch.setitem(sys.modules, name, mod)

    @contextlib.contextmanager
    def stream(s: FakeStream):
        before = current_stream(fabric)
        fabric.local.stream = s
        try:
            yield s
        finally:
            fabric.local.stream = before

    for name, value in (("current_stream", lambda device=None: current_stream(fabric)),
                        ("stream", stream), ("Event", make_event_class(fabric)),
                        ("set_device", lambda index: None), ("current_device", lambda: 0),
                        ("Stream", lambda device=None, **_: FakeStream(fabric))):
        monkeypatch.setattr(torch.cuda, name, value)
