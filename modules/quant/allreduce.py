"""Mean all-reduce whose wire carries int8 codes + block scales (or fp16) instead of fp32.

Two phases over a group of W ranks, the flat tensor cut into W chunks of whole blocks:
1. reduce-scatter: every rank quantises its tensor once and sends chunk j straight to its owner
   j (all pairs at once); the owner dequantises the W inputs of its chunk, its own included,
   and accumulates them in fp32, then divides by W;
2. all-gather: each owner re-quantises its reduced chunk once; the codes are gathered and every
   rank, the owner included, dequantises the same bytes, so all ranks end bit-identical. Nothing
   is re-quantised while being forwarded.

Error against the exact fp32 mean, per element of block b (each scale = block absmax / 127):
  |mean' - mean| <= (1/W) sum_r scale_r,b / 2  +  scale'_b / 2  +  fp32 rounding (few ulp)
where scale_r,b is rank r's input scale and scale'_b that of the reduced block.
Bytes sent per rank ~ 2 (W-1)/W (n + 4 n / block) for int8 vs 2 (W-1)/W 4 n for an fp32 ring:
about a quarter (fp16: a half). Works over any modules.comm.Communicator: gloo on CPU tensors,
cupy NCCL on CUDA tensors (there the codec is the int8.cu kernel).
"""

from __future__ import annotations

import math

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


def _chunk_bounds(n: int, world: int, block: int) -> list[tuple[int, int]]:
    per = math.ceil(math.ceil(n / block) / world) * block
    return [(min(n, j * per), min(n, (j + 1) * per)) for j in range(world)]


def _encode(x: torch.Tensor, compression: str, block: int) -> list[torch.Tensor]:
    if compression == "fp16":
        return [x.to(torch.float16)]
    q = quantize_int8(x, block)
    return [q.codes, q.scales]


def _decode(parts: list[torch.Tensor], numel: int, compression: str, block: int) -> torch.Tensor:
    if compression == "fp16":
        return parts[0][:numel].to(torch.float32)
    codes, scales = parts
    nblocks = math.ceil(numel / block)
    return dequantize_int8(QuantizedTensor(codes[:numel], scales[:nblocks], numel, block))


def _div(x: torch.Tensor, w: int) -> torch.Tensor:
    """x / w as an IEEE division on every device (torch CUDA multiplies by 1/w for a Python
    scalar divisor, which would make CUDA and CPU results differ in the last bit)."""
    return x / torch.tensor(float(w), dtype=x.dtype, device=x.device)


def reference_compressed_mean(inputs: list[torch.Tensor], compression: str = "int8",
                              block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """What every rank ends with, computed in one process from all W inputs (same bytes)."""
    world = len(inputs)
    flats = [x.reshape(-1).to(torch.float32) for x in inputs]
    if world == 1:
        return flats[0].clone()
    if compression == "none":
        return _div(torch.stack(flats).sum(0), world)
    for i, x in enumerate(flats):
        check_finite(x, f"input {i}")
    bounds = _chunk_bounds(flats[0].numel(), world, block)
    out = torch.empty_like(flats[0])
    width = max(b - a for a, b in bounds)
    for j, (lo, hi) in enumerate(bounds):
        if hi == lo:
            continue
        encoded = [_encode(x[lo:hi], compression, block) for x in flats]
        order = [j] + [r for r in range(world) if r != j]  # the owner's own chunk first
        acc = _decode(encoded[order[0]], hi - lo, compression, block)
        for r in order[1:]:
            acc += _decode(encoded[r], hi - lo, compression, block)
        padded = torch.zeros(width, dtype=torch.float32, device=out.device)
        padded[: hi - lo] = _div(acc, world)
        out[lo:hi] = _decode(_encode(padded, compression, block), hi - lo, compression, block)
    return out


def as_communicator(comm_or_group: Communicator | dist.ProcessGroup | None,
                    timeout_s: float = 1800.0) -> Communicator:
    """A Communicator as is; a torch process group (None = world) wrapped in GlooCommunicator."""
    if isinstance(comm_or_group, Communicator):
        return comm_or_group
    return GlooCommunicator(comm_or_group, timeout_s)


def compressed_all_reduce_mean(tensor: torch.Tensor,
                               comm_or_group: Communicator | dist.ProcessGroup | None = None,
                               compression: str = "int8", block: int = DEFAULT_BLOCK) -> int:
    """Average a contiguous fp32 tensor in place over the group; return the bytes this rank sent.

    `comm_or_group`: a modules.comm Communicator, or a torch.distributed process group (None =
    the world group) used through gloo. `compression`: none (fp32 all_reduce; bytes counted as
    a ring sends them), fp16, or int8. Every member must call it with the same numel and
    arguments. NaN/inf in the input raises NonFiniteError on the rank that holds them, before
    anything is sent (its peers then fail with a timeout / CommError). Backend failures and
    timeouts raise CommError (a RuntimeError).
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
    bounds = _chunk_bounds(flat.numel(), world, block)
    _reduce_scatter(flat, bounds, comm, compression, block)
    _all_gather(flat, bounds, comm, compression, block)
    return comm.bytes_sent - before


def _reduce_scatter(flat: torch.Tensor, bounds: list[tuple[int, int]], comm: Communicator,
                    compression: str, block: int) -> None:
    """Phase 1: leaves this rank's chunk of `flat` holding the fp32 mean of dequantised chunks."""
    me = comm.ranks.index(comm.rank)
    mine = [_encode(flat[lo:hi], compression, block) if hi > lo else [] for lo, hi in bounds]
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
    comm.exchange(sends, recvs)
    if hi > lo:
        acc = _decode(mine[me], hi - lo, compression, block)
        for parts in inbox:
            acc += _decode(parts, hi - lo, compression, block)
        flat[lo:hi] = _div(acc, len(bounds))


def _all_gather(flat: torch.Tensor, bounds: list[tuple[int, int]], comm: Communicator,
                compression: str, block: int) -> None:
    """Phase 2: every rank receives every owner's re-encoded chunk and decodes the same bytes."""
    lo, hi = bounds[comm.ranks.index(comm.rank)]
    width = max(b - a for a, b in bounds)
    padded = torch.zeros(width, dtype=torch.float32, device=flat.device)
    padded[: hi - lo] = flat[lo:hi]
    gathered = []
    for part in _encode(padded, compression, block):
        bufs = [torch.empty_like(part) for _ in range(comm.size)]
        comm.all_gather(bufs, part)
        gathered.append(bufs)
    for j, (jlo, jhi) in enumerate(bounds):
        if jhi > jlo:
            flat[jlo:jhi] = _decode([g[j] for g in gathered], jhi - jlo, compression, block)
