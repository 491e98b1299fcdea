"""`Communicator` over cupy.cuda.nccl for CUDA tensors (one process per GPU).

The members first meet in the rendezvous TCPStore (a member that does not come is a CommError
naming it, not a hung NCCL init); the NCCL unique id is then made by the group's first rank and
handed to the others through the store (keys: modules.control.protocol). Calls take torch CUDA
tensors (contiguous, on `device`) and are enqueued on torch's current CUDA stream of that device
unless a stream handle is given. NCCL has no timeout of its own: a Watchdog aborts the communicator
when an operation is not done within the timeout, and the next call (or `synchronize`) raises
a CommError naming the operation and its peers, as the gloo path does. cupy (the `gpu` extra)
is imported lazily.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from modules.comm.base import CommStats, GroupMembership, Posted, check_op, nbytes
from modules.comm.errors import CommError, first_line
from modules.comm.watchdog import Watchdog
from modules.control.protocol import member_key, nccl_arrival_prefix, nccl_unique_id_key, wait_keys

UNIQUE_ID_BYTES = 128


def encode_unique_id(uid: Sequence[int]) -> bytes:
    """cupy's unique id (128 signed chars) -> 128 bytes for the store."""
    if len(uid) != UNIQUE_ID_BYTES:
        raise ValueError(f"NCCL unique id has {len(uid)} bytes, expected {UNIQUE_ID_BYTES}")
    return bytes(int(v) & 0xFF for v in uid)


def decode_unique_id(data: bytes) -> tuple[int, ...]:
    """128 bytes from the store -> the signed-char tuple cupy's NcclCommunicator takes."""
    if len(data) != UNIQUE_ID_BYTES:
        raise CommError(f"NCCL unique id in the store has {len(data)} bytes, expected "
                        f"{UNIQUE_ID_BYTES}", op="NCCL unique id")
    return tuple(b - 256 if b >= 128 else b for b in data)


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


def load_nccl():  # noqa: ANN201 - cupy.cuda.nccl; cupy may be absent
    """cupy's NCCL bindings, or CommError saying what to install."""
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise CommError("CupyNcclCommunicator needs cupy with NCCL: pip install "
                        f"'scattered-train[gpu]' (cupy-cuda12x) ({e})", op="NCCL") from None
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
        with cupy.cuda.Device(self.device.index):
            self._comm = nccl.NcclCommunicator(self.size, uid, self.group_rank)
        self.watchdog = Watchdog(timeout_s, self._comm.abort, on_failure=on_failure)
        """Aborts the communicator when an operation is not done within the timeout."""

    def _stream(self, stream: int | None) -> int:
        return stream if stream is not None else torch.cuda.current_stream(self.device).cuda_stream

    def _check(self, t: torch.Tensor) -> None:
        if t.device != self.device or not t.is_contiguous():
            raise ValueError(f"NCCL communicator on {self.device}: got a tensor on {t.device} "
                             f"(contiguous={t.is_contiguous()})")

    def _enqueue(self, call: Callable[[], None], stream: int, what: str,
                 peers: Sequence[int]) -> None:
        """Enqueue one NCCL call on `stream` and watch it; a backend failure, or an earlier
        operation that timed out, is a CommError."""
        self.watchdog.check()
        t0 = time.perf_counter()
        try:
            call()
        except Exception as e:  # cupy raises NcclError (not a RuntimeError)
            raise CommError(f"{what}: NCCL failed ({first_line(e)})", op=what,
                            peers=peers) from None
        finally:
            self._count_wait(time.perf_counter() - t0)
        done = torch.cuda.Event()
        done.record(torch.cuda.ExternalStream(stream, device=self.device))
        self.watchdog.watch(done.query, what, peers)

    # -- point to point ----------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0,
              stream: int | None = None) -> Posted:
        """Enqueue a send of a contiguous CUDA tensor to global rank `dst` (tags: NCCL matches
        the messages of a pair in order)."""
        self.exchange([(tensor, dst)], [], stream=stream)
        return Posted(dst, "send", None, tensor)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0,
              stream: int | None = None) -> Posted:
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
             stream: int | None = None) -> None:
        """Enqueue a send of a contiguous CUDA tensor to global rank `dst`."""
        self.exchange([(tensor, dst)], [], what, stream)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0, what: str | None = None,
             stream: int | None = None) -> torch.Tensor:
        """Enqueue a receive into `tensor` from global rank `src`; returns it."""
        self.exchange([], [(tensor, src)], what, stream)
        return tensor

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]],
                 recvs: Sequence[tuple[torch.Tensor, int]], what: str | None = None,
                 stream: int | None = None) -> None:
        """Many sends and receives in one NCCL group call (runs them concurrently)."""
        nccl, s = self._nccl, self._stream(stream)
        for t, peer in [*sends, *recvs]:
            self._check(t)
            self.group_index(peer)
        peers = tuple(sorted({p for _, p in [*sends, *recvs]}))

        def group_call() -> None:
            nccl.groupStart()
            try:
                for t, dst in sends:
                    self._comm.send(t.data_ptr(), t.numel(), _dtype(nccl, t.dtype),
                                    self.group_index(dst), s)
                for t, src in recvs:
                    self._comm.recv(t.data_ptr(), t.numel(), _dtype(nccl, t.dtype),
                                    self.group_index(src), s)
            finally:
                nccl.groupEnd()

        self._enqueue(group_call, s, what or "point-to-point exchange", peers)
        self._count_sent(sum(nbytes(t) for t, _ in sends))

    # -- collectives -------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", what: str | None = None,
                   stream: int | None = None) -> None:
        """In-place reduction (`sum`, `max` or `min`) over the group."""
        check_op(op)
        self._check(tensor)
        nccl = self._nccl
        code = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}[op]
        self._count_sent(self._ring_bytes(tensor))
        s = self._stream(stream)
        self._enqueue(lambda: self._comm.allReduce(
            tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), _dtype(nccl, tensor.dtype),
            code, s), s, what or f"all_reduce over ranks {list(self.ranks)}", self.others())

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor,
                   what: str | None = None, stream: int | None = None) -> None:
        """outputs[i] <- the `tensor` of group rank i (through one flat receive buffer)."""
        self._check(tensor)
        flat = torch.empty(self.size * tensor.numel(), dtype=tensor.dtype, device=self.device)
        self._count_sent((self.size - 1) * nbytes(tensor))
        s = self._stream(stream)
        self._enqueue(lambda: self._comm.allGather(
            tensor.data_ptr(), flat.data_ptr(), tensor.numel(),
            _dtype(self._nccl, tensor.dtype), s),
            s, what or f"all_gather over ranks {list(self.ranks)}", self.others())
        with torch.cuda.stream(torch.cuda.ExternalStream(s, device=self.device)):
            for out, part in zip(outputs, flat.view(self.size, -1)):
                out.view(-1).copy_(part)

    def broadcast(self, tensor: torch.Tensor, src: int, what: str | None = None,
                  stream: int | None = None) -> None:
        """In place: every member ends with global rank `src`'s tensor."""
        self._check(tensor)
        root = self.group_index(src)
        if self.rank == src:
            self._count_sent(nbytes(tensor))
        s = self._stream(stream)
        self._enqueue(lambda: self._comm.bcast(
            tensor.data_ptr(), tensor.numel(), _dtype(self._nccl, tensor.dtype), root, s),
            s, what or f"broadcast from rank {src}", (src,))

    def barrier(self, what: str | None = None) -> None:
        """A one-element all-reduce, then wait for this device's stream."""
        what = what or f"barrier over ranks {list(self.ranks)}"
        one = torch.ones(1, device=self.device)
        self.all_reduce(one, what=what)
        self.synchronize(what)

    def synchronize(self, what: str | None = None) -> None:
        """Block until this device's current stream has run everything enqueued so far, at
        most the timeout (CommError naming the late operation otherwise)."""
        t0 = time.perf_counter()
        try:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self.watchdog.watch(done.query, what or "waiting for the stream", self.others())
            self.watchdog.wait_all()
        finally:
            self._count_wait(time.perf_counter() - t0)

    def close(self) -> None:
        """Free the NCCL communicator (an aborted one is already gone)."""
        self.watchdog.close()
        if self.watchdog.failure is None:
            self._comm.destroy()
