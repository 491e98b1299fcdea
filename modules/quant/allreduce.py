"""The arithmetic of the compressed mean all-reduce: chunking, the wire format of a chunk, and
`reference_compressed_mean`, a one-process model of what every rank ends with.

The flat tensor is processed in segments of SEGMENT values; each segment is cut into W chunks
of whole blocks (W = group size) and goes through two phases (modules.comm.compressed moves
them over a Communicator):
1. reduce-scatter: every rank quantises the segment once and sends chunk j straight to its
   owner j (all pairs at once); the owner dequantises the W inputs of its chunk, its own first
   and then the peers' in rank order, accumulates them in fp32 and divides by W;
2. all-gather: each owner re-quantises its mean once; the codes are gathered and every rank,
   the owner included, dequantises the same bytes, so all ranks end bit-identical (and equal
   to reference_compressed_mean). Nothing is re-quantised while being forwarded.

Error against the exact fp32 mean, per element of block b (scales as in codec.py):
  |mean' - mean| <= (1/W) sum_r scale_r,b / 2  +  scale'_b / 2  +  fp32 rounding (few ulp)
where scale_r,b is rank r's input scale and scale'_b that of the averaged block.
Bytes sent per rank: 2 (W-1)/W (n + 4 n / block) for int8 vs 2 (W-1)/W 4 n for an fp32 ring,
about a quarter (fp16: a half).
"""

from __future__ import annotations

import math

import torch

from formats.plan import COMPRESSIONS
from modules.quant.codec import (
    DEFAULT_BLOCK,
    QuantizedTensor,
    check_finite,
    dequantize_int8,
    quantize_int8,
)

SEGMENT = 1 << 21
"""Values per pipelined segment of the compressed all-reduce (8 MiB of fp32); results depend
on it (it fixes which rank sums which values), so every rank must use the same."""


def check_compression(compression: str) -> None:
    """ValueError naming an unknown payload."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression: {compression!r} is not one of {', '.join(COMPRESSIONS)}")


def chunk_bounds(n: int, world: int, block: int) -> list[tuple[int, int]]:
    """[lo, hi) of the chunk each of `world` ranks owns in a segment of n values (whole blocks)."""
    per = math.ceil(math.ceil(n / block) / world) * block
    return [(min(n, j * per), min(n, (j + 1) * per)) for j in range(world)]


def segment_bounds(n: int, segment: int, block: int) -> list[tuple[int, int]]:
    """[lo, hi) of each pipelined segment of a flat tensor of n values (whole blocks)."""
    per = max(block, -(-segment // block) * block)
    return [(lo, min(n, lo + per)) for lo in range(0, n, per)] or [(0, 0)]


def encode_chunk(x: torch.Tensor, compression: str, block: int,
                 read_back: bool = True) -> list[torch.Tensor]:
    """The messages that carry chunk `x` (fp16: one; int8: one holding scales, then codes).
    `read_back=False`: no host sync on CUDA (codec.quantize_int8)."""
    if compression == "fp16":
        return [x.to(torch.float16)]
    q = quantize_int8(x, block, read_back)
    # One message: the scales' bytes first (so their fp32 view stays 4-byte aligned), then the
    # codes. Over gloo every message costs a rendezvous round trip, on WAN links ~2 latencies.
    return [torch.cat([q.scales.view(torch.uint8), q.codes.view(torch.uint8)])]


def decode_chunk(parts: list[torch.Tensor], numel: int, compression: str,
                 block: int) -> torch.Tensor:
    """fp32 values back from what encode_chunk made (the first `numel` of them)."""
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


def ieee_div(x: torch.Tensor, w: int) -> torch.Tensor:
    """x / w as an IEEE division on every device (torch CUDA multiplies by 1/w for a Python
    scalar divisor, which would make CUDA and CPU results differ in the last bit)."""
    return x / torch.tensor(float(w), dtype=x.dtype, device=x.device)


def reduce_chunk(parts: list[list[torch.Tensor]], numel: int, width: int, world: int,
                 compression: str, block: int, device: torch.device) -> torch.Tensor:
    """The owner's mean of one chunk, zero-padded to `width`: its own encoding first, then the
    peers' in rank order, accumulated in fp32."""
    padded = torch.zeros(width, dtype=torch.float32, device=device)
    if numel > 0:
        acc = decode_chunk(parts[0], numel, compression, block)
        for p in parts[1:]:
            acc += decode_chunk(p, numel, compression, block)
        padded[:numel] = ieee_div(acc, world)
    return padded


def reference_compressed_mean(inputs: list[torch.Tensor], compression: str = "int8",
                              block: int = DEFAULT_BLOCK, segment: int = SEGMENT) -> torch.Tensor:
    """What every rank ends with, computed in one process from all W inputs (same bytes)."""
    world = len(inputs)
    flats = [x.reshape(-1).to(torch.float32) for x in inputs]
    if world == 1:
        return flats[0].clone()
    if compression == "none":
        return ieee_div(torch.stack(flats).sum(0), world)
    for i, x in enumerate(flats):
        check_finite(x, f"input {i}")
    out = torch.empty_like(flats[0])
    for slo, shi in segment_bounds(out.numel(), segment, block):
        bounds = chunk_bounds(shi - slo, world, block)
        width = max(b - a for a, b in bounds)
        for j, (lo, hi) in enumerate(bounds):
            if hi == lo:
                continue
            encoded = [encode_chunk(x[slo + lo: slo + hi], compression, block) for x in flats]
            order = [j] + [r for r in range(world) if r != j]  # the owner's own chunk first
            mean = reduce_chunk([encoded[r] for r in order], hi - lo, width, world, compression,
                                block, out.device)
            out[slo + lo: slo + hi] = decode_chunk(encode_chunk(mean, compression, block),
                                                   hi - lo, compression, block)
    return out
