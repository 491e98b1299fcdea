"""Mean all-reduce whose wire carries int8 codes + block scales (or fp16) instead of fp32.

The flat tensor is processed in segments of SEGMENT values; each segment is cut into W chunks
of whole blocks (W = group size) and goes through two phases:
1. reduce-scatter: every rank quantises the segment once and sends chunk j straight to its
   owner j (all pairs at once); the owner dequantises the W inputs of its chunk, its own first
   and then the peers' in rank order, accumulates them in fp32 and divides by W;
2. all-gather: each owner re-quantises its mean once; the codes are gathered and every rank,
   the owner included, dequantises the same bytes, so all ranks end bit-identical (and equal
   to reference_compressed_mean). Nothing is re-quantised while being forwarded.
On CPU a helper thread moves segment k while the caller encodes k+1 and decodes k-1.

Error against the exact fp32 mean, per element of block b (scales as in codec.py):
  |mean' - mean| <= (1/W) sum_r scale_r,b / 2  +  scale'_b / 2  +  fp32 rounding (few ulp)
where scale_r,b is rank r's input scale and scale'_b that of the averaged block.
Bytes sent per rank: 2 (W-1)/W (n + 4 n / block) for int8 vs 2 (W-1)/W 4 n for an fp32 ring,
about a quarter (fp16: a half). Works over any modules.comm.Communicator: gloo on CPU tensors,
cupy NCCL on CUDA tensors (there the codec is the int8.cu kernel).
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from modules.comm.base import Communicator
from modules.comm.gloo import GlooCommunicator
from modules.quant.codec import (
    DEFAULT_BLOCK,
    QuantizedTensor,
    check_finite,
    dequantize_int8,
    quantize_int8,
)

COMPRESSIONS = ("none", "fp16", "int8")
SEGMENT = 1 << 21
"""Values per pipelined segment of compressed_all_reduce_mean (8 MiB of fp32); results depend
on it (it fixes which rank sums which values), so every rank must use the same."""


def _chunk_bounds(n: int, world: int, block: int) -> list[tuple[int, int]]:
    per = math.ceil(math.ceil(n / block) / world) * block
    return [(min(n, j * per), min(n, (j + 1) * per)) for j in range(world)]


def _encode(x: torch.Tensor, compression: str, block: int) -> list[torch.Tensor]:
    if compression == "fp16":
        return [x.to(torch.float16)]
    q = quantize_int8(x, block)
    # One message: the scales' bytes first (so their fp32 view stays 4-byte aligned), then the
    # codes. Over gloo every message costs a rendezvous round trip, on WAN links ~2 latencies.
    return [torch.cat([q.scales.view(torch.uint8), q.codes.view(torch.uint8)])]


def _decode(parts: list[torch.Tensor], numel: int, compression: str, block: int) -> torch.Tensor:
    if compression == "fp16":
        return parts[0][:numel].to(torch.float32)
    buf = parts[0]
    # c codes and ceil(c / block) scales make L = c + 4 ceil(c / block) bytes, so the number of
    # scales is ceil(L / (block + 4))
    nscales = -(-buf.numel() // (block + 4))
    scales = buf[: 4 * nscales].view(torch.float32)
    codes = buf[4 * nscales:].view(torch.int8)
    nblocks = math.ceil(numel / block)
    return dequantize_int8(QuantizedTensor(codes[:numel], scales[:nblocks], numel, block))


def _div(x: torch.Tensor, w: int) -> torch.Tensor:
    """x / w as an IEEE division on every device (torch CUDA multiplies by 1/w for a Python
    scalar divisor, which would make CUDA and CPU results differ in the last bit)."""
    return x / torch.tensor(float(w), dtype=x.dtype, device=x.device)


def reference_compressed_mean(inputs: list[torch.Tensor], compression: str = "int8",
                              block: int = DEFAULT_BLOCK, segment: int = SEGMENT) -> torch.Tensor:
    """What every rank ends with, computed in one process from all W inputs (same bytes)."""
    world = len(inputs)
    flats = [x.reshape(-1).to(torch.float32) for x in inputs]
    if world == 1:
        return flats[0].clone()
    if compression == "none":
        return _div(torch.stack(flats).sum(0), world)
    for i, x in enumerate(flats):
        check_finite(x, f"input {i}")
    out = torch.empty_like(flats[0])
    for slo, shi in _segments(out.numel(), segment, block):
        bounds = _chunk_bounds(shi - slo, world, block)
        width = max(b - a for a, b in bounds)
        for j, (lo, hi) in enumerate(bounds):
            if hi == lo:
                continue
            encoded = [_encode(x[slo + lo: slo + hi], compression, block) for x in flats]
            order = [j] + [r for r in range(world) if r != j]  # the owner's own chunk first
            acc = _decode(encoded[order[0]], hi - lo, compression, block)
            for r in order[1:]:
                acc += _decode(encoded[r], hi - lo, compression, block)
            padded = torch.zeros(width, dtype=torch.float32, device=out.device)
            padded[: hi - lo] = _div(acc, world)
            out[slo + lo: slo + hi] = _decode(_encode(padded, compression, block), hi - lo,
                                              compression, block)
    return out


def as_communicator(comm_or_group: Communicator | dist.ProcessGroup | None,
                    timeout_s: float = 1800.0) -> Communicator:
    """A Communicator as is; a torch process group (None = world) wrapped in GlooCommunicator."""
    if isinstance(comm_or_group, Communicator):
        return comm_or_group
    return GlooCommunicator(comm_or_group, timeout_s)


def compressed_all_reduce_mean(tensor: torch.Tensor,
                               comm_or_group: Communicator | dist.ProcessGroup | None = None,
                               compression: str = "int8", block: int = DEFAULT_BLOCK,
                               segment: int = SEGMENT) -> int:
    """Average a contiguous fp32 tensor in place over the group; return the bytes this rank sent.

    `comm_or_group`: a modules.comm Communicator, or a torch.distributed process group (None =
    the world group) used through gloo. `compression`: none (fp32 all_reduce; bytes counted as
    a ring sends them), fp16, or int8. The tensor is processed in segments of `segment` values
    (rounded up to whole blocks); on CPU a helper thread moves segment k while this thread
    encodes k+1 and decodes k-1 (on CUDA, NCCL already runs on the stream asynchronously).
    Every member must call it with the same numel and arguments. NaN/inf in the input raises
    NonFiniteError on the rank that holds them, before anything is sent (its peers then fail
    with CommError at their timeout). Backend failures and timeouts raise CommError.
    """
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression: {compression!r} is not one of {', '.join(COMPRESSIONS)}")
    if tensor.dtype != torch.float32 or not tensor.is_contiguous():
        raise ValueError(f"compressed_all_reduce_mean takes a contiguous float32 tensor, got "
                         f"{tensor.dtype} (contiguous={tensor.is_contiguous()})")
    comm = as_communicator(comm_or_group)
    world = comm.size
    if world == 1:
        return 0
    flat = tensor.view(-1)
    before = comm.bytes_sent
    if compression == "none":
        comm.all_reduce(flat, "sum")
        flat.copy_(_div(flat, world))
        return comm.bytes_sent - before
    check_finite(flat, "all-reduce input")
    with _Mover(comm) as mover:
        rs: list[_Step] = []
        ag: list[_Step] = []
        for lo, hi in _segments(flat.numel(), segment, block):
            rs.append(_start_reduce_scatter(flat[lo:hi], comm, compression, block, mover))
            if len(rs) > 1:  # segment k-1 reduces and re-sends while segment k is on the wire
                ag.append(_finish_reduce_scatter(rs.pop(0), comm, compression, block, mover))
            while len(ag) > 1 and ag[0].future.done():
                _finish_all_gather(ag.pop(0), compression, block)
        for step in rs:
            ag.append(_finish_reduce_scatter(step, comm, compression, block, mover))
        for step in ag:
            _finish_all_gather(step, compression, block)
    return comm.bytes_sent - before


def _segments(n: int, segment: int, block: int) -> list[tuple[int, int]]:
    per = max(block, -(-segment // block) * block)
    return [(lo, min(n, lo + per)) for lo in range(0, n, per)] or [(0, 0)]


class _Mover:
    """Runs communication calls in submission order: on a helper thread for CPU tensors (gloo
    waits and torch kernels release the GIL, so they overlap), inline for CUDA (NCCL enqueues
    on the stream; another thread would see another current stream)."""

    def __init__(self, comm: Communicator) -> None:
        self.pool = ThreadPoolExecutor(1, "quant-allreduce") if comm.device.type == "cpu" \
            else None

    def __enter__(self) -> _Mover:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, fn, *args) -> Future:  # noqa: ANN001
        """fn(*args) after every call submitted before it."""
        if self.pool is not None:
            return self.pool.submit(fn, *args)
        done: Future = Future()
        done.set_result(fn(*args))
        return done


@dataclass
class _Step:
    """One segment between two calls: what was sent/received and the call's future."""

    seg: torch.Tensor
    bounds: list[tuple[int, int]]
    parts: list
    future: Future


def _start_reduce_scatter(seg: torch.Tensor, comm: Communicator, compression: str, block: int,
                          mover: _Mover) -> _Step:
    """Encode the segment and start sending chunk j to its owner j (receiving mine)."""
    bounds = _chunk_bounds(seg.numel(), comm.size, block)
    me = comm.ranks.index(comm.rank)
    mine = [_encode(seg[lo:hi], compression, block) if hi > lo else [] for lo, hi in bounds]
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
    return _Step(seg, bounds, [mine[me]] + inbox, mover.submit(comm.exchange, sends, recvs))


def _finish_reduce_scatter(step: _Step, comm: Communicator, compression: str, block: int,
                           mover: _Mover) -> _Step:
    """Average my chunk (own encoding first, then peers in rank order), start the all-gather."""
    step.future.result()
    seg, bounds = step.seg, step.bounds
    lo, hi = bounds[comm.ranks.index(comm.rank)]
    width = max(b - a for a, b in bounds)
    padded = torch.zeros(width, dtype=torch.float32, device=seg.device)
    if hi > lo:
        acc = _decode(step.parts[0], hi - lo, compression, block)
        for parts in step.parts[1:]:
            acc += _decode(parts, hi - lo, compression, block)
        padded[: hi - lo] = _div(acc, comm.size)
    gathered = []
    for part in _encode(padded, compression, block):
        gathered.append(([torch.empty_like(part) for _ in range(comm.size)], part))

    def gather_all() -> None:
        for bufs, part in gathered:
            comm.all_gather(bufs, part)

    return _Step(seg, bounds, [bufs for bufs, _ in gathered], mover.submit(gather_all))


def _finish_all_gather(step: _Step, compression: str, block: int) -> None:
    """Every rank decodes the same gathered bytes into the segment (the owner too)."""
    step.future.result()
    for j, (lo, hi) in enumerate(step.bounds):
        if hi > lo:
            step.seg[lo:hi] = _decode([bufs[j] for bufs in step.parts], hi - lo, compression,
                                      block)
