"""The compressed mean all-reduce over a Communicator: fp16 or int8 codes + block scales on the
wire instead of fp32 (the arithmetic and wire format: modules.quant.allreduce).

Per segment, a reduce-scatter (chunk j straight to its owner j) and an all-gather of the
owners' re-quantised means; every rank decodes the same bytes and ends bit-identical. On CPU a
helper thread moves segment k while the caller encodes k+1 and decodes k-1; on CUDA the calls
run inline (NCCL already runs on the stream asynchronously; another thread would see another
current stream).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from modules.quant.allreduce import (
    SEGMENT,
    check_compression,
    chunk_bounds,
    decode_chunk,
    encode_chunk,
    ieee_div,
    reduce_chunk,
    segment_bounds,
)
from modules.quant.codec import DEFAULT_BLOCK, check_finite


class Transport(Protocol):
    """The part of a modules.comm Communicator the compressed mean uses."""

    ranks: tuple[int, ...]
    rank: int
    bytes_sent: int

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        ...

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]],
                 recvs: Sequence[tuple[torch.Tensor, int]], what: str | None = None) -> None:
        """Many sends and receives at once."""
        ...

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", what: str | None = None) -> None:
        """In-place reduction over the group."""
        ...

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor,
                   what: str | None = None) -> None:
        """outputs[i] <- group rank i's tensor."""
        ...


def mean_all_reduce(tensor: torch.Tensor, comm: Transport, compression: str = "int8",
                    block: int = DEFAULT_BLOCK, segment: int = SEGMENT,
                    what: str = "mean all-reduce") -> int:
    """Average a contiguous fp32 tensor in place over `comm`'s group; return the bytes sent.

    `compression`: none (fp32 all_reduce; bytes counted as a ring sends them), fp16, or int8.
    Every member must call it with the same numel and arguments. NaN/inf in the input raises
    NonFiniteError on the rank that holds them, before anything is sent (its peers then fail
    with CommError at their timeout). Backend failures and timeouts raise CommError naming
    `what` and the peer(s).
    """
    check_compression(compression)
    if tensor.dtype != torch.float32 or not tensor.is_contiguous():
        raise ValueError(f"compressed_all_reduce_mean takes a contiguous float32 tensor, got "
                         f"{tensor.dtype} (contiguous={tensor.is_contiguous()})")
    world = comm.size
    if world == 1:
        return 0
    flat = tensor.view(-1)
    before = comm.bytes_sent
    if compression == "none":
        comm.all_reduce(flat, "sum", what=what)
        flat.copy_(ieee_div(flat, world))
        return comm.bytes_sent - before
    check_finite(flat, "all-reduce input")
    with _Mover(flat.device) as mover:
        rs: list[_Step] = []
        ag: list[_Step] = []
        for lo, hi in segment_bounds(flat.numel(), segment, block):
            rs.append(_start_reduce_scatter(flat[lo:hi], comm, compression, block, mover, what))
            if len(rs) > 1:  # segment k-1 reduces and re-sends while segment k is on the wire
                ag.append(_finish_reduce_scatter(rs.pop(0), comm, compression, block, mover,
                                                 what))
            while len(ag) > 1 and ag[0].future.done():
                _finish_all_gather(ag.pop(0), compression, block)
        for step in rs:
            ag.append(_finish_reduce_scatter(step, comm, compression, block, mover, what))
        for step in ag:
            _finish_all_gather(step, compression, block)
    return comm.bytes_sent - before


class _Mover:
    """Runs communication calls in submission order: on a helper thread for CPU tensors (gloo
    waits and torch kernels release the GIL, so they overlap), inline for CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.pool = ThreadPoolExecutor(1, "quant-allreduce") if device.type == "cpu" else None

    def __enter__(self) -> _Mover:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, fn, *args, **kwargs) -> Future:  # noqa: ANN001
        """fn(*args, **kwargs) after every call submitted before it."""
        if self.pool is not None:
            return self.pool.submit(fn, *args, **kwargs)
        done: Future = Future()
        done.set_result(fn(*args, **kwargs))
        return done


@dataclass
class _Step:
    """One segment between two calls: what was sent/received and the call's future."""

    seg: torch.Tensor
    bounds: list[tuple[int, int]]
    parts: list
    future: Future


def _start_reduce_scatter(seg: torch.Tensor, comm: Transport, compression: str, block: int,
                          mover: _Mover, what: str) -> _Step:
    """Encode the segment and start sending chunk j to its owner j (receiving mine)."""
    bounds = chunk_bounds(seg.numel(), comm.size, block)
    me = comm.ranks.index(comm.rank)
    # the whole input was checked: no host sync per chunk on CUDA
    mine = [encode_chunk(seg[lo:hi], compression, block, read_back=False) if hi > lo else []
            for lo, hi in bounds]
    lo, hi = bounds[me]
    sends, recvs, inbox = [], [], []
    for j, peer in enumerate(comm.ranks):
        if j == me:
            continue
        sends.extend((part, peer) for part in mine[j])
        if hi > lo:
            parts = [torch.empty_like(p) for p in mine[me]]
            inbox.append(parts)
            recvs.extend((p, peer) for p in parts)
    future = mover.submit(comm.exchange, sends, recvs, what=f"{what} ({compression}, "
                          "reduce-scatter)")
    return _Step(seg, bounds, [mine[me]] + inbox, future)


def _finish_reduce_scatter(step: _Step, comm: Transport, compression: str, block: int,
                           mover: _Mover, what: str) -> _Step:
    """Average my chunk (own encoding first, then peers in rank order), start the all-gather."""
    step.future.result()
    lo, hi = step.bounds[comm.ranks.index(comm.rank)]
    width = max(b - a for a, b in step.bounds)
    mean = reduce_chunk(step.parts, hi - lo, width, comm.size, compression, block,
                        step.seg.device)
    gathered = []
    for part in encode_chunk(mean, compression, block, read_back=False):  # NaN if it overflowed
        gathered.append(([torch.empty_like(part) for _ in range(comm.size)], part))

    def gather_all() -> None:
        for bufs, part in gathered:
            comm.all_gather(bufs, part, what=f"{what} ({compression}, all-gather)")

    return _Step(step.seg, step.bounds, [bufs for bufs, _ in gathered], mover.submit(gather_all))


def _finish_all_gather(step: _Step, compression: str, block: int) -> None:
    """Every rank decodes the same gathered bytes into the segment (the owner too)."""
    step.future.result()
    for j, (lo, hi) in enumerate(step.bounds):
        if hi > lo:
            step.seg[lo:hi] = decode_chunk([bufs[j] for bufs in step.parts], hi - lo,
                                           compression, block)
