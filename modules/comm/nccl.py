"""`Communicator` over cupy.cuda.nccl for CUDA tensors (one process per GPU).

The members first meet in the rendezvous TCPStore (a member that does not come is a CommError
naming it, not a hung NCCL init); the NCCL unique id is then made by the group's first rank and
handed to the others through the store (keys: modules.comm.keys). Calls take torch CUDA
tensors (contiguous, on `device`) and are enqueued on torch's current CUDA stream of that device
unless a torch Stream is given. The torch Stream object is kept for everything torch does around
an operation (its done-event, the all-gather's copies, the allocator's view of buffers); only
NCCL gets its raw handle. (`torch.cuda.ExternalStream(0)` would NOT wrap the legacy default
stream: torch hands out a fresh pooled stream for a null pointer, unordered with the operation.)
NCCL has no timeout of its own: ncclCommInitRank runs on a helper thread waited for at most
the timeout, and a Watchdog aborts the communicator when a host call (NCCL 2.22+ connects to a
peer inside the first call to it, blocking until the peer answers) or an enqueued operation is
not done within the timeout, or when NCCL reports an asynchronous error; the next call (or
`synchronize`, `check_health`) raises a CommError naming the operation and its peers, as the
gloo path does. Host calls go through `HostCalls` (modules.comm.nccl_guard: one abort, no call
after it, one communicator inside NCCL per device at a time). cupy (the `gpu` extra) is
imported lazily.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from modules.comm.base import CommStats, GroupMembership, Posted, check_op, nbytes
from modules.comm.compressed import mean_all_reduce
from modules.comm.errors import CommError, first_line
from modules.comm.keys import member_key, nccl_arrival_prefix, nccl_unique_id_key, wait_keys
from modules.comm.nccl_guard import HostCalls, bounded
from modules.comm.watchdog import Watchdog
from modules.quant.allreduce import SEGMENT
from modules.quant.blocks import DEFAULT_BLOCK

UNIQUE_ID_BYTES = 128
CUPY_NEWEST = 13
"""The newest CUDA major a cupy wheel exists for (cupy-cuda13x)."""


def encode_unique_id(uid: Sequence[int]) -> bytes:
    """cupy's unique id (128 C `char`s) -> 128 bytes for the store. `char` is signed on x86-64
    and unsigned on aarch64 (GH200), so cupy hands out -128..127 or 0..255: both map to the
    same byte."""
    if len(uid) != UNIQUE_ID_BYTES:
        raise ValueError(f"NCCL unique id has {len(uid)} bytes, expected {UNIQUE_ID_BYTES}")
    bad = [int(v) for v in uid if not -128 <= int(v) <= 255]
    if bad:
        raise ValueError(f"NCCL unique id holds {bad[0]}, which is no C char")
    return bytes(int(v) & 0xFF for v in uid)


def char_is_signed(machine: str | None = None) -> bool:
    """Whether C `char` is signed on `machine` (default this one): x86-64 yes; aarch64 (GH200),
    ppc64le, s390x no (their ABIs make plain char unsigned)."""
    import platform

    arch = (machine or platform.machine()).lower()
    return arch not in ("aarch64", "arm64", "armv7l", "ppc64le", "s390x")


def decode_unique_id(data: bytes, signed: bool | None = None) -> tuple[int, ...]:
    """128 bytes from the store -> the tuple of C chars cupy's NcclCommunicator takes: -128..127
    where `char` is signed, 0..255 where it is unsigned (aarch64: cupy's Cython conversion of a
    negative value to an unsigned char raises OverflowError). `signed`: default this machine's."""
    if len(data) != UNIQUE_ID_BYTES:
        raise CommError(f"NCCL unique id in the store has {len(data)} bytes, expected "
                        f"{UNIQUE_ID_BYTES}", op="NCCL unique id")
    if signed is None:
        signed = char_is_signed()
    return tuple(b - 256 if signed and b >= 128 else b for b in data)


def share_unique_id(store: dist.Store, key: str, is_first: bool,
                    make_id: Callable[[], Sequence[int]], timeout_s: float) -> tuple[int, ...]:
    """The first rank makes the id and publishes it under `key`; the others wait and read it."""
    if is_first:
        uid = tuple(make_id())
        store.set(key, encode_unique_id(uid))
        return decode_unique_id(encode_unique_id(uid))
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise CommError(f"NCCL unique id {key!r}: the group's first rank did not publish it "
                        f"within {timeout_s:g} s ({str(e).strip()[:200]})",
                        op="NCCL unique id") from None
    return decode_unique_id(store.get(key))


def new_communicator(nccl, size: int, uid: Sequence[int], rank: int):  # noqa: ANN001, ANN201
    """cupy's NcclCommunicator for `uid`: cupy <= 13 takes the id as a tuple of C chars, cupy 14
    as 128 bytes (it raises TypeError naming bytes for a tuple, before NCCL is called)."""
    try:
        return nccl.NcclCommunicator(size, tuple(uid), rank)
    except TypeError as e:
        if "bytes" not in str(e):
            raise
    return nccl.NcclCommunicator(size, encode_unique_id(uid), rank)


def meet(store: dist.Store, prefix: str, rank: int, ranks: Sequence[int],
         timeout_s: float) -> None:
    """Announce `rank` under `prefix` and wait for every one of `ranks`; CommError naming the
    ranks that did not come within the timeout."""
    store.set(member_key(prefix, rank), "1")
    late = wait_keys(store, ranks, [member_key(prefix, r) for r in ranks], timeout_s)
    if late is not None:
        missing = late[0] or [r for r in ranks if r != rank]
        raise CommError(f"NCCL communicator {prefix!r}: rank(s) {missing} did not come within "
                        f"{timeout_s:g} s ({late[1]})", op="NCCL init", peers=missing)


def cupy_package(cuda_version: str | None = None) -> str:
    """The cupy wheel that matches a CUDA version (default: the installed torch's
    `torch.version.cuda`): cupy-cuda12x for CUDA 12, cupy-cuda13x for 13; CPU torch (None)
    gets the newest."""
    version = torch.version.cuda if cuda_version is None else cuda_version
    try:
        major = int(str(version).split(".")[0])
    except ValueError:
        major = CUPY_NEWEST
    return f"cupy-cuda{min(max(major, 11), CUPY_NEWEST)}x"


def load_nccl():  # noqa: ANN201 - cupy.cuda.nccl; cupy may be absent
    """cupy's NCCL bindings, or CommError saying what to install (the cupy of torch's CUDA)."""
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise CommError(f"CupyNcclCommunicator needs cupy with NCCL: pip install "
                        f"{cupy_package()} (torch's CUDA is {torch.version.cuda}; or pip "
                        f"install 'scattered-train[gpu]') ({e})", op="NCCL") from None
    if not getattr(nccl, "available", True):
        raise CommError("cupy was built without NCCL: cupy.cuda.nccl is not available",
                        op="NCCL")
    return nccl


def _dtype(nccl, dtype: torch.dtype) -> int:  # noqa: ANN001
    table = {torch.float32: "NCCL_FLOAT32", torch.float16: "NCCL_FLOAT16",
             torch.bfloat16: "NCCL_BFLOAT16", torch.float64: "NCCL_FLOAT64",
             torch.int8: "NCCL_INT8", torch.uint8: "NCCL_UINT8", torch.int32: "NCCL_INT32",
             torch.int64: "NCCL_INT64"}
    if dtype not in table or not hasattr(nccl, table[dtype]):
        raise ValueError(f"NCCL communicator: dtype {dtype} is not supported")
    return getattr(nccl, table[dtype])


class CupyNcclCommunicator(GroupMembership):
    """One NCCL communicator over global `ranks` (this process: `rank`, on CUDA `device`).

    Every member constructs it (a blocking NCCL init among the members); build several in the
    same order on every rank (build_communicators does) so that no two ranks wait on each other.
    Posted receives are enqueued when waited on: a receive enqueued early would hold up the
    kernels behind it on the stream (gloo's reason to post early does not apply to NCCL).
    """

    def __init__(self, ranks: Sequence[int], rank: int, store: dist.Store, name: str,
                 device: torch.device | int | str, timeout_s: float = 300.0,
                 stats: CommStats | None = None,
                 on_failure: Callable[[CommError], None] | None = None) -> None:
        self._init_membership(ranks, rank, timeout_s, stats)
        self.device = torch.device(device) if not isinstance(device, int) \
            else torch.device("cuda", device)
        if self.device.type != "cuda":
            raise ValueError(f"CupyNcclCommunicator: device {self.device} is not a CUDA device")
        nccl = self._nccl = load_nccl()
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        import cupy

        meet(store, nccl_arrival_prefix(name, self.ranks), rank, self.ranks, timeout_s)
        uid = share_unique_id(store, nccl_unique_id_key(name, self.ranks), rank == self.ranks[0],
                              nccl.get_unique_id, timeout_s)
        index = self.device.index

        def init():  # noqa: ANN202 - ncclCommInitRank on the rank's device
            with cupy.cuda.Device(index):
                return new_communicator(nccl, self.size, uid, self.group_rank)

        self._comm = bounded(init, timeout_s, f"NCCL communicator {name!r} over ranks "
                             f"{list(self.ranks)}", self.others())
        self.host = HostCalls(index, self._comm.abort, self._comm.destroy)
        """The state machine of the host calls (modules.comm.nccl_guard)."""
        poll = getattr(self._comm, "check_async_error", None)
        self.watchdog = Watchdog(timeout_s, self.host.abort, on_failure=on_failure,
                                 thread_init=lambda: torch.cuda.set_device(index), poll=poll,
                                 peers=self.others())
        """Aborts the communicator when an operation or a host call is not done within the
        timeout, or when NCCL reports an asynchronous error (its thread queries events on
        this rank's device: no extra context on GPU 0)."""
        self._timing: list[torch.cuda.Event] | None = None
        """Inside `mean_all_reduce`: the start event of the whole mean (inner calls untimed)."""

    def connect(self, what: str | None = None) -> None:
        """Connect to every member now, under the watchdog's deadline (NCCL 2.22+ would do it
        inside the first call to each peer): a one-element all-reduce and one message to and
        from each member. build_communicators calls it right after each communicator is made,
        so every rank connects its communicators in one order with nothing else in flight
        (no first call can then block inside NCCL while holding the device's lock)."""
        if self.size == 1:
            return
        what = what or f"connecting the NCCL communicator over ranks {list(self.ranks)}"
        one = torch.zeros(1, device=self.device)
        inbox = [(torch.zeros(1, device=self.device), p) for p in self.others()]
        self.all_reduce(one, what=what)
        self.exchange([(one, p) for p in self.others()], inbox, what)
        self.synchronize(what)  # the buffers live until then

    def _stream(self, stream: torch.cuda.Stream | None) -> torch.cuda.Stream:
        """The torch Stream to run on: `stream`, or the device's current one (never a wrapper
        made from a raw handle)."""
        return stream if stream is not None else torch.cuda.current_stream(self.device)

    def _check(self, t: torch.Tensor) -> None:
        if t.device != self.device or not t.is_contiguous():
            raise ValueError(f"NCCL communicator on {self.device}: got a tensor on {t.device} "
                             f"(contiguous={t.is_contiguous()})")

    def _enqueue(self, call: Callable[[int], None], stream: torch.cuda.Stream, what: str,
                 peers: Sequence[int]) -> None:
        """Enqueue one NCCL call (given the raw handle of `stream`) and watch it; a backend
        failure, or an earlier operation that failed, is a CommError. The host call itself is
        watched too (a first call to a peer connects to it and blocks until it answers). Its
        time on the stream is measured with CUDA events around it."""
        self.watchdog.check()
        start = self._event(stream) if self._timing is None else None
        returned = threading.Event()
        self.watchdog.watch(returned.is_set, f"{what} (NCCL host call)", peers)
        try:
            self.host.call(lambda: call(stream.cuda_stream), self._refused)
        except CommError:
            raise
        except Exception as e:  # cupy raises NcclError (not a RuntimeError)
            self.watchdog.check()  # ended by the abort: the watchdog's error says why
            raise CommError(f"{what}: NCCL failed ({first_line(e)})", op=what,
                            peers=peers) from None
        finally:
            returned.set()
        self.watchdog.check()  # aborted while inside: what it enqueued never ran
        done = self._event(stream)
        if start is not None:
            self.stats.time_on_stream(start, done, self)
        self.watchdog.watch(done.query, what, peers)

    def _refused(self) -> CommError:
        """The error of a call on a communicator that is no longer open."""
        if self.watchdog.failure is not None:
            return self.watchdog.failure
        return CommError(f"NCCL communicator over ranks {list(self.ranks)} is "
                         f"{self.host.state}: no call can start", op="NCCL",
                         peers=self.others())

    def check_health(self, what: str, wait: bool = True) -> None:
        """CommError unless every operation enqueued so far completed on a healthy
        communicator (`wait`: wait for them, at most the timeout; else only what is known
        now). Called before an optimizer step and a checkpoint: an aborted operation's
        buffers hold garbage, and its kernels end as if done."""
        if wait:
            self.watchdog.wait_all()
        self.watchdog.check()
        if self.host.state != HostCalls.OPEN:
            raise self._refused()

    @staticmethod
    def _event(stream: torch.cuda.Stream) -> torch.cuda.Event:
        """An event recorded on `stream` now (timing enabled: it also marks a start or end)."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def mean_all_reduce(self, tensor: torch.Tensor, compression: str = "int8",
                        what: str | None = None, block: int = DEFAULT_BLOCK,
                        segment: int = SEGMENT) -> int:
        """The compressed mean (modules.comm.compressed), timed as one span on the stream from
        before its first call to after its last (codec kernels included, as on gloo)."""
        stream = self._stream(None)
        self._timing = [self._event(stream)]
        try:
            return mean_all_reduce(tensor, self, compression, block, segment,
                                   what or f"mean all-reduce over ranks {list(self.ranks)}")
        finally:
            start, self._timing = self._timing[0], None
            self.stats.time_on_stream(start, self._event(stream), self)

    # -- point to point ----------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0,
              stream: torch.cuda.Stream | None = None) -> Posted:
        """Enqueue a send of a contiguous CUDA tensor to global rank `dst` (tags: NCCL matches
        the messages of a pair in order)."""
        self.exchange([(tensor, dst)], [], stream=stream)
        return Posted(dst, "send", None, tensor)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0,
              stream: torch.cuda.Stream | None = None) -> Posted:
        """A receive from `src` into `tensor`, enqueued when it is waited on."""
        self._check(tensor)
        self.group_index(src)
        return Posted(src, "recv", lambda what: self.exchange([], [(tensor, src)], what, stream),
                      tensor)

    def wait(self, posted: Posted, what: str | None = None) -> torch.Tensor:
        """Enqueue a posted receive; kernels enqueued after this see its data (stream order)."""
        if posted.handle is not None:
            handle, posted.handle = posted.handle, None
            handle(what or f"receiving from rank {posted.peer}")
        return posted.buffer

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, what: str | None = None,
             stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue a send of a contiguous CUDA tensor to global rank `dst`."""
        self.exchange([(tensor, dst)], [], what, stream)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0, what: str | None = None,
             stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """Enqueue a receive into `tensor` from global rank `src`; returns it."""
        self.exchange([], [(tensor, src)], what, stream)
        return tensor

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]],
                 recvs: Sequence[tuple[torch.Tensor, int]], what: str | None = None,
                 stream: torch.cuda.Stream | None = None) -> None:
        """Many sends and receives in one NCCL group call (runs them concurrently)."""
        nccl, s = self._nccl, self._stream(stream)
        for t, peer in [*sends, *recvs]:
            self._check(t)
            self.group_index(peer)
        peers = tuple(sorted({p for _, p in [*sends, *recvs]}))

        def group_call(handle: int) -> None:
            nccl.groupStart()
            try:
                for t, dst in sends:
                    self._comm.send(t.data_ptr(), t.numel(), _dtype(nccl, t.dtype),
                                    self.group_index(dst), handle)
                for t, src in recvs:
                    self._comm.recv(t.data_ptr(), t.numel(), _dtype(nccl, t.dtype),
                                    self.group_index(src), handle)
            finally:
                nccl.groupEnd()

        self._enqueue(group_call, s, what or "point-to-point exchange", peers)
        self._count_sent(sum(nbytes(t) for t, _ in sends))

    # -- collectives -------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", what: str | None = None,
                   stream: torch.cuda.Stream | None = None) -> None:
        """In-place reduction (`sum`, `max` or `min`) over the group."""
        check_op(op)
        self._check(tensor)
        nccl = self._nccl
        code = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}[op]
        self._count_sent(self._ring_bytes(tensor))
        s = self._stream(stream)
        self._enqueue(lambda h: self._comm.allReduce(
            tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), _dtype(nccl, tensor.dtype),
            code, h), s, what or f"all_reduce over ranks {list(self.ranks)}", self.others())

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor,
                   what: str | None = None, stream: torch.cuda.Stream | None = None) -> None:
        """outputs[i] <- the `tensor` of group rank i (through one flat receive buffer)."""
        self._check(tensor)
        s = self._stream(stream)
        with torch.cuda.stream(s):  # allocated, filled and read on s: the allocator keeps
            flat = torch.empty(self.size * tensor.numel(), dtype=tensor.dtype,  # it for s
                               device=tensor.device)
            self._count_sent((self.size - 1) * nbytes(tensor))
            self._enqueue(lambda h: self._comm.allGather(
                tensor.data_ptr(), flat.data_ptr(), tensor.numel(),
                _dtype(self._nccl, tensor.dtype), h),
                s, what or f"all_gather over ranks {list(self.ranks)}", self.others())
            for out, part in zip(outputs, flat.view(self.size, -1)):
                out.view(-1).copy_(part)  # ordered after the allGather on the same stream

    def broadcast(self, tensor: torch.Tensor, src: int, what: str | None = None,
                  stream: torch.cuda.Stream | None = None) -> None:
        """In place: every member ends with global rank `src`'s tensor."""
        self._check(tensor)
        root = self.group_index(src)
        if self.rank == src:
            self._count_sent(nbytes(tensor))
        s = self._stream(stream)
        self._enqueue(lambda h: self._comm.bcast(
            tensor.data_ptr(), tensor.numel(), _dtype(self._nccl, tensor.dtype), root, h),
            s, what or f"broadcast from rank {src}", (src,))

    def barrier(self, what: str | None = None) -> None:
        """A one-element all-reduce, then wait for this device's stream."""
        what = what or f"barrier over ranks {list(self.ranks)}"
        one = torch.ones(1, device=self.device)
        self.all_reduce(one, what=what)
        self.synchronize(what)

    def synchronize(self, what: str | None = None) -> None:
        """Block until this device's current stream has run everything enqueued so far, at
        most the timeout (CommError naming the late operation otherwise). Not counted as
        waiting: the operations' own time on the stream is (CUDA events)."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self.watchdog.watch(done.query, what or "waiting for the stream", self.others())
        self.watchdog.wait_all()

    def close(self) -> None:
        """Free the NCCL communicator (ncclCommDestroy, which first flushes every operation:
        only for a healthy group; an aborted one is already gone)."""
        self.watchdog.close()
        self.host.close()

    def abort(self) -> None:
        """Drop the communicator without flushing (ncclCommAbort): for a group that held a
        lost peer, whose pending operations would never finish under destroy(). Safe twice,
        and after the watchdog aborted it."""
        self.watchdog.close()
        self.host.abort()
